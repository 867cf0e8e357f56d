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
    /// `MIN_STRIDE..=extent_bytes - BLOCK`, and `epoch` above the extent's
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
            || stride > self.extent_bytes.saturating_sub(BLOCK)
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
        match x.occupants.get(slot_index as usize) {
            None => return reject(format!("slot {slot_index} outside extent {extent}")),
            Some(Some(_)) => return reject(format!("slot {slot_index} of extent {extent} taken")),
            Some(None) => {}
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
        }
        // Free lists are rebuilt by `finish_recovery` (searching them here is quadratic).
        self.recovering = true;
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
            let x = &mut self.extents[ext as usize];
            if x.stride == 0 {
                continue;
            }
            if x.live == 0 {
                self.release_extent(ext);
                continue;
            }
            if self.recovering {
                x.free = (0..x.occupants.len() as u32)
                    .rev()
                    .filter(|&i| x.occupants[i as usize].is_none())
                    .collect();
                let stride = x.stride;
                let partial = !x.free.is_empty() && !x.draining;
                let set = self.strides.entry(stride).or_default();
                if partial {
                    set.partial.insert(ext);
                } else {
                    set.partial.remove(&ext);
                }
            }
        }
        self.recovering = false;
    }
}
