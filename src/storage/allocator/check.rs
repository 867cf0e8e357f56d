//! Consistency: the full internal check behind [`SlabAllocator::check`], and the test-only
//! state snapshot and cache release.

use std::collections::BTreeSet;

use super::classes::slab_geometry;
use super::{SlabAllocator, ALIGN, MAX_POOL_BYTES, MAX_SIZE_CLASSES, NO_SLAB, PAGE};

impl SlabAllocator {
    pub(super) fn check_internal(&self) -> Result<(), String> {
        let tp = self.total_pages;
        if self.capacity != tp * PAGE || self.capacity > MAX_POOL_BYTES {
            return Err(format!("capacity {} vs {} pages", self.capacity, tp));
        }
        if self.page_owner.len() as u64 > tp {
            return Err(format!(
                "page table has {} > {} pages",
                self.page_owner.len(),
                tp
            ));
        }
        // Free runs: disjoint, coalesced, mirrored, not owned.
        if self.runs.len() != self.runs_by_len.len() {
            return Err("run maps differ in size".into());
        }
        let mut free_pages = 0u64;
        let mut prev_end: Option<u64> = None;
        for (&s, &l) in &self.runs {
            if l == 0 || s.checked_add(l).is_none_or(|e| e > tp) {
                return Err(format!("bad free run {s}+{l}"));
            }
            if let Some(pe) = prev_end {
                if s < pe {
                    return Err(format!("free runs overlap at page {s}"));
                }
                if s == pe {
                    return Err(format!("free runs not coalesced at page {s}"));
                }
            }
            if !self.runs_by_len.contains(&(l, s)) {
                return Err(format!("run {s}+{l} missing from length map"));
            }
            for p in s..s + l {
                if self.owner_of(p).is_some() {
                    return Err(format!("free page {p} is owned by a slab"));
                }
            }
            free_pages += l;
            prev_end = Some(s + l);
        }
        // Slabs.
        let n_none = self.slabs.iter().filter(|s| s.is_none()).count();
        let ids: BTreeSet<u32> = self.free_slab_ids.iter().copied().collect();
        if ids.len() != self.free_slab_ids.len() || ids.len() != n_none {
            return Err("free slab id list inconsistent".into());
        }
        if let Some(&bad) = ids.iter().find(|&&id| self.slab(id).is_some()) {
            return Err(format!("free slab id {bad} is in use"));
        }
        let nc = self.classes.len();
        let mut c_live = vec![0usize; nc];
        let mut c_slabs = vec![0usize; nc];
        let mut c_free = vec![0u64; nc];
        let mut c_partial = vec![0usize; nc];
        let mut owned_pages = 0u64;
        for (sid, slab) in self.slabs.iter().enumerate() {
            let Some(slab) = slab else { continue };
            let sid = sid as u32;
            let ci = slab.class as usize;
            let Some(class) = self.class(slab.class) else {
                return Err(format!("slab {sid} has no class"));
            };
            if slab.pages != class.slab_pages || slab.objs != class.objs_per_slab {
                return Err(format!("slab {sid} geometry differs from its class"));
            }
            if u64::from(slab.objs) * class.class_bytes > slab.pages * PAGE {
                return Err(format!("slab {sid} objects overflow its pages"));
            }
            if slab.start_page + slab.pages > tp {
                return Err(format!("slab {sid} beyond pool"));
            }
            for p in slab.start_page..slab.start_page + slab.pages {
                if self.owner_of(p) != Some(sid) {
                    return Err(format!("page {p} of slab {sid} not owned by it"));
                }
            }
            owned_pages += slab.pages;
            if slab.bitmap.len() != slab.objs.div_ceil(64) as usize {
                return Err(format!("slab {sid} bitmap size"));
            }
            let pop: u32 = slab.bitmap.iter().map(|w| w.count_ones()).sum();
            if pop != slab.live || slab.live > slab.objs {
                return Err(format!("slab {sid} live {} vs bitmap {pop}", slab.live));
            }
            if (slab.next_fresh..slab.objs.div_ceil(64) * 64).any(|i| slab.is_live(i)) {
                return Err(format!("slab {sid} has live objects at or past next_fresh"));
            }
            let freed: BTreeSet<u32> = slab.freed.iter().copied().collect();
            if freed.len() != slab.freed.len()
                || freed
                    .iter()
                    .any(|&i| i >= slab.next_fresh || slab.is_live(i))
            {
                return Err(format!("slab {sid} freed stack inconsistent"));
            }
            if slab.freed.len() as u64 + u64::from(slab.objs - slab.next_fresh)
                != u64::from(slab.free_count())
            {
                return Err(format!("slab {sid} free accounting"));
            }
            let key = (slab.free_count(), slab.start_page);
            let in_partial = class.partial.contains(&key);
            let is_cached = class.cached == Some(sid);
            if slab.live == 0 {
                if !is_cached || in_partial {
                    return Err(format!("empty slab {sid} is not the cached slab"));
                }
            } else if slab.live == slab.objs {
                if in_partial || is_cached {
                    return Err(format!("full slab {sid} listed as free"));
                }
            } else {
                if !in_partial || is_cached {
                    return Err(format!("partial slab {sid} not in partial set"));
                }
                c_partial[ci] += 1;
            }
            c_live[ci] += slab.live as usize;
            c_slabs[ci] += 1;
            c_free[ci] += u64::from(slab.free_count());
        }
        let owned_entries = self.page_owner.iter().filter(|&&o| o != NO_SLAB).count() as u64;
        if owned_entries != owned_pages {
            return Err(format!(
                "page table owns {owned_entries} pages, slabs {owned_pages}"
            ));
        }
        if owned_pages + free_pages != tp {
            return Err(format!(
                "pages leaked: {owned_pages} owned + {free_pages} free != {tp}"
            ));
        }
        // Classes.
        let n_classes = self.classes.iter().filter(|c| c.is_some()).count();
        if n_classes != self.class_by_size.len() || n_classes > MAX_SIZE_CLASSES {
            return Err(format!(
                "{n_classes} classes vs {} in map",
                self.class_by_size.len()
            ));
        }
        let mut total_live = 0usize;
        let mut total_bytes = 0u64;
        for (ci, c) in self.classes.iter().enumerate() {
            let Some(c) = c else { continue };
            if self.class_by_size.get(&c.class_bytes) != Some(&(ci as u32)) {
                return Err(format!("class {} not mapped", c.class_bytes));
            }
            if c.class_bytes == 0 || !c.class_bytes.is_multiple_of(ALIGN) {
                return Err(format!("class size {} not aligned", c.class_bytes));
            }
            let (p, o) = slab_geometry(c.class_bytes, tp);
            if (p, o) != (c.slab_pages, u64::from(c.objs_per_slab)) {
                return Err(format!("class {} geometry", c.class_bytes));
            }
            if c.live != c_live[ci] || c.slabs != c_slabs[ci] || c.free_slots != c_free[ci] {
                return Err(format!(
                    "class {} counters: live {}/{} slabs {}/{} free {}/{}",
                    c.class_bytes,
                    c.live,
                    c_live[ci],
                    c.slabs,
                    c_slabs[ci],
                    c.free_slots,
                    c_free[ci]
                ));
            }
            if c.partial.len() != c_partial[ci] {
                return Err(format!(
                    "class {} partial set has stale entries",
                    c.class_bytes
                ));
            }
            if c.slabs == 0 {
                return Err(format!("class {} has no slabs", c.class_bytes));
            }
            if let Some(sid) = c.cached {
                if self
                    .slab(sid)
                    .is_none_or(|s| s.class as usize != ci || s.live != 0)
                {
                    return Err(format!("class {} cached slab invalid", c.class_bytes));
                }
            }
            total_live += c.live;
            total_bytes += c.live as u64 * c.class_bytes;
        }
        if total_live != self.live_slots || total_bytes != self.allocated_bytes {
            return Err(format!(
                "totals: live {}/{} bytes {}/{}",
                self.live_slots, total_live, self.allocated_bytes, total_bytes
            ));
        }
        if self.allocated_bytes > self.capacity {
            return Err("allocated beyond capacity".into());
        }
        Ok(())
    }

    /// Exact dump of the internal state, for "nothing changed" assertions.
    #[cfg(test)]
    pub(super) fn snapshot(&self) -> String {
        format!(
            "{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{}|{}",
            self.runs,
            self.runs_by_len,
            self.page_owner,
            self.slabs,
            self.free_slab_ids,
            self.classes,
            self.class_by_size,
            self.allocated_bytes,
            self.live_slots
        )
    }

    /// Gives every cached empty slab back (tests: "fully freed pool is one run").
    #[cfg(test)]
    pub(super) fn release_all_cached(&mut self) {
        for ci in 0..self.classes.len() as u32 {
            self.release_cached(ci);
        }
    }
}
