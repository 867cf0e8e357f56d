//! Write-behind: a bounded queue of committed keys and the thread that writes them to L2 in
//! batches. The request path only pushes keys (lock-free); it never waits for the disk.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use parking_lot::{Condvar, Mutex};

use crate::config::WritePolicy;
use crate::modules::NodeContext;
use crate::storage::StorageKey;

/// How long the writer sleeps when idle before re-checking the queue and the shutdown flag.
const IDLE_WAIT: Duration = Duration::from_millis(50);
/// Pause after a demotion round that could evict nothing.
const DEMOTE_BACKOFF: Duration = Duration::from_millis(500);
/// Batches per `persist` call of a demotion round (pipelined inside the call).
const PIPELINE_BATCHES: usize = 8;
/// Completed writes are made durable (fdatasync) at least this often while writing.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// A committed object waiting for write-behind (the layout it was committed under is kept
/// with the L1 object itself).
pub type Queued = StorageKey;

/// Keys committed in L1 and waiting for their write-behind. Invariant: holds at most its
/// capacity; keys that do not fit are counted in `dropped` (they stay in L1 only).
pub struct WriteQueue {
    keys: ArrayQueue<Queued>,
    dropped: AtomicU64,
    /// Set by the shutdown drain: later pushes are counted as dropped, never left queued.
    closed: std::sync::atomic::AtomicBool,
    /// Pushes between their check of `closed` and their last push: the drain waits for them
    /// after closing, so nothing lands behind its final pop.
    pushing: std::sync::atomic::AtomicUsize,
    idle: Mutex<()>,
    wake: Condvar,
}

impl WriteQueue {
    /// An empty queue for `capacity` keys (at least 1).
    pub fn new(capacity: usize) -> WriteQueue {
        WriteQueue {
            keys: ArrayQueue::new(capacity.max(1)),
            dropped: AtomicU64::new(0),
            closed: std::sync::atomic::AtomicBool::new(false),
            pushing: std::sync::atomic::AtomicUsize::new(0),
            idle: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    /// Queues keys for write-behind; returns those that did not fit (counted as dropped).
    pub fn push(&self, keys: impl IntoIterator<Item = Queued>) -> Vec<StorageKey> {
        let mut refused = Vec::new();
        // SeqCst on both sides (here and in `close`): either the drain sees this push in
        // flight and waits for it, or this push sees the queue closed.
        self.pushing.fetch_add(1, Ordering::SeqCst);
        let closed = self.closed.load(Ordering::SeqCst);
        for k in keys {
            if closed {
                refused.push(k);
            } else if let Err(back) = self.keys.push(k) {
                refused.push(back);
            }
        }
        self.pushing.fetch_sub(1, Ordering::SeqCst);
        let dropped = refused.len() as u64;
        if closed && dropped > 0 {
            tracing::warn!(
                dropped,
                "objects committed while the node was stopping: not written to L2"
            );
        }
        if dropped > 0 {
            self.dropped.fetch_add(dropped, Ordering::Relaxed);
            tracing::debug!(dropped, "L2 write-behind queue full");
        }
        self.wake.notify_one();
        refused
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

    /// Refuses every later push, then waits for pushes already past their check to finish,
    /// so that whatever they queued is in the queue when this returns.
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        while self.pushing.load(Ordering::SeqCst) > 0 {
            std::thread::yield_now();
        }
    }

    fn pop_batch(&self, max: usize) -> Vec<Queued> {
        std::iter::from_fn(|| self.keys.pop()).take(max).collect()
    }

    /// Pops keys until `max` of them or until their lengths (`len_of`) reach `max_bytes`,
    /// whichever comes first; at least one key if any is queued.
    fn pop_batch_within(
        &self,
        max: usize,
        max_bytes: u64,
        len_of: &dyn Fn(&StorageKey) -> u64,
    ) -> Vec<Queued> {
        let mut out = Vec::new();
        let mut bytes = 0u64;
        while out.len() < max && bytes < max_bytes {
            let Some(q) = self.keys.pop() else { break };
            bytes += len_of(&q);
            out.push(q);
        }
        out
    }

    fn wait(&self) {
        let mut g = self.idle.lock();
        if self.keys.is_empty() {
            self.wake.wait_for(&mut g, IDLE_WAIT);
        }
    }
}

/// Starts one write-behind thread per L2 device (none without L2). Each drains its queue
/// before it exits at shutdown and syncs its file; the first also runs `on-evict` demotion.
pub fn spawn(ctx: &Arc<NodeContext>) -> std::io::Result<Vec<JoinHandle<()>>> {
    let devices = ctx.l2.as_ref().map_or(0, |s| s.tiers().len());
    (0..devices)
        .map(|device| {
            let ctx = ctx.clone();
            thread::Builder::new()
                .name(format!("kvnode-l2-writer-{device}"))
                .spawn(move || run(&ctx, device))
        })
        .collect()
}

fn run(ctx: &NodeContext, device: usize) {
    let set = ctx.l2.as_ref().expect("spawned only with an L2 tier");
    let l2 = &set.tiers()[device];
    std::thread::scope(|scope| {
        // The pipeline: this thread locks, checksums and stages batch k+1 while the I/O thread
        // has batch k on the disk (one more may wait in the channel).
        let (tx, rx) = std::sync::mpsc::sync_channel::<super::tier::WriteBatch<'_>>(1);
        let io = thread::Builder::new()
            .name("kvnode-l2-io".into())
            .spawn_scoped(scope, move || complete_batches(ctx, l2, rx));
        if let Err(e) = io {
            // Its receiver is gone with it: every batch is then completed (and synced) on this
            // thread below, so the queue still drains and no object stays marked unwritten.
            tracing::error!(error = %e, "cannot start the L2 I/O thread: writing without pipelining");
        }
        // A demotion round that found nothing to evict (every candidate locked) is not retried
        // for a while: each round scans and sorts L1's evictable objects.
        let mut idle_demotion: Option<Instant> = None;
        loop {
            let items = l2.queue.pop_batch_within(
                l2.batch_objects(),
                super::tier::WRITE_BATCH_BYTES,
                &|k| ctx.storage.ready_object(k).map_or(0, |(len, _)| len),
            );
            if items.is_empty() {
                if device == 0
                    && l2.policy() == WritePolicy::OnEvict
                    && idle_demotion.is_none_or(|t| t.elapsed() >= DEMOTE_BACKOFF)
                {
                    match demote(ctx, set) {
                        Some(0) => idle_demotion = Some(Instant::now()),
                        Some(_) => {
                            idle_demotion = None;
                            continue;
                        }
                        None => idle_demotion = None, // below the watermark
                    }
                }
                if ctx.shutting_down.load(Ordering::Acquire) {
                    break;
                }
                l2.queue.wait();
                // Keys that waited for an older busy entry of theirs: tried again when idle.
                l2.requeue_deferred();
                // A CLEAR whose new format id could not be written yet: tried again when idle.
                if l2.format_pending() && !l2.stuck() {
                    if let Err(e) = l2.persist_format() {
                        tracing::warn!(error = %e, "L2 format id still not durable");
                    }
                }
                continue;
            }
            let keys = items;
            let batch = l2.prepare_write(&ctx.storage, &ctx.namespaces, &keys);
            // Those being written are read-locked now (not evictable until written); the rest
            // will not be written: either way eviction may treat them like any object again.
            ctx.storage.clear_unwritten(&keys);
            if let Some(batch) = batch {
                if let Err(back) = tx.send(batch) {
                    // No I/O thread: finish here so nothing stays locked, and make it durable.
                    if l2.complete_write(&ctx.storage, back.0) > 0 {
                        sync(ctx, l2);
                    }
                }
            }
        }
        // Dropping the sender lets the I/O thread finish what it holds, sync and exit.
    });
    tracing::debug!("L2 writer stopped");
}

/// The I/O end of the write-behind pipeline: completes batches in order and makes completed
/// writes durable (fdatasync) at least every [`SYNC_EVERY`] while writing, and when idle.
fn complete_batches(
    ctx: &NodeContext,
    l2: &super::L2Tier,
    rx: std::sync::mpsc::Receiver<super::tier::WriteBatch<'_>>,
) {
    use std::sync::mpsc::RecvTimeoutError;
    let mut last_sync = Instant::now();
    let mut unsynced = false;
    loop {
        match rx.recv_timeout(IDLE_WAIT) {
            Ok(batch) => {
                unsynced |= l2.complete_write(&ctx.storage, batch) > 0;
                if unsynced && last_sync.elapsed() >= SYNC_EVERY {
                    unsynced = !sync(ctx, l2);
                    last_sync = Instant::now();
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if unsynced {
                    unsynced = !sync(ctx, l2);
                    last_sync = Instant::now();
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    if unsynced {
        let _ = sync(ctx, l2);
    }
}

/// Writes the rest of the queue and syncs, on the caller's thread, then closes the queue: the
/// shutdown path calls it after the worker threads have stopped. A commit that still slips in
/// on a connection thread afterwards is counted as dropped (and logged), never left queued.
pub fn drain(ctx: &NodeContext) {
    let Some(set) = &ctx.l2 else { return };
    for l2 in set.tiers() {
        drain_device(ctx, l2);
    }
    // Every device is drained and synced: their tables make the next start fast (a device
    // that is stuck or failed its sync refuses, and is read header by header next time).
    set.checkpoint(&ctx.namespaces);
}

fn drain_device(ctx: &NodeContext, l2: &super::L2Tier) {
    // Keys that waited for an older busy entry of theirs get their last chance.
    l2.requeue_deferred();
    let mut n = 0;
    loop {
        if l2.queue.is_empty() {
            l2.queue.close();
        }
        let items = l2.queue.pop_batch(l2.batch_objects() * PIPELINE_BATCHES);
        if items.is_empty() {
            break;
        }
        n += l2.persist(&ctx.storage, &ctx.namespaces, &items);
        ctx.storage.clear_unwritten(&items);
    }
    let deferred = l2.discard_deferred();
    if deferred > 0 {
        tracing::warn!(
            deferred,
            "objects still waiting for an older busy copy of theirs: not written to L2"
        );
    }
    if l2.stuck() {
        tracing::error!(
            path = %l2.status().path,
            "an L2 device is not answering at shutdown: its final fdatasync is skipped"
        );
    } else if !sync(ctx, l2) {
        tracing::error!(
            path = %l2.status().path,
            "the final L2 fdatasync failed at shutdown: objects written since the last good sync \
             may be missing after the restart (none is served unless its checksum holds)"
        );
    }
    if n > 0 {
        tracing::info!(written = n, "L2 write-behind drained at shutdown");
    }
}

/// The `on-evict` policy: when L1 is at its high watermark, writes the objects the eviction
/// pass would take (oldest first, down to the low watermark) to L2 in batches, evicting each
/// batch right after its write, so eviction drops only objects that survive on disk (or whose
/// write failed, counted). Returns the number of objects evicted, `None` below the watermark.
fn demote(ctx: &NodeContext, l2: &super::L2Set) -> Option<u64> {
    let cap = ctx.storage.capacity() as f64;
    let used = ctx.storage.used_bytes() as f64;
    if cap == 0.0 || used < cap * ctx.config.high_watermark {
        return None;
    }
    let excess = (used - cap * ctx.config.low_watermark).max(0.0) as u64;
    let victims = ctx.storage.eviction_candidates(excess);
    let mut evicted = 0;
    let mut written = 0;
    let per_round = l2.tiers()[0].batch_objects() * PIPELINE_BATCHES;
    for part in victims.chunks(per_round) {
        // Objects of unknown layout are not demoted (they could later be served under
        // another layout); each object is stamped with the layout it was committed under.
        let todo: Vec<StorageKey> = part
            .iter()
            .filter(|k| {
                ctx.storage
                    .ready_object(k)
                    .is_some_and(|(len, layout)| layout != 0 && !l2.holds_as(k, len, layout))
            })
            .copied()
            .collect();
        written += l2.persist(&ctx.storage, &ctx.namespaces, &todo);
        // Only what is now on L2 goes: an object whose write failed or was not attempted stays
        // (an allocation that needs its room still evicts it, counted).
        let on_l2: Vec<StorageKey> = part
            .iter()
            .filter(|k| {
                ctx.storage
                    .ready_object(k)
                    .is_some_and(|(len, layout)| l2.holds_as(k, len, layout))
            })
            .copied()
            .collect();
        evicted += ctx.storage.evict_if_idle(&on_l2);
        if ctx.shutting_down.load(Ordering::Acquire) {
            break;
        }
    }
    if written > 0 {
        for t in l2.tiers() {
            let _ = sync(ctx, t);
        }
    }
    tracing::debug!(evicted, candidates = victims.len(), "L2 demotion");
    Some(evicted)
}

/// `fdatasync`; false (logged) if it failed, so the caller tries again later. The objects
/// written since the last good sync were then dropped from L2 (see [`super::L2Tier::sync`]):
/// those still in L1 are queued to be written again.
fn sync(ctx: &NodeContext, l2: &super::L2Tier) -> bool {
    match l2.sync() {
        Ok(()) => true,
        Err((e, dropped)) => {
            let again: Vec<StorageKey> = dropped
                .iter()
                .filter(|k| ctx.storage.ready_object(k).is_some())
                .copied()
                .collect();
            let requeued = again.len() - l2.queue.push(again).len();
            tracing::warn!(
                error = %e,
                dropped = dropped.len(),
                requeued,
                "L2 fdatasync failed: the objects written since the last good sync are no longer \
                 counted as on disk"
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::NamespaceId;

    fn key(i: u8) -> StorageKey {
        StorageKey {
            chunk_hash: [i; 32],
            kv_rank: 0,
            object_group: 0,
            namespace: NamespaceId(0),
        }
    }

    #[test]
    fn queue_bounds_and_closing() {
        let q = WriteQueue::new(2);
        assert_eq!(
            q.push([key(1), key(2), key(3)]),
            vec![key(3)],
            "beyond capacity: dropped"
        );
        assert_eq!((q.len(), q.dropped()), (2, 1));
        assert_eq!(q.pop_batch(8), vec![key(1), key(2)]);
        q.close();
        assert_eq!(
            q.push([key(4)]),
            vec![key(4)],
            "after the shutdown drain: dropped, not queued"
        );
        assert!(q.is_empty());
        assert_eq!(q.dropped(), 2);
    }

    #[test]
    fn closing_while_pushing_leaves_nothing_behind_the_drain() {
        let q = Arc::new(WriteQueue::new(1 << 16));
        let accepted = Arc::new(AtomicU64::new(0));
        let pushers: Vec<_> = (0..4u8)
            .map(|t| {
                let (q, accepted) = (q.clone(), accepted.clone());
                std::thread::spawn(move || {
                    for i in 0..2000u32 {
                        let mut k = key(t);
                        k.chunk_hash[4..8].copy_from_slice(&i.to_le_bytes());
                        let mut k2 = k;
                        k2.kv_rank = 1;
                        let refused = q.push([k, k2]).len() as u64;
                        accepted.fetch_add(2 - refused, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        // The shutdown drain's loop, racing the pushers.
        let mut popped = 0u64;
        loop {
            if q.is_empty() {
                q.close();
            }
            let items = q.pop_batch(64);
            if items.is_empty() {
                break;
            }
            popped += items.len() as u64;
        }
        for p in pushers {
            p.join().unwrap();
        }
        assert!(q.is_empty(), "a push landed behind the drain's last pop");
        assert_eq!(popped, accepted.load(Ordering::Relaxed));
        assert_eq!(popped + q.dropped(), 4 * 2000 * 2);
    }

    #[test]
    fn batches_are_bounded_by_count_and_bytes() {
        let q = WriteQueue::new(16);
        assert!(q.push((1..=6).map(key)).is_empty());
        // Objects of 40 bytes under a 100-byte budget: the third one crosses it and ends the batch.
        let len = |_: &StorageKey| 40;
        assert_eq!(q.pop_batch_within(8, 100, &len).len(), 3);
        assert_eq!(q.pop_batch_within(2, 1000, &len).len(), 2, "count bound");
        // One object larger than the budget still makes a batch of one.
        assert_eq!(q.pop_batch_within(8, 10, &len), vec![key(6)]);
        assert!(q.pop_batch_within(8, 10, &len).is_empty());
    }
}
