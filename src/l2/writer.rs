//! Write-behind: a bounded queue of committed keys and the thread that writes them to L2 in
//! batches. The request path only pushes keys (lock-free); it never waits for the disk.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use parking_lot::{Condvar, Mutex};

use crate::modules::NodeContext;
use crate::storage::StorageKey;

/// How long the writer sleeps when idle before re-checking the queue and the shutdown flag.
const IDLE_WAIT: Duration = Duration::from_millis(50);
/// Completed writes are made durable (fdatasync) at least this often while writing.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// Keys committed in L1 and waiting for their write-behind. Invariant: holds at most its
/// capacity; keys that do not fit are counted in `dropped` (they stay in L1 only).
pub struct WriteQueue {
    keys: ArrayQueue<StorageKey>,
    dropped: AtomicU64,
    idle: Mutex<()>,
    wake: Condvar,
}

impl WriteQueue {
    /// An empty queue for `capacity` keys (at least 1).
    pub fn new(capacity: usize) -> WriteQueue {
        WriteQueue {
            keys: ArrayQueue::new(capacity.max(1)),
            dropped: AtomicU64::new(0),
            idle: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    /// Queues keys for write-behind; returns how many did not fit (counted as dropped).
    pub fn push(&self, keys: impl IntoIterator<Item = StorageKey>) -> u64 {
        let mut dropped = 0;
        for k in keys {
            if self.keys.push(k).is_err() {
                dropped += 1;
            }
        }
        if dropped > 0 {
            self.dropped.fetch_add(dropped, Ordering::Relaxed);
            tracing::debug!(dropped, "L2 write-behind queue full");
        }
        self.wake.notify_one();
        dropped
    }

    /// Keys waiting.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is waiting.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Keys that did not fit so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn pop_batch(&self, max: usize) -> Vec<StorageKey> {
        std::iter::from_fn(|| self.keys.pop()).take(max).collect()
    }

    fn wait(&self) {
        let mut g = self.idle.lock();
        if self.keys.is_empty() {
            self.wake.wait_for(&mut g, IDLE_WAIT);
        }
    }
}

/// Starts the write-behind thread when the node has an L2 tier. It drains the queue before it
/// exits at shutdown (nothing committed before SIGTERM is left unwritten) and syncs the file.
pub fn spawn(ctx: &Arc<NodeContext>) -> std::io::Result<Option<JoinHandle<()>>> {
    if ctx.l2.is_none() {
        return Ok(None);
    }
    let ctx = ctx.clone();
    thread::Builder::new()
        .name("kvnode-l2-writer".into())
        .spawn(move || run(&ctx))
        .map(Some)
}

fn run(ctx: &NodeContext) {
    let l2 = ctx.l2.as_ref().expect("spawned only with an L2 tier");
    let mut last_sync = Instant::now();
    let mut unsynced = false;
    loop {
        let batch = l2.queue.pop_batch(l2.batch_objects());
        if batch.is_empty() {
            if unsynced {
                sync(l2);
                unsynced = false;
            }
            if ctx.shutting_down.load(Ordering::Acquire) {
                break;
            }
            l2.queue.wait();
            continue;
        }
        unsynced |= l2.persist(&ctx.storage, &ctx.namespaces, &batch) > 0;
        if unsynced && last_sync.elapsed() >= SYNC_EVERY {
            sync(l2);
            unsynced = false;
            last_sync = Instant::now();
        }
    }
    tracing::debug!("L2 writer stopped");
}

fn sync(l2: &super::L2Tier) {
    if let Err(e) = l2.sync() {
        tracing::warn!(error = %e, "L2 fdatasync failed");
    }
}
