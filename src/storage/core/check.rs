//! Whole-index views of [`StorageCore`]: namespaces in use, snapshots, object and eviction
//! counts, allocator statistics, and the memcheck consistency check.

use std::sync::atomic::Ordering;

use super::{EvictionCounters, MemcheckReport, ObjectCounts, StorageCore};
use crate::storage::index::{Entry, ObjectState};
use crate::storage::key::StorageKey;

impl StorageCore {
    /// The namespaces of every object in the index (the namespace reclaimer keeps them).
    pub fn namespaces_in_use(&self) -> std::collections::HashSet<crate::storage::key::NamespaceId> {
        let mut out = std::collections::HashSet::new();
        for shard in self.shards.iter() {
            out.extend(shard.lock().map.keys().map(|k| k.namespace));
        }
        out
    }

    /// Every object in the index with its entry, on a consistent snapshot (the simulator's
    /// checkers compare it with what clients were promised). O(objects): never on a request path.
    pub fn snapshot(&self) -> Vec<(StorageKey, Entry)> {
        let _g = self.gate.write();
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            out.extend(shard.lock().map.iter().map(|(k, e)| (*k, e.clone())));
        }
        out.sort_unstable_by_key(|(k, _)| *k);
        out
    }

    /// Counts objects by state.
    pub fn counts(&self) -> ObjectCounts {
        let mut c = ObjectCounts::default();
        for shard in self.shards.iter() {
            for e in shard.lock().map.values() {
                match (e.state, e.unheld()) {
                    (ObjectState::WriteReserved, _) => c.write_reserved += 1,
                    (ObjectState::Ready, true) => c.ready += 1,
                    (ObjectState::Ready, false) => c.read_locked += 1,
                }
                c.temporary += u64::from(e.temporary);
                c.doomed += u64::from(e.doomed);
                c.unwritten += u64::from(e.unwritten);
            }
        }
        c
    }

    /// Eviction and expiry counters.
    pub fn eviction_counters(&self) -> EvictionCounters {
        EvictionCounters {
            sync_evictions: self.sync_evictions.load(Ordering::Relaxed),
            background_evictions: self.background_evictions.load(Ordering::Relaxed),
            unwritten_evictions: self.unwritten_evictions.load(Ordering::Relaxed),
            expired_writes: self.expired_writes.load(Ordering::Relaxed),
            expired_reads: self.expired_reads.load(Ordering::Relaxed),
            oom_keys: self.oom_keys.load(Ordering::Relaxed),
        }
    }

    /// Checks every invariant on a consistent snapshot: allocated bytes equal the sum of live
    /// objects' slots, no two slots overlap, the allocator's live set is exactly the index's,
    /// recency lists match the Ready entries, write reservations hold no read locks.
    pub fn memcheck(&self) -> MemcheckReport {
        let _g = self.gate.write();
        let shards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let alloc = self.alloc.lock();
        let mut problems = Vec::new();
        let mut slots = Vec::new();
        let mut index_bytes = 0;
        for (si, shard) in shards.iter().enumerate() {
            let mut evictable = 0;
            for (k, e) in shard.map.iter() {
                slots.push(e.slot);
                index_bytes += e.slot.class_bytes;
                if e.state == ObjectState::WriteReserved && !e.unheld() {
                    problems.push(format!(
                        "shard {si}: write-reserved object holds {} read locks",
                        e.readers
                    ));
                }
                if e.evictable() {
                    evictable += 1;
                    let list = if e.unwritten {
                        &shard.recency_unwritten
                    } else {
                        &shard.recency
                    };
                    if list.get(&e.stamp) != Some(k) {
                        problems.push(format!(
                            "shard {si}: evictable object missing from its recency list"
                        ));
                    }
                }
            }
            let listed = shard.recency.len() + shard.recency_unwritten.len();
            if evictable != listed {
                problems.push(format!(
                    "shard {si}: recency lists have {listed} entries for {evictable} evictable objects"
                ));
            }
        }
        let allocated_bytes = alloc.allocated_bytes();
        if allocated_bytes != index_bytes {
            problems.push(format!(
                "allocator holds {allocated_bytes} bytes, index accounts for {index_bytes}"
            ));
        }
        if slots.len() as u64 != self.object_count.load(Ordering::Relaxed) {
            problems.push(format!(
                "object counter {} != {} objects in the index",
                self.object_count.load(Ordering::Relaxed),
                slots.len()
            ));
        }
        if let Err(e) = alloc.check(&slots) {
            problems.push(format!("allocator: {e}"));
        }
        MemcheckReport {
            ok: problems.is_empty(),
            objects: slots.len() as u64,
            index_bytes,
            allocated_bytes,
            problems,
        }
    }

    /// With the `strict-assertions` feature, panics if memcheck fails (for tests); otherwise no-op.
    pub fn assert_consistent(&self) {
        #[cfg(feature = "strict-assertions")]
        {
            let r = self.memcheck();
            assert!(r.ok, "memcheck failed: {:?}", r.problems);
        }
    }

    /// Allocator size classes: (class bytes, live slots, slabs).
    pub fn class_stats(&self) -> Vec<(u64, usize, usize)> {
        self.alloc.lock().class_stats()
    }
}
