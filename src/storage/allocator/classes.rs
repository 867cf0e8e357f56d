//! Size classes: rounding a length to its class, the slab-choice rule (`slab_geometry`), and
//! the per-slab (`Slab`: live bitmap, freed stack, bump index) and per-class (`Class`) state.

use std::collections::BTreeSet;

use super::{ALIGN, PAGE};

/// Largest slab page count considered by the slab-choice search.
const MAX_SEARCH_PAGES: u64 = 16;

/// Rounds `len` up to a multiple of [`ALIGN`]; callers guarantee no overflow
/// (`len <= MAX_POOL_BYTES`).
pub(super) fn round_up(len: u64) -> u64 {
    len.div_ceil(ALIGN) * ALIGN
}

/// Slab geometry of a class: `(pages per slab, objects per slab)`.
///
/// Applies the slab-choice rule of the module docs, with the page count
/// limited to the pool's page count so a small pool can still serve a class
/// that fits in it.
pub(super) fn slab_geometry(class_bytes: u64, pool_pages: u64) -> (u64, u64) {
    debug_assert!(class_bytes > 0 && class_bytes.is_multiple_of(ALIGN));
    let class_bytes = class_bytes.max(ALIGN);
    let mut best: Option<(u64, u64)> = None; // (pages, tail bytes)
    if class_bytes <= MAX_SEARCH_PAGES * PAGE {
        for p in 1..=MAX_SEARCH_PAGES.min(pool_pages) {
            let slab = p * PAGE;
            if slab < class_bytes {
                continue;
            }
            let tail = slab % class_bytes;
            if tail * 16 < slab {
                best = Some((p, tail));
                break;
            }
            // tail / slab < best_tail / best_slab, compared exactly.
            let better = match best {
                None => true,
                Some((bp, bt)) => {
                    u128::from(tail) * u128::from(bp * PAGE) < u128::from(bt) * u128::from(slab)
                }
            };
            if better {
                best = Some((p, tail));
            }
        }
    }
    match best {
        Some((p, _)) => (p, p * PAGE / class_bytes),
        None => (class_bytes.div_ceil(PAGE), 1),
    }
}

/// A run of pages owned by one size class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Slab {
    pub(super) class: u32,
    pub(super) start_page: u64,
    pub(super) pages: u64,
    pub(super) objs: u32,
    pub(super) live: u32,
    /// Objects `next_fresh..objs` have never been handed out since the slab was last empty.
    pub(super) next_fresh: u32,
    /// Freed object indices below `next_fresh` (a stack).
    pub(super) freed: Vec<u32>,
    /// Bit `i` set <=> object `i` is live.
    pub(super) bitmap: Vec<u64>,
}

impl Slab {
    pub(super) fn new(class: u32, start_page: u64, pages: u64, objs: u32) -> Self {
        Slab {
            class,
            start_page,
            pages,
            objs,
            live: 0,
            next_fresh: 0,
            freed: Vec::new(),
            bitmap: vec![0; objs.div_ceil(64) as usize],
        }
    }

    pub(super) fn free_count(&self) -> u32 {
        self.objs - self.live
    }

    pub(super) fn is_live(&self, i: u32) -> bool {
        self.bitmap
            .get((i / 64) as usize)
            .is_some_and(|w| w & (1u64 << (i % 64)) != 0)
    }

    fn set_bit(&mut self, i: u32, on: bool) {
        if let Some(w) = self.bitmap.get_mut((i / 64) as usize) {
            if on {
                *w |= 1u64 << (i % 64);
            } else {
                *w &= !(1u64 << (i % 64));
            }
        }
    }

    /// Takes a free object index (most recently freed first, then never-used ones).
    pub(super) fn pop(&mut self) -> Option<u32> {
        let i = match self.freed.pop() {
            Some(i) => i,
            None if self.next_fresh < self.objs => {
                self.next_fresh += 1;
                self.next_fresh - 1
            }
            None => return None,
        };
        debug_assert!(!self.is_live(i));
        self.set_bit(i, true);
        self.live += 1;
        Some(i)
    }

    /// Returns live object `i`; an emptied slab starts again from object 0.
    pub(super) fn push(&mut self, i: u32) {
        debug_assert!(self.is_live(i));
        self.set_bit(i, false);
        self.live -= 1;
        if self.live == 0 {
            self.freed.clear();
            self.next_fresh = 0;
        } else {
            self.freed.push(i);
        }
    }
}

/// One size class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Class {
    pub(super) class_bytes: u64,
    pub(super) slab_pages: u64,
    pub(super) objs_per_slab: u32,
    pub(super) live: usize,
    pub(super) slabs: usize,
    /// Free objects in partial slabs plus the cached empty slab.
    pub(super) free_slots: u64,
    /// Slabs with `0 < live < objs`, keyed `(free objects, start page)`.
    pub(super) partial: BTreeSet<(u32, u64)>,
    /// The one cached completely free slab.
    pub(super) cached: Option<u32>,
}
