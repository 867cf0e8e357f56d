//! Placement of stores: a store lands on the engine's own node first (its copy stays local,
//! zero-copy); once published, the chunks another member owns are pushed to that owner in the
//! background, so any node finds them where placement says they are.
//!
//! Write amplification: each stored chunk crosses the network once unless this node owns it
//! (a share `w_self / sum(w)` of keys), so about `(n-1)/n` of the stored bytes with n equal
//! members, and the cluster holds up to two copies of such a chunk (the writer's, evictable like
//! any cached object, and the owner's). Pushes never delay a store: they wait in a queue bounded
//! in bytes (`cluster.max_push_queue_bytes`); beyond it a push is dropped and counted (the chunk
//! stays cached here; only other nodes miss it).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::ClusterNode;
use crate::error::{Error, Result};
use crate::modules::instances::Instance;
use crate::modules::NodeContext;
use crate::protocol::ChunkRange;
use crate::storage::{Layout, StorageKey};

/// Times a failed push is retried (after 1, 2 and 4 s: a link that flaps for a few seconds
/// loses nothing; a longer partition ends the owner's lease, and its rejoin hands it its share).
pub const PUSH_RETRIES: u8 = 3;

/// Failed pushes waiting for their retry, at most (beyond: dropped, counted).
pub const MAX_DELAYED_PUSHES: usize = 65_536;

/// Bytes one push call moves at most (its chunks are copied out of the pool under read locks
/// into one buffer of this size at most).
pub const MAX_PUSH_BATCH_BYTES: u64 = 32 << 20;

/// One chunk (one rank) to push.
#[derive(Clone)]
pub struct PushItem {
    /// The owner's id and endpoint.
    pub owner: String,
    /// The owner's fabric endpoint.
    pub endpoint: String,
    /// Model and cache salt.
    pub model: String,
    /// Cache salt.
    pub salt: String,
    /// KV world size and this object's rank.
    pub world_size: u32,
    /// The rank.
    pub rank: u32,
    /// The layout the object was stored under.
    pub layout: Layout,
    /// The local key.
    pub key: StorageKey,
    /// Pushes of it that failed so far (retried after 1, 2 and 4 s; then dropped).
    pub attempts: u8,
}

impl PushItem {
    fn same_batch(&self, o: &PushItem) -> bool {
        self.owner == o.owner
            && self.model == o.model
            && self.salt == o.salt
            && self.world_size == o.world_size
            && self.rank == o.rank
            && self.layout.fingerprint() == o.layout.fingerprint()
    }
}

/// The queue of pushes. Invariant: `inner.1` is the sum of the queued items' object sizes, at
/// most `max_bytes`; `inner.2` counts the batches taken and not yet [`PushQueue::done`].
pub struct PushQueue {
    inner: Mutex<(VecDeque<PushItem>, u64, u64)>,
    /// Failed pushes and when they are due again (at most [`MAX_DELAYED_PUSHES`]).
    delayed: Mutex<Vec<(Instant, PushItem)>>,
    ready: Condvar,
    max_bytes: u64,
}

impl PushQueue {
    /// An empty queue of at most `max_bytes`.
    pub fn new(max_bytes: u64) -> PushQueue {
        PushQueue {
            inner: Mutex::new((VecDeque::new(), 0, 0)),
            delayed: Mutex::new(Vec::new()),
            ready: Condvar::new(),
            max_bytes,
        }
    }

    /// Queues `item`; `false` (dropped) when it does not fit.
    pub fn offer(&self, item: PushItem) -> bool {
        let size = item.layout.object_bytes();
        let mut q = self.inner.lock();
        if q.1 + size > self.max_bytes {
            return false;
        }
        q.1 += size;
        q.0.push_back(item);
        drop(q);
        self.ready.notify_one();
        true
    }

    /// The next batch (same owner, namespace, rank and layout; at most
    /// [`MAX_PUSH_BATCH_BYTES`]), waiting up to `wait` for one.
    pub fn next_batch(&self, wait: Duration) -> Vec<PushItem> {
        let mut q = self.inner.lock();
        if q.0.is_empty() {
            self.ready.wait_for(&mut q, wait);
        }
        let Some(first) = q.0.pop_front() else {
            return Vec::new();
        };
        let mut bytes = first.layout.object_bytes();
        let mut batch = vec![first];
        let mut i = 0;
        while i < q.0.len() {
            let size = q.0[i].layout.object_bytes();
            if batch[0].same_batch(&q.0[i]) && bytes + size <= MAX_PUSH_BATCH_BYTES {
                bytes += size;
                batch.push(q.0.remove(i).expect("index checked"));
            } else {
                i += 1;
            }
        }
        q.1 -= bytes;
        q.2 += 1;
        batch
    }

    /// Marks a batch [`PushQueue::next_batch`] handed out as finished (pushed or failed).
    pub fn done(&self) {
        let mut q = self.inner.lock();
        debug_assert!(q.2 > 0);
        q.2 = q.2.saturating_sub(1);
    }

    /// Schedules the retry of `items` whose push failed; returns how many were dropped (out of
    /// retries, or no room).
    pub fn delay(&self, items: &[PushItem]) -> usize {
        let now = Instant::now();
        let mut d = self.delayed.lock();
        let mut dropped = 0;
        for it in items {
            if it.attempts >= PUSH_RETRIES || d.len() >= MAX_DELAYED_PUSHES {
                dropped += 1;
                continue;
            }
            let mut again = it.clone();
            again.attempts += 1;
            d.push((now + Duration::from_secs(1 << it.attempts), again));
        }
        dropped
    }

    /// Queues the delayed pushes that are due; returns how many did not fit (dropped).
    pub fn promote_due(&self) -> usize {
        let now = Instant::now();
        let due: Vec<PushItem> = {
            let mut d = self.delayed.lock();
            if d.iter().all(|(t, _)| *t > now) {
                return 0;
            }
            let (due, wait): (Vec<_>, Vec<_>) = d.drain(..).partition(|(t, _)| *t <= now);
            *d = wait;
            due.into_iter().map(|(_, i)| i).collect()
        };
        due.into_iter().filter(|i| !self.offer(i.clone())).count()
    }

    /// Pushes waiting for a retry.
    pub fn delayed(&self) -> usize {
        self.delayed.lock().len()
    }

    /// Bytes queued.
    pub fn bytes(&self) -> u64 {
        self.inner.lock().1
    }

    /// Batches being pushed now.
    pub fn in_flight(&self) -> u64 {
        self.inner.lock().2
    }
}

impl ClusterNode {
    /// See [`crate::modules::cluster_link::ClusterLink::published`].
    pub(super) fn queue_pushes(&self, ctx: &NodeContext, inst: &Instance, keys: &[StorageKey]) {
        if !self.cfg.push || keys.is_empty() {
            return;
        }
        self.layouts.learn(&inst.layout);
        let view = self.view();
        if view.members.len() < 2 {
            return;
        }
        for k in keys {
            let Some((model, salt)) = ctx.namespaces.name(k.namespace) else {
                continue;
            };
            let key = super::placement::placement_key(&model, &salt, &k.chunk_hash);
            let Some(owner) = view.owner(key) else { return };
            if owner.local {
                continue;
            }
            let item = PushItem {
                owner: owner.desc.node_id.clone(),
                endpoint: owner.desc.endpoints[0].clone(),
                model,
                salt,
                world_size: k.kv_rank >> 24,
                rank: (k.kv_rank >> 16) & 0xff,
                layout: inst.layout.clone(),
                key: *k,
                attempts: 0,
            };
            if self.pushes.offer(item) {
                self.counters.push_queued.fetch_add(1, Ordering::Relaxed);
            } else {
                self.counters.push_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Pushes one batch: asks the owner which chunks it lacks (PREPARE_STORE), copies those out
    /// of the pool under read locks (one buffer per chunk, at most [`MAX_PUSH_BATCH_BYTES`] in
    /// all) and sends them with the commit. A batch whose owner left the view (or moved) is
    /// dropped, counted; chunks evicted here meanwhile end the push (the owner's reservation is
    /// aborted). Returns the bytes the owner received.
    pub(super) fn push_batch(&self, ctx: &NodeContext, batch: &[PushItem]) -> Result<u64> {
        let first = &batch[0];
        if !super::peers::shareable(&first.layout) {
            return Ok(0);
        }
        let view = self.view();
        let current = view
            .get(&first.owner)
            .is_some_and(|m| m.desc.endpoints[0] == first.endpoint);
        if !current {
            self.counters
                .push_dropped
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            return Ok(0);
        }
        let object_bytes = first.layout.object_bytes();
        let keys: Vec<StorageKey> = batch
            .iter()
            .map(|b| b.key)
            .filter(|k| ctx.storage.contains_ready(k))
            .collect();
        if keys.is_empty() {
            return Ok(0); // evicted or cleared meanwhile: nothing to push
        }
        // Bytes move at 50 MB/s at least: the deadline grows with the batch.
        let deadline = Instant::now()
            + self.cfg.peer_timeout()
            + Duration::from_millis(keys.len() as u64 * object_bytes / 50_000);
        let mut t = self.peers.take(&first.owner, &first.endpoint, deadline)?;
        let result = (|| {
            let left = deadline.saturating_duration_since(Instant::now());
            t.conn
                .client
                .set_timeout(Some(left.max(Duration::from_millis(1))))?;
            let inst = t.conn.instance(
                &first.model,
                first.world_size,
                &first.layout,
                self.peers.ids(),
            )?;
            let range = ChunkRange {
                model: first.model.clone(),
                world_size: first.world_size,
                worker_id: Some(first.rank),
                cache_salt: first.salt.clone(),
                first_chunk: 0,
                chunk_hashes: keys.iter().map(|k| k.chunk_hash).collect(),
            };
            let p = t.conn.client.prepare_store(inst, &range)?;
            if p.transfer_id == 0 {
                return Ok(0); // the owner has them all
            }
            let abort = |t: &mut super::peers::Taken, why: Error| {
                let _ = t.conn.client.abort_store(inst, p.transfer_id);
                Err(why)
            };
            let mut wanted = Vec::with_capacity(p.chunk_indices.len());
            for (slot, &i) in p.slots.iter().zip(&p.chunk_indices) {
                let Some(k) = keys.get(i as usize) else {
                    return abort(
                        &mut t,
                        Error::internal(format!("chunk index {i} out of range")),
                    );
                };
                if slot.length != object_bytes {
                    return abort(
                        &mut t,
                        Error::new(
                            crate::error::ErrorKind::Unsupported,
                            format!(
                                "the owner's slot holds {} bytes, the object {object_bytes}",
                                slot.length
                            ),
                        ),
                    );
                }
                wanted.push(*k);
            }
            // Copied out under read locks, released before the bytes go out.
            let grants = ctx.storage.reserve_read(&wanted, 0);
            let mut locked = Vec::with_capacity(wanted.len());
            let mut data: Vec<Vec<u8>> = Vec::with_capacity(wanted.len());
            for (k, g) in wanted.iter().zip(grants) {
                let Ok(g) = g else { break };
                locked.push((*k, g.lease));
                let mut buf = vec![0u8; object_bytes as usize];
                if g.slot.len != object_bytes
                    || ctx.pool.region().read_at(g.slot.offset, &mut buf).is_err()
                {
                    break;
                }
                data.push(buf);
            }
            ctx.storage.finish_read(&locked, 0);
            if data.len() != wanted.len() {
                // Evicted (or replaced) here since the owner was asked: no push this time.
                let _ = t.conn.client.abort_store(inst, p.transfer_id);
                return Ok(0);
            }
            let parts: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let (bytes, _) = t
                .conn
                .client
                .write_slots(inst, p.transfer_id, &parts, true)?;
            Ok(bytes)
        })();
        match result {
            Ok(bytes) => {
                self.peers.put(t);
                Ok(bytes)
            }
            Err(e) => {
                self.peers.close(t);
                Err(e)
            }
        }
    }
}

/// Starts the pusher thread (ends when the node stops or is dropped).
pub fn spawn(node: Weak<ClusterNode>) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kvnode-push".into())
        .spawn(move || {
            let mut known: Option<std::collections::HashSet<(String, i64)>> = None;
            loop {
                let Some(n) = node.upgrade() else { return };
                if n.stopping() {
                    return;
                }
                // Members that appeared since the last turn receive their share.
                let view = n.view();
                let ids = super::handoff::remote_members(&view);
                let joined: std::collections::HashSet<String> = match &known {
                    Some(k) => ids.difference(k).map(|(id, _)| id.clone()).collect(),
                    None => ids.iter().map(|(id, _)| id.clone()).collect(),
                };
                if !joined.is_empty() {
                    if let Some(ctx) = n.ctx.upgrade() {
                        n.hand_off(&ctx, &view, &joined);
                    }
                }
                known = Some(ids);
                push_turn(&n);
            }
        })
}

/// One turn of the pusher: pushes the next batch, if one comes within 100 ms.
fn push_turn(n: &Arc<ClusterNode>) {
    {
        let late = n.pushes.promote_due();
        if late > 0 {
            n.counters
                .push_dropped
                .fetch_add(late as u64, Ordering::Relaxed);
        }
        let batch = n.pushes.next_batch(Duration::from_millis(100));
        if batch.is_empty() {
            return;
        }
        if let Some(ctx) = n.ctx.upgrade() {
            push_one(n, &ctx, &batch);
        }
        n.pushes.done();
    }
}

fn push_one(n: &Arc<ClusterNode>, ctx: &NodeContext, batch: &[PushItem]) {
    match n.push_batch(ctx, batch) {
        Ok(bytes) => {
            n.counters.pushed_batches.fetch_add(1, Ordering::Relaxed);
            n.counters.pushed_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        Err(e) => {
            n.counters
                .push_failed
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            let dropped = n.pushes.delay(batch);
            n.counters
                .push_dropped
                .fetch_add(dropped as u64, Ordering::Relaxed);
            tracing::info!(peer = %batch[0].owner, error = %e, chunks = batch.len(), retried = batch.len() - dropped, "push to the owner failed (the chunks stay cached here; retried later)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{Dtype, NamespaceId};

    fn item(owner: &str, rank: u32, n: u8, layout: &Layout) -> PushItem {
        PushItem {
            owner: owner.into(),
            endpoint: "tcp://127.0.0.1:1".into(),
            model: "m".into(),
            salt: String::new(),
            world_size: 2,
            rank,
            layout: layout.clone(),
            key: StorageKey {
                chunk_hash: [n; 32],
                kv_rank: crate::storage::pack_kv_rank(2, rank),
                object_group: 0,
                namespace: NamespaceId(1),
            },
            attempts: 0,
        }
    }

    #[test]
    fn the_queue_is_bounded_in_bytes_and_batches_by_owner_rank_and_layout() {
        let l = Layout::engine_driven(2, 16, 64, Dtype::Float32, false).unwrap();
        let other = Layout::engine_driven(2, 16, 64, Dtype::Float16, false).unwrap();
        let size = l.object_bytes();
        let q = PushQueue::new(4 * size);
        assert!(q.offer(item("a", 0, 1, &l)));
        assert!(q.offer(item("b", 0, 2, &l)));
        assert!(q.offer(item("a", 1, 3, &l)));
        assert!(q.offer(item("a", 0, 4, &l)));
        // Full: the fifth is refused, nothing else changes.
        assert!(!q.offer(item("a", 0, 5, &l)));
        assert_eq!(q.bytes(), 4 * size);
        let b = q.next_batch(Duration::ZERO);
        let keys: Vec<u8> = b.iter().map(|i| i.key.chunk_hash[0]).collect();
        assert_eq!(keys, [1, 4], "same owner, rank and layout, in order");
        assert_eq!(q.in_flight(), 1);
        assert_eq!(q.bytes(), 2 * size);
        q.done();
        assert_eq!(q.in_flight(), 0);
        assert!(q.offer(item("a", 0, 6, &other)));
        let b = q.next_batch(Duration::ZERO);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].key.chunk_hash[0], 2);
        q.done();
        let b = q.next_batch(Duration::ZERO);
        assert_eq!(b.len(), 1, "another rank is another batch");
        q.done();
        let b = q.next_batch(Duration::ZERO);
        assert_eq!(b.len(), 1, "another layout is another batch");
        q.done();
        assert!(q.next_batch(Duration::ZERO).is_empty());
        assert_eq!((q.bytes(), q.in_flight()), (0, 0));
    }

    #[test]
    fn failed_pushes_come_back_after_their_delay_and_give_up_after_the_last_retry() {
        let l = Layout::engine_driven(2, 16, 64, Dtype::Float32, false).unwrap();
        let q = PushQueue::new(1 << 30);
        let mut it = item("a", 0, 1, &l);
        assert_eq!(q.delay(std::slice::from_ref(&it)), 0);
        assert_eq!(q.delayed(), 1);
        // Not due for a second.
        assert_eq!(q.promote_due(), 0);
        assert!(q.next_batch(Duration::ZERO).is_empty());
        it.attempts = PUSH_RETRIES;
        assert_eq!(q.delay(&[it]), 1, "out of retries: dropped");
        // Due items move back to the queue with their attempt counted.
        {
            let mut d = q.delayed.lock();
            d[0].0 = Instant::now();
        }
        assert_eq!(q.promote_due(), 0);
        assert_eq!(q.delayed(), 0);
        let b = q.next_batch(Duration::ZERO);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].attempts, 1);
        q.done();
    }

    #[test]
    fn a_batch_stops_at_its_byte_limit() {
        // Objects of 8 MiB: four per 32 MiB batch.
        let l = Layout::engine_driven(8, 256, 1024, Dtype::Float32, true).unwrap();
        assert_eq!(l.object_bytes(), 8 << 20);
        let q = PushQueue::new(1 << 30);
        for n in 0..10 {
            assert!(q.offer(item("a", 0, n, &l)));
        }
        let b = q.next_batch(Duration::ZERO);
        assert_eq!(b.len() as u64 * l.object_bytes(), MAX_PUSH_BATCH_BYTES);
        q.done();
    }
}
