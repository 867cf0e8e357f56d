//! The mover: posts a remote transfer's work items to the fabric and waits for their completion,
//! with one thread per fabric polling completions and waking the waiters.
//!
//! Slot safety rests here: [`Mover::transfer`] never returns before the fabric returned the
//! op's completion (the fabric's invariant: after it, the op's pool ranges are no longer
//! touched). A fabric that misses an op's deadline by [`STUCK_GRACE`] is told to tear the
//! connection down; the caller keeps waiting (its slots stay reserved — a leak, never a
//! corruption) and the node says so in its log and status.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvnode_hw::fabric::{
    Completion, ConnId, ConnSetup, Dir, Fabric, FabricError, OpId, PostBatch, PostError, WorkItem,
};
use parking_lot::{Condvar, Mutex};

/// Completions one poll takes at most.
const POLL_BATCH: usize = 64;
/// How long one poll waits for the first completion (also how soon the thread sees `stop`).
const POLL_WAIT: Duration = Duration::from_millis(10);
/// How long past its deadline an op may stay without completion before the mover tears its
/// connection down (the fabric should have completed it with `Deadline` by then).
pub const STUCK_GRACE: Duration = Duration::from_secs(2);
/// How often a `Full` fabric is asked again (nothing was posted; within the op's deadline).
const FULL_RETRY: Duration = Duration::from_micros(200);
/// Longest [`Mover::teardown`] waits for the fabric's `TEARDOWN_DONE` before logging and going
/// on (the connection's ops completed already: its reader is the only poster and waits).
const TEARDOWN_WAIT: Duration = Duration::from_secs(10);

/// Most bytes [`Mover::transfer_paced`] posts as one op (each piece gets its own deadline).
pub const PACE_PIECE_BYTES: u64 = 4 << 20;

/// How long a transfer's bytes may take: each piece of at most [`PACE_PIECE_BYTES`] must move
/// within `stall` plus its size at `min_bytes_per_sec`, and the whole transfer by `cap`. So an
/// engine that stops sending or reading mid-transfer is detected within about `stall`, however
/// large the transfer, while a slow but live one is not cut off.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Allowance for a piece's first byte.
    pub stall: Duration,
    /// The slowest rate accepted once bytes flow (at least 1).
    pub min_bytes_per_sec: u64,
    /// No piece's deadline passes this.
    pub cap: Instant,
}

impl Pace {
    /// The deadline of a piece of `bytes` starting `now`.
    pub fn deadline(&self, now: Instant, bytes: u64) -> Instant {
        let nanos = u128::from(bytes) * 1_000_000_000 / u128::from(self.min_bytes_per_sec.max(1));
        let allowance = self.stall.saturating_add(Duration::from_nanos(
            u64::try_from(nanos).unwrap_or(u64::MAX),
        ));
        now.checked_add(allowance).unwrap_or(self.cap).min(self.cap)
    }
}

/// Splits `items` into consecutive pieces of at most `piece` bytes (an item larger than that is
/// cut: the stream is sequential, and an RDMA segment's address advances with its offset).
pub fn pieces(items: &[WorkItem], piece: u64) -> Vec<Vec<WorkItem>> {
    let mut out: Vec<Vec<WorkItem>> = Vec::new();
    let mut cur: Vec<WorkItem> = Vec::new();
    let mut cur_bytes = 0u64;
    for it in items {
        let mut done = 0u64;
        while done < it.local.len {
            let room = piece - cur_bytes;
            let n = room.min(it.local.len - done);
            let remote = match it.remote {
                kvnode_hw::fabric::RemoteSeg::Rdma { addr, rkey } => {
                    kvnode_hw::fabric::RemoteSeg::Rdma {
                        addr: addr + done,
                        rkey,
                    }
                }
                kvnode_hw::fabric::RemoteSeg::Stream => kvnode_hw::fabric::RemoteSeg::Stream,
            };
            cur.push(WorkItem {
                local: kvnode_hw::fabric::LocalRange {
                    offset: it.local.offset + done,
                    len: n,
                },
                remote,
            });
            done += n;
            cur_bytes += n;
            if cur_bytes == piece {
                out.push(std::mem::take(&mut cur));
                cur_bytes = 0;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Why a transfer did not move its bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoveError {
    /// The fabric refused the batch: nothing was posted, no byte moved.
    #[error("not posted: {0}")]
    NotPosted(PostError),
    /// The op completed with an error: the pool ranges of a pull may hold any bytes.
    #[error("{0}")]
    Failed(FabricError),
}

/// A completion's landing place. Invariant: `done` is set exactly once.
#[derive(Default)]
struct Landing {
    done: Mutex<Option<Result<u64, FabricError>>>,
    cv: Condvar,
}

impl Landing {
    fn set(&self, r: Result<u64, FabricError>) {
        *self.done.lock() = Some(r);
        self.cv.notify_all();
    }
}

/// Counters of the mover (status).
#[derive(Debug, Default)]
pub struct MoverStats {
    /// Transfers that completed successfully.
    pub ops_ok: AtomicU64,
    /// Transfers that completed with an error.
    pub ops_failed: AtomicU64,
    /// Transfers that completed with `Deadline`.
    pub deadline_misses: AtomicU64,
    /// Ops the fabric did not complete within [`STUCK_GRACE`] of their deadline.
    pub stuck_ops: AtomicU64,
    /// Transfers waiting for their completion now.
    pub waiting: AtomicU64,
}

/// Posts transfers to one fabric and routes its completions. Invariant: every op id in
/// `waiters` was posted and its completion not yet routed; `transfer` returns only after its
/// op's completion was routed.
pub struct Mover {
    fabric: Arc<dyn Fabric>,
    waiters: Mutex<HashMap<u64, Arc<Landing>>>,
    teardowns: Mutex<HashMap<u64, Arc<Landing>>>,
    next_op: AtomicU64,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Counters.
    pub stats: MoverStats,
}

impl Mover {
    /// A mover over `fabric`, with its polling thread started.
    pub fn start(fabric: Arc<dyn Fabric>) -> std::io::Result<Arc<Mover>> {
        let m = Arc::new(Mover {
            fabric,
            waiters: Mutex::new(HashMap::new()),
            teardowns: Mutex::new(HashMap::new()),
            next_op: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            stats: MoverStats::default(),
        });
        let weak = Arc::downgrade(&m);
        let handle = std::thread::Builder::new()
            .name(format!("kvnode-mover-{}", m.fabric.kind().as_str()))
            .spawn(move || {
                let mut out = Vec::with_capacity(POLL_BATCH);
                loop {
                    let Some(m) = weak.upgrade() else { return };
                    if m.stop.load(Ordering::Acquire) && m.waiters.lock().is_empty() {
                        return;
                    }
                    out.clear();
                    m.fabric.poll(&mut out, POLL_BATCH, POLL_WAIT);
                    for c in out.drain(..) {
                        m.route(c);
                    }
                }
            })?;
        *m.thread.lock() = Some(handle);
        Ok(m)
    }

    /// The fabric this mover drives.
    pub fn fabric(&self) -> &Arc<dyn Fabric> {
        &self.fabric
    }

    /// Hands a connection to the fabric.
    pub fn connect(&self, setup: ConnSetup) -> kvnode_hw::HwResult<ConnId> {
        self.fabric.connect(setup)
    }

    fn route(&self, c: Completion) {
        if c.op == OpId::TEARDOWN_DONE {
            // Kept until `teardown` collects it: a teardown the mover started itself (a stuck
            // op) completes before the connection's own teardown asks for it.
            let l = self.teardowns.lock().entry(c.conn.0).or_default().clone();
            l.set(c.result);
            return;
        }
        match self.waiters.lock().remove(&c.op.0) {
            Some(l) => l.set(c.result),
            None => tracing::error!(op = c.op.0, "fabric completed an op nobody posted"),
        }
    }

    /// Moves `items` over `conn` in direction `dir`, giving the fabric until `deadline`.
    /// Returns the bytes moved. Never returns while the fabric may still touch the items'
    /// pool ranges.
    pub fn transfer(
        &self,
        conn: ConnId,
        dir: Dir,
        items: &[WorkItem],
        deadline: Instant,
    ) -> Result<u64, MoveError> {
        let op = OpId(self.next_op.fetch_add(1, Ordering::Relaxed));
        let landing = Arc::new(Landing::default());
        self.waiters.lock().insert(op.0, landing.clone());
        loop {
            let batch = PostBatch {
                op,
                conn,
                dir,
                items,
                deadline,
            };
            match self.fabric.post(batch) {
                Ok(()) => break,
                Err(PostError::Full) if Instant::now() < deadline => {
                    std::thread::sleep(FULL_RETRY);
                }
                Err(e) => {
                    self.waiters.lock().remove(&op.0);
                    return Err(MoveError::NotPosted(e));
                }
            }
        }
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        let result = self.wait(conn, &landing, deadline);
        self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        match result {
            Ok(n) => {
                self.stats.ops_ok.fetch_add(1, Ordering::Relaxed);
                Ok(n)
            }
            Err(e) => {
                self.stats.ops_failed.fetch_add(1, Ordering::Relaxed);
                if e == FabricError::Deadline {
                    self.stats.deadline_misses.fetch_add(1, Ordering::Relaxed);
                }
                Err(MoveError::Failed(e))
            }
        }
    }

    /// [`Mover::transfer`] in pieces of at most [`PACE_PIECE_BYTES`], each with its own
    /// deadline from `pace`: a peer that stalls mid-transfer is detected within about
    /// `pace.stall`. Returns the bytes moved; the first failed piece ends the transfer (the
    /// caller treats it as failed whole). `NotPosted` only when nothing moved.
    pub fn transfer_paced(
        &self,
        conn: ConnId,
        dir: Dir,
        items: &[WorkItem],
        pace: &Pace,
    ) -> Result<u64, MoveError> {
        let mut moved = 0;
        for (k, piece) in pieces(items, PACE_PIECE_BYTES).into_iter().enumerate() {
            let bytes: u64 = piece.iter().map(|i| i.local.len).sum();
            let deadline = pace.deadline(Instant::now(), bytes);
            match self.transfer(conn, dir, &piece, deadline) {
                Ok(n) => moved += n,
                // Only the first piece's refusal means nothing moved.
                Err(MoveError::NotPosted(e)) if k > 0 => {
                    return Err(MoveError::Failed(FabricError::Local(format!(
                        "not posted after {moved} bytes moved: {e}"
                    ))))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(moved)
    }

    /// Waits for `landing` without a time limit (the slots must not be released before the
    /// completion); past the deadline plus [`STUCK_GRACE`], tears the connection down once.
    fn wait(&self, conn: ConnId, landing: &Landing, deadline: Instant) -> Result<u64, FabricError> {
        let mut done = landing.done.lock();
        let mut escalated = false;
        loop {
            if let Some(r) = done.take() {
                return r;
            }
            let stuck_at = deadline + STUCK_GRACE;
            let now = Instant::now();
            if !escalated && now >= stuck_at {
                escalated = true;
                self.stats.stuck_ops.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    conn = conn.0,
                    fabric = self.fabric.kind().as_str(),
                    "a transfer is past its deadline without completion: tearing its connection \
                     down; its slots stay reserved until the fabric completes it"
                );
                parking_lot::MutexGuard::unlocked(&mut done, || self.fabric.teardown(conn));
                continue;
            }
            let wait = if escalated {
                Duration::from_secs(1)
            } else {
                stuck_at - now
            };
            landing.cv.wait_for(&mut done, wait);
        }
    }

    /// Tears `conn` down and waits (bounded) for the fabric to confirm that every op of it
    /// completed and its socket or queue pair is gone.
    pub fn teardown(&self, conn: ConnId) {
        let landing = self.teardowns.lock().entry(conn.0).or_default().clone();
        // A teardown already confirmed (started for a stuck op) is not asked for again: the
        // fabric would ignore the second request and never confirm it.
        if landing.done.lock().is_none() {
            self.fabric.teardown(conn);
        }
        let mut done = landing.done.lock();
        let end = Instant::now() + TEARDOWN_WAIT;
        while done.is_none() {
            if landing.cv.wait_until(&mut done, end).timed_out() {
                tracing::warn!(
                    conn = conn.0,
                    "the fabric did not confirm a connection's teardown in time"
                );
                break;
            }
        }
        drop(done);
        self.teardowns.lock().remove(&conn.0);
    }

    /// The mover's and its fabric's counters (status report).
    pub fn status(&self) -> serde_json::Value {
        let s = &self.stats;
        let f = self.fabric.stats();
        serde_json::json!({
            "fabric": self.fabric.kind().as_str(),
            "ops_ok": s.ops_ok.load(Ordering::Relaxed),
            "ops_failed": s.ops_failed.load(Ordering::Relaxed),
            "deadline_misses": s.deadline_misses.load(Ordering::Relaxed),
            "stuck_ops": s.stuck_ops.load(Ordering::Relaxed),
            "waiting": s.waiting.load(Ordering::Relaxed),
            "inflight_ops": f.inflight_ops,
            "bytes_pulled": f.bytes_pulled,
            "bytes_pushed": f.bytes_pushed,
            "fabric_errors": f.errors,
        })
    }

    /// Stops the polling thread once no transfer waits.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.thread.lock().take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cut_items_at_the_piece_size_and_keep_every_byte_in_order() {
        use kvnode_hw::fabric::{LocalRange, RemoteSeg};
        let items = [
            WorkItem {
                local: LocalRange { offset: 0, len: 10 },
                remote: RemoteSeg::Stream,
            },
            WorkItem {
                local: LocalRange {
                    offset: 100,
                    len: 7,
                },
                remote: RemoteSeg::Rdma {
                    addr: 1000,
                    rkey: 3,
                },
            },
        ];
        let p = pieces(&items, 4);
        let sizes: Vec<u64> = p
            .iter()
            .map(|x| x.iter().map(|i| i.local.len).sum())
            .collect();
        assert_eq!(sizes, vec![4, 4, 4, 4, 1]);
        let flat: Vec<WorkItem> = p.into_iter().flatten().collect();
        assert_eq!(flat[2].local, LocalRange { offset: 8, len: 2 });
        assert_eq!(
            flat[3].local,
            LocalRange {
                offset: 100,
                len: 2
            }
        );
        assert_eq!(
            flat[4].remote,
            RemoteSeg::Rdma {
                addr: 1002,
                rkey: 3
            }
        );
        assert_eq!(flat.iter().map(|i| i.local.len).sum::<u64>(), 17);
    }

    #[test]
    fn a_pace_gives_each_piece_its_stall_plus_its_size_never_past_the_cap() {
        let now = Instant::now();
        let pace = Pace {
            stall: Duration::from_millis(750),
            min_bytes_per_sec: 100_000_000,
            cap: now + Duration::from_secs(5),
        };
        assert_eq!(
            pace.deadline(now, 100_000_000),
            now + Duration::from_millis(1750)
        );
        assert_eq!(pace.deadline(now, 1 << 40), now + Duration::from_secs(5));
    }
    use kvnode_hw::fabric::{FakeFabric, FakeOptions, FakePeer, FakeRegion, LocalRange, RemoteSeg};
    use kvnode_hw::{PagePreference, PoolOptions, SharedPool};

    fn pool() -> Arc<SharedPool> {
        Arc::new(
            SharedPool::create(&PoolOptions {
                bytes: 1 << 20,
                prefer: PagePreference::Pages4K,
                prefault: false,
                name: "kvnode-mover-test".into(),
                ..PoolOptions::default()
            })
            .unwrap(),
        )
    }

    /// A transfer returns only with its completion, and the fake's clock drives it: the bytes
    /// are in the pool when it returns.
    #[test]
    fn transfer_waits_for_its_completion() {
        let pool = pool();
        let fake = Arc::new(
            FakeFabric::new(
                FakeOptions {
                    delay_ms: (5, 5),
                    ..FakeOptions::default()
                },
                pool.clone(),
            )
            .unwrap(),
        );
        fake.register(&pool).unwrap();
        let mover = Mover::start(fake.clone()).unwrap();
        let conn = mover
            .connect(ConnSetup::Fake(FakePeer {
                regions: vec![FakeRegion {
                    addr: 0x1000,
                    rkey: 3,
                    bytes: vec![0xAB; 8192],
                }],
            }))
            .unwrap();
        let clock = {
            let fake = fake.clone();
            std::thread::spawn(move || {
                for t in 0..200 {
                    fake.advance_to(t);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        let items = [WorkItem {
            local: LocalRange {
                offset: 4096,
                len: 8192,
            },
            remote: RemoteSeg::Rdma {
                addr: 0x1000,
                rkey: 3,
            },
        }];
        let n = mover
            .transfer(
                conn,
                Dir::Pull,
                &items,
                Instant::now() + Duration::from_secs(60),
            )
            .unwrap();
        assert_eq!(n, 8192);
        let mut got = vec![0u8; 8192];
        pool.region().read_at(4096, &mut got).unwrap();
        assert!(got.iter().all(|b| *b == 0xAB));
        clock.join().unwrap();
        mover.teardown(conn);
        mover.stop();
    }
}
