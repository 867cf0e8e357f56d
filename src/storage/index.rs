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

/// One object in the index. Invariants: `readers == 0` while `WriteReserved`; a `Ready` entry is in
/// the shard's recency list under `stamp`, a `WriteReserved` one is not.
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
    /// Recency stamp (smaller = older) while in the recency list.
    pub stamp: u64,
    /// Millisecond deadline of the current lock (write reservation or read locks): the TTL safety net.
    pub lock_deadline_ms: u64,
}

impl Entry {
    /// Whether eviction may take this object now.
    pub fn evictable(&self) -> bool {
        self.state == ObjectState::Ready && self.readers == 0 && !self.doomed
    }
}

/// One index shard. Invariant: `recency` holds exactly the `Ready` entries' stamps, each once.
#[derive(Default)]
pub struct Shard {
    /// Key -> entry.
    pub map: HashMap<StorageKey, Entry, BuildHasherDefault<FingerprintHasher>>,
    /// Stamp -> key for `Ready` entries, oldest first.
    pub recency: BTreeMap<u64, StorageKey>,
}

impl Shard {
    /// Publishes `key` (already in `map`) in the recency list under `stamp`.
    pub fn link(&mut self, key: StorageKey, stamp: u64) {
        if let Some(e) = self.map.get_mut(&key) {
            e.stamp = stamp;
            let prev = self.recency.insert(stamp, key);
            debug_assert!(prev.is_none(), "recency stamps are unique");
        }
    }

    /// Moves a `Ready` entry to a new stamp.
    pub fn retouch(&mut self, key: &StorageKey, stamp: u64) {
        if let Some(e) = self.map.get_mut(key) {
            if e.state == ObjectState::Ready {
                self.recency.remove(&e.stamp);
                e.stamp = stamp;
                self.recency.insert(stamp, *key);
            }
        }
    }

    /// Removes an entry from the map and (if Ready) the recency list, returning it.
    pub fn remove(&mut self, key: &StorageKey) -> Option<Entry> {
        let e = self.map.remove(key)?;
        if e.state == ObjectState::Ready {
            let k = self.recency.remove(&e.stamp);
            debug_assert_eq!(k.as_ref(), Some(key), "recency list in sync with map");
        }
        Some(e)
    }

    /// The oldest evictable entry's stamp and key, looking at most `scan_limit` entries.
    pub fn oldest_evictable(&self, scan_limit: usize) -> Option<(u64, StorageKey)> {
        self.recency
            .iter()
            .take(scan_limit)
            .find(|(_, k)| self.map.get(k).is_some_and(Entry::evictable))
            .map(|(s, k)| (*s, *k))
    }
}
