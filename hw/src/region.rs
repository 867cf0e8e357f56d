//! Raw shared mappings: [`PoolRegion`] (bounds-checked access to a mapped
//! pool) and [`PoolMapping`] (the client-side mapping of a received pool fd).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{HwError, HwResult};
use crate::shm;

/// Bytes pre-faulted per step (between two checks of the cancel flag). A multiple of every
/// page size (1 GiB).
pub(crate) const PREFAULT_STEP_BYTES: usize = 1 << 30;

/// 2 MiB: minimum alignment we give every shared mapping, so that THP (and
/// 2 MiB hugetlb) can use PMD-sized pages from the first byte on.
pub(crate) const ALIGN_2M: usize = 2 << 20;

/// The base page size of the system.
pub(crate) fn base_page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 {
        v as usize
    } else {
        4096
    }
}

/// Rounds `v` up to a multiple of `to` (a power of two); `None` on overflow.
pub(crate) fn round_up(v: u64, to: u64) -> Option<u64> {
    debug_assert!(to.is_power_of_two());
    Some(v.checked_add(to - 1)? & !(to - 1))
}

/// A mapped view of a pool (node side or client side). All access is
/// bounds-checked.
///
/// Invariant: `ptr..ptr+map_len` is a live `MAP_SHARED`, read-write mapping
/// owned by this value for its whole lifetime (unmapped on drop), `len <=
/// map_len`, and only `ptr..ptr+len` is ever handed out or accessed. The
/// memory may be written concurrently by other processes sharing the pool,
/// so Rust references to it are never created; all access goes through raw
/// copies, and callers must coordinate who writes which range (concurrent
/// overlapping accesses give unspecified, possibly torn, bytes).
#[derive(Debug)]
pub struct PoolRegion {
    ptr: NonNull<u8>,
    len: u64,
    map_len: usize,
}

// SAFETY: PoolRegion owns its mapping outright; the raw pointer is not tied
// to any thread, and the mapping can be unmapped from any thread.
unsafe impl Send for PoolRegion {}
// SAFETY: all shared-reference methods only do raw copies into/out of
// process-shared memory (which other processes may touch concurrently
// anyway); no Rust references into the mapping are ever created.
unsafe impl Sync for PoolRegion {}

impl PoolRegion {
    /// Maps `map_len` bytes of `fd` from offset 0, `MAP_SHARED` read-write,
    /// at an address aligned to `align` (a power of two, at least the base
    /// page size); the region exposes the first `len <= map_len` bytes.
    pub(crate) fn map_shared(
        fd: BorrowedFd<'_>,
        map_len: usize,
        align: usize,
        len: u64,
    ) -> HwResult<PoolRegion> {
        let page = base_page_size();
        let align = align.max(page);
        if map_len == 0 || !align.is_power_of_two() || len > map_len as u64 {
            return Err(HwError::Invalid(format!(
                "bad mapping geometry: map_len {map_len}, align {align}, len {len}"
            )));
        }
        let too_big = || HwError::Invalid(format!("mapping of {map_len} bytes is too large"));
        let reserve_len = map_len
            .checked_add(align)
            .filter(|&r| r <= isize::MAX as usize)
            .ok_or_else(too_big)?;
        // SAFETY: a fresh anonymous PROT_NONE reservation at a kernel-chosen
        // address; it cannot alias any existing Rust object.
        let reserve = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserve_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if reserve == libc::MAP_FAILED {
            return Err(HwError::last_os("mmap (reserve address space)"));
        }
        let start = reserve as usize;
        let aligned = (start + align - 1) & !(align - 1);
        // SAFETY: aligned..aligned+map_len lies inside our own reservation
        // (aligned - start < align and reserve_len = map_len + align), so
        // MAP_FIXED only replaces pages we own and nobody else references.
        let p = unsafe {
            libc::mmap(
                aligned as *mut libc::c_void,
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let err = HwError::last_os("mmap");
            // SAFETY: unmapping exactly our reservation (a failed MAP_FIXED
            // may have left parts of it mapped or unmapped; both are fine).
            unsafe { libc::munmap(reserve, reserve_len) };
            return Err(err);
        }
        let head = aligned - start;
        let tail_start = aligned + map_len;
        let tail = start + reserve_len - tail_start;
        if head > 0 {
            // SAFETY: start..aligned is the unused head of our reservation.
            unsafe { libc::munmap(reserve, head) };
        }
        if tail > 0 {
            // SAFETY: tail_start..start+reserve_len is the unused tail of our
            // reservation, page aligned because map_len and align are.
            unsafe { libc::munmap(tail_start as *mut libc::c_void, tail) };
        }
        Ok(PoolRegion {
            // SAFETY: mmap succeeded, so p is not null (MAP_FAILED is -1).
            ptr: unsafe { NonNull::new_unchecked(p.cast()) },
            len,
            map_len,
        })
    }

    /// Length in bytes of the accessible region.
    ///
    /// Invariant: constant for the life of the region.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never true for regions built by this
    /// crate; present for API hygiene).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address of the mapping, for callers that do their own copies
    /// (e.g. GPU/RDMA registration).
    ///
    /// Invariant: valid for `len()` bytes for as long as `self` lives; the
    /// caller is responsible for bounds and for cross-process coordination.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Checks `[offset, offset+len)` and returns a pointer to its start.
    fn range(&self, offset: u64, len: u64) -> HwResult<*mut u8> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                // SAFETY: offset <= end <= self.len <= map_len, so the result
                // stays inside (or one past the end of) our mapping.
                Ok(unsafe { self.ptr.as_ptr().add(offset as usize) })
            }
            _ => Err(HwError::OutOfBounds {
                offset,
                len,
                pool_len: self.len,
            }),
        }
    }

    /// Copies `src` into the pool at `offset`.
    ///
    /// Invariant: either the whole range is in bounds and is written, or
    /// `OutOfBounds` is returned and nothing is written.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> HwResult<()> {
        let dst = self.range(offset, src.len() as u64)?;
        // SAFETY: dst..dst+src.len() is inside the live mapping (checked by
        // range); ptr::copy tolerates overlap should src alias the pool.
        unsafe { std::ptr::copy(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes out of the pool at `offset` into `dst`.
    ///
    /// Invariant: either the whole range is in bounds and is read, or
    /// `OutOfBounds` is returned and `dst` is untouched.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> HwResult<()> {
        let src = self.range(offset, dst.len() as u64)?;
        // SAFETY: src..src+dst.len() is inside the live mapping (checked by
        // range); dst is a valid exclusive buffer of that length.
        unsafe { std::ptr::copy(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Calls `f` with a shared view of `[offset, offset+len)` (checksums of
    /// committed objects without copying them).
    ///
    /// Invariant: the view is in bounds or `OutOfBounds` is returned and `f`
    /// is not called. The caller must guarantee nobody writes the range while
    /// `f` runs (the node only does this for committed, read-locked slots:
    /// clients write only into slots they reserved and have not committed).
    pub fn with_bytes<R>(&self, offset: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> HwResult<R> {
        let src = self.range(offset, len)?;
        // SAFETY: src..src+len is inside the live mapping (checked by range);
        // the caller guarantees the range is not written while `f` runs, so
        // the shared slice is not aliased by a mutable access.
        let bytes = unsafe { std::slice::from_raw_parts(src.cast_const(), len as usize) };
        Ok(f(bytes))
    }

    /// Sets `len` bytes at `offset` to `byte`.
    ///
    /// Invariant: either the whole range is in bounds and is filled, or
    /// `OutOfBounds` is returned and nothing is written.
    pub fn fill_at(&self, offset: u64, len: u64, byte: u8) -> HwResult<()> {
        let dst = self.range(offset, len)?;
        // SAFETY: dst..dst+len is inside the live mapping (checked by range;
        // len <= self.len fits in usize because the mapping exists).
        unsafe { std::ptr::write_bytes(dst, byte, len as usize) };
        Ok(())
    }

    /// `madvise(advice)` over the whole mapping.
    pub(crate) fn madvise(&self, advice: libc::c_int) -> std::io::Result<()> {
        // SAFETY: advising our own live mapping; the advice values used by
        // this crate (HUGEPAGE/NOHUGEPAGE/POPULATE_WRITE) never discard data.
        let rc = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.map_len, advice) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Maps every page of an existing shared pool into this process's page tables up front
    /// (`MADV_POPULATE_WRITE` on pages that already exist only installs mappings; contents are
    /// untouched), so the first copy into a slot does not pay one page fault per 4 KiB. Best
    /// effort: on failure (old kernel, memory pressure) pages simply fault in on first use.
    pub(crate) fn populate_existing(&self) {
        loop {
            match self.madvise(libc::MADV_POPULATE_WRITE) {
                Ok(()) => return,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "could not pre-populate the pool mapping");
                    return;
                }
            }
        }
    }

    /// Faults in every page of a freshly created mapping for writing.
    ///
    /// Uses `MADV_POPULATE_WRITE` (Linux >= 5.14), which reports allocation
    /// failures as errors instead of a later SIGBUS. On older kernels
    /// (`EINVAL`) falls back to writing a zero byte into every base page,
    /// which is only correct because the pool is brand new (all zeroes).
    /// Works in steps of [`PREFAULT_STEP_BYTES`] and stops (with an error) between two steps
    /// once `cancel` is raised.
    pub(crate) fn prefault_fresh(&self, cancel: Option<&AtomicBool>) -> HwResult<()> {
        let cancelled = || cancel.is_some_and(|c| c.load(Ordering::Relaxed));
        let interrupted = || {
            HwError::Invalid(
                "start-up interrupted by a signal while the pool was being pre-faulted".into(),
            )
        };
        let mut off = 0;
        let mut supported = true;
        while off < self.map_len {
            if cancelled() {
                return Err(interrupted());
            }
            let len = PREFAULT_STEP_BYTES.min(self.map_len - off);
            // SAFETY: off..off+len lies inside our live mapping (off < map_len, len clipped);
            // MADV_POPULATE_WRITE only faults pages in, it never discards data.
            let rc = unsafe {
                libc::madvise(
                    self.ptr.as_ptr().add(off).cast(),
                    len,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if rc == 0 {
                off += len;
                continue;
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EINVAL) if off == 0 => {
                    supported = false;
                    break;
                }
                _ => return Err(HwError::os("madvise(MADV_POPULATE_WRITE)", e)),
            }
        }
        if supported {
            return Ok(());
        }
        tracing::debug!("MADV_POPULATE_WRITE unsupported; touching every page");
        let page = base_page_size();
        let mut off = 0;
        while off < self.map_len {
            if off % PREFAULT_STEP_BYTES == 0 && cancelled() {
                return Err(interrupted());
            }
            // SAFETY: off < map_len, inside our live, writable, fresh
            // mapping; writing 0 over zero-filled memory changes nothing.
            unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(off), 0) };
            off += page;
        }
        Ok(())
    }
}

impl Drop for PoolRegion {
    fn drop(&mut self) {
        // SAFETY: we own ptr..ptr+map_len (mapped in map_shared) and nothing
        // borrowed from it can outlive self.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
        if rc != 0 {
            tracing::error!(
                error = %std::io::Error::last_os_error(),
                "munmap of pool region failed"
            );
        }
    }
}

/// Client side: a pool received over `SCM_RIGHTS` (or opened by POSIX shm
/// name) mapped `MAP_SHARED` read-write.
///
/// Invariant: owns both the fd and the mapping; the region covers exactly
/// the `len` bytes asked for, which the underlying file is at least as long
/// as, and stays mapped until the `PoolMapping` drops.
#[derive(Debug)]
pub struct PoolMapping {
    region: PoolRegion,
    fd: OwnedFd,
}

impl PoolMapping {
    /// Maps the first `len` bytes of `fd`. Fails with `Invalid` if `len` is 0
    /// or the file (checked by `fstat`) is shorter than `len`.
    pub fn from_fd(fd: OwnedFd, len: u64) -> HwResult<PoolMapping> {
        if len == 0 {
            return Err(HwError::Invalid("pool mapping length is 0".into()));
        }
        let file = File::from(fd);
        let md = file.metadata().map_err(|e| HwError::os("fstat", e))?;
        if md.len() < len {
            return Err(HwError::Invalid(format!(
                "pool fd is {} bytes, shorter than the {len} bytes to map",
                md.len()
            )));
        }
        // hugetlbfs reports its huge page size as st_blksize; mapping and
        // unmapping must use multiples of it.
        let blk = md.blksize().max(base_page_size() as u64);
        let blk = if blk.is_power_of_two() { blk } else { 4096 };
        let map_len = round_up(len, blk)
            .filter(|&m| m <= isize::MAX as u64 / 2)
            .ok_or_else(|| HwError::Invalid(format!("pool length {len} too large")))?;
        let align = (blk as usize).max(ALIGN_2M);
        let region = PoolRegion::map_shared(file.as_fd(), map_len as usize, align, len)?;
        region.populate_existing();
        Ok(PoolMapping {
            region,
            fd: OwnedFd::from(file),
        })
    }

    /// Opens the existing POSIX shm segment `/dev/shm/<name>` read-write
    /// and maps its first `len` bytes (see [`PoolMapping::from_fd`]).
    pub fn open_posix_shm(name: &str, len: u64) -> HwResult<PoolMapping> {
        let fd = shm::open_existing(name)?;
        PoolMapping::from_fd(fd, len)
    }

    /// The mapped pool.
    pub fn region(&self) -> &PoolRegion {
        &self.region
    }

    /// The fd this mapping was made from.
    ///
    /// Invariant: open for as long as `self` lives.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
