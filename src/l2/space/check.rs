//! Invariant checker of the index: recomputes every aggregate and compares.

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
            if x.occupants.get(s.index as usize) != Some(&Some(*k)) {
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
                if !x.occupants.is_empty() || !x.free.is_empty() {
                    return Err(format!("free extent {i} has slots"));
                }
                continue;
            }
            if self.free_extents.contains(&i) || x.epoch == 0 {
                return Err(format!("assigned extent {i}: in free set or epoch 0"));
            }
            if x.occupants.len() != self.slots_per(x.stride) as usize {
                return Err(format!("extent {i}: wrong slot count"));
            }
            let live = x.occupants.iter().flatten().count();
            occupied += live;
            if live != x.live as usize {
                return Err(format!("extent {i}: live {live} != counter {}", x.live));
            }
            if self.recovering {
                continue; // free lists and partial sets are rebuilt by finish_recovery
            }
            if live + x.free.len() != x.occupants.len() {
                return Err(format!(
                    "extent {i}: live {live}/{} free {}",
                    x.live,
                    x.free.len()
                ));
            }
            let mut seen = vec![false; x.occupants.len()];
            for &j in &x.free {
                let j = j as usize;
                if x.occupants.get(j) != Some(&None) || std::mem::replace(&mut seen[j], true) {
                    return Err(format!("extent {i}: bad free slot {j}"));
                }
            }
            if x.draining && x.live == 0 {
                return Err(format!("draining extent {i} is empty"));
            }
            if in_partial(x.stride) != (!x.draining && !x.free.is_empty()) {
                return Err(format!("extent {i}: partial membership wrong"));
            }
        }
        if occupied != self.entries.len() {
            return Err(format!(
                "{occupied} occupied slots, {} entries",
                self.entries.len()
            ));
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
