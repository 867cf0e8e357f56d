//! Invariant checker of the index: recomputes every aggregate and compares.

use std::collections::BTreeSet;
use std::fmt;
use std::hash::Hash;

use super::reclaim::Summary;
use super::{Counts, L2Index, State, BLOCK};

impl<K: Copy + Eq + Hash + fmt::Debug> L2Index<K> {
    /// Verifies every invariant; O(n). `Err` describes the first violation.
    pub fn check(&self) -> Result<(), String> {
        let mut counts = Counts::default();
        let mut evictable = 0usize;
        for (k, e) in &self.entries {
            counts.add(Counts::of(e), true);
            let s = e.slot;
            let x = self
                .extents
                .get(s.extent as usize)
                .ok_or(format!("{k:?}: extent {} out of range", s.extent))?;
            if x.stride == 0 || x.stride != s.stride || x.epoch != s.epoch {
                return Err(format!("{k:?}: slot {s:?} does not match its extent"));
            }
            if !x.is_used(s.index) || self.by_slot.get(&(s.extent, s.index)) != Some(k) {
                return Err(format!("{k:?}: slot {s:?} not occupied by it"));
            }
            if s != self.slot_ref(s.extent, s.index) {
                return Err(format!("{k:?}: bad slot offset {s:?}"));
            }
            if e.object_len == 0 || e.object_len > s.stride - BLOCK {
                return Err(format!(
                    "{k:?}: object_len {} vs stride {}",
                    e.object_len, s.stride
                ));
            }
            if e.state == State::Writing && e.pins > 0 {
                return Err(format!("{k:?}: Writing entry pinned"));
            }
            if e.state == State::Ready && e.pins == 0 && e.doomed {
                return Err(format!("{k:?}: doomed entry should have been freed"));
            }
            if e.evictable() {
                evictable += 1;
                let lru = self.strides.get(&s.stride).map(|set| set.lru.get(&e.stamp));
                if lru != Some(Some(k)) {
                    return Err(format!("{k:?}: evictable but not in LRU"));
                }
            }
        }
        if counts != self.counts {
            return Err(format!("counts {:?} != recomputed {counts:?}", self.counts));
        }
        let lru_len: usize = self.strides.values().map(|s| s.lru.len()).sum();
        if lru_len != evictable {
            return Err(format!("LRU holds {lru_len}, {evictable} evictable"));
        }
        let mut occupied = 0usize;
        for (i, x) in self.extents.iter().enumerate() {
            let i = i as u32;
            let in_partial = |stride| {
                self.strides
                    .get(&stride)
                    .is_some_and(|s| s.partial.contains(&i))
            };
            if x.stride == 0 {
                if !self.free_extents.contains(&i) || x.live != 0 || x.draining {
                    return Err(format!("free extent {i} inconsistent"));
                }
                if x.slots != 0 || !x.used.is_empty() {
                    return Err(format!("free extent {i} has slots"));
                }
                continue;
            }
            if self.free_extents.contains(&i) || x.epoch == 0 {
                return Err(format!("assigned extent {i}: in free set or epoch 0"));
            }
            if x.slots != self.slots_per(x.stride) || x.used.len() != x.slots.div_ceil(64) as usize
            {
                return Err(format!("extent {i}: wrong slot count"));
            }
            // Bits at and above `slots` are set; below, one per entry.
            let pad = x.used.len() as u64 * 64 - u64::from(x.slots);
            let ones: u64 = x.used.iter().map(|w| u64::from(w.count_ones())).sum();
            if !x.slots.is_multiple_of(64)
                && x.used[x.used.len() - 1] >> (x.slots % 64) != u64::MAX >> (x.slots % 64)
            {
                return Err(format!("extent {i}: padding bits clear"));
            }
            let live = ones - pad;
            let keyed = self.by_slot.range((i, 0)..=(i, u32::MAX)).count() as u64;
            occupied += live as usize;
            if live != u64::from(x.live) || keyed != live {
                return Err(format!(
                    "extent {i}: {live} bits, {keyed} keys, live counter {}",
                    x.live
                ));
            }
            if x.used[..x.first_free_word as usize]
                .iter()
                .any(|w| *w != u64::MAX)
            {
                return Err(format!("extent {i}: a free slot below the search hint"));
            }
            if x.draining && x.live == 0 {
                return Err(format!("draining extent {i} is empty"));
            }
            if in_partial(x.stride) != (!x.draining && x.live < x.slots) {
                return Err(format!("extent {i}: partial membership wrong"));
            }
        }
        if occupied != self.entries.len() || self.by_slot.len() != self.entries.len() {
            return Err(format!(
                "{occupied} occupied slots, {} keyed, {} entries",
                self.by_slot.len(),
                self.entries.len()
            ));
        }
        if self.entries.len() as u64 > self.max_entries {
            return Err(format!(
                "{} entries above the cap of {}",
                self.entries.len(),
                self.max_entries
            ));
        }
        if self.index_bytes() > self.limit_bytes {
            return Err(format!(
                "index charged {} bytes, above its limit of {}",
                self.index_bytes(),
                self.limit_bytes
            ));
        }
        let mut heads = BTreeSet::new();
        for (&stride, set) in &self.strides {
            if set.lru.is_empty() && set.partial.is_empty() {
                return Err(format!("empty sets of stride {stride} kept"));
            }
            if let Some((stamp, _)) = set.lru.first_key_value() {
                heads.insert((*stamp, stride));
            }
        }
        if heads != self.heads {
            return Err(format!("heads {:?} != LRU heads {heads:?}", self.heads));
        }
        for (&stride, set) in &self.strides {
            for &i in &set.partial {
                if self.extents.get(i as usize).map(|x| x.stride) != Some(stride) {
                    return Err(format!("partial set of stride {stride} holds extent {i}"));
                }
            }
            for (stamp, k) in &set.lru {
                if self.entries.get(k).map(|e| (e.stamp, e.slot.stride)) != Some((*stamp, stride)) {
                    return Err(format!("LRU of stride {stride} holds stale {k:?}"));
                }
            }
        }
        self.check_summaries()
    }

    /// Verifies the reclaim summaries (see [`Summary`]) against a recomputation from the
    /// entries, and the reclaimable set against the summaries.
    fn check_summaries(&self) -> Result<(), String> {
        let mut exact = vec![Summary::default(); self.extents.len()];
        for e in self.entries.values() {
            let s = &mut exact[e.slot.extent as usize];
            s.busy += u32::from(!e.evictable());
            s.newest = s.newest.max(Some(e.stamp));
        }
        let mut listed = 0usize;
        for (i, (x, exact)) in self.extents.iter().zip(&exact).enumerate() {
            let s = x.summary;
            if s.busy != exact.busy {
                return Err(format!("extent {i}: busy {} != {}", s.busy, exact.busy));
            }
            // `newest` is an upper bound of the exact value, and exact when empty.
            if s.newest < exact.newest || (exact.newest.is_none() && s.newest.is_some()) {
                return Err(format!(
                    "extent {i}: newest {:?} below or beside {:?}",
                    s.newest, exact.newest
                ));
            }
            let want = (x.stride != 0 && !x.draining && s.busy == 0).then_some(s.newest);
            if s.listed != want {
                return Err(format!("extent {i}: listed {:?}, want {want:?}", s.listed));
            }
            if let Some(newest) = want {
                listed += 1;
                if !self.reclaimable.contains(&(newest, i as u32)) {
                    return Err(format!("extent {i}: reclaimable but not in the set"));
                }
            }
        }
        if self.reclaimable.len() != listed {
            return Err(format!(
                "reclaimable set holds {}, {listed} extents reclaimable",
                self.reclaimable.len()
            ));
        }
        Ok(())
    }
}
