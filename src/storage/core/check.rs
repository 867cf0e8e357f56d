//! Whole-index views of [`StorageCore`]: namespaces in use, snapshots, object and eviction
//! counts, allocator statistics, and the memcheck consistency check.

use std::sync::atomic::Ordering;

use super::incremental::Problems;
use super::tally::ShardTally;
use super::{EvictionCounters, MemcheckReport, StorageCore};
use crate::storage::index::{Entry, ObjectState};
use crate::storage::key::StorageKey;

/// Most objects in the index for which `strict-assertions` builds still run the exact memcheck
/// after every storage mutation ([`StorageCore::assert_consistent`]).
pub const STRICT_CHECK_MAX_OBJECTS: u64 = 8192;

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

    /// The exact check, on a consistent snapshot: allocated bytes equal the sum of live
    /// objects' slots, no two slots overlap, the allocator's live set is exactly the index's,
    /// recency lists match the Ready entries, write reservations hold no read locks, every key
    /// lives in its own shard and every shard's counters match a recount.
    ///
    /// Stops the world: it takes the write gate, every shard and the allocator for its whole
    /// run, O(objects). For tests and the simulator (where exactness matters and nothing else
    /// runs); the wire's MEMCHECK runs [`StorageCore::memcheck_incremental`].
    pub fn memcheck(&self) -> MemcheckReport {
        let _g = self.gate.write();
        let shards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let alloc = self.alloc.lock();
        let mut problems = Problems::default();
        let mut slots = Vec::new();
        let mut index_bytes = 0;
        for (si, shard) in shards.iter().enumerate() {
            self.check_shard_locked(si, shard, &mut problems);
            for e in shard.map.values() {
                slots.push(e.slot);
                index_bytes += e.slot.class_bytes;
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
        let problems = problems.into_vec();
        MemcheckReport {
            ok: problems.is_empty(),
            objects: slots.len() as u64,
            index_bytes,
            allocated_bytes,
            problems,
        }
    }

    /// The invariants local to shard `si`, whose lock the caller holds (`shard`): write
    /// reservations hold no read locks, the recency lists hold exactly the evictable entries,
    /// every key belongs to this shard, and the shard's counters equal a recount.
    pub(super) fn check_shard_locked(
        &self,
        si: usize,
        shard: &crate::storage::index::Shard,
        problems: &mut Problems,
    ) {
        {
            let mut evictable = 0;
            for (k, e) in shard.map.iter() {
                if Self::shard_index(k) != si {
                    problems.push(format!(
                        "shard {si}: holds a key of shard {}",
                        Self::shard_index(k)
                    ));
                }
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
        let kept = self.tallies[si].read();
        let counted = ShardTally::recount(shard.map.values());
        if kept != counted {
            problems.push(format!(
                "shard {si}: counters say {:?} / {} objects / {} bytes, the entries {:?} / {} / {}",
                kept.0, kept.1, kept.2, counted.0, counted.1, counted.2
            ));
        }
    }

    /// With the `strict-assertions` feature, panics if memcheck fails (for tests); otherwise no-op.
    /// The exact check stops the world and costs O(objects), so it runs only while the index
    /// holds at most [`STRICT_CHECK_MAX_OBJECTS`] objects (tests that fill a node with many
    /// objects, e.g. to show that a MEMCHECK does not stall other clients, would otherwise
    /// measure this check).
    pub fn assert_consistent(&self) {
        #[cfg(feature = "strict-assertions")]
        {
            if self.object_count.load(Ordering::Relaxed) > STRICT_CHECK_MAX_OBJECTS {
                return;
            }
            let r = self.memcheck();
            assert!(r.ok, "memcheck failed: {:?}", r.problems);
        }
    }

    /// Allocator size classes: (class bytes, live slots, slabs).
    pub fn class_stats(&self) -> Vec<(u64, usize, usize)> {
        self.alloc.lock().class_stats()
    }
}
