//! Reading the index and pinning entries for loads: where a key lies, what an extent holds
//! (the checkpoint's tables), pins, recency touches and the space statistics.

use std::fmt;
use std::hash::Hash;

use super::{Entry, L2Index, Located, SlotRef, SpaceStats, StateError};

impl<K: Copy + Eq + Hash + fmt::Debug> L2Index<K> {
    /// The slot of `key`'s entry, in any state.
    pub fn slot_of(&self, key: &K) -> Option<SlotRef> {
        self.entries.get(key).map(|e| e.slot)
    }

    /// The entry of `key` if it is Ready and not doomed. Does not touch.
    pub fn get(&self, key: &K) -> Option<Located> {
        self.entries
            .get(key)
            .filter(|e| e.visible())
            .map(Entry::located)
    }

    /// `(extent, epoch, stride, slots)` of every assigned extent whose on-disk header describes
    /// its assignment (one whose header write failed is left out), in extent order.
    pub fn assigned_extents(&self) -> Vec<(u32, u64, u64, u32)> {
        self.extents
            .iter()
            .enumerate()
            .filter(|(_, x)| x.stride != 0 && !x.needs_header)
            .map(|(e, x)| (e as u32, x.epoch, x.stride, x.slots))
            .collect()
    }

    /// `(slot index, key, entry)` of every visible (Ready, not doomed) entry of `extent`, in
    /// slot order: what an extent table records.
    pub fn visible_in_extent(&self, extent: u32) -> Vec<(u32, K, Located)> {
        self.by_slot
            .range((extent, 0)..=(extent, u32::MAX))
            .filter_map(|(&(_, j), k)| {
                let e = self.entries.get(k)?;
                e.visible().then(|| (j, *k, e.located()))
            })
            .collect()
    }

    /// Every key with an entry (any state).
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.keys()
    }

    /// Whether `get(key)` would return `Some`.
    pub fn contains(&self, key: &K) -> bool {
        self.entries.get(key).is_some_and(Entry::visible)
    }

    /// Pins a visible entry (its slot is then neither evicted nor reused until
    /// `unpin`) and touches it. `None` if not visible (or at `u32::MAX` pins).
    pub fn pin(&mut self, key: &K) -> Option<Located> {
        let e = self.entries.get(key)?;
        if !e.visible() || e.pins == u32::MAX {
            return None;
        }
        let stamp = self.next_stamp();
        self.modify(key, |e| {
            e.pins += 1;
            e.stamp = stamp;
        })
        .map(|e| e.located())
    }

    /// [`L2Index::pin`] only if `wanted` accepts the visible entry: an entry refused is
    /// neither pinned nor touched (a copy nobody can use must not look recently used).
    pub fn pin_if(&mut self, key: &K, wanted: impl FnOnce(&Located) -> bool) -> Option<Located> {
        if !self.get(key).is_some_and(|l| wanted(&l)) {
            return None;
        }
        self.pin(key)
    }

    /// Drops one pin taken on `slot`; frees a doomed entry when its last pin goes.
    pub fn unpin(&mut self, key: &K, slot: SlotRef) -> Result<(), StateError> {
        let e = self.entries.get(key).ok_or(StateError::NotFound)?;
        if e.pins == 0 || e.slot != slot {
            return Err(StateError::WrongState);
        }
        if e.pins == 1 && e.doomed {
            self.drop_entry(key);
        } else {
            self.modify(key, |e| e.pins -= 1);
        }
        Ok(())
    }

    /// Marks a non-doomed entry as most recently used.
    pub fn touch(&mut self, key: &K) {
        if self.entries.get(key).is_some_and(|e| !e.doomed) {
            let stamp = self.next_stamp();
            self.modify(key, |e| e.stamp = stamp);
        }
    }

    /// Current usage; O(1).
    pub fn stats(&self) -> SpaceStats {
        SpaceStats {
            capacity_bytes: (self.extents.len() as u64).saturating_mul(self.extent_bytes),
            used_bytes: self.counts.used_bytes,
            objects: self.counts.objects,
            writing: self.counts.writing,
            pinned: self.counts.pinned,
            free_extents: self.free_extents.len() as u32,
            extents: self.extents.len() as u32,
            entries: self.entries.len() as u64,
            max_entries: self.max_entries,
            index_bytes: self.index_bytes(),
            index_limit_bytes: self.limit_bytes,
            unindexed: self.unindexed,
        }
    }
}
