//! The storage core: sharded index + slab allocator + the L1 object state machine + eviction.
//!
//! State machine per key (LMCache `l1_manager` semantics, section 8.1 of the reference):
//! `absent -> WriteReserved -> Ready <-> Ready(readers > 0)`, plus temporary and doomed flags.
//! Fixes over LMCache: an aborted or expired write reservation is deleted and its memory freed
//! (never published, W3); CLEAR dooms in-flight objects instead of freeing memory a client may
//! still be copying (W4); allocation evicts synchronously before failing (P6).
//!
//! Concurrency: each key operation locks one index shard; the allocator has its own short mutex.
//! Lock order is always shard -> allocator (several shards: in index order). Batch operations
//! hold `gate` in shared mode so that the exact `memcheck` (exclusive) sees a consistent snapshot;
//! no exclusive lock is held across a batch. Every change to an entry updates its shard's
//! `ShardTally` under the shard's lock, so object counts are read without any lock.
//!
//! This file holds the types and the core's shared helpers; the operations are split by job:
//! `write` (reserve, publish, abort), `read` (read locks, I/O holds, lookups), `evict`
//! (eviction, expiry, CLEAR), `check` (whole-index views and the exact memcheck), `tally` (the
//! per-shard counters) and `incremental` (the memcheck that never stops the hot path).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::Clock;

use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use super::allocator::{SlabAllocator, Slot};
use super::index::{Entry, Shard};
use super::key::StorageKey;

mod check;
mod evict;
mod incremental;
mod pin;
mod read;
mod tally;
mod write;

pub use check::STRICT_CHECK_MAX_OBJECTS;
pub use incremental::{MemcheckStatus, MEMCHECK_MAX_PROBLEMS};
pub use pin::Moving;
use tally::{ShardTally, Tally};

/// Number of index shards (a power of two).
pub const INDEX_SHARDS: usize = 64;

/// Per-key error codes of the L1 state machine (LMCache `distributed/error.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum KeyError {
    /// The key has no object (or its object is doomed).
    KeyNotExist,
    /// The object exists but cannot be read (write-reserved).
    KeyNotReadable,
    /// The object cannot be (re)written: it exists already.
    KeyNotWritable,
    /// The object is not in the state the operation needs.
    KeyInWrongState,
    /// The object holds locks that forbid the operation.
    KeyIsLocked,
    /// No memory, even after evicting every evictable object.
    OutOfMemory,
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// Tunables of the storage core. Invariant: `0 < low_watermark <= high_watermark <= 1`.
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// Write reservations older than this are deleted and freed (last-resort safety net).
    pub write_ttl: Duration,
    /// Read locks older than this are dropped (last-resort safety net).
    pub read_ttl: Duration,
    /// Background eviction starts when used/capacity reaches this ratio...
    pub high_watermark: f64,
    /// ...and evicts until used/capacity is at most this ratio.
    pub low_watermark: f64,
    /// Hard limit on objects in the index.
    pub max_objects: usize,
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            write_ttl: Duration::from_secs(600),
            read_ttl: Duration::from_secs(300),
            high_watermark: 0.95,
            low_watermark: 0.85,
            max_objects: 16 << 20,
        }
    }
}

/// Object counts by state and the byte accounting, as reported in STATUS.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ObjectCounts {
    /// Committed, unlocked objects.
    pub ready: u64,
    /// Reserved, uncommitted objects.
    pub write_reserved: u64,
    /// Committed objects holding read locks.
    pub read_locked: u64,
    /// Temporary objects (freed when their last reader finishes).
    pub temporary: u64,
    /// Objects waiting for their transfer to end before deletion.
    pub doomed: u64,
    /// Committed objects whose L2 write-behind has not run yet (evicted last).
    pub unwritten: u64,
}

/// Eviction and expiry counters.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EvictionCounters {
    /// Objects evicted synchronously because an allocation needed room.
    pub sync_evictions: u64,
    /// Objects evicted by the watermark pass.
    pub background_evictions: u64,
    /// Evicted objects (of both kinds above) whose L2 write-behind had not run yet: nothing
    /// else was evictable, and they are lost to both tiers.
    pub unwritten_evictions: u64,
    /// Write reservations deleted by TTL expiry.
    pub expired_writes: u64,
    /// Read locks dropped by TTL expiry (objects affected).
    pub expired_reads: u64,
    /// Keys that could not be reserved for lack of memory.
    pub oom_keys: u64,
}

/// What a reservation or read lock hands out: the slot, and the entry's lease at that moment.
/// Invariant: committing, aborting or unlocking with a grant whose lease no longer matches the
/// entry is refused, so a stale transfer can never act on a newer reservation of the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grant {
    /// Where the bytes live.
    pub slot: Slot,
    /// The entry's lease when the grant was issued.
    pub lease: u64,
    /// Fingerprint of the layout the object was committed (or loaded) under, as the entry held
    /// it when the grant was issued; 0 = unknown (always for a write reservation).
    pub layout: u64,
}

/// Result of a consistency check. Invariant: `ok` iff `problems` is empty.
#[derive(Debug, Clone, Serialize)]
pub struct MemcheckReport {
    /// Whether every invariant holds.
    pub ok: bool,
    /// Live objects seen in the index.
    pub objects: u64,
    /// Sum of slot bytes of live objects.
    pub index_bytes: u64,
    /// What the allocator believes is allocated.
    pub allocated_bytes: u64,
    /// Descriptions of violated invariants.
    pub problems: Vec<String>,
}

/// The shared storage core. See the module docs for the locking rules.
pub struct StorageCore {
    shards: Box<[Mutex<Shard>]>,
    /// Object counters per shard, changed only under that shard's lock (see `tally`).
    tallies: Box<[ShardTally]>,
    /// Serialises memchecks node-wide and remembers the last outcome (see `incremental`).
    checks: incremental::CheckRecord,
    alloc: Mutex<SlabAllocator>,
    gate: RwLock<()>,
    stamp: AtomicU64,
    clock: Clock,
    config: StorageConfig,
    object_count: AtomicU64,
    sync_evictions: AtomicU64,
    background_evictions: AtomicU64,
    unwritten_evictions: AtomicU64,
    expired_writes: AtomicU64,
    expired_reads: AtomicU64,
    oom_keys: AtomicU64,
}

impl StorageCore {
    /// A core managing `pool_bytes` of pool address space (offsets from 0), on real time.
    pub fn new(pool_bytes: u64, config: StorageConfig) -> StorageCore {
        StorageCore::with_clock(pool_bytes, config, Clock::real())
    }

    /// [`StorageCore::new`] reading its TTL deadlines from `clock` (the simulator's manual clock).
    pub fn with_clock(pool_bytes: u64, config: StorageConfig, clock: Clock) -> StorageCore {
        assert!(
            0.0 < config.low_watermark
                && config.low_watermark <= config.high_watermark
                && config.high_watermark <= 1.0,
            "watermarks must satisfy 0 < low <= high <= 1"
        );
        StorageCore {
            shards: (0..INDEX_SHARDS).map(|_| Mutex::default()).collect(),
            tallies: (0..INDEX_SHARDS).map(|_| ShardTally::default()).collect(),
            checks: incremental::CheckRecord::default(),
            alloc: Mutex::new(SlabAllocator::new(pool_bytes)),
            gate: RwLock::new(()),
            stamp: AtomicU64::new(1),
            clock,
            config,
            object_count: AtomicU64::new(0),
            sync_evictions: AtomicU64::new(0),
            background_evictions: AtomicU64::new(0),
            unwritten_evictions: AtomicU64::new(0),
            expired_writes: AtomicU64::new(0),
            expired_reads: AtomicU64::new(0),
            oom_keys: AtomicU64::new(0),
        }
    }

    /// Milliseconds on the TTL clock.
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    fn read_ttl_ms(&self) -> u64 {
        u64::try_from(self.config.read_ttl.as_millis()).unwrap_or(u64::MAX)
    }

    fn write_ttl_ms(&self) -> u64 {
        u64::try_from(self.config.write_ttl.as_millis()).unwrap_or(u64::MAX)
    }

    /// The configuration in force.
    pub fn config(&self) -> &StorageConfig {
        &self.config
    }

    /// The index shard `key` lives in, for life (a pure function of the key).
    fn shard_index(key: &StorageKey) -> usize {
        let mut b = [0u8; 8];
        b.copy_from_slice(&key.chunk_hash[8..16]);
        let h = u64::from_le_bytes(b) ^ u64::from(key.kv_rank) ^ key.namespace.0;
        (h as usize) & (INDEX_SHARDS - 1)
    }

    fn shard(&self, key: &StorageKey) -> &Mutex<Shard> {
        &self.shards[Self::shard_index(key)]
    }

    fn next_stamps(&self, n: u64) -> u64 {
        self.stamp.fetch_add(n, Ordering::Relaxed)
    }

    /// Drops read locks whose TTL passed (last-resort safety net): the count restarts at 0 and
    /// the lease changes, so holders of the expired locks can no longer release anyone else's.
    /// Locks whose bytes are being moved (`pins > 0`) never expire.
    fn drop_expired_reads(&self, e: &mut Entry, now_ms: u64) -> bool {
        if e.readers > 0 && e.pins == 0 && e.lock_deadline_ms <= now_ms {
            e.readers = 0;
            e.lease = self.next_stamps(1);
            self.expired_reads.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// After a read lock or an I/O hold on `key` was released (its entry counted as `before`
    /// until then): a temporary or doomed object that nothing holds any more is deleted and
    /// freed, anything else goes back to its recency list. Caller holds shard `si`, the key's.
    fn settle_released(&self, si: usize, shard: &mut Shard, key: &StorageKey, before: Tally) {
        let Some(e) = shard.map.get(key) else { return };
        if e.unheld() && (e.temporary || e.doomed) {
            let e = shard.remove(key).expect("present");
            self.tally(si, before, Tally::ABSENT);
            self.release_slot(e.slot);
        } else {
            let after = Tally::of(e);
            shard.sync_recency(key);
            self.tally(si, before, after);
        }
    }

    /// Frees the slot of `e`, just removed from shard `si` (whose lock the caller holds), and
    /// takes it out of the shard's counters.
    fn discard(&self, si: usize, e: Entry) {
        self.tally(si, Tally::of(&e), Tally::ABSENT);
        self.release_slot(e.slot);
    }

    /// Pool capacity usable for objects.
    pub fn capacity(&self) -> u64 {
        self.alloc.lock().capacity()
    }

    /// Bytes currently in slots (reserved or committed).
    pub fn used_bytes(&self) -> u64 {
        self.alloc.lock().allocated_bytes()
    }

    fn release_slot(&self, slot: Slot) {
        if let Err(e) = self.alloc.lock().free(slot) {
            // A double free would mean two entries shared a slot: report loudly, keep serving.
            tracing::error!(error = %e, ?slot, "allocator rejected a free: index/allocator out of sync");
            debug_assert!(false, "allocator rejected free: {e}");
        }
        self.object_count.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
