//! The node's shared memory pool: creation with the hugetlb -> THP -> 4K
//! fallback chain.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::error::{HwError, HwResult};
use crate::region::{round_up, PoolRegion, ALIGN_2M};
use crate::shm::ShmSegment;
use crate::sys;

const GIB: u64 = 1 << 30;
/// Largest pool we accept: far beyond any real machine, but small enough
/// that every length/offset computation stays clear of overflow.
const MAX_POOL_BYTES: u64 = 1 << 46;

/// What physically backs the pool pages. `as_str()` gives exactly
/// `"hugetlb-1g"`, `"hugetlb-2m"`, `"thp"`, `"4k"`.
///
/// Invariant: describes what the kernel confirmed. Hugetlb: the mapping succeeded with
/// reserved pages. `Thp`: for a pre-faulted pool, at least half of it was mapped by huge pages
/// right after pre-faulting (the node's own `/proc/self/smaps`), otherwise the pool reports
/// `Pages4K`; without pre-faulting, that THP is enabled for the backing file system (not yet
/// verified). Not a guarantee that every page is huge at every instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolBacking {
    /// 1 GiB hugetlb pages.
    Hugetlb1G,
    /// 2 MiB hugetlb pages.
    Hugetlb2M,
    /// Transparent huge pages on shmem (2 MiB).
    Thp,
    /// Ordinary 4 KiB pages.
    Pages4K,
}

impl PoolBacking {
    /// Stable short name: `"hugetlb-1g"`, `"hugetlb-2m"`, `"thp"` or `"4k"`.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolBacking::Hugetlb1G => "hugetlb-1g",
            PoolBacking::Hugetlb2M => "hugetlb-2m",
            PoolBacking::Thp => "thp",
            PoolBacking::Pages4K => "4k",
        }
    }

    /// Page size in bytes: 1 GiB, 2 MiB, 2 MiB, 4096.
    pub fn page_bytes(self) -> u64 {
        match self {
            PoolBacking::Hugetlb1G => GIB,
            PoolBacking::Hugetlb2M | PoolBacking::Thp => 2 << 20,
            PoolBacking::Pages4K => 4096,
        }
    }
}

impl std::fmt::Display for PoolBacking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which page size to try first; the chain always falls back downwards:
/// 1G -> 2M -> THP -> 4K.
///
/// Invariant: `Pages4K` additionally opts the mapping out of THP
/// (`MADV_NOHUGEPAGE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PagePreference {
    /// Try 1 GiB hugetlb pages first.
    Huge1G,
    /// Try 2 MiB hugetlb pages first (default).
    #[default]
    Huge2M,
    /// Try shmem THP first.
    Thp,
    /// Plain 4 KiB pages.
    Pages4K,
}

/// How to create a [`SharedPool`].
///
/// Invariant: plain data; validated by [`SharedPool::create`].
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Requested size; must be > 0. Rounded up to a multiple of 2 MiB
    /// (1 GiB when the pool ends up on 1 GiB hugetlb pages).
    pub bytes: u64,
    /// Which page size to try first.
    pub prefer: PagePreference,
    /// Fault every page in at creation (default true).
    pub prefault: bool,
    /// memfd name (debug only, shows in `/proc/<pid>/maps`).
    pub name: String,
    /// If set, back the pool with the named POSIX shm segment
    /// `/dev/shm/<name>` (created exclusively, mode 0600, under the lock file
    /// `/dev/shm/<name>.lock` held while the pool lives; a stale one is
    /// unlinked first) instead of a memfd; unlinked when the pool drops.
    /// Hugepages there: see [`SharedPool::create`].
    pub posix_shm_name: Option<String>,
    /// Opt-in (default false): a root node may put a named segment on huge pages by
    /// bind-mounting a private hugetlbfs / huge tmpfs file over `/dev/shm/<name>`. The mount is
    /// seen only in the node's mount namespace (and those it propagates to): every client must
    /// run there, or it opens an empty placeholder. Refused (with a warning, falling back) when
    /// the node is not in PID 1's mount namespace. Ignored without `posix_shm_name`.
    pub segment_bind_mount: bool,
    /// When set and raised (a signal during start-up), pre-faulting stops at the next 1 GiB and
    /// creation fails: a node asked to stop never spends minutes building a pool first.
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            bytes: GIB,
            prefer: PagePreference::Huge2M,
            prefault: true,
            name: "kvnode-pool".into(),
            posix_shm_name: None,
            segment_bind_mount: false,
            cancel: None,
        }
    }
}

/// The node's pool: one shared mapping (`MAP_SHARED`) of a memfd (or POSIX
/// shm segment) that clients map too.
///
/// Invariants: the base pointer is aligned to `backing().page_bytes()` and
/// at least 2 MiB; `len()` is a multiple of 2 MiB (of 1 GiB for
/// `Hugetlb1G`); the fd's file is exactly `len()` bytes; the mapping lives
/// as long as the `SharedPool`.
#[derive(Debug)]
pub struct SharedPool {
    // Drop order: the mapping goes first, then the fd; the shm name is
    // unlinked by `shm`'s own Drop last.
    region: PoolRegion,
    fd: OwnedFd,
    backing: PoolBacking,
    detail: String,
    shm: Option<ShmSegment>,
}

impl SharedPool {
    /// Removes the POSIX shm name now (if this pool has one and it is still ours); the mapping
    /// and existing client mappings stay valid. Used at shutdown, when other threads may still
    /// hold the pool. Idempotent.
    pub fn unlink_shm_name(&self) {
        if let Some(seg) = &self.shm {
            seg.unlink_if_ours();
        }
    }

    /// Creates the pool, trying the chain from `opts.prefer` downwards.
    /// Logs the backing obtained at info and, at warn, why each better one
    /// failed. Errors: `Invalid` for a zero/oversized size or a bad name,
    /// `Os` if even the 4K fallback fails.
    ///
    /// A named POSIX shm pool (`posix_shm_name`) tries, in order: hugetlb pages (1G, 2M per
    /// `prefer`) as a file on a private hugetlbfs instance bind-mounted over the name (root
    /// only; see `segment_mount`); THP from `/dev/shm` itself when it is mounted with `huge=`;
    /// THP from a private `huge=within_size` tmpfs bind-mounted the same way (root only); and
    /// finally 4 KiB pages of `/dev/shm`, with a warning naming why each better one failed.
    /// Every mount it makes is removed again when the pool drops (or by the next pool of that
    /// name after a crash); it never touches a mount it did not make.
    pub fn create(opts: &PoolOptions) -> HwResult<SharedPool> {
        if opts.bytes == 0 {
            return Err(HwError::Invalid("pool size is 0".into()));
        }
        if opts.bytes > MAX_POOL_BYTES {
            return Err(HwError::Invalid(format!(
                "pool size {} exceeds the maximum {MAX_POOL_BYTES}",
                opts.bytes
            )));
        }
        let pool = match &opts.posix_shm_name {
            Some(shm_name) => create_posix_shm(opts, shm_name)?,
            None => create_memfd_chain(opts)?,
        };
        tracing::info!(
            backing = pool.backing.as_str(),
            bytes = pool.len(),
            requested = opts.bytes,
            posix_shm = pool.posix_shm_name().unwrap_or(""),
            "shared pool created"
        );
        Ok(pool)
    }

    /// What backs the pool pages.
    pub fn backing(&self) -> PoolBacking {
        self.backing
    }

    /// One line for people: where the pool's memory comes from (memfd, `/dev/shm`, or which
    /// file system is bind-mounted at the segment's path) and how much of it the node's own
    /// mapping saw in huge pages after pre-faulting, or why it has 4 KiB pages.
    pub fn backing_detail(&self) -> &str {
        &self.detail
    }

    /// Pool length in bytes (after rounding).
    pub fn len(&self) -> u64 {
        self.region.len()
    }

    /// Always false: pools are never empty (present for API hygiene).
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// The pool's fd, to pass to clients (e.g. with
    /// [`crate::send_with_fd`]); it stays open as long as the pool.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The POSIX shm name (without `/`) if the pool is a named segment.
    pub fn posix_shm_name(&self) -> Option<&str> {
        self.shm.as_ref().map(ShmSegment::name)
    }

    /// The node-side mapping of the whole pool.
    pub fn region(&self) -> &PoolRegion {
        &self.region
    }

    /// Dies the way a killed node does as far as the name goes: its lock is released, while the
    /// segment, a bind mount over it and the lock file's record of that mount stay.
    #[cfg(test)]
    pub(crate) fn abandon_name(mut self) {
        if let Some(seg) = self.shm.take() {
            seg.abandon();
        }
    }
}

fn create_memfd_chain(opts: &PoolOptions) -> HwResult<SharedPool> {
    // memfd_create accepts at most 249 bytes (NAME_MAX minus "memfd:").
    if opts.name.len() > 249 {
        return Err(HwError::Invalid(format!(
            "memfd name is {} bytes, longer than 249",
            opts.name.len()
        )));
    }
    let name = CString::new(opts.name.as_str())
        .map_err(|_| HwError::Invalid(format!("memfd name {:?} contains NUL", opts.name)))?;
    let mut hugetlb: &[PoolBacking] = &[];
    match opts.prefer {
        PagePreference::Huge1G => hugetlb = &[PoolBacking::Hugetlb1G, PoolBacking::Hugetlb2M],
        PagePreference::Huge2M => hugetlb = &[PoolBacking::Hugetlb2M],
        PagePreference::Thp | PagePreference::Pages4K => {}
    }
    for &backing in hugetlb {
        match try_hugetlb(opts, &name, backing) {
            Ok(pool) => return Ok(pool),
            Err(e) if is_cancelled(opts) => return Err(e),
            Err(e) => {
                let dir = match backing {
                    PoolBacking::Hugetlb1G => sys::HUGE_1G_DIR,
                    _ => sys::HUGE_2M_DIR,
                };
                tracing::warn!(
                    backing = backing.as_str(),
                    error = %e,
                    available_pages = ?sys::hugepages_available(dir),
                    "hugetlb pool unavailable, falling back"
                );
            }
        }
    }
    let want_thp = opts.prefer != PagePreference::Pages4K;
    let fd = memfd_create(&name, libc::MFD_CLOEXEC).map_err(|e| HwError::os("memfd_create", e))?;
    let len = round_up(opts.bytes, ALIGN_2M as u64).expect("bounded by MAX_POOL_BYTES");
    let file = File::from(fd);
    file.set_len(len).map_err(|e| HwError::os("ftruncate", e))?;
    let fd = OwnedFd::from(file);
    let region = PoolRegion::map_shared(fd.as_fd(), len as usize, ALIGN_2M, len)?;
    let backing = thp_or_4k(&region, want_thp, sys::memfd_thp_active(), "memfd");
    finish(opts, region, fd, backing, None, "memfd".into())
}

fn is_cancelled(opts: &PoolOptions) -> bool {
    opts.cancel
        .as_ref()
        .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
}

fn try_hugetlb(opts: &PoolOptions, name: &CString, backing: PoolBacking) -> HwResult<SharedPool> {
    let size_flag = match backing {
        PoolBacking::Hugetlb1G => libc::MFD_HUGE_1GB,
        _ => libc::MFD_HUGE_2MB,
    };
    let page = backing.page_bytes();
    let len = round_up(opts.bytes, page).expect("bounded by MAX_POOL_BYTES");
    let fd = memfd_create(name, libc::MFD_CLOEXEC | libc::MFD_HUGETLB | size_flag)
        .map_err(|e| HwError::os("memfd_create(MFD_HUGETLB)", e))?;
    let file = File::from(fd);
    file.set_len(len)
        .map_err(|e| HwError::os("ftruncate (hugetlb)", e))?;
    let fd = OwnedFd::from(file);
    // Without free hugepages this mmap fails with ENOMEM (reservation).
    let region = PoolRegion::map_shared(fd.as_fd(), len as usize, page as usize, len)?;
    finish(opts, region, fd, backing, None, "memfd (hugetlb)".into())
}

/// Applies the THP advice to a shmem mapping and decides Thp vs Pages4K.
fn thp_or_4k(region: &PoolRegion, want_thp: bool, active: bool, what: &str) -> PoolBacking {
    if !want_thp {
        if let Err(e) = region.madvise(libc::MADV_NOHUGEPAGE) {
            tracing::debug!(error = %e, "madvise(MADV_NOHUGEPAGE) failed");
        }
        return PoolBacking::Pages4K;
    }
    if let Err(e) = region.madvise(libc::MADV_HUGEPAGE) {
        tracing::warn!(error = %e, "madvise(MADV_HUGEPAGE) failed; using 4K pages");
        return PoolBacking::Pages4K;
    }
    if active {
        PoolBacking::Thp
    } else {
        tracing::warn!(
            backing = what,
            "shmem THP is not enabled (shmem_enabled / tmpfs huge=); using 4K pages"
        );
        PoolBacking::Pages4K
    }
}

/// Pre-faults the pool (when asked), then [`assemble`]s it.
fn finish(
    opts: &PoolOptions,
    region: PoolRegion,
    fd: OwnedFd,
    backing: PoolBacking,
    shm: Option<ShmSegment>,
    detail: String,
) -> HwResult<SharedPool> {
    if opts.prefault {
        region.prefault_fresh(opts.cancel.as_deref())?;
    }
    Ok(assemble(opts, region, fd, backing, shm, detail))
}

/// The pool on `region` (already pre-faulted when `opts.prefault`), its backing verified.
fn assemble(
    opts: &PoolOptions,
    region: PoolRegion,
    fd: OwnedFd,
    backing: PoolBacking,
    shm: Option<ShmSegment>,
    detail: String,
) -> SharedPool {
    if !opts.prefault {
        return SharedPool {
            region,
            fd,
            backing,
            detail: format!("{detail}; pages not verified (not pre-faulted)"),
            shm,
        };
    }
    let (backing, detail) = verify_backing(&region, backing, detail);
    SharedPool {
        region,
        fd,
        backing,
        detail,
        shm,
    }
}

/// Checks in the node's own `/proc/self/smaps` what really backs the freshly pre-faulted
/// mapping: a `Thp` pool with less than half of its bytes in huge pages is reported as
/// `Pages4K` (with a warning); the detail gains the huge-page count.
fn verify_backing(
    region: &PoolRegion,
    backing: PoolBacking,
    detail: String,
) -> (PoolBacking, String) {
    let Some(pages) = sys::mapping_pages(region.as_ptr() as usize) else {
        return (
            backing,
            format!("{detail}; pages not verified (smaps unreadable)"),
        );
    };
    let len = region.len();
    let mib = |b: u64| b >> 20;
    match backing {
        PoolBacking::Hugetlb1G | PoolBacking::Hugetlb2M => {
            if pages.kernel_page_bytes != backing.page_bytes() {
                tracing::warn!(
                    kernel_page_bytes = pages.kernel_page_bytes,
                    "the hugetlb pool's mapping reports another page size"
                );
            }
            let n = pages.huge_bytes / backing.page_bytes();
            (backing, format!("{detail}; {n} hugetlb pages mapped"))
        }
        PoolBacking::Thp if pages.huge_bytes.saturating_mul(2) >= len => (
            backing,
            format!(
                "{detail}; {} of {} MiB in huge pages",
                mib(pages.huge_bytes),
                mib(len)
            ),
        ),
        PoolBacking::Thp => {
            tracing::warn!(
                huge_bytes = pages.huge_bytes,
                bytes = len,
                "transparent huge pages were enabled for the pool but the kernel gave mostly \
                 4 KiB pages (memory fragmented?); reporting 4k"
            );
            (
                PoolBacking::Pages4K,
                format!(
                    "{detail}; THP asked for but only {} of {} MiB in huge pages",
                    mib(pages.huge_bytes),
                    mib(len)
                ),
            )
        }
        PoolBacking::Pages4K => (backing, detail),
    }
}

fn memfd_create(name: &CString, flags: libc::c_uint) -> std::io::Result<OwnedFd> {
    // SAFETY: name is a valid NUL-terminated string; flags are plain bits.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        // SAFETY: fd was just returned by memfd_create and is owned by nobody.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

#[path = "pool_shm.rs"]
mod shm_chain;
use shm_chain::create_posix_shm;

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
