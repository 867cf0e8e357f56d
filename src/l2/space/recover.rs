//! Recovery: rebuilding the index from the extent and slot headers found on disk.

use std::fmt;
use std::hash::Hash;

use super::{Entry, L2Index, RecoverError, RecoverOutcome, Recovered, State, BLOCK, MIN_STRIDE};

impl<K: Copy + Eq + Hash + fmt::Debug> L2Index<K> {
    /// Recovery: makes every later assignment use an epoch above `epoch` (seen in any header
    /// on disk, valid or stale), so stale slot headers never match a new assignment.
    pub fn note_epoch(&mut self, epoch: u64) {
        self.next_epoch = self.next_epoch.max(epoch.saturating_add(1));
    }

    /// Recovery: assigns a free extent as found on disk. Requires `extent <
    /// extent_count`, the extent free, `stride` a multiple of `BLOCK` in
    /// `MIN_STRIDE..` with at least one slot in the extent, and `epoch` above the extent's
    /// current epoch (and below `u64::MAX`).
    pub fn recover_extent(
        &mut self,
        extent: u32,
        epoch: u64,
        stride: u64,
    ) -> Result<(), RecoverError> {
        let bad = |s: String| Err(RecoverError::BadExtent(s));
        let Some(x) = self.extents.get(extent as usize) else {
            return bad(format!(
                "extent {extent} out of range ({})",
                self.extents.len()
            ));
        };
        if x.stride != 0 {
            return bad(format!("extent {extent} already assigned"));
        }
        if !stride.is_multiple_of(BLOCK)
            || stride < MIN_STRIDE
            || super::slots_in(self.extent_bytes, stride) == 0
        {
            return bad(format!("extent {extent}: bad stride {stride}"));
        }
        if epoch <= x.epoch || epoch == u64::MAX {
            return bad(format!(
                "extent {extent}: bad epoch {epoch} (current {})",
                x.epoch
            ));
        }
        let next = self.next_epoch;
        self.assign(extent, stride);
        self.next_epoch = next; // the epoch comes from disk, not from the counter
        self.extents[extent as usize].epoch = epoch;
        self.note_epoch(epoch);
        Ok(())
    }

    /// Recovery: inserts a Ready entry found in slot `slot_index` of a
    /// recovered extent. The slot must exist and be free and `object_len` must
    /// fit the stride. For a key seen twice the higher seq wins (ties keep the
    /// existing entry). Recency follows seq; later stamps are newer than all.
    ///
    /// At the entry cap (`max_entries`) a new key displaces the least recently used entry
    /// if that one is older (lower seq), else it is left out (`OverCap`); either way one
    /// record is counted in [`L2Index::unindexed`] and its slot is free. So whatever the
    /// order records arrive in, the index keeps the most recently written ones. A record left
    /// out is treated as if evicted: its slot header stays on disk until the slot is written
    /// again; a reassigned extent has a new epoch, so the header no longer matches it, and a
    /// newer copy of its key written later has a higher seq, which wins at the next start.
    pub fn recover_entry(
        &mut self,
        key: K,
        slot_index: u32,
        extent: u32,
        found: Recovered,
    ) -> RecoverOutcome {
        let Recovered {
            object_len,
            checksum,
            seq,
            layout,
        } = found;
        let reject = |s: String| RecoverOutcome::Rejected(s);
        let Some(x) = self.extents.get(extent as usize) else {
            return reject(format!("extent {extent} out of range"));
        };
        if x.stride == 0 || x.draining {
            return reject(format!("extent {extent} not assigned"));
        }
        if slot_index >= x.slots {
            return reject(format!("slot {slot_index} outside extent {extent}"));
        }
        if x.is_used(slot_index) {
            return reject(format!("slot {slot_index} of extent {extent} taken"));
        }
        if object_len == 0 || object_len > x.stride - BLOCK {
            return reject(format!(
                "object_len {object_len} does not fit stride {}",
                x.stride
            ));
        }
        let mut outcome = RecoverOutcome::Inserted;
        if let Some(old) = self.entries.get(&key) {
            if !old.evictable() {
                return reject("key busy".to_string());
            }
            if old.seq >= seq {
                return RecoverOutcome::KeptNewer;
            }
            self.drop_entry(&key);
            outcome = RecoverOutcome::ReplacedOlder;
        } else if self.entries.len() as u64 >= self.max_entries {
            self.unindexed = self.unindexed.saturating_add(1);
            match self.oldest_evictable() {
                Some((oldest, old)) if oldest < (seq, self.tick) => {
                    self.drop_entry(&old);
                }
                _ => return RecoverOutcome::OverCap,
            }
        }
        let stamp = (seq, self.tick);
        self.tick = self.tick.saturating_add(1);
        self.clock = self.clock.max(seq.saturating_add(1));
        let entry = Entry {
            slot: self.slot_ref(extent, slot_index),
            object_len,
            checksum,
            seq,
            layout,
            state: State::Ready,
            pins: 0,
            doomed: false,
            stamp,
        };
        self.insert(key, entry);
        outcome
    }

    /// Recovery: frees every assigned extent that holds no entry.
    pub fn finish_recovery(&mut self) {
        for ext in 0..self.extents.len() as u32 {
            let x = &self.extents[ext as usize];
            if x.stride != 0 && x.live == 0 {
                self.release_extent(ext);
            }
        }
    }

    /// Records [`L2Index::recover_entry`] left out, or indexed and later displaced, because
    /// of the entry cap (`RecoverOutcome::OverCap` counts here too).
    pub fn unindexed(&self) -> u64 {
        self.unindexed
    }
}
