//! The read path of [`StorageCore`]: read locks and their release, I/O holds, lock adoption by
//! retrieves, prefix lookups, and lock-free presence queries.

use super::{Grant, KeyError, StorageCore, Tally};
use crate::storage::index::ObjectState;
use crate::storage::key::StorageKey;

impl StorageCore {
    /// Takes `1 + extra` read locks on each key. Requires `Ready` and not doomed.
    pub fn reserve_read(&self, keys: &[StorageKey], extra: u32) -> Vec<Result<Grant, KeyError>> {
        let _g = self.gate.read();
        let now = self.now_ms();
        let deadline = now.saturating_add(self.read_ttl_ms());
        keys.iter()
            .map(|k| {
                let si = Self::shard_index(k);
                let mut shard = self.shards[si].lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.doomed {
                    return Err(KeyError::KeyNotExist);
                }
                if e.state != ObjectState::Ready {
                    return Err(KeyError::KeyNotReadable);
                }
                let before = Tally::of(e);
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
                    layout: e.layout,
                };
                let after = Tally::of(e);
                shard.sync_recency(k);
                self.tally(si, before, after);
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
                let si = Self::shard_index(k);
                let mut shard = self.shards[si].lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.doomed {
                    return Err(KeyError::KeyNotExist);
                }
                if e.state != ObjectState::Ready {
                    return Err(KeyError::KeyNotReadable);
                }
                let before = Tally::of(e);
                e.io_holds = e.io_holds.checked_add(1).ok_or(KeyError::KeyIsLocked)?;
                let grant = Grant {
                    slot: e.slot,
                    lease: e.lease,
                    layout: e.layout,
                };
                let after = Tally::of(e);
                shard.sync_recency(k);
                self.tally(si, before, after);
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
                let si = Self::shard_index(k);
                let mut shard = self.shards[si].lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.state != ObjectState::Ready || e.slot != grant.slot || e.io_holds == 0 {
                    return Err(KeyError::KeyInWrongState);
                }
                let before = Tally::of(e);
                e.io_holds -= 1;
                self.settle_released(si, &mut shard, k, before);
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
        let si = Self::shard_index(key);
        let mut shard = self.shards[si].lock();
        let e = shard.map.get_mut(key).ok_or(KeyError::KeyNotExist)?;
        if e.doomed {
            return Err(KeyError::KeyNotExist);
        }
        if e.state != ObjectState::Ready {
            return Err(KeyError::KeyNotReadable);
        }
        let before = Tally::of(e);
        if self.drop_expired_reads(e, now) {
            let after = Tally::of(e);
            shard.sync_recency(key);
            self.tally(si, before, after);
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
            layout: e.layout,
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
                    layout: e.layout,
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

    pub(super) fn finish_read_unlocked(
        &self,
        items: &[(StorageKey, u64)],
        extra: u32,
    ) -> Vec<Result<(), KeyError>> {
        items
            .iter()
            .map(|(k, lease)| {
                let si = Self::shard_index(k);
                let mut shard = self.shards[si].lock();
                let e = shard.map.get_mut(k).ok_or(KeyError::KeyNotExist)?;
                if e.state != ObjectState::Ready || e.lease != *lease {
                    return Err(KeyError::KeyInWrongState);
                }
                if e.readers == 0 {
                    return Err(KeyError::KeyNotReadable);
                }
                let before = Tally::of(e);
                e.readers = e.readers.saturating_sub(1 + extra);
                self.settle_released(si, &mut shard, k, before);
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

    /// Index shards, for [`StorageCore::scan_ready_shard`].
    pub fn index_shards(&self) -> usize {
        self.shards.len()
    }

    /// Up to `max` objects of index shard `shard` that are `Ready`, not doomed and not
    /// temporary, with their slot length and layout fingerprint; the shard is locked only while
    /// they are copied out (the caller decides about them after). O(shard size): background
    /// work only (the cluster's hand-off to a joining member).
    pub fn scan_ready_shard(&self, shard: usize, max: usize) -> Vec<(StorageKey, u64, u64)> {
        let Some(shard) = self.shards.get(shard) else {
            return Vec::new();
        };
        let shard = shard.lock();
        shard
            .map
            .iter()
            .filter(|(_, e)| e.state == ObjectState::Ready && !e.doomed && !e.temporary)
            .take(max)
            .map(|(k, e)| (*k, e.slot.len, e.layout))
            .collect()
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
}
