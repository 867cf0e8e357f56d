//! Carrying out a plan: evicting and reclaiming, creating the class, taking objects from the
//! fullest partial slab, the cached empty slab or a newly carved one, and dropping empty slabs.

use std::collections::BTreeSet;

use super::classes::{Class, Slab};
use super::plan::Plan;
use super::{AllocError, SlabAllocator, Slot, NO_SLAB, PAGE};

impl SlabAllocator {
    pub(super) fn execute(
        &mut self,
        plan: Plan,
        len: u64,
        count: usize,
    ) -> Result<Vec<Slot>, AllocError> {
        if let Some(e) = plan.evict {
            self.release_cached(e);
        }
        if plan.reclaim {
            let keep = plan.class;
            let others: Vec<u32> = (0..self.classes.len() as u32)
                .filter(|&ci| Some(ci) != keep)
                .collect();
            for ci in others {
                self.release_cached(ci);
            }
        }
        let ci = match plan.class {
            Some(ci) => ci,
            None => self.create_class(plan.class_bytes, plan.slab_pages, plan.objs),
        };
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            match self.pop_slot(ci, len) {
                Some(s) => out.push(s),
                None => {
                    debug_assert!(false, "planned allocation failed");
                    for s in out {
                        let _ = self.free(s);
                    }
                    return Err(self.oom(plan.class_bytes, count));
                }
            }
        }
        Ok(out)
    }

    fn create_class(&mut self, class_bytes: u64, slab_pages: u64, objs: u32) -> u32 {
        let class = Class {
            class_bytes,
            slab_pages,
            objs_per_slab: objs,
            live: 0,
            slabs: 0,
            free_slots: 0,
            partial: BTreeSet::new(),
            cached: None,
        };
        let ci = match self.classes.iter().position(Option::is_none) {
            Some(i) => {
                self.classes[i] = Some(class);
                i as u32
            }
            None => {
                self.classes.push(Some(class));
                (self.classes.len() - 1) as u32
            }
        };
        self.class_by_size.insert(class_bytes, ci);
        ci
    }

    /// Takes one object of class `ci`: fullest partial slab, then the cached
    /// empty slab, then a new slab carved from the free runs.
    fn pop_slot(&mut self, ci: u32, len: u64) -> Option<Slot> {
        let (class_bytes, pages, objs, first, cached) = {
            let c = self.class(ci)?;
            (
                c.class_bytes,
                c.slab_pages,
                c.objs_per_slab,
                c.partial.first().copied(),
                c.cached,
            )
        };
        let sid = if let Some(key) = first {
            self.class_mut(ci)?.partial.remove(&key);
            let sid = self.owner_of(key.1)?;
            debug_assert_eq!(self.slab(sid).map(|s| s.free_count()), Some(key.0));
            sid
        } else if let Some(sid) = cached {
            self.class_mut(ci)?.cached = None;
            sid
        } else {
            let start = self.take_run(pages)?;
            let sid = self.install_slab(ci, start, pages, objs);
            let c = self.class_mut(ci)?;
            c.slabs += 1;
            c.free_slots += u64::from(objs);
            sid
        };
        let slab = self.slab_mut(sid)?;
        let i = slab.pop()?;
        let start_page = slab.start_page;
        let free_after = slab.free_count();
        let c = self.class_mut(ci)?;
        if free_after > 0 {
            c.partial.insert((free_after, start_page));
        }
        c.free_slots -= 1;
        c.live += 1;
        self.allocated_bytes += class_bytes;
        self.live_slots += 1;
        Some(Slot {
            offset: start_page * PAGE + u64::from(i) * class_bytes,
            len,
            class_bytes,
        })
    }

    /// Gives the cached empty slab of class `ci` (if any) back to the free runs.
    pub(super) fn release_cached(&mut self, ci: u32) {
        let cached = self.class_mut(ci).and_then(|c| c.cached.take());
        if let Some(sid) = cached {
            self.drop_empty_slab(ci, sid);
        }
    }

    /// Releases empty slab `sid` of class `ci` (already unlinked from the
    /// class's partial set and cache); removes the class once it has no slabs.
    pub(super) fn drop_empty_slab(&mut self, ci: u32, sid: u32) {
        let Some(slab) = self.slabs.get_mut(sid as usize).and_then(Option::take) else {
            debug_assert!(false, "dropping missing slab {sid}");
            return;
        };
        debug_assert_eq!(slab.live, 0);
        debug_assert_eq!(slab.class, ci);
        self.free_slab_ids.push(sid);
        for p in slab.start_page..slab.start_page + slab.pages {
            if let Some(o) = self.page_owner.get_mut(p as usize) {
                *o = NO_SLAB;
            }
        }
        self.release_run(slab.start_page, slab.pages);
        let mut remove = None;
        if let Some(c) = self.class_mut(ci) {
            c.slabs -= 1;
            c.free_slots -= u64::from(slab.objs);
            if c.slabs == 0 {
                debug_assert_eq!(c.live, 0);
                remove = Some(c.class_bytes);
            }
        }
        if let Some(bytes) = remove {
            self.class_by_size.remove(&bytes);
            if let Some(c) = self.classes.get_mut(ci as usize) {
                *c = None;
            }
        }
    }

    fn install_slab(&mut self, ci: u32, start_page: u64, pages: u64, objs: u32) -> u32 {
        let slab = Slab::new(ci, start_page, pages, objs);
        let sid = match self.free_slab_ids.pop() {
            Some(sid) => {
                self.slabs[sid as usize] = Some(slab);
                sid
            }
            None => {
                self.slabs.push(Some(slab));
                (self.slabs.len() - 1) as u32
            }
        };
        let end = (start_page + pages) as usize;
        if self.page_owner.len() < end {
            self.page_owner.resize(end, NO_SLAB);
        }
        for o in &mut self.page_owner[start_page as usize..end] {
            *o = sid;
        }
        sid
    }
}
