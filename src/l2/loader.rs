//! The L2 I/O workers: threads that run, for request threads, the device work a request waits
//! for (loads, and the superblock write that makes a CLEAR durable). A request waits for its
//! job at most `l2.io_timeout_ms`; a device that stops answering then costs that request a miss
//! (or a CLEAR an error saying it is not durable yet), never the request thread, and the worker
//! that is stuck in the kernel gives back everything the job holds when the device answers.
//!
//! A load's result is handed over through a [`Reply`]: the requester either takes the result or
//! gives up first; whichever comes second sees the other's mark, so read locks a load took for a
//! requester that gave up are released by the worker (never leaked, never released twice).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::Result;
use crate::modules::NodeContext;
use crate::storage::{Layout, StorageCore, StorageKey};

use super::L2Set;

/// Worker threads per node.
pub const WORKERS: usize = 4;
/// Jobs waiting for a worker at most; beyond, a load misses at once (counted as stalled).
pub const MAX_QUEUED: usize = 64;
/// How long an idle worker sleeps before it looks at the shutdown flag again.
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// Where a job's result meets its requester. Invariant: moves `Waiting -> Done` (the worker
/// delivered first; the requester takes it) or `Waiting -> Abandoned` (the requester gave up
/// first; the worker keeps the result and undoes it), never both.
pub struct Reply<T> {
    state: Mutex<ReplyState<T>>,
    done: Condvar,
}

enum ReplyState<T> {
    Waiting,
    Done(T),
    Abandoned,
    Taken,
}

impl<T> Reply<T> {
    fn new() -> Arc<Reply<T>> {
        Arc::new(Reply {
            state: Mutex::new(ReplyState::Waiting),
            done: Condvar::new(),
        })
    }

    /// A reply nobody will deliver (a job that could not be queued): waiting on it gives up.
    pub fn abandoned() -> Arc<Reply<T>> {
        Arc::new(Reply {
            state: Mutex::new(ReplyState::Abandoned),
            done: Condvar::new(),
        })
    }

    /// Waits until `deadline` for the result; `None` (and the job is abandoned) if it has not
    /// come by then.
    pub fn wait_until(&self, deadline: Instant) -> Option<T> {
        let mut s = self.state.lock();
        loop {
            match std::mem::replace(&mut *s, ReplyState::Taken) {
                ReplyState::Done(v) => return Some(v),
                ReplyState::Waiting => *s = ReplyState::Waiting,
                other => {
                    *s = other;
                    return None;
                }
            }
            if self.done.wait_until(&mut s, deadline).timed_out() {
                if let ReplyState::Done(v) = std::mem::replace(&mut *s, ReplyState::Abandoned) {
                    *s = ReplyState::Taken;
                    return Some(v);
                }
                return None;
            }
        }
    }

    /// Hands the result over; `Err(result)` when the requester has given up (the caller must
    /// undo what the result holds).
    pub fn deliver(&self, v: T) -> std::result::Result<(), T> {
        let mut s = self.state.lock();
        match *s {
            ReplyState::Waiting => {
                *s = ReplyState::Done(v);
                self.done.notify_all();
                Ok(())
            }
            _ => Err(v),
        }
    }
}

/// One job.
enum Job {
    /// [`super::L2Set::load_now`] of `keys` for a requester.
    Load {
        keys: Vec<StorageKey>,
        extra: u32,
        expected: Option<Layout>,
        reply: Arc<Reply<Vec<Option<u64>>>>,
    },
    /// [`super::L2Tier::persist_format`] of device `device`.
    PersistFormat {
        device: usize,
        reply: Arc<Reply<Result<()>>>,
    },
}

/// The job queue and whether workers serve it. Invariant: at most [`MAX_QUEUED`] jobs wait;
/// once `running` is false no job is accepted (callers do the work themselves).
#[derive(Default)]
pub struct Workers {
    queue: Mutex<VecDeque<Job>>,
    wake: Condvar,
    running: AtomicBool,
}

/// Why a job was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum NotQueued {
    /// No worker runs (tests, or after shutdown): do the work on the calling thread.
    NoWorkers,
    /// [`MAX_QUEUED`] jobs wait already (the device is slow or stuck).
    Full,
}

impl Workers {
    /// Accepts jobs from now on (the workers are about to run).
    pub(crate) fn start(&self) {
        self.running.store(true, Ordering::Release);
    }

    fn push(&self, job: Job) -> std::result::Result<(), NotQueued> {
        if !self.running.load(Ordering::Acquire) {
            return Err(NotQueued::NoWorkers);
        }
        let mut q = self.queue.lock();
        if q.len() >= MAX_QUEUED {
            return Err(NotQueued::Full);
        }
        q.push_back(job);
        self.wake.notify_one();
        Ok(())
    }

    /// Queues a load; the returned reply receives, per key, the lease of the `1 + extra` read
    /// locks taken (see [`super::L2Tier::load`]).
    pub fn load(
        &self,
        keys: &[StorageKey],
        extra: u32,
        expected: Option<&Layout>,
    ) -> std::result::Result<Arc<Reply<Vec<Option<u64>>>>, NotQueued> {
        let reply = Reply::new();
        self.push(Job::Load {
            keys: keys.to_vec(),
            extra,
            expected: expected.cloned(),
            reply: reply.clone(),
        })?;
        Ok(reply)
    }

    /// Queues the durable write of device `device`'s format id.
    pub fn persist_format(
        &self,
        device: usize,
    ) -> std::result::Result<Arc<Reply<Result<()>>>, NotQueued> {
        let reply = Reply::new();
        self.push(Job::PersistFormat {
            device,
            reply: reply.clone(),
        })?;
        Ok(reply)
    }
}

/// Starts the workers (none without L2).
pub fn spawn(ctx: &Arc<NodeContext>) -> std::io::Result<Vec<JoinHandle<()>>> {
    let Some(l2) = &ctx.l2 else {
        return Ok(Vec::new());
    };
    l2.workers().start();
    (0..WORKERS)
        .map(|i| {
            let ctx = ctx.clone();
            thread::Builder::new()
                .name(format!("kvnode-l2-io-{i}"))
                .spawn(move || run(&ctx))
        })
        .collect()
}

fn run(ctx: &NodeContext) {
    let l2 = ctx.l2.as_ref().expect("spawned only with an L2 tier");
    serve(l2, &ctx.storage, &ctx.shutting_down);
}

/// One worker's loop: runs jobs until `stop` is set and the queue is empty.
pub(crate) fn serve(l2: &L2Set, storage: &StorageCore, stop: &AtomicBool) {
    let workers = l2.workers();
    loop {
        let job = {
            let mut q = workers.queue.lock();
            loop {
                if let Some(j) = q.pop_front() {
                    break Some(j);
                }
                if stop.load(Ordering::Acquire) {
                    workers.running.store(false, Ordering::Release);
                    break None;
                }
                workers.wake.wait_for(&mut q, IDLE_WAIT);
            }
        };
        let Some(job) = job else { break };
        match job {
            Job::Load {
                keys,
                extra,
                expected,
                reply,
            } => {
                let leases = l2.load_now(storage, &keys, extra, expected.as_ref());
                if let Err(leases) = reply.deliver(leases) {
                    // The requester gave up (the device was slow): nobody will use these locks.
                    let held: Vec<(StorageKey, u64)> = keys
                        .iter()
                        .zip(leases)
                        .filter_map(|(k, l)| l.map(|l| (*k, l)))
                        .collect();
                    storage.finish_read(&held, extra);
                }
            }
            Job::PersistFormat { device, reply } => {
                let r = l2.tiers()[device].persist_format();
                let _ = reply.deliver(r);
            }
        }
    }
    tracing::debug!("L2 I/O worker stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_goes_to_exactly_one_side() {
        let r: Arc<Reply<u32>> = Reply::new();
        assert_eq!(r.deliver(7), Ok(()));
        assert_eq!(
            r.wait_until(Instant::now()),
            Some(7),
            "delivered first: taken"
        );
        let r: Arc<Reply<u32>> = Reply::new();
        assert_eq!(
            r.wait_until(Instant::now() + Duration::from_millis(1)),
            None
        );
        assert_eq!(
            r.deliver(7),
            Err(7),
            "abandoned first: the worker undoes it"
        );
        // Racing: whatever the interleaving, the value is either taken or returned.
        for _ in 0..200 {
            let r: Arc<Reply<u32>> = Reply::new();
            let r2 = r.clone();
            let t = std::thread::spawn(move || r2.deliver(1).is_ok());
            let taken = r.wait_until(Instant::now()).is_some();
            let delivered = t.join().unwrap();
            assert_eq!(delivered, taken, "a value lost or taken twice");
        }
    }
}
