//! Planning a request: whether `count` slots of a length can be had and how (existing or new
//! class, class eviction, reclaiming other classes' cached empty slabs), without touching state.

use super::classes::{round_up, slab_geometry};
use super::{AllocError, SlabAllocator, MAX_SIZE_CLASSES};

/// What a planned request will do; produced by `plan` without touching state.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    /// Existing class index, or `None` for a new class.
    pub(super) class: Option<u32>,
    pub(super) class_bytes: u64,
    pub(super) slab_pages: u64,
    pub(super) objs: u32,
    /// Class with no live slots to evict first (new class with a full table).
    pub(super) evict: Option<u32>,
    /// Give back other classes' cached empty slabs before carving.
    pub(super) reclaim: bool,
}

impl SlabAllocator {
    pub(super) fn oom(&self, class_bytes: u64, count: usize) -> AllocError {
        AllocError::OutOfMemory {
            requested_bytes: class_bytes.saturating_mul(u64::try_from(count).unwrap_or(u64::MAX)),
            free_bytes: self.free_bytes(),
        }
    }

    /// Decides whether `count` slots of `len` can be had, and how. `Ok(None)`
    /// for a valid `len` with `count == 0`. Pure.
    pub(super) fn plan(&self, len: u64, count: usize) -> Result<Option<Plan>, AllocError> {
        if len == 0 {
            return Err(AllocError::ZeroLength);
        }
        if len > self.capacity {
            return Err(AllocError::TooLarge {
                len,
                pool_bytes: self.capacity,
            });
        }
        let class_bytes = round_up(len);
        if count == 0 {
            return Ok(None);
        }
        let count64 = u64::try_from(count).unwrap_or(u64::MAX);
        let existing = self
            .class_by_size
            .get(&class_bytes)
            .and_then(|&ci| self.class(ci).map(|c| (ci, c)));
        let mut plan = match existing {
            Some((ci, c)) => Plan {
                class: Some(ci),
                class_bytes,
                slab_pages: c.slab_pages,
                objs: c.objs_per_slab,
                evict: None,
                reclaim: false,
            },
            None => {
                let (slab_pages, objs) = slab_geometry(class_bytes, self.total_pages);
                let evict = if self.class_by_size.len() >= MAX_SIZE_CLASSES {
                    match self.evictable_class() {
                        Some(e) => Some(e),
                        None => {
                            return Err(AllocError::TooManyClasses {
                                limit: MAX_SIZE_CLASSES,
                            })
                        }
                    }
                } else {
                    None
                };
                Plan {
                    class: None,
                    class_bytes,
                    slab_pages,
                    objs: u32::try_from(objs).unwrap_or(u32::MAX),
                    evict,
                    reclaim: false,
                }
            }
        };
        let free_slots = existing.map_or(0, |(_, c)| c.free_slots);
        if count64 <= free_slots {
            return Ok(Some(plan));
        }
        let need_slabs = (count64 - free_slots).div_ceil(u64::from(plan.objs.max(1)));
        if need_slabs > self.total_pages / plan.slab_pages.max(1) {
            return Err(self.oom(class_bytes, count));
        }
        if self.slabs_in_runs(plan.slab_pages, need_slabs) >= need_slabs {
            return Ok(Some(plan));
        }
        if self.slabs_with_reclaim(plan.slab_pages, need_slabs, plan.class) >= need_slabs {
            plan.reclaim = true;
            return Ok(Some(plan));
        }
        Err(self.oom(class_bytes, count))
    }

    /// How many `p`-page slabs the free runs yield, counting until `want`
    /// (visits at most `want` runs: largest first, each yields >= 1).
    fn slabs_in_runs(&self, p: u64, want: u64) -> u64 {
        let mut n = 0u64;
        for &(len, _) in self.runs_by_len.iter().rev() {
            if len < p || n >= want {
                break;
            }
            n += len / p;
        }
        n
    }

    /// Like `slabs_in_runs`, but as if the cached empty slabs of every class
    /// other than `keep` had been given back (and coalesced). Linear in the
    /// number of free runs: only used near out-of-memory.
    fn slabs_with_reclaim(&self, p: u64, want: u64, keep: Option<u32>) -> u64 {
        let mut cached: Vec<(u64, u64)> = self
            .classes
            .iter()
            .enumerate()
            .filter(|(ci, _)| Some(*ci as u32) != keep)
            .filter_map(|(_, c)| c.as_ref().and_then(|c| c.cached))
            .filter_map(|sid| self.slab(sid).map(|s| (s.start_page, s.pages)))
            .collect();
        if cached.is_empty() {
            return self.slabs_in_runs(p, want);
        }
        cached.sort_unstable();
        let mut runs = self.runs.iter().map(|(&s, &l)| (s, l)).peekable();
        let mut slabs = cached.into_iter().peekable();
        let mut n = 0u64;
        let mut cur: Option<(u64, u64)> = None;
        loop {
            let next = match (runs.peek(), slabs.peek()) {
                (Some(&r), Some(&s)) => {
                    if r.0 < s.0 {
                        runs.next()
                    } else {
                        slabs.next()
                    }
                }
                (Some(_), None) => runs.next(),
                (None, Some(_)) => slabs.next(),
                (None, None) => None,
            };
            match (cur, next) {
                (Some((cs, cl)), Some((ns, nl))) if cs + cl == ns => cur = Some((cs, cl + nl)),
                (Some((_, cl)), Some(item)) => {
                    n += cl / p;
                    if n >= want {
                        return n;
                    }
                    cur = Some(item);
                }
                (None, Some(item)) => cur = Some(item),
                (Some((_, cl)), None) => return n + cl / p,
                (None, None) => return n,
            }
        }
    }

    /// A class with no live slots (it only holds a cached empty slab).
    fn evictable_class(&self) -> Option<u32> {
        self.class_by_size
            .values()
            .copied()
            .find(|&ci| self.class(ci).is_some_and(|c| c.live == 0))
    }
}
