//! The storage core: sharded index + slab allocator + the L1 object state machine + eviction.
//!
//! State machine per key (LMCache `l1_manager` semantics, section 8.1 of the reference):
//! `absent -> WriteReserved -> Ready <-> Ready(readers > 0)`, plus temporary and doomed flags.
//! Fixes over LMCache: an aborted or expired write reservation is deleted and its memory freed
//! (never published, W3); CLEAR dooms in-flight objects instead of freeing memory a client may
//! still be copying (W4); allocation evicts synchronously before failing (P6).
//!
//! Concurrency: each key operation locks one index shard; the allocator has its own short mutex.
//! Lock order is always shard -> allocator. Batch operations hold `gate` in shared mode so that
//! `memcheck` (exclusive) sees a consistent snapshot; no exclusive lock is held across a batch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::Clock;

use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use super::allocator::{AllocError, SlabAllocator, Slot};
use super::index::{Entry, ObjectState, Shard};
use super::key::StorageKey;

/// Number of index shards (a power of two).
pub const INDEX_SHARDS: usize = 64;
/// Rounds of the two eviction passes an allocation tries while objects are evictable but keep
/// moving between the recency lists under it.
const EVICT_ATTEMPTS: usize = 4;

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

    fn shard(&self, key: &StorageKey) -> &Mutex<Shard> {
        let mut b = [0u8; 8];
        b.copy_from_slice(&key.chunk_hash[8..16]);
        let h = u64::from_le_bytes(b) ^ u64::from(key.kv_rank) ^ key.namespace.0;
        &self.shards[(h as usize) & (INDEX_SHARDS - 1)]
    }

    fn next_stamps(&self, n: u64) -> u64 {
        self.stamp.fetch_add(n, Ordering::Relaxed)
    }

    /// Drops read locks whose TTL passed (last-resort safety net): the count restarts at 0 and
    /// the lease changes, so holders of the expired locks can no longer release anyone else's.
    fn drop_expired_reads(&self, e: &mut Entry, now_ms: u64) -> bool {
        if e.readers > 0 && e.lock_deadline_ms <= now_ms {
            e.readers = 0;
            e.lease = self.next_stamps(1);
            self.expired_reads.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// After a read lock or an I/O hold on `key` was released: a temporary or doomed object
    /// that nothing holds any more is deleted and freed, anything else goes back to its recency
    /// list. Caller holds the key's shard.
    fn settle_released(&self, shard: &mut Shard, key: &StorageKey) {
        let Some(e) = shard.map.get(key) else { return };
        if e.unheld() && (e.temporary || e.doomed) {
            let e = shard.remove(key).expect("present");
            self.release_slot(e.slot);
        } else {
            shard.sync_recency(key);
        }
    }

    /// Pool capacity usable for objects.
    pub fn capacity(&self) -> u64 {
        self.alloc.lock().capacity()
    }

    /// Bytes currently in slots (reserved or committed).
    pub fn used_bytes(&self) -> u64 {
        self.alloc.lock().allocated_bytes()
    }

    /// Reserves write slots for every **absent** key ("new" mode): existing keys are skipped with
    /// an error code. When memory is short it evicts ready, unlocked objects (oldest first) until
    /// the reservation fits; if it still does not, it reserves the longest prefix of the absent keys
    /// that fits and marks the rest `OutOfMemory` (earlier chunks are worth more than later ones).
    /// Results are per key, in order. Reserved objects start `WriteReserved`.
    pub fn reserve_write(
        &self,
        keys: &[StorageKey],
        object_bytes: u64,
        temporary: bool,
    ) -> Vec<Result<Grant, KeyError>> {
        let deadline = self.now_ms().saturating_add(self.write_ttl_ms());
        self.reserve_write_until(keys, object_bytes, temporary, deadline)
    }

    /// [`StorageCore::reserve_write`] for the node's own I/O (an L2 load writing into the slot):
    /// the reservation never expires, because freeing a slot the kernel may still be writing
    /// into would corrupt whatever reuses it. The tier always commits or aborts it.
    pub fn reserve_write_untimed(
        &self,
        keys: &[StorageKey],
        object_bytes: u64,
    ) -> Vec<Result<Grant, KeyError>> {
        self.reserve_write_until(keys, object_bytes, false, u64::MAX)
    }

    fn reserve_write_until(
        &self,
        keys: &[StorageKey],
        object_bytes: u64,
        temporary: bool,
        deadline: u64,
    ) -> Vec<Result<Grant, KeyError>> {
        let _g = self.gate.read();
        let mut results: Vec<Result<Grant, KeyError>> = Vec::with_capacity(keys.len());
        let mut absent = Vec::with_capacity(keys.len());
        let mut seen: std::collections::HashSet<
            StorageKey,
            std::hash::BuildHasherDefault<super::index::FingerprintHasher>,
        > = std::collections::HashSet::with_capacity_and_hasher(keys.len(), Default::default());
        for (i, k) in keys.iter().enumerate() {
            let shard = self.shard(k).lock();
            match shard.map.get(k) {
                None => {
                    // Duplicate keys inside one batch: only the first is reserved (a set, so a
                    // 64k-chunk batch stays linear).
                    if !seen.insert(*k) {
                        results.push(Err(KeyError::KeyNotWritable));
                    } else {
                        absent.push(i);
                        results.push(Err(KeyError::OutOfMemory)); // placeholder until allocated
                    }
                }
                Some(e) if !e.unheld() || e.state == ObjectState::WriteReserved => {
                    results.push(Err(KeyError::KeyIsLocked))
                }
                Some(_) => results.push(Err(KeyError::KeyNotWritable)),
            }
        }
        if absent.is_empty() {
            return results;
        }
        let room = self
            .object_count
            .load(Ordering::Relaxed)
            .saturating_add(absent.len() as u64);
        if room > self.config.max_objects as u64 {
            self.oom_keys
                .fetch_add(absent.len() as u64, Ordering::Relaxed);
            return results;
        }
        // The request's own objects that are already here (its cached prefix) are held while
        // the allocation evicts: a large store must not evict the chunks it extends.
        let pinned = self.pin_unlocked(keys);
        let slots = self.allocate_with_eviction(object_bytes, absent.len());
        self.unpin(&pinned);
        let mut slots = slots.into_iter();
        for &i in &absent {
            let Some(slot) = slots.next() else {
                self.oom_keys.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let mut shard = self.shard(&keys[i]).lock();
            if shard.map.contains_key(&keys[i]) {
                // Lost a race with another writer between the check and the insert.
                self.alloc.lock().free(slot).expect("fresh slot frees");
                results[i] = Err(KeyError::KeyNotWritable);
                continue;
            }
            let lease = self.next_stamps(1);
            shard.map.insert(
                keys[i],
                Entry {
                    slot,
                    state: ObjectState::WriteReserved,
                    readers: 0,
                    io_holds: 0,
                    temporary,
                    doomed: false,
                    layout: 0,
                    unwritten: false,
                    stamp: 0,
                    lease,
                    lock_deadline_ms: deadline,
                },
            );
            self.object_count.fetch_add(1, Ordering::Relaxed);
            results[i] = Ok(Grant { slot, lease });
        }
        results
    }

    /// Takes one read lock on each of `keys` that is readable (`Ready`, not doomed), so eviction
    /// passes it by even if its other holders let go meanwhile; returns the `(key, lease)` pairs
    /// for [`StorageCore::unpin`]. Caller holds `gate`.
    fn pin_unlocked(&self, keys: &[StorageKey]) -> Vec<(StorageKey, u64)> {
        let now = self.now_ms();
        let deadline = now.saturating_add(self.read_ttl_ms());
        let mut pinned = Vec::new();
        for k in keys {
            let mut shard = self.shard(k).lock();
            let Some(e) = shard.map.get_mut(k) else {
                continue;
            };
            if e.state != ObjectState::Ready || e.doomed {
                continue;
            }
            self.drop_expired_reads(e, now);
            e.lock_deadline_ms = if e.readers == 0 {
                deadline
            } else {
                e.lock_deadline_ms.max(deadline)
            };
            e.readers = e.readers.saturating_add(1);
            pinned.push((*k, e.lease));
            shard.sync_recency(k);
        }
        pinned
    }

    /// Releases the locks of [`StorageCore::pin_unlocked`] (unless they expired meanwhile).
    /// Caller holds `gate`.
    fn unpin(&self, pinned: &[(StorageKey, u64)]) {
        for r in self.finish_read_unlocked(pinned, 0) {
            debug_assert!(r.is_ok() || r == Err(KeyError::KeyInWrongState));
        }
    }

    /// Allocates up to `count` slots, evicting as needed; returns fewer (a prefix) when even
    /// eviction cannot make room.
    fn allocate_with_eviction(&self, object_bytes: u64, count: usize) -> Vec<Slot> {
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
            let mut shard = self.shard(&key).lock();
            // Re-check under the lock: it may have been locked, touched, written or removed.
            match shard.map.get(&key) {
                Some(e) if e.evictable() && e.stamp == stamp && e.unwritten == unwritten => {}
                _ => continue,
            }
            let e = shard.remove(&key).expect("checked present");
            self.release_slot(e.slot);
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

    fn release_slot(&self, slot: Slot) {
        if let Err(e) = self.alloc.lock().free(slot) {
            // A double free would mean two entries shared a slot: report loudly, keep serving.
            tracing::error!(error = %e, ?slot, "allocator rejected a free: index/allocator out of sync");
            debug_assert!(false, "allocator rejected free: {e}");
        }
        self.object_count.fetch_sub(1, Ordering::Relaxed);
    }

    /// Publishes write reservations (`WriteReserved -> Ready`). Each grant must match the
    /// reservation exactly (slot and lease: the paired check with `reserve_write`). Doomed
    /// reservations are freed instead and reported `KeyNotExist`. Keys are given in chunk order;
    /// they get recency stamps in reverse so later chunks are evicted before earlier ones.
    pub fn finish_write(&self, items: &[(StorageKey, Grant)]) -> Vec<Result<(), KeyError>> {
        self.finish_write_as(items, 0, false)
    }

    /// [`StorageCore::finish_write`] recording `layout` (the fingerprint of the layout the
    /// objects were committed under, 0 = unknown; see [`StorageCore::layout_of`]). With
    /// `unwritten`, the published objects are marked as waiting for their L2 write-behind, so
    /// eviction prefers every other object to them until [`StorageCore::clear_unwritten`].
    pub fn finish_write_as(
        &self,
        items: &[(StorageKey, Grant)],
        layout: u64,
        unwritten: bool,
    ) -> Vec<Result<(), KeyError>> {
        self.publish(items, None, layout, unwritten)
            .into_iter()
            .map(|r| r.map(|_| ()))
            .collect()
    }

    /// Clears the pending-L2-write mark of those `keys` present: their write-behind has run
    /// (written, failed or skipped) or was never queued.
    pub fn clear_unwritten(&self, keys: &[StorageKey]) {
        for k in keys {
            self.shard(k).lock().set_unwritten(k, false);
        }
    }

    /// [`StorageCore::finish_write_as`] (not unwritten) that also takes `1 + extra` read locks
    /// on each published object in the same step (L2 prefetch: the loaded object cannot be
    /// evicted between its publication and the lookup that locks it). Returns each object's
    /// lease for the unlock.
    pub fn finish_write_locked(
        &self,
        items: &[(StorageKey, Grant)],
        extra: u32,
        layout: u64,
    ) -> Vec<Result<u64, KeyError>> {
        self.publish(items, Some(extra), layout, false)
    }

    fn publish(
        &self,
        items: &[(StorageKey, Grant)],
        lock_extra: Option<u32>,
        layout: u64,
        unwritten: bool,
    ) -> Vec<Result<u64, KeyError>> {
        let _g = self.gate.read();
        let n = items.len() as u64;
        let base = self.next_stamps(n);
        let read_deadline = self.now_ms().saturating_add(self.read_ttl_ms());
        items
            .iter()
            .enumerate()
            .map(|(i, (k, grant))| {
                let mut shard = self.shard(k).lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.state != ObjectState::WriteReserved
                    || e.slot != grant.slot
                    || e.lease != grant.lease
                {
                    return Err(KeyError::KeyInWrongState);
                }
                debug_assert_eq!(e.readers, 0, "write-reserved objects hold no read locks");
                if e.doomed {
                    let e = shard.remove(k).expect("present");
                    self.release_slot(e.slot);
                    return Err(KeyError::KeyNotExist);
                }
                e.state = ObjectState::Ready;
                e.lock_deadline_ms = 0;
                if let Some(extra) = lock_extra {
                    e.readers = 1 + extra;
                    e.lock_deadline_ms = read_deadline;
                }
                e.stamp = base + (n - 1 - i as u64);
                e.unwritten = unwritten;
                e.layout = layout;
                let lease = e.lease;
                shard.sync_recency(k);
                Ok(lease)
            })
            .collect()
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

    /// Deletes write reservations and frees their memory (abort, disconnect, reaping). Only
    /// entries still `WriteReserved` under exactly this grant are touched; anything else is reported.
    pub fn abort_write(&self, items: &[(StorageKey, Grant)]) -> Vec<Result<(), KeyError>> {
        let _g = self.gate.read();
        items
            .iter()
            .map(|(k, grant)| {
                let mut shard = self.shard(k).lock();
                let e = shard.map.get(k).ok_or(KeyError::KeyNotExist)?;
                if e.state != ObjectState::WriteReserved
                    || e.slot != grant.slot
                    || e.lease != grant.lease
                {
                    return Err(KeyError::KeyInWrongState);
                }
                let e = shard.remove(k).expect("present");
                self.release_slot(e.slot);
                Ok(())
            })
            .collect()
    }

    /// Takes `1 + extra` read locks on each key. Requires `Ready` and not doomed.
    pub fn reserve_read(&self, keys: &[StorageKey], extra: u32) -> Vec<Result<Grant, KeyError>> {
        let _g = self.gate.read();
        let now = self.now_ms();
        let deadline = now.saturating_add(self.read_ttl_ms());
        keys.iter()
            .map(|k| {
                let mut shard = self.shard(k).lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.doomed {
                    return Err(KeyError::KeyNotExist);
                }
                if e.state != ObjectState::Ready {
                    return Err(KeyError::KeyNotReadable);
                }
                self.drop_expired_reads(e, now);
                // One deadline covers all of an entry's locks: the latest one's.
                e.lock_deadline_ms = if e.readers == 0 {
                    deadline
                } else {
                    e.lock_deadline_ms.max(deadline)
                };
                e.readers = e.readers.saturating_add(1 + extra);
                let grant = Grant {
                    slot: e.slot,
                    lease: e.lease,
                };
                shard.sync_recency(k);
                Ok(grant)
            })
            .collect()
    }

    /// Holds each key's bytes for the node's own I/O (an L2 write-behind reading the slot):
    /// requires `Ready` and not doomed. A hold never expires; the object is neither evicted nor
    /// freed (CLEAR dooms it) until [`StorageCore::release_io_holds`]. The grant's slot names it.
    pub fn hold_for_io(&self, keys: &[StorageKey]) -> Vec<Result<Grant, KeyError>> {
        let _g = self.gate.read();
        keys.iter()
            .map(|k| {
                let mut shard = self.shard(k).lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.doomed {
                    return Err(KeyError::KeyNotExist);
                }
                if e.state != ObjectState::Ready {
                    return Err(KeyError::KeyNotReadable);
                }
                e.io_holds = e.io_holds.checked_add(1).ok_or(KeyError::KeyIsLocked)?;
                let grant = Grant {
                    slot: e.slot,
                    lease: e.lease,
                };
                shard.sync_recency(k);
                Ok(grant)
            })
            .collect()
    }

    /// Releases one I/O hold per item, taken by [`StorageCore::hold_for_io`] with that grant
    /// (matched by slot: the object cannot have been freed or moved while held). A doomed or
    /// temporary object nothing holds any more is freed.
    pub fn release_io_holds(&self, items: &[(StorageKey, Grant)]) -> Vec<Result<(), KeyError>> {
        let _g = self.gate.read();
        items
            .iter()
            .map(|(k, grant)| {
                let mut shard = self.shard(k).lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.state != ObjectState::Ready || e.slot != grant.slot || e.io_holds == 0 {
                    return Err(KeyError::KeyInWrongState);
                }
                e.io_holds -= 1;
                self.settle_released(&mut shard, k);
                Ok(())
            })
            .collect()
    }

    /// Takes over one read lock that a lookup session holds on `key` under `lease`, for a
    /// retrieve that relies on the lookup: the lock must still be live (same lease, not past its
    /// deadline, object `Ready` and not doomed), and its deadline is extended to cover the
    /// retrieve (now + read TTL). The lock count does not change: the caller moves one lock from
    /// the session to the retrieve. `KeyInWrongState` means the lock is gone (expired or another
    /// lease); `KeyNotExist`/`KeyNotReadable` that it is still held on an object that cannot be
    /// read (doomed by CLEAR): its owner must still release it.
    pub fn adopt_read(&self, key: &StorageKey, lease: u64) -> Result<Grant, KeyError> {
        let _g = self.gate.read();
        let now = self.now_ms();
        let mut shard = self.shard(key).lock();
        let e = shard.map.get_mut(key).ok_or(KeyError::KeyNotExist)?;
        if e.doomed {
            return Err(KeyError::KeyNotExist);
        }
        if e.state != ObjectState::Ready {
            return Err(KeyError::KeyNotReadable);
        }
        if self.drop_expired_reads(e, now) {
            shard.sync_recency(key);
            return Err(KeyError::KeyInWrongState);
        }
        if e.lease != lease || e.readers == 0 {
            return Err(KeyError::KeyInWrongState);
        }
        let deadline = now.saturating_add(self.read_ttl_ms());
        e.lock_deadline_ms = e.lock_deadline_ms.max(deadline);
        Ok(Grant {
            slot: e.slot,
            lease: e.lease,
        })
    }

    /// Grants for keys that are `Ready` and currently read-locked; takes no lock (LMCache
    /// `unsafe_read`, used by retrieves that rely on LOOKUP's locks).
    pub fn read_locked_slots(&self, keys: &[StorageKey]) -> Vec<Result<Grant, KeyError>> {
        keys.iter()
            .map(|k| {
                let shard = self.shard(k).lock();
                let e = shard.map.get(k).ok_or(KeyError::KeyNotExist)?;
                if e.state != ObjectState::Ready || e.doomed {
                    return Err(KeyError::KeyNotReadable);
                }
                if e.readers == 0 {
                    return Err(KeyError::KeyInWrongState);
                }
                Ok(Grant {
                    slot: e.slot,
                    lease: e.lease,
                })
            })
            .collect()
    }

    /// Releases `1 + extra` read locks per key (floor 0), if the lease still matches (locks that
    /// expired meanwhile are not released twice). Temporary or doomed objects whose count reaches
    /// 0 are deleted and freed.
    pub fn finish_read(
        &self,
        items: &[(StorageKey, u64)],
        extra: u32,
    ) -> Vec<Result<(), KeyError>> {
        let _g = self.gate.read();
        self.finish_read_unlocked(items, extra)
    }

    fn finish_read_unlocked(
        &self,
        items: &[(StorageKey, u64)],
        extra: u32,
    ) -> Vec<Result<(), KeyError>> {
        items
            .iter()
            .map(|(k, lease)| {
                let mut shard = self.shard(k).lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.state != ObjectState::Ready || e.lease != *lease {
                    return Err(KeyError::KeyInWrongState);
                }
                if e.readers == 0 {
                    return Err(KeyError::KeyNotReadable);
                }
                e.readers = e.readers.saturating_sub(1 + extra);
                self.settle_released(&mut shard, k);
                Ok(())
            })
            .collect()
    }

    /// Looks up a prefix: for each chunk (a group of keys that must all be present), takes
    /// `1 + extra` read locks on all its keys; stops at the first chunk with a missing key
    /// (releasing that chunk's partial locks). Returns the locked chunks' `(key, lease)` pairs.
    pub fn lock_prefix(
        &self,
        chunks: impl IntoIterator<Item = Vec<StorageKey>>,
        extra: u32,
    ) -> Vec<Vec<(StorageKey, u64)>> {
        let mut locked = Vec::new();
        for chunk in chunks {
            let got = self.reserve_read(&chunk, extra);
            let taken: Vec<(StorageKey, u64)> = chunk
                .iter()
                .zip(&got)
                .filter_map(|(k, r)| r.as_ref().ok().map(|g| (*k, g.lease)))
                .collect();
            if taken.len() < chunk.len() {
                self.finish_read(&taken, extra);
                break;
            }
            locked.push(taken);
        }
        locked
    }

    /// Whether every key is `Ready` and not doomed (no lock taken).
    pub fn contains_ready(&self, key: &StorageKey) -> bool {
        let shard = self.shard(key).lock();
        shard
            .map
            .get(key)
            .is_some_and(|e| e.state == ObjectState::Ready && !e.doomed)
    }

    /// The slot length and layout fingerprint (0 = unknown) of `key` if it is present and
    /// `Ready` (not doomed); `None` otherwise. Stable while the caller holds a read lock on it.
    pub fn ready_object(&self, key: &StorageKey) -> Option<(u64, u64)> {
        let shard = self.shard(key).lock();
        shard
            .map
            .get(key)
            .filter(|e| e.state == ObjectState::Ready && !e.doomed)
            .map(|e| (e.slot.len, e.layout))
    }

    /// Refreshes recency of present `Ready` keys, given in chunk order (later chunks stay older).
    pub fn touch(&self, keys: &[StorageKey]) {
        let n = keys.len() as u64;
        let base = self.next_stamps(n);
        for (i, k) in keys.iter().enumerate() {
            self.shard(k).lock().restamp(k, base + (n - 1 - i as u64));
        }
    }

    /// Drops every object: ready, unlocked ones are deleted at once; write-reserved or read-locked
    /// ones are doomed and freed when their transfer ends. Returns (deleted, deferred).
    pub fn clear(&self) -> (u64, u64) {
        let _g = self.gate.read();
        let (mut deleted, mut deferred) = (0, 0);
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let keys: Vec<StorageKey> = shard.map.keys().copied().collect();
            for k in keys {
                let e = shard.map.get_mut(&k).expect("listed");
                if e.state == ObjectState::Ready && e.unheld() {
                    let e = shard.remove(&k).expect("present");
                    self.release_slot(e.slot);
                    deleted += 1;
                } else if !e.doomed {
                    e.doomed = true;
                    deferred += 1;
                    shard.sync_recency(&k);
                }
            }
        }
        (deleted, deferred)
    }

    /// The TTL safety net, run by the maintenance thread: write reservations past their deadline
    /// are deleted and freed (never published); read locks past theirs are dropped.
    /// Returns (expired writes, expired read-locked objects).
    pub fn expire_locks(&self, now_ms: u64) -> (u64, u64) {
        let _g = self.gate.read();
        let (mut w, mut r) = (0, 0);
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let stale: Vec<StorageKey> = shard
                .map
                .iter()
                .filter(|(_, e)| {
                    (e.state == ObjectState::WriteReserved || e.readers > 0)
                        && e.lock_deadline_ms <= now_ms
                })
                .map(|(k, _)| *k)
                .collect();
            for k in stale {
                let e = shard.map.get_mut(&k).expect("listed");
                if e.state == ObjectState::WriteReserved {
                    let e = shard.remove(&k).expect("present");
                    self.release_slot(e.slot);
                    w += 1;
                } else {
                    self.drop_expired_reads(e, now_ms);
                    r += 1;
                    self.settle_released(&mut shard, &k);
                }
            }
        }
        self.expired_writes.fetch_add(w, Ordering::Relaxed);
        (w, r)
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
            let mut shard = self.shard(k).lock();
            if shard.map.get(k).is_some_and(|e| e.evictable()) {
                let e = shard.remove(k).expect("checked present");
                self.release_slot(e.slot);
                n += 1;
            }
        }
        self.background_evictions.fetch_add(n, Ordering::Relaxed);
        n
    }

    /// The namespaces of every object in the index (the namespace reclaimer keeps them).
    pub fn namespaces_in_use(&self) -> std::collections::HashSet<super::key::NamespaceId> {
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
}

impl StorageCore {
    /// Allocator size classes: (class bytes, live slots, slabs).
    pub fn class_stats(&self) -> Vec<(u64, usize, usize)> {
        self.alloc.lock().class_stats()
    }
}
