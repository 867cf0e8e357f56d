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

/// One object in the index. Invariants: `readers == 0` while `WriteReserved`; the entry is in the
/// shard's recency list under `stamp` exactly when it is evictable (`Ready`, no readers, not doomed).
#[derive(Debug, Clone)]
pub struct Entry {
    /// Where the bytes live.
    pub slot: Slot,
    /// Life-cycle state.
    pub state: ObjectState,
    /// Read-lock count (integer; MLA readers take `1 + extra_count`).
    pub readers: u32,
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
}

impl Entry {
    /// Whether eviction may take this object now.
    pub fn evictable(&self) -> bool {
        self.state == ObjectState::Ready && self.readers == 0 && !self.doomed
    }
}

/// One index shard. Invariant: `recency` holds exactly the evictable entries, each once, under
/// its stamp.
#[derive(Default)]
pub struct Shard {
    /// Key -> entry.
    pub map: HashMap<StorageKey, Entry, BuildHasherDefault<FingerprintHasher>>,
    /// Stamp -> key for evictable entries, oldest first.
    pub recency: BTreeMap<u64, StorageKey>,
}

impl Shard {
    /// Re-establishes the recency invariant for `key` after its state changed: inserts it when it
    /// became evictable, removes it when it stopped being evictable.
    pub fn sync_recency(&mut self, key: &StorageKey) {
        let Some(e) = self.map.get(key) else { return };
        if e.evictable() {
            let prev = self.recency.insert(e.stamp, *key);
            debug_assert!(
                prev.is_none() || prev == Some(*key),
                "recency stamps are unique"
            );
        } else if self.recency.get(&e.stamp) == Some(key) {
            self.recency.remove(&e.stamp);
        }
    }

    /// Gives an entry a new stamp (recency refresh), keeping the recency list in sync.
    pub fn restamp(&mut self, key: &StorageKey, stamp: u64) {
        let Some(e) = self.map.get_mut(key) else {
            return;
        };
        if e.state != ObjectState::Ready {
            return;
        }
        let old = e.stamp;
        e.stamp = stamp;
        if self.recency.get(&old) == Some(key) {
            self.recency.remove(&old);
            self.recency.insert(stamp, *key);
        }
    }

    /// Removes an entry from the map and the recency list, returning it.
    pub fn remove(&mut self, key: &StorageKey) -> Option<Entry> {
        let e = self.map.remove(key)?;
        if self.recency.get(&e.stamp) == Some(key) {
            self.recency.remove(&e.stamp);
        }
        Some(e)
    }

    /// The oldest evictable entry's stamp and key.
    pub fn oldest_evictable(&self) -> Option<(u64, StorageKey)> {
        let (s, k) = self.recency.first_key_value()?;
        debug_assert!(self.map.get(k).is_some_and(Entry::evictable));
        Some((*s, *k))
    }
}
