//! [`PreadEngine`]: the `pread`/`pwrite` block engine, used where io_uring
//! is unavailable.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::block::{eof_error, validate_batch, BlockEngine, BlockIo, EngineKind};
use crate::error::{HwError, HwResult};
use crate::pool::SharedPool;

/// Largest single `pread`/`pwrite` call (Linux caps one call at about 2 GiB
/// anyway); longer I/Os loop.
const MAX_CALL: u64 = 1 << 30;

/// `pread`/`pwrite` block engine: a batch runs on up to `threads` scoped
/// worker threads (sequentially on the caller's thread when `threads <= 1`
/// or the batch has one I/O), with the [`BlockEngine`] semantics.
///
/// Invariant: holds the pool (`Arc`) and the file for its whole life, so
/// every validated pool range stays mapped while it is read or written;
/// stateless between batches, so concurrent batches from several threads are
/// allowed.
#[derive(Debug)]
pub struct PreadEngine {
    file: File,
    pool: Arc<SharedPool>,
    threads: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Read,
    Write,
}

impl PreadEngine {
    /// Creates the engine; `threads` is the maximum parallelism per batch
    /// (0 is treated as 1). Never fails today; the `Result` keeps the
    /// constructor uniform with [`crate::UringEngine::new`].
    pub fn new(pool: Arc<SharedPool>, file: File, threads: usize) -> HwResult<PreadEngine> {
        Ok(PreadEngine {
            file,
            pool,
            threads: threads.max(1),
        })
    }

    fn one(&self, io: &BlockIo, dir: Dir) -> HwResult<u64> {
        io.validate(self.pool.len())?;
        let base = self.pool.region().as_ptr();
        let fd = self.file.as_raw_fd();
        let op = match dir {
            Dir::Read => "pread",
            Dir::Write => "pwrite",
        };
        let mut done = 0u64;
        while done < io.len {
            let chunk = (io.len - done).min(MAX_CALL) as usize;
            // SAFETY: validate() checked pool_offset + len <= pool len, so
            // base + pool_offset + done .. + chunk lies inside the live pool
            // mapping (held alive by self.pool); no Rust references into it
            // exist, and the kernel only copies to/from that range.
            let ptr = unsafe { base.add((io.pool_offset + done) as usize) };
            let off = (io.file_offset + done) as libc::off_t;
            let rc = match dir {
                // SAFETY: see above; ptr is valid for `chunk` writable bytes.
                Dir::Read => unsafe { libc::pread(fd, ptr.cast(), chunk, off) },
                // SAFETY: see above; ptr is valid for `chunk` readable bytes.
                Dir::Write => unsafe { libc::pwrite(fd, ptr.cast(), chunk, off) },
            };
            if rc < 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(HwError::os(op, err));
            }
            if rc == 0 {
                return Err(match dir {
                    Dir::Read => eof_error(op),
                    Dir::Write => HwError::os(op, std::io::Error::from_raw_os_error(libc::EIO)),
                });
            }
            done += rc as u64;
        }
        Ok(io.len)
    }

    fn batch(&self, ios: &[BlockIo], dir: Dir) -> Vec<HwResult<u64>> {
        self.batch_then(ios, dir, &|_| {})
    }

    /// Runs a batch on up to `threads` threads; `each(i)` runs on the thread that completed
    /// I/O `i`, right after it succeeded.
    fn batch_then(
        &self,
        ios: &[BlockIo],
        dir: Dir,
        each: &(dyn Fn(usize) + Sync),
    ) -> Vec<HwResult<u64>> {
        let run = |i: usize| {
            let r = self.one(&ios[i], dir);
            if r.is_ok() {
                each(i);
            }
            r
        };
        // Validate everything first so that an invalid I/O never reaches the
        // OS (one() validates again, cheaply, as its own safety guard).
        let invalid = validate_batch(ios, self.pool.len());
        let workers = self.threads.min(ios.len());
        if workers <= 1 {
            return ios
                .iter()
                .zip(invalid)
                .enumerate()
                .map(|(i, (_, bad))| match bad {
                    Some(e) => Err(e),
                    None => run(i),
                })
                .collect();
        }
        let slots: Vec<std::sync::Mutex<Option<HwResult<u64>>>> = invalid
            .into_iter()
            .map(|bad| std::sync::Mutex::new(bad.map(Err)))
            .collect();
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= ios.len() {
                        break;
                    }
                    let mut slot = slots[i].lock().unwrap_or_else(|p| p.into_inner());
                    if slot.is_none() {
                        *slot = Some(run(i));
                    }
                });
            }
        });
        slots
            .into_iter()
            .map(|m| {
                m.into_inner()
                    .unwrap_or_else(|p| p.into_inner())
                    .unwrap_or_else(|| Err(HwError::Invalid("I/O was not run".into())))
            })
            .collect()
    }
}

impl BlockEngine for PreadEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Pread
    }

    fn write_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>> {
        self.batch(ios, Dir::Write)
    }

    fn read_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>> {
        self.batch(ios, Dir::Read)
    }

    fn read_batch_then(
        &self,
        ios: &[BlockIo],
        each: &(dyn Fn(usize) + Sync),
    ) -> Vec<HwResult<u64>> {
        self.batch_then(ios, Dir::Read, each)
    }

    fn sync(&self) -> HwResult<()> {
        self.file
            .sync_data()
            .map_err(|e| HwError::os("fdatasync", e))
    }
}
