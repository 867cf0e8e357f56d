//! The write path of [`StorageCore`]: reserving slots for absent keys (pinning the request's
//! cached prefix while the allocation evicts), publishing reservations, and aborting them.

use std::sync::atomic::Ordering;

use super::{Grant, KeyError, StorageCore, Tally};
use crate::storage::index::{Entry, ObjectState};
use crate::storage::key::StorageKey;

impl StorageCore {
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
            std::hash::BuildHasherDefault<crate::storage::index::FingerprintHasher>,
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
            let si = Self::shard_index(&keys[i]);
            let mut shard = self.shards[si].lock();
            if shard.map.contains_key(&keys[i]) {
                // Lost a race with another writer between the check and the insert.
                self.alloc.lock().free(slot).expect("fresh slot frees");
                results[i] = Err(KeyError::KeyNotWritable);
                continue;
            }
            let lease = self.next_stamps(1);
            let entry = Entry {
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
                pins: 0,
            };
            self.tally(si, Tally::ABSENT, Tally::of(&entry));
            shard.map.insert(keys[i], entry);
            self.object_count.fetch_add(1, Ordering::Relaxed);
            results[i] = Ok(Grant {
                slot,
                lease,
                layout: 0,
            });
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
            let si = Self::shard_index(k);
            let mut shard = self.shards[si].lock();
            let Some(e) = shard.map.get_mut(k) else {
                continue;
            };
            if e.state != ObjectState::Ready || e.doomed {
                continue;
            }
            let before = Tally::of(e);
            self.drop_expired_reads(e, now);
            e.lock_deadline_ms = if e.readers == 0 {
                deadline
            } else {
                e.lock_deadline_ms.max(deadline)
            };
            e.readers = e.readers.saturating_add(1);
            pinned.push((*k, e.lease));
            let after = Tally::of(e);
            shard.sync_recency(k);
            self.tally(si, before, after);
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
            let si = Self::shard_index(k);
            let mut shard = self.shards[si].lock();
            let Some(before) = shard.map.get(k).map(Tally::of) else {
                continue;
            };
            shard.set_unwritten(k, false);
            if let Some(after) = shard.map.get(k).map(Tally::of) {
                self.tally(si, before, after);
            }
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
                let si = Self::shard_index(k);
                let mut shard = self.shards[si].lock();
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
                    self.discard(si, e);
                    return Err(KeyError::KeyNotExist);
                }
                let before = Tally::of(e);
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
                let after = Tally::of(e);
                shard.sync_recency(k);
                self.tally(si, before, after);
                Ok(lease)
            })
            .collect()
    }

    /// Deletes write reservations and frees their memory (abort, disconnect, reaping). Only
    /// entries still `WriteReserved` under exactly this grant are touched; anything else is reported.
    pub fn abort_write(&self, items: &[(StorageKey, Grant)]) -> Vec<Result<(), KeyError>> {
        let _g = self.gate.read();
        items
            .iter()
            .map(|(k, grant)| {
                let si = Self::shard_index(k);
                let mut shard = self.shards[si].lock();
                let e = shard.map.get(k).ok_or(KeyError::KeyNotExist)?;
                if e.state != ObjectState::WriteReserved
                    || e.slot != grant.slot
                    || e.lease != grant.lease
                {
                    return Err(KeyError::KeyInWrongState);
                }
                let e = shard.remove(k).expect("present");
                self.discard(si, e);
                Ok(())
            })
            .collect()
    }
}
