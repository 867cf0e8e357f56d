//! One shard of the object index: key -> entry map plus the shard's recency list.
//!
//! Shards are independent; the storage core picks one by key fingerprint and holds its mutex only
//! for a single key operation (never across a batch).

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hash, Hasher};

use super::allocator::Slot;
use super::key::StorageKey;

impl Hash for StorageKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.fingerprint());
    }
}

/// A hasher that passes through the key's fingerprint (already well mixed). Invariant: only fed
/// one `u64` per key; any other input is folded in so it stays a valid hasher.
#[derive(Default)]
pub struct FingerprintHasher(u64);

impl Hasher for FingerprintHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

/// Where an object is in its life. Absent objects have no entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectState {
    /// Reserved for a writer that has not committed; never readable.
    WriteReserved,
    /// Committed and readable; `readers` counts read locks.
    Ready,
}

/// One object in the index. Invariants: `readers == 0` and `io_holds == 0` while
/// `WriteReserved`; the entry is in exactly one of the shard's recency lists under `stamp`
/// (`recency`, or `recency_unwritten` when `unwritten`) exactly when it is evictable (`Ready`, no
/// readers, no I/O holds, not doomed); an entry with I/O holds is never freed.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Where the bytes live.
    pub slot: Slot,
    /// Life-cycle state.
    pub state: ObjectState,
    /// Read-lock count (integer; MLA readers take `1 + extra_count`).
    pub readers: u32,
    /// Holds of the node's own I/O on the bytes (an L2 write-behind reading the slot with
    /// `O_DIRECT`): unlike read locks they never expire, because the slot must not be freed or
    /// reused before the device has finished reading it.
    pub io_holds: u32,
    /// Loaded on behalf of a reader only (L2 prefetch): deleted when `readers` drops to 0.
    pub temporary: bool,
    /// Deletion requested (CLEAR) while a transfer was in flight: freed when it ends; invisible meanwhile.
    pub doomed: bool,
    /// Recency stamp (smaller = older). Kept while locked, so unlocking restores the old position.
    pub stamp: u64,
    /// Identity of the current reservation and read-lock generation: fresh on creation and
    /// whenever expired locks are dropped, so a stale commit/abort/unlock can never act on a
    /// later reservation that reuses the same key and slot.
    pub lease: u64,
    /// Millisecond deadline of the current lock (write reservation or read locks): the TTL safety net.
    pub lock_deadline_ms: u64,
    /// Data ops moving bytes into (a write reservation) or out of (read locks) the slot right
    /// now (remote engines: the node's fabric holds the memory). While it is not 0 the lock
    /// never expires, whatever its deadline: the slot cannot be freed or reused under the move.
    pub pins: u32,
    /// Fingerprint of the layout the object was committed (or loaded from L2) under, 0 if
    /// unknown: what its L2 copy is stamped with.
    pub layout: u64,
    /// Committed with an L2 write-behind still to come: eviction takes it only when no other
    /// object can go (dropping it loses the only copy). Cleared once the write-behind has run
    /// (written, failed or skipped) or if it was never queued.
    pub unwritten: bool,
}

impl Entry {
    /// Whether eviction may take this object now.
    pub fn evictable(&self) -> bool {
        self.state == ObjectState::Ready && self.readers == 0 && self.io_holds == 0 && !self.doomed
    }

    /// Whether nothing holds the bytes (no read lock, no I/O hold).
    pub fn unheld(&self) -> bool {
        self.readers == 0 && self.io_holds == 0
    }
}

/// One index shard. Invariant: `recency` and `recency_unwritten` together hold exactly the
/// evictable entries, each once, under its stamp, in the list its `unwritten` flag names.
#[derive(Default)]
pub struct Shard {
    /// Key -> entry.
    pub map: HashMap<StorageKey, Entry, BuildHasherDefault<FingerprintHasher>>,
    /// Stamp -> key for evictable entries without a pending L2 write, oldest first.
    pub recency: BTreeMap<u64, StorageKey>,
    /// Stamp -> key for evictable entries whose L2 write-behind has not run yet, oldest first.
    pub recency_unwritten: BTreeMap<u64, StorageKey>,
}

impl Shard {
    fn list(&mut self, unwritten: bool) -> &mut BTreeMap<u64, StorageKey> {
        if unwritten {
            &mut self.recency_unwritten
        } else {
            &mut self.recency
        }
    }

    /// Takes `key` (listed under `stamp`) out of whichever recency list holds it.
    fn unlist(&mut self, key: &StorageKey, stamp: u64) {
        for list in [&mut self.recency, &mut self.recency_unwritten] {
            if list.get(&stamp) == Some(key) {
                list.remove(&stamp);
                return; // listed at most once
            }
        }
    }

    /// Re-establishes the recency invariant for `key` after its state changed: inserts it when it
    /// became evictable, removes it when it stopped being evictable.
    pub fn sync_recency(&mut self, key: &StorageKey) {
        let Some(e) = self.map.get(key) else { return };
        let (stamp, evictable, unwritten) = (e.stamp, e.evictable(), e.unwritten);
        self.unlist(key, stamp);
        if evictable {
            let prev = self.list(unwritten).insert(stamp, *key);
            debug_assert!(prev.is_none(), "recency stamps are unique");
        }
    }

    /// Sets or clears `key`'s pending-L2-write mark, moving it between the recency lists.
    pub fn set_unwritten(&mut self, key: &StorageKey, unwritten: bool) {
        let Some(e) = self.map.get_mut(key) else {
            return;
        };
        if e.unwritten != unwritten {
            e.unwritten = unwritten;
            self.sync_recency(key);
        }
    }

    /// Gives an entry a new stamp (recency refresh), keeping the recency lists in sync.
    pub fn restamp(&mut self, key: &StorageKey, stamp: u64) {
        let Some(e) = self.map.get_mut(key) else {
            return;
        };
        if e.state != ObjectState::Ready {
            return;
        }
        let old = e.stamp;
        e.stamp = stamp;
        let unwritten = e.unwritten;
        if self.list(unwritten).get(&old) == Some(key) {
            self.list(unwritten).remove(&old);
            self.list(unwritten).insert(stamp, *key);
        }
    }

    /// Removes an entry from the map and the recency lists, returning it.
    pub fn remove(&mut self, key: &StorageKey) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.unlist(key, e.stamp);
        Some(e)
    }

    /// The oldest evictable entry's stamp and key among those with (`unwritten`) or without a
    /// pending L2 write.
    pub fn oldest_evictable(&self, unwritten: bool) -> Option<(u64, StorageKey)> {
        let list = if unwritten {
            &self.recency_unwritten
        } else {
            &self.recency
        };
        let (s, k) = list.first_key_value()?;
        debug_assert!(self
            .map
            .get(k)
            .is_some_and(|e| e.evictable() && e.unwritten == unwritten));
        Some((*s, *k))
    }
}
