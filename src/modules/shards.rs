//! The instance-shard worker pool: a few threads (about one per core), each owning a run queue of
//! instances that have queued requests. An instance is bound to one shard for life, so its
//! requests run in arrival order; different instances run in parallel. No global lock: a request
//! goes into the instance's lock-free mailbox, and the instance (not the request) is put on its
//! shard's lock-free run queue when it becomes runnable.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::Duration;

use crossbeam_queue::SegQueue;

use super::context::NodeContext;
use super::instances::{Instance, Job};

/// Requests run from one instance before the shard moves to the next runnable instance (fairness).
const RUN_BUDGET: usize = 32;
/// Longest a worker sleeps without a wake-up (guards against a lost unpark; never on the hot path).
const IDLE_PARK: Duration = Duration::from_millis(200);

/// An instance's mailbox is at its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MailboxFull;

struct ShardQueue {
    runnable: SegQueue<Arc<Instance>>,
    thread: OnceLock<Thread>,
    executed: AtomicU64,
}

/// The worker pool. Invariant: an instance is in at most one run queue at a time, guarded by
/// its `scheduled` flag.
pub struct ShardPool {
    shards: Vec<ShardQueue>,
    stop: AtomicBool,
}

impl ShardPool {
    /// A pool of `n` (>= 1) shards; threads start with [`ShardPool::spawn`].
    pub fn new(n: usize) -> ShardPool {
        ShardPool {
            shards: (0..n.max(1))
                .map(|_| ShardQueue {
                    runnable: SegQueue::new(),
                    thread: OnceLock::new(),
                    executed: AtomicU64::new(0),
                })
                .collect(),
            stop: AtomicBool::new(false),
        }
    }

    /// Number of shards.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Whether the pool has no shards (never true).
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// The shard an instance id is bound to.
    pub fn shard_for(&self, instance_id: u64) -> usize {
        (instance_id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % self.shards.len()
    }

    /// Queues a job on its instance; `Err(MailboxFull)` when the instance's mailbox is full
    /// (the job is dropped; the caller answers with a typed error).
    pub fn submit(&self, inst: &Arc<Instance>, job: Job) -> Result<(), MailboxFull> {
        inst.mailbox.push(job).map_err(|_| MailboxFull)?;
        self.schedule(inst);
        Ok(())
    }

    /// Runs `job` right here when its instance is idle (nothing queued, not running anywhere),
    /// taking the instance's `scheduled` flag exactly as a shard would, so per-instance order is
    /// kept; otherwise queues it. The fast path saves a thread wake-up per request.
    pub fn run_or_submit(
        &self,
        ctx: &NodeContext,
        inst: &Arc<Instance>,
        job: Job,
    ) -> Result<(), MailboxFull> {
        if inst.mailbox.is_empty() && !inst.scheduled.swap(true, Ordering::SeqCst) {
            super::transfer::execute(ctx, inst, job);
            inst.scheduled.store(false, Ordering::SeqCst);
            if !inst.mailbox.is_empty() {
                self.schedule(inst);
            }
            return Ok(());
        }
        self.submit(inst, job)
    }

    fn schedule(&self, inst: &Arc<Instance>) {
        // SeqCst pairs with the worker's store(false) + mailbox check: either the worker sees
        // our job, or we see the flag cleared and schedule (no lost wake-up).
        if !inst.scheduled.swap(true, Ordering::SeqCst) {
            let q = &self.shards[inst.shard];
            q.runnable.push(inst.clone());
            if let Some(t) = q.thread.get() {
                t.unpark();
            }
        }
    }

    /// Requests executed per shard (status report; shows balance across cores).
    pub fn executed(&self) -> Vec<u64> {
        self.shards
            .iter()
            .map(|s| s.executed.load(Ordering::Relaxed))
            .collect()
    }

    /// Starts one thread per shard running jobs against `ctx`.
    pub fn spawn(ctx: &Arc<NodeContext>) -> std::io::Result<Vec<JoinHandle<()>>> {
        (0..ctx.shards.len())
            .map(|i| {
                let ctx = ctx.clone();
                thread::Builder::new()
                    .name(format!("kvnode-shard-{i}"))
                    .spawn(move || run_shard(&ctx, i))
            })
            .collect()
    }

    /// Asks every shard thread to exit after its current job.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        for s in &self.shards {
            if let Some(t) = s.thread.get() {
                t.unpark();
            }
        }
    }
}

fn run_shard(ctx: &Arc<NodeContext>, index: usize) {
    let pool = &ctx.shards;
    let q = &pool.shards[index];
    let _ = q.thread.set(thread::current());
    while !pool.stop.load(Ordering::Acquire) {
        let Some(inst) = q.runnable.pop() else {
            thread::park_timeout(IDLE_PARK);
            continue;
        };
        let mut ran = 0;
        while ran < RUN_BUDGET {
            let Some(job) = inst.mailbox.pop() else { break };
            super::transfer::execute(ctx, &inst, job);
            ran += 1;
        }
        q.executed.fetch_add(ran as u64, Ordering::Relaxed);
        inst.scheduled.store(false, Ordering::SeqCst);
        // A job may have arrived after the last pop but before the flag cleared.
        if !inst.mailbox.is_empty() {
            pool.schedule(&inst);
        }
    }
}
