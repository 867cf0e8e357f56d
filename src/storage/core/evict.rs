//! Removal of objects from [`StorageCore`]: eviction for allocations and by watermark, the
//! eviction candidates for L2 demotion, the TTL safety net, and CLEAR.

use std::sync::atomic::Ordering;

use super::{StorageCore, Tally};
use crate::storage::allocator::{AllocError, Slot};
use crate::storage::index::ObjectState;
use crate::storage::key::StorageKey;

/// Rounds of the two eviction passes an allocation tries while objects are evictable but keep
/// moving between the recency lists under it.
const EVICT_ATTEMPTS: usize = 4;

impl StorageCore {
    /// Allocates up to `count` slots, evicting as needed; returns fewer (a prefix) when even
    /// eviction cannot make room.
    pub(super) fn allocate_with_eviction(&self, object_bytes: u64, count: usize) -> Vec<Slot> {
        loop {
            match self.alloc.lock().allocate_batch(object_bytes, count) {
                Ok(slots) => return slots,
                Err(AllocError::OutOfMemory { .. }) => {}
                Err(e) => {
                    tracing::warn!(error = %e, object_bytes, "allocation rejected");
                    return Vec::new();
                }
            }
            if !self.evict_one() {
                break;
            }
        }
        // Nothing left to evict: take what fits, earliest keys first.
        let mut got = Vec::new();
        let mut alloc = self.alloc.lock();
        while got.len() < count {
            match alloc.allocate(object_bytes) {
                Ok(s) => got.push(s),
                Err(_) => break,
            }
        }
        got
    }

    /// Evicts the globally oldest evictable object whose L2 write-behind is not pending, else
    /// the oldest one still waiting for it (counted in `unwritten_evictions`: that object is
    /// lost to both tiers). Returns false when nothing is evictable. (Allocation path only.)
    fn evict_one(&self) -> bool {
        // An object can move from the unwritten list to the other between the two passes (its
        // write-behind ran meanwhile): look again while anything at all is evictable.
        for _ in 0..EVICT_ATTEMPTS {
            if self.evict_oldest(false, false) || self.evict_oldest(false, true) {
                return true;
            }
            if !self.shards.iter().any(|s| {
                let s = s.lock();
                !s.recency.is_empty() || !s.recency_unwritten.is_empty()
            }) {
                return false;
            }
        }
        false
    }

    fn evict_oldest(&self, background: bool, unwritten: bool) -> bool {
        loop {
            let mut best: Option<(u64, StorageKey)> = None;
            for shard in self.shards.iter() {
                if let Some(c) = shard.lock().oldest_evictable(unwritten) {
                    if best.is_none_or(|b| c.0 < b.0) {
                        best = Some(c);
                    }
                }
            }
            let Some((stamp, key)) = best else {
                return false;
            };
            let si = Self::shard_index(&key);
            let mut shard = self.shards[si].lock();
            // Re-check under the lock: it may have been locked, touched, written or removed.
            match shard.map.get(&key) {
                Some(e) if e.evictable() && e.stamp == stamp && e.unwritten == unwritten => {}
                _ => continue,
            }
            let e = shard.remove(&key).expect("checked present");
            self.discard(si, e);
            let counter = if background {
                &self.background_evictions
            } else {
                &self.sync_evictions
            };
            counter.fetch_add(1, Ordering::Relaxed);
            if unwritten {
                self.unwritten_evictions.fetch_add(1, Ordering::Relaxed);
            }
            return true;
        }
    }

    /// The oldest evictable objects (least recently used first, whether or not their L2 write is
    /// pending) whose slots add up to at least `bytes` (or all of them): under the `on-evict`
    /// policy (nothing is ever marked unwritten) what the next eviction passes would take. Takes no lock on the
    /// objects; callers that act on them (L2 demotion) lock them first.
    pub fn eviction_candidates(&self, bytes: u64) -> Vec<StorageKey> {
        let mut all: Vec<(u64, StorageKey, u64)> = Vec::new();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            all.extend(
                shard
                    .recency
                    .iter()
                    .chain(shard.recency_unwritten.iter())
                    .filter_map(|(stamp, k)| {
                        shard.map.get(k).map(|e| (*stamp, *k, e.slot.class_bytes))
                    }),
            );
        }
        all.sort_unstable_by_key(|c| c.0);
        let mut total = 0u64;
        all.into_iter()
            .take_while(|c| {
                let more = total < bytes;
                total += c.2;
                more
            })
            .map(|c| c.1)
            .collect()
    }

    /// The watermark pass: when usage is at or above the high watermark, evicts oldest-first down
    /// to the low watermark, skipping objects whose L2 write-behind is pending. Returns the
    /// number evicted.
    pub fn evict_to_watermark(&self) -> u64 {
        let cap = self.capacity() as f64;
        if cap == 0.0 || (self.used_bytes() as f64) < cap * self.config.high_watermark {
            return 0;
        }
        let _g = self.gate.read();
        let mut n = 0;
        // Objects still waiting for their L2 write are left alone here: the write-behind will
        // make them cheap to evict soon; only an allocation that needs the room takes them.
        while (self.used_bytes() as f64) > cap * self.config.low_watermark {
            if !self.evict_oldest(true, false) {
                break;
            }
            n += 1;
        }
        n
    }

    /// Evicts those of `keys` that are evictable right now (ready, unlocked, not doomed);
    /// counted as background evictions. Returns how many were evicted.
    pub fn evict_if_idle(&self, keys: &[StorageKey]) -> u64 {
        let _g = self.gate.read();
        let mut n = 0;
        for k in keys {
            let si = Self::shard_index(k);
            let mut shard = self.shards[si].lock();
            if shard.map.get(k).is_some_and(|e| e.evictable()) {
                let e = shard.remove(k).expect("checked present");
                self.discard(si, e);
                n += 1;
            }
        }
        self.background_evictions.fetch_add(n, Ordering::Relaxed);
        n
    }

    /// The TTL safety net, run by the maintenance thread: write reservations past their deadline
    /// are deleted and freed (never published); read locks past theirs are dropped.
    /// Returns (expired writes, expired read-locked objects).
    pub fn expire_locks(&self, now_ms: u64) -> (u64, u64) {
        let _g = self.gate.read();
        let (mut w, mut r) = (0, 0);
        for (si, shard) in self.shards.iter().enumerate() {
            let mut shard = shard.lock();
            let stale: Vec<StorageKey> = shard
                .map
                .iter()
                .filter(|(_, e)| {
                    (e.state == ObjectState::WriteReserved || e.readers > 0)
                        && e.lock_deadline_ms <= now_ms
                        && e.pins == 0
                })
                .map(|(k, _)| *k)
                .collect();
            for k in stale {
                let e = shard.map.get_mut(&k).expect("listed");
                if e.state == ObjectState::WriteReserved {
                    let e = shard.remove(&k).expect("present");
                    self.discard(si, e);
                    w += 1;
                } else {
                    let before = Tally::of(e);
                    self.drop_expired_reads(e, now_ms);
                    r += 1;
                    self.settle_released(si, &mut shard, &k, before);
                }
            }
        }
        self.expired_writes.fetch_add(w, Ordering::Relaxed);
        (w, r)
    }

    /// Drops every object: ready, unlocked ones are deleted at once; write-reserved or read-locked
    /// ones are doomed and freed when their transfer ends. Returns (deleted, deferred).
    pub fn clear(&self) -> (u64, u64) {
        let _g = self.gate.read();
        let (mut deleted, mut deferred) = (0, 0);
        for (si, shard) in self.shards.iter().enumerate() {
            let mut shard = shard.lock();
            let keys: Vec<StorageKey> = shard.map.keys().copied().collect();
            for k in keys {
                let e = shard.map.get_mut(&k).expect("listed");
                if e.state == ObjectState::Ready && e.unheld() {
                    let e = shard.remove(&k).expect("present");
                    self.discard(si, e);
                    deleted += 1;
                } else if !e.doomed {
                    let before = Tally::of(e);
                    e.doomed = true;
                    let after = Tally::of(e);
                    deferred += 1;
                    shard.sync_recency(&k);
                    self.tally(si, before, after);
                }
            }
        }
        (deleted, deferred)
    }
}
