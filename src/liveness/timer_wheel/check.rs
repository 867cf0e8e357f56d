//! The invariant checker of [`TimerWheel`]: every list, link, slot and count recomputed.

use super::{list_for, Entry, ListId, State, TimerWheel, LEVELS, NIL, SLOTS};

impl<T> TimerWheel<T> {
    /// Verifies every structural invariant (list membership and placement,
    /// link symmetry, occupancy bitmaps, counts, free list, capacity).
    /// Returns a description of the first violation found. O(slab size).
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.slab.len();
        let mut seen = vec![false; n];
        let mut linked = 0usize;
        for level in 0..LEVELS {
            for slot in 0..SLOTS {
                let head = self.heads[level][slot];
                let bit = self.occupied[level] & (1u64 << slot) != 0;
                if bit != (head != NIL) {
                    return Err(format!(
                        "level {level} slot {slot}: occupancy bit {bit} but head {head}"
                    ));
                }
                let list = ListId::Wheel {
                    level: level as u8,
                    slot: slot as u8,
                };
                linked += self.check_list(head, list, &mut seen)?;
            }
        }
        for &(deadline, seq, index) in &self.overflow {
            let Some(Entry {
                state: State::Occupied(node),
                ..
            }) = self.slab.get(index)
            else {
                return Err(format!("overflow: index {index} not a live entry"));
            };
            if seen[index] {
                return Err(format!("overflow: entry {index} present twice"));
            }
            seen[index] = true;
            if node.list != ListId::Overflow || node.deadline != deadline || node.seq != seq {
                return Err(format!(
                    "overflow key ({deadline}, {seq}, {index}) disagrees with entry {:?}/{}/{}",
                    node.list, node.deadline, node.seq
                ));
            }
            let want = list_for(self.now, deadline);
            if want != ListId::Overflow {
                return Err(format!(
                    "entry {index} deadline {deadline} in overflow, belongs on {want:?} (now {})",
                    self.now
                ));
            }
            linked += 1;
        }
        linked += self.check_list(self.ready_head, ListId::Ready, &mut seen)?;

        let mut live = 0usize;
        let mut retired = 0usize;
        for (i, entry) in self.slab.iter().enumerate() {
            match &entry.state {
                State::Occupied(node) => {
                    live += 1;
                    if !seen[i] {
                        return Err(format!("live entry {i} is on no list"));
                    }
                    if node.seq >= self.next_seq && self.next_seq != 0 {
                        return Err(format!("entry {i} seq {} >= next_seq", node.seq));
                    }
                }
                State::Vacant { .. } => {
                    if entry.generation == u64::MAX {
                        retired += 1;
                    }
                }
            }
        }
        if live != self.len || linked != self.len {
            return Err(format!(
                "len {} but {live} live entries and {linked} linked",
                self.len
            ));
        }
        if self.len > self.capacity {
            return Err(format!("len {} > capacity {}", self.len, self.capacity));
        }

        let mut free = 0usize;
        let mut cur = self.free_head;
        let mut free_seen = vec![false; n];
        while cur != NIL {
            let Some(entry) = self.slab.get(cur) else {
                return Err(format!("free list index {cur} out of bounds"));
            };
            if free_seen[cur] {
                return Err(format!("free list cycle at {cur}"));
            }
            free_seen[cur] = true;
            if entry.generation == u64::MAX {
                return Err(format!("retired entry {cur} on free list"));
            }
            match entry.state {
                State::Vacant { next_free } => cur = next_free,
                State::Occupied(_) => return Err(format!("occupied entry {cur} on free list")),
            }
            free += 1;
        }
        if live + free + retired != n {
            return Err(format!(
                "slab {n} != live {live} + free {free} + retired {retired}"
            ));
        }
        Ok(())
    }

    fn check_list(&self, head: usize, list: ListId, seen: &mut [bool]) -> Result<usize, String> {
        let mut count = 0usize;
        let mut prev = NIL;
        let mut cur = head;
        while cur != NIL {
            let Some(entry) = self.slab.get(cur) else {
                return Err(format!("{list:?}: index {cur} out of bounds"));
            };
            let State::Occupied(node) = &entry.state else {
                return Err(format!("{list:?}: vacant entry {cur} linked"));
            };
            if seen[cur] {
                return Err(format!("{list:?}: entry {cur} linked twice"));
            }
            seen[cur] = true;
            if node.list != list {
                return Err(format!(
                    "entry {cur} on {list:?} but tagged {:?}",
                    node.list
                ));
            }
            if node.prev != prev {
                return Err(format!("entry {cur}: prev {} expected {prev}", node.prev));
            }
            let want = list_for(self.now, node.deadline);
            if want != list {
                return Err(format!(
                    "entry {cur} deadline {} on {list:?}, belongs on {want:?} (now {})",
                    node.deadline, self.now
                ));
            }
            count += 1;
            prev = cur;
            cur = node.next;
        }
        Ok(count)
    }

    // ----- internals -----
}
