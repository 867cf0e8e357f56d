//! [`UringEngine`]: the io_uring block engine with the pool registered as
//! fixed buffers.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::block::{eof_error, validate_batch, BlockEngine, BlockIo, EngineKind};
use crate::error::{HwError, HwResult};
use crate::pool::SharedPool;

/// Largest piece of the pool registered as one fixed buffer.
pub(crate) const PIECE: u64 = 1 << 30;

/// How often an I/O is retried after `EAGAIN`/`EINTR` before giving up.
const MAX_RETRIES: u32 = 16;

struct Ring {
    ring: IoUring<squeue::Entry, cqueue::Entry>,
    /// Tag of the current batch, in the upper 32 bits of `user_data`, so a
    /// completion left over from an aborted batch is never mistaken for one
    /// of the current batch.
    generation: u32,
}

/// io_uring block engine: one or more rings (queue depth `qd` each,
/// optional SQPOLL), the whole pool registered as fixed buffers in pieces of
/// at most 1 GiB (once per ring),
/// `IORING_OP_WRITE_FIXED` / `IORING_OP_READ_FIXED`; an I/O that spans a
/// piece boundary is split at it; short transfers are resubmitted for the
/// remainder; per-I/O errors (EIO, ENOSPC, ...) come back as `HwError::Os`.
///
/// Invariants: a ring is used by one thread at a time (a `Mutex` each; a
/// batch takes a free ring, or waits for the first); at most `qd` SQEs are in
/// flight per ring, so no completion queue can overflow; every call waits
/// for all its SQEs to complete; the rings (and with them the buffer
/// registrations) are dropped before the file and the pool, so registered
/// memory outlives every in-flight I/O.
pub struct UringEngine {
    // Field order is drop order: rings first, then file and pool.
    /// At least one; a batch runs on a free ring, so up to this many batches (from different
    /// threads) are on the disk at once.
    rings: Vec<Mutex<Ring>>,
    file: File,
    pool: Arc<SharedPool>,
    qd: u32,
    piece: u64,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("qd", &self.qd)
            .field("piece", &self.piece)
            .finish_non_exhaustive()
    }
}

/// One kernel-sized part of an I/O: never crosses a registered piece.
struct Seg {
    io: usize,
    pool_off: u64,
    file_off: u64,
    len: u64,
    done: u64,
    retries: u32,
}

impl UringEngine {
    /// Creates the ring (`qd` entries, 1..=4096; SQPOLL with a 2 s idle
    /// time if `sqpoll`) and registers the pool as fixed buffers.
    ///
    /// Errors: `Invalid` for a bad `qd`; `Os` if io_uring setup or buffer
    /// registration fails (e.g. io_uring disabled, `RLIMIT_MEMLOCK`).
    pub fn new(pool: Arc<SharedPool>, file: File, qd: u32, sqpoll: bool) -> HwResult<UringEngine> {
        Self::with_piece(pool, file, qd, sqpoll, PIECE)
    }

    /// [`UringEngine::new`] with up to `rings` rings (each with the pool registered), so that
    /// batches from several threads run concurrently instead of queueing for one ring. The
    /// first ring must work; further rings that cannot be set up (e.g. `RLIMIT_MEMLOCK` for
    /// another registration) are skipped with a warning.
    pub fn with_rings(
        pool: Arc<SharedPool>,
        file: File,
        qd: u32,
        sqpoll: bool,
        rings: usize,
    ) -> HwResult<UringEngine> {
        let mut e = Self::with_piece(pool, file, qd, sqpoll, PIECE)?;
        for _ in 1..rings.max(1) {
            match e.new_ring(sqpoll) {
                Ok(r) => e.rings.push(Mutex::new(r)),
                Err(err) => {
                    tracing::warn!(error = %err, rings = e.rings.len(), "no further io_uring ring");
                    break;
                }
            }
        }
        Ok(e)
    }

    /// Number of rings.
    pub fn ring_count(&self) -> usize {
        self.rings.len()
    }

    /// [`UringEngine::new`] with a custom registration piece size (a
    /// multiple of [`crate::BLOCK_ALIGN`], at most 1 GiB); tests use small
    /// pieces to exercise I/Os that span pieces.
    pub(crate) fn with_piece(
        pool: Arc<SharedPool>,
        file: File,
        qd: u32,
        sqpoll: bool,
        piece: u64,
    ) -> HwResult<UringEngine> {
        if qd == 0 || qd > 4096 {
            return Err(HwError::Invalid(format!(
                "io_uring queue depth {qd} not in 1..=4096"
            )));
        }
        debug_assert!(piece > 0 && piece <= PIECE && piece & (crate::block::BLOCK_ALIGN - 1) == 0);
        let len = pool.len();
        let npieces = len.div_ceil(piece);
        if npieces > u16::MAX as u64 {
            return Err(HwError::Invalid(format!(
                "pool of {len} bytes needs {npieces} fixed buffers"
            )));
        }
        let mut e = UringEngine {
            rings: Vec::new(),
            file,
            pool,
            qd,
            piece,
        };
        let ring = e.new_ring(sqpoll)?;
        e.rings.push(Mutex::new(ring));
        Ok(e)
    }

    /// A ring of `qd` entries with the whole pool registered as fixed buffers.
    fn new_ring(&self, sqpoll: bool) -> HwResult<Ring> {
        let mut builder = IoUring::<squeue::Entry, cqueue::Entry>::builder();
        if sqpoll {
            builder.setup_sqpoll(2000);
        }
        let ring = builder
            .build(self.qd)
            .map_err(|e| HwError::os("io_uring_setup", e))?;
        let base = self.pool.region().as_ptr();
        let len = self.pool.len();
        let piece = self.piece;
        let iovecs: Vec<libc::iovec> = (0..len.div_ceil(piece))
            .map(|i| {
                let off = i * piece;
                libc::iovec {
                    // SAFETY: off < len, inside the live pool mapping.
                    iov_base: unsafe { base.add(off as usize) }.cast(),
                    iov_len: (len - off).min(piece) as usize,
                }
            })
            .collect();
        // SAFETY: the iovecs describe the pool mapping, which stays mapped
        // as long as `pool` (an Arc held by the engine) lives; the engine's
        // field order drops the rings (ending the registrations) before the
        // pool. The kernel pins the pages, so only the kernel writes there
        // during I/O, into ranges the caller gave us for that purpose.
        unsafe { ring.submitter().register_buffers(&iovecs) }
            .map_err(|e| HwError::os("io_uring_register_buffers", e))?;
        Ok(Ring {
            ring,
            generation: 0,
        })
    }

    fn batch(
        &self,
        ios: &[BlockIo],
        write: bool,
        each: &(dyn Fn(usize) + Sync),
    ) -> Vec<HwResult<u64>> {
        let op = if write { "write_fixed" } else { "read_fixed" };
        let invalid = validate_batch(ios, self.pool.len());
        let mut results: Vec<Option<HwResult<u64>>> =
            invalid.into_iter().map(|bad| bad.map(Err)).collect();
        // Split valid I/Os into segments that never cross a piece.
        let mut segs = Vec::new();
        for (i, io) in ios.iter().enumerate() {
            if results[i].is_some() {
                continue;
            }
            let mut off = 0;
            while off < io.len {
                let p = io.pool_offset + off;
                let room = self.piece - p % self.piece;
                let len = room.min(io.len - off);
                segs.push(Seg {
                    io: i,
                    pool_off: p,
                    file_off: io.file_offset + off,
                    len,
                    done: 0,
                    retries: 0,
                });
                off += len;
            }
        }
        // Per-I/O: first error seen (other segments still complete).
        let mut errors: Vec<Option<HwError>> = (0..ios.len()).map(|_| None).collect();
        // Per-I/O: segments not yet complete (the callback runs when this reaches 0).
        let mut unfinished = vec![0u32; ios.len()];
        let mut panicked: Option<Box<dyn std::any::Any + Send>> = None;
        for s in &segs {
            unfinished[s.io] += 1;
        }
        // A free ring if there is one, else wait for the first.
        let mut guard = self
            .rings
            .iter()
            .find_map(|r| match r.try_lock() {
                Ok(g) => Some(g),
                // A ring whose holder panicked is still sound: every call drains its own SQEs.
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            })
            .unwrap_or_else(|| self.rings[0].lock().unwrap_or_else(|p| p.into_inner()));
        let st = &mut *guard;
        st.generation = st.generation.wrapping_add(1);
        let gen = st.generation as u64;
        let base = self.pool.region().as_ptr();
        let fd = types::Fd(self.file.as_raw_fd());
        let mut pending: VecDeque<usize> = (0..segs.len()).collect();
        let mut inflight = 0usize;
        let mut fatal: Option<std::io::Error> = None;
        while fatal.is_none() && (!pending.is_empty() || inflight > 0) {
            // Fill the SQ up to the queue depth.
            {
                let mut sq = st.ring.submission();
                while inflight < self.qd as usize && !sq.is_full() {
                    let Some(si) = pending.pop_front() else { break };
                    let s = &segs[si];
                    let start = s.pool_off + s.done;
                    let len = (s.len - s.done) as u32;
                    let buf_index = (s.pool_off / self.piece) as u16;
                    // SAFETY: start + len <= pool len (validated) and within
                    // the registered piece `buf_index` (segments never cross
                    // pieces), so the pointer is inside the live mapping.
                    let ptr = unsafe { base.add(start as usize) };
                    let entry = if write {
                        opcode::WriteFixed::new(fd, ptr, len, buf_index)
                            .offset(s.file_off + s.done)
                            .build()
                    } else {
                        opcode::ReadFixed::new(fd, ptr, len, buf_index)
                            .offset(s.file_off + s.done)
                            .build()
                    }
                    .user_data((gen << 32) | si as u64);
                    // SAFETY: the entry's buffer is the registered pool range
                    // above, which outlives the I/O (the pool is held by the
                    // engine, and this call waits for every completion); the
                    // fd is our open file.
                    unsafe { sq.push(&entry) }.expect("SQ checked not full");
                    inflight += 1;
                }
            }
            let want = if inflight > 0 { 1 } else { 0 };
            match st.ring.submit_and_wait(want) {
                Ok(_) => {}
                Err(e) if transient(&e) => {}
                Err(e) => {
                    fatal = Some(e);
                    // Stop submitting, but never return while the kernel may still move
                    // bytes into or out of pool memory the caller will reuse.
                    pending.clear();
                    drain(&mut st.ring, gen, &mut inflight);
                    break;
                }
            }
            for cqe in st.ring.completion() {
                let ud = cqe.user_data();
                if ud >> 32 != gen {
                    continue; // stale completion from an aborted batch
                }
                let si = (ud & 0xffff_ffff) as usize;
                inflight -= 1;
                let s = &mut segs[si];
                let res = cqe.result();
                if res < 0 {
                    let errno = -res;
                    if (errno == libc::EAGAIN || errno == libc::EINTR) && s.retries < MAX_RETRIES {
                        s.retries += 1;
                        pending.push_back(si);
                    } else if errors[s.io].is_none() {
                        errors[s.io] =
                            Some(HwError::os(op, std::io::Error::from_raw_os_error(errno)));
                    }
                } else if res == 0 {
                    if errors[s.io].is_none() {
                        errors[s.io] = Some(if write {
                            HwError::os(op, std::io::Error::from_raw_os_error(libc::EIO))
                        } else {
                            eof_error(op)
                        });
                    }
                } else {
                    s.done += res as u64;
                    if s.done < s.len {
                        pending.push_back(si); // short transfer: the rest
                    } else {
                        unfinished[s.io] -= 1;
                        if unfinished[s.io] == 0 && errors[s.io].is_none() && panicked.is_none() {
                            // A panicking callback must not unwind past I/Os still in flight:
                            // it is held until the batch has drained, then resumed.
                            let io = s.io;
                            if let Err(p) =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| each(io)))
                            {
                                panicked = Some(p);
                            }
                        }
                    }
                }
            }
        }
        drop(guard);
        if let Some(p) = panicked {
            std::panic::resume_unwind(p);
        }
        let mut incomplete = vec![false; ios.len()];
        for s in &segs {
            if s.done < s.len {
                incomplete[s.io] = true;
            }
        }
        for (i, r) in results.iter_mut().enumerate() {
            if r.is_some() {
                continue;
            }
            *r = Some(if let Some(e) = errors[i].take() {
                Err(e)
            } else if let (true, Some(f)) = (incomplete[i], &fatal) {
                Err(HwError::os(
                    "io_uring_enter",
                    match f.raw_os_error() {
                        Some(n) => std::io::Error::from_raw_os_error(n),
                        None => std::io::Error::new(f.kind(), f.to_string()),
                    },
                ))
            } else {
                Ok(ios[i].len)
            });
        }
        results.into_iter().map(|r| r.expect("filled")).collect()
    }
}

fn transient(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
    )
}

/// Waits until every SQE of batch `gen` still in flight has completed (results discarded: the
/// batch failed). If the ring cannot even wait any more, the process aborts: returning would let
/// the kernel write into pool slots that are about to be reused.
fn drain(ring: &mut IoUring<squeue::Entry, cqueue::Entry>, gen: u64, inflight: &mut usize) {
    let mut failures = 0u32;
    while *inflight > 0 {
        match ring.submit_and_wait(1) {
            Ok(_) => failures = 0,
            Err(e) if transient(&e) => {}
            Err(e) => {
                failures += 1;
                if failures > 1000 {
                    tracing::error!(error = %e, inflight = *inflight, "io_uring cannot reap in-flight I/O: aborting to protect pool memory");
                    std::process::abort();
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        for cqe in ring.completion() {
            if cqe.user_data() >> 32 == gen {
                *inflight -= 1;
            }
        }
    }
}

impl BlockEngine for UringEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Uring
    }

    fn write_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>> {
        self.batch(ios, true, &|_| {})
    }

    fn read_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>> {
        self.batch(ios, false, &|_| {})
    }

    fn read_batch_then(
        &self,
        ios: &[BlockIo],
        each: &(dyn Fn(usize) + Sync),
    ) -> Vec<HwResult<u64>> {
        self.batch(ios, false, each)
    }

    fn sync(&self) -> HwResult<()> {
        self.file
            .sync_data()
            .map_err(|e| HwError::os("fdatasync", e))
    }

    fn release(&self) {
        for r in &self.rings {
            let st = r.lock().unwrap_or_else(|p| p.into_inner());
            // Every batch drains its own SQEs before it returns, so none is in flight here.
            if let Err(e) = st.ring.submitter().unregister_buffers() {
                tracing::debug!(error = %e, "io_uring buffers already unregistered");
            }
        }
    }
}
