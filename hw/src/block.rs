//! Block I/O between the shared pool and an `O_DIRECT` data file (the
//! future L2 disk tier): the [`BlockEngine`] trait, the [`BlockIo`]
//! descriptor, [`open_direct`] and [`open_engine`].
//!
//! Two engines implement the trait: [`crate::UringEngine`] (io_uring with
//! the pool registered as fixed buffers) and [`crate::PreadEngine`]
//! (`pread`/`pwrite` on a few threads). Both move bytes straight between
//! pool pages and the file, without a bounce buffer, and report per-I/O
//! results with identical semantics:
//!
//! * An I/O that fails validation ([`BlockIo::validate`]) gets
//!   `HwError::Invalid` / `HwError::OutOfBounds` and is never submitted; the
//!   other I/Os of the same batch still run.
//! * Short transfers are continued for the remainder until the I/O is
//!   complete, so `Ok(n)` always has `n == io.len`.
//! * A read that reaches end-of-file before `len` bytes were transferred is
//!   an error: `HwError::Os { op, source }` with
//!   `source.kind() == std::io::ErrorKind::UnexpectedEof` (no raw errno).
//!   The bytes before EOF have been written to the pool.
//! * Any other OS error (EIO, ENOSPC, EFBIG, ...) is `HwError::Os` with that
//!   errno; bytes already transferred for that I/O are unspecified.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use crate::error::{HwError, HwResult};
use crate::pool::SharedPool;

/// Alignment required of every offset and length in a [`BlockIo`] (the
/// logical block size `O_DIRECT` needs, rounded up to the page size).
///
/// Invariant: a power of two; the pool base is aligned to at least this.
pub const BLOCK_ALIGN: u64 = 4096;

/// One I/O between a pool range and a file range.
///
/// Invariant (checked by [`BlockIo::validate`] before anything is
/// submitted): `pool_offset`, `file_offset` and `len` are multiples of
/// [`BLOCK_ALIGN`], `len > 0`, `file_offset + len` does not overflow, and the
/// pool range `[pool_offset, pool_offset + len)` lies inside the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockIo {
    /// Start of the range in the shared pool.
    pub pool_offset: u64,
    /// Start of the range in the data file.
    pub file_offset: u64,
    /// Number of bytes.
    pub len: u64,
}

impl BlockIo {
    /// Checks the [`BlockIo`] invariant against a pool of `pool_len` bytes.
    ///
    /// Errors: `Invalid` for zero length, misalignment or file-range
    /// overflow; `OutOfBounds` if the pool range does not fit.
    pub fn validate(&self, pool_len: u64) -> HwResult<()> {
        if self.len == 0 {
            return Err(HwError::Invalid("block I/O of length 0".into()));
        }
        if self.pool_offset & (BLOCK_ALIGN - 1) != 0
            || self.file_offset & (BLOCK_ALIGN - 1) != 0
            || self.len & (BLOCK_ALIGN - 1) != 0
        {
            return Err(HwError::Invalid(format!(
                "block I/O not {BLOCK_ALIGN}-aligned: pool_offset {} file_offset {} len {}",
                self.pool_offset, self.file_offset, self.len
            )));
        }
        if self.file_offset.checked_add(self.len).is_none()
            || self.file_offset > i64::MAX as u64 - self.len
        {
            return Err(HwError::Invalid(format!(
                "file range overflows: file_offset {} len {}",
                self.file_offset, self.len
            )));
        }
        match self.pool_offset.checked_add(self.len) {
            Some(end) if end <= pool_len => Ok(()),
            _ => Err(HwError::OutOfBounds {
                offset: self.pool_offset,
                len: self.len,
                pool_len,
            }),
        }
    }
}

/// Which block engine.
///
/// Invariant: plain tag; `as_str` gives the stable config name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// io_uring with fixed buffers ([`crate::UringEngine`]).
    Uring,
    /// `pread`/`pwrite` ([`crate::PreadEngine`]).
    Pread,
}

impl EngineKind {
    /// Stable name: `"uring"` or `"pread"`.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Uring => "uring",
            EngineKind::Pread => "pread",
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A block engine: moves bytes between the shared pool and one `O_DIRECT`
/// file, with no bounce buffer.
///
/// Invariant: I/Os of a batch may complete in any order, but each call
/// returns only when every I/O of the batch has finished (none is still in
/// flight); the returned vector has one entry per input I/O, in input order:
/// `Ok(len)` on full transfer, otherwise the error (see the module docs for
/// the exact semantics). The caller must not access or concurrently use the
/// pool ranges of a batch while it runs (the pool itself stays valid: the
/// engine holds an `Arc` to it).
pub trait BlockEngine: Send + Sync {
    /// Which engine this is.
    fn kind(&self) -> EngineKind;
    /// Copies each pool range to its file range (pool -> file).
    fn write_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>>;
    /// Copies each file range to its pool range (file -> pool).
    fn read_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>>;
    /// [`BlockEngine::read_batch`] that calls `each(i)` as soon as I/O `i` has completed in
    /// full (never for a failed one), possibly on another thread and while other I/Os of the
    /// batch are still in flight, so the caller can work on finished data (verify a checksum)
    /// while the disk keeps going. Same results as `read_batch`. The default runs the batch
    /// first and the callbacks after it.
    fn read_batch_then(
        &self,
        ios: &[BlockIo],
        each: &(dyn Fn(usize) + Sync),
    ) -> Vec<HwResult<u64>> {
        let results = self.read_batch(ios);
        for (i, r) in results.iter().enumerate() {
            if r.is_ok() {
                each(i);
            }
        }
        results
    }
    /// `fdatasync` of the data file: all completed writes are durable after
    /// it returns `Ok`.
    fn sync(&self) -> HwResult<()>;
    /// Gives up any kernel registration of the pool (io_uring fixed buffers)
    /// now, at shutdown, instead of leaving it to the kernel's asynchronous
    /// teardown after the process exits (which keeps the pool's hugepages
    /// pinned for a while, so a node restarted at once would not get them).
    /// Batches after this fail. Default: nothing to release.
    fn release(&self) {}
}

/// Opens (creating if needed, mode 0600, with `O_DIRECT`, read-write) a data
/// file and makes it exactly `size` bytes long: space is reserved with
/// `fallocate` (falling back to `set_len`, i.e. a sparse file, where the
/// filesystem does not support it). A longer existing file is refused
/// (`Invalid`), never truncated: it may hold cached objects.
///
/// Invariant of the result: opened `O_RDWR | O_DIRECT`, length `size`.
/// Errors: `Invalid` if `size` is not a multiple of [`BLOCK_ALIGN`]; `Os`
/// for open (e.g. `EINVAL` where the filesystem has no `O_DIRECT`),
/// `fallocate` (e.g. `ENOSPC`) or `ftruncate` failures.
pub fn open_direct(path: &Path, size: u64) -> HwResult<File> {
    check_data_size(size)?;
    size_data_file(open_o_direct(path)?, path, size, true)
}

/// Opens an existing block device read-write with `O_DIRECT` and `O_EXCL` (refused while
/// the kernel uses it: mounted, a RAID or LVM member) and returns it with its size in bytes
/// (rounded down to [`BLOCK_ALIGN`]).
///
/// Errors: `Invalid` if `path` is not a block device; `Os` for open/seek.
pub fn open_block_device(path: &Path) -> HwResult<(File, u64)> {
    use std::io::Seek;
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(path).map_err(|e| HwError::os("stat", e))?;
    if !meta.file_type().is_block_device() {
        return Err(HwError::Invalid(format!(
            "{} is not a block device",
            path.display()
        )));
    }
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        // O_EXCL on a block device: refused (EBUSY) while the kernel uses it (mounted, an md
        // or LVM member, another exclusive opener).
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC | libc::O_EXCL)
        .open(path)
        .map_err(|e| HwError::os("open(O_DIRECT|O_EXCL)", e))?;
    let size = file
        .seek(std::io::SeekFrom::End(0))
        .map_err(|e| HwError::os("lseek(SEEK_END)", e))?;
    Ok((file, size & !(BLOCK_ALIGN - 1)))
}

/// Takes an exclusive `flock` on `file` (held until every duplicate of the
/// descriptor is closed), so two nodes never share one data file or device.
///
/// A lock still held is retried every 10 ms for up to `wait`: after a crash the
/// kernel keeps the dead process's file open until its io_uring teardown has
/// finished the I/Os still in flight, so waiting for the lock is also waiting
/// for those writes to land before this process reads the device.
///
/// Errors: `Os { op: "flock", .. }` with `EWOULDBLOCK` if another process
/// still holds it after `wait`.
pub fn lock_exclusive(file: &File, wait: std::time::Duration) -> HwResult<()> {
    use std::os::fd::AsRawFd;
    // A wait too long to represent (`u64::MAX` ms, say) waits as long as it takes.
    let deadline = std::time::Instant::now().checked_add(wait);
    let mut logged = false;
    loop {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        let held = err.raw_os_error() == Some(libc::EWOULDBLOCK);
        if err.raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if !held || deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return Err(HwError::os("flock", err));
        }
        if !logged {
            tracing::info!(?wait, "data file locked by another process; waiting for it");
            logged = true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

fn check_data_size(size: u64) -> HwResult<()> {
    if size & (BLOCK_ALIGN - 1) != 0 || size > i64::MAX as u64 {
        return Err(HwError::Invalid(format!(
            "data file size {size} is not a multiple of {BLOCK_ALIGN}"
        )));
    }
    Ok(())
}

fn open_o_direct(path: &Path) -> HwResult<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| HwError::os("open(O_DIRECT)", e))
}

/// Grows `file` to `size` (reserved with `fallocate`, or sparse), refusing a longer file.
fn size_data_file(file: File, path: &Path, size: u64, reserve: bool) -> HwResult<File> {
    let cur = file.metadata().map_err(|e| HwError::os("fstat", e))?.len();
    if cur > size {
        return Err(HwError::Invalid(format!(
            "{} is {cur} bytes, larger than the {size} requested; refusing to truncate it",
            path.display()
        )));
    } else if cur < size && !reserve {
        file.set_len(size)
            .map_err(|e| HwError::os("ftruncate", e))?;
    } else if cur < size {
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on an fd we own; no memory is passed.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size as libc::off_t) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => file
                    .set_len(size)
                    .map_err(|e| HwError::os("ftruncate", e))?,
                _ => return Err(HwError::os("fallocate", err)),
            }
        }
    }
    Ok(file)
}

/// Builds the requested engine over `pool` and `file` (which should come
/// from [`open_direct`]). `Some(Uring)`: io_uring with queue depth `qd`, no
/// SQPOLL, errors if io_uring is unavailable. `Some(Pread)`: pread engine
/// with up to 4 threads. `None` (auto): tries io_uring and falls back to
/// pread, logging why at warn.
///
/// Invariant of the result: the engine owns `file` and holds `pool` alive.
pub fn open_engine(
    kind: Option<EngineKind>,
    pool: Arc<SharedPool>,
    file: File,
    qd: u32,
) -> HwResult<Box<dyn BlockEngine>> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(4);
    match kind {
        Some(EngineKind::Uring) => Ok(Box::new(crate::uring::UringEngine::new(
            pool, file, qd, false,
        )?)),
        Some(EngineKind::Pread) => Ok(Box::new(crate::pread_engine::PreadEngine::new(
            pool, file, threads,
        )?)),
        None => {
            // Keep a duplicate of the fd so the pread fallback still has the
            // file if the uring constructor consumed (and dropped) it.
            let spare = file.try_clone().map_err(|e| HwError::os("dup", e))?;
            match crate::uring::UringEngine::new(pool.clone(), file, qd, false) {
                Ok(e) => Ok(Box::new(e)),
                Err(err) => {
                    tracing::warn!(error = %err, "io_uring block engine unavailable, using pread");
                    Ok(Box::new(crate::pread_engine::PreadEngine::new(
                        pool, spare, threads,
                    )?))
                }
            }
        }
    }
}

/// The error for a read that hit end-of-file before `len` bytes.
pub(crate) fn eof_error(op: &'static str) -> HwError {
    HwError::os(
        op,
        std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "read reached end of file before the full length",
        ),
    )
}

/// Validates a whole batch: `Some(err)` for each invalid I/O, `None` for
/// valid ones.
pub(crate) fn validate_batch(ios: &[BlockIo], pool_len: u64) -> Vec<Option<HwError>> {
    ios.iter().map(|io| io.validate(pool_len).err()).collect()
}
