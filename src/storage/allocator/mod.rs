//! Pool allocator for the node's shared hugepage region.
//!
//! The pool is one contiguous region of `capacity()` bytes addressed by byte
//! offset from 0 (offset 0 is 2 MiB aligned). Clients copy KV chunks into the
//! slots handed out here, so every offset must stay valid and exclusive until
//! it is freed.
//!
//! # Layout
//!
//! * Requested lengths are rounded up to a multiple of [`ALIGN`]; every distinct
//!   rounded length is a *size class* (at most [`MAX_SIZE_CLASSES`] at once).
//! * The pool is cut into [`PAGE`]-sized pages. A class receives pages as
//!   *slabs*: runs of contiguous pages whose objects are packed back to back
//!   from the slab start. So every slot offset is a multiple of [`ALIGN`], and a
//!   class whose size is a multiple of [`PAGE`] always starts on a page
//!   boundary. (A class of, say, 3 MiB packs two objects into a 3-page slab;
//!   its second object starts at +3 MiB, which is 4 KiB but not 2 MiB aligned.)
//! * **Slab-choice rule** (see `slab_geometry`): for a class of `s` bytes with
//!   `s <= 16 * PAGE`, the slab page count `p` is taken from
//!   `1..=min(16, pool pages)` (only `p` with `p * PAGE >= s`) so as to
//!   minimise the wasted tail fraction `((p * PAGE) % s) / (p * PAGE)`. The
//!   search goes from small to large `p`; the first `p` whose waste is below
//!   1/16 is taken at once, and on equal waste the smaller `p` wins. A class
//!   larger than 16 pages uses `ceil(s / PAGE)` pages holding one object.
//!   Examples: 64 KiB -> 1 page / 32 objects, 1.5 MiB -> 3 pages / 4 objects,
//!   32 MiB -> 16 pages / 1 object, 33 MiB -> 17 pages / 1 object.
//!
//! # Data structures
//!
//! * Free page runs live in two ordered maps, `start -> len` and
//!   `(len, start)`, giving best-fit run allocation (smallest run that fits,
//!   lowest address among equals) and neighbour coalescing in `O(log n)`.
//! * `page -> slab` is a `Vec` indexed by page number (`O(1)` for `free`).
//! * Each slab has a bitmap of live objects, a stack of freed object indices
//!   and a bump index for never-used objects.
//! * Each class keeps its partially used slabs in an ordered set keyed by
//!   `(free objects, start page)`: allocation takes the **fullest** partial slab,
//!   lowest address on ties, so nearly empty slabs drain and can return their
//!   pages. A completely free slab is kept as the class's single cached empty
//!   slab (the lower-addressed one is kept if there are two); any other empty
//!   slab returns its pages to the free runs at once.
//! * Cached empty slabs of other classes are given back when a request could
//!   not be met otherwise, and a class with no live slot is evicted when a new
//!   class is needed and all [`MAX_SIZE_CLASSES`] entries are taken. Only that
//!   near-out-of-memory path walks the free runs linearly.
//!
//! Every request is planned first (a pure function of the state) and only
//! then carried out, so a failed `allocate`/`allocate_batch` changes nothing.
//!
//! Files: `classes` (size classes, slab geometry, slabs), `plan` (deciding a request),
//! `execute` (carrying it out), `runs` (the free page runs), `check` (consistency).

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

mod check;
mod classes;
mod execute;
mod plan;
mod runs;
#[cfg(test)]
mod tests;

use classes::{round_up, Class, Slab};

/// Allocation granularity in bytes. Invariant: every slot offset and every
/// `Slot::class_bytes` is a multiple of it.
pub const ALIGN: u64 = 4096;

/// Page size of the pool in bytes (2 MiB). Invariant: the capacity is a
/// multiple of it and every slab starts on a multiple of it.
pub const PAGE: u64 = 2 << 20;

/// Most size classes that may exist at once. Invariant: the allocator never
/// holds more classes than this; a request that would need one more (while
/// every class has live slots) fails with [`AllocError::TooManyClasses`].
pub const MAX_SIZE_CLASSES: usize = 64;

/// Largest pool managed (256 TiB). Invariant: `capacity() <= MAX_POOL_BYTES`;
/// a larger `pool_bytes` passed to [`SlabAllocator::new`] is clamped to it, which
/// keeps page numbers and the page table small.
pub const MAX_POOL_BYTES: u64 = 1 << 48;

/// `page_owner` entry of a page that belongs to no slab.
const NO_SLAB: u32 = u32::MAX;

/// One allocated object's place in the pool. Invariant: offset % ALIGN == 0,
/// len <= class_bytes, offset + class_bytes <= pool bytes. A live slot is
/// identified by `(offset, class_bytes)`; `len` is the length that was
/// requested, so `class_bytes - ALIGN < len <= class_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    /// Byte offset of the slot from the start of the pool (multiple of [`ALIGN`]).
    pub offset: u64,
    /// Requested length in bytes (`0 < len <= class_bytes`).
    pub len: u64,
    /// Size of the slot: `len` rounded up to a multiple of [`ALIGN`].
    pub class_bytes: u64,
}

/// Why an allocator call failed. Invariant: whenever one of these is returned
/// the allocator's state is exactly what it was before the call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// Not enough free (or suitably contiguous) memory right now.
    /// `requested_bytes` is `class_bytes * count` (saturating), `free_bytes`
    /// is [`SlabAllocator::free_bytes`] at the time of the call.
    OutOfMemory {
        /// Bytes the request needed in total.
        requested_bytes: u64,
        /// Bytes not in any live slot when the request failed.
        free_bytes: u64,
    },
    /// The object could never fit: `len` exceeds the pool's capacity.
    TooLarge {
        /// Requested length.
        len: u64,
        /// The pool's capacity.
        pool_bytes: u64,
    },
    /// A zero-length object was requested.
    ZeroLength,
    /// A new size class was needed but `limit` classes already hold live slots.
    TooManyClasses {
        /// [`MAX_SIZE_CLASSES`].
        limit: usize,
    },
    /// The slot given to `free` is not live (double free, wrong offset or wrong class).
    NotAllocated {
        /// Offset of the rejected slot.
        offset: u64,
    },
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory {
                requested_bytes,
                free_bytes,
            } => write!(
                f,
                "pool out of memory: {requested_bytes} bytes requested, {free_bytes} bytes free"
            ),
            AllocError::TooLarge { len, pool_bytes } => write!(
                f,
                "object of {len} bytes can never fit in a pool of {pool_bytes} bytes"
            ),
            AllocError::ZeroLength => write!(f, "zero-length allocation"),
            AllocError::TooManyClasses { limit } => {
                write!(f, "too many size classes in use (limit {limit})")
            }
            AllocError::NotAllocated { offset } => write!(
                f,
                "no live slot at offset {offset} (double free, wrong offset or wrong class)"
            ),
        }
    }
}

impl std::error::Error for AllocError {}

/// Slab allocator over a pool of `capacity()` bytes.
///
/// Invariants (verified by [`SlabAllocator::check`]): every page is either in
/// exactly one free run or owned by exactly one slab; free runs are disjoint
/// and coalesced; each slab belongs to one live size class and its objects lie
/// inside it; `allocated_bytes()` is the sum of `class_bytes` of the live
/// slots and never exceeds `capacity()`; a failed call changes nothing.
pub struct SlabAllocator {
    capacity: u64,
    total_pages: u64,
    /// Free runs: start page -> page count.
    runs: BTreeMap<u64, u64>,
    /// Free runs: (page count, start page).
    runs_by_len: BTreeSet<(u64, u64)>,
    /// Page -> slab id (`NO_SLAB` if free); grows lazily up to the highest slab end.
    page_owner: Vec<u32>,
    slabs: Vec<Option<Slab>>,
    free_slab_ids: Vec<u32>,
    classes: Vec<Option<Class>>,
    class_by_size: BTreeMap<u64, u32>,
    allocated_bytes: u64,
    live_slots: usize,
}

impl fmt::Debug for SlabAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlabAllocator")
            .field("capacity", &self.capacity)
            .field("allocated_bytes", &self.allocated_bytes)
            .field("live_slots", &self.live_slots)
            .field("free_runs", &self.runs.len())
            .field("classes", &self.class_stats())
            .finish()
    }
}

impl SlabAllocator {
    /// Creates an empty allocator. pool_bytes is rounded DOWN to a multiple of
    /// PAGE (a pool smaller than one PAGE has capacity 0) and clamped to
    /// [`MAX_POOL_BYTES`]. Invariant: the whole capacity starts as one free run.
    pub fn new(pool_bytes: u64) -> Self {
        let capacity = pool_bytes.min(MAX_POOL_BYTES) / PAGE * PAGE;
        let total_pages = capacity / PAGE;
        let mut a = SlabAllocator {
            capacity,
            total_pages,
            runs: BTreeMap::new(),
            runs_by_len: BTreeSet::new(),
            page_owner: Vec::new(),
            slabs: Vec::new(),
            free_slab_ids: Vec::new(),
            classes: Vec::new(),
            class_by_size: BTreeMap::new(),
            allocated_bytes: 0,
            live_slots: 0,
        };
        if total_pages > 0 {
            a.insert_run(0, total_pages);
        }
        a
    }

    /// Usable pool bytes. Invariant: a multiple of [`PAGE`], constant for the
    /// allocator's lifetime, at most [`MAX_POOL_BYTES`].
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Sum of class_bytes of all live slots (what memcheck compares with the
    /// index). Invariant: `allocated_bytes() <= capacity()`.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_bytes
    }

    /// Bytes not in any live slot (capacity - allocated_bytes; includes slab
    /// tails and cached empty slabs). Invariant: `free_bytes() + allocated_bytes() == capacity()`.
    pub fn free_bytes(&self) -> u64 {
        self.capacity - self.allocated_bytes
    }

    /// Number of live slots. Invariant: equals the number of successful
    /// allocations minus successful frees.
    pub fn live_slots(&self) -> usize {
        self.live_slots
    }

    /// Allocates one slot of `len` bytes. Invariant: on success the slot is
    /// disjoint from every other live slot; on error nothing changed.
    pub fn allocate(&mut self, len: u64) -> Result<Slot, AllocError> {
        let mut v = self.allocate_batch(len, 1)?;
        match v.pop() {
            Some(s) => Ok(s),
            None => {
                debug_assert!(false, "batch of one returned no slot");
                Err(self.oom(round_up(len), 1))
            }
        }
    }

    /// All-or-nothing: `count` slots of `len` bytes each, or an error with no
    /// state change. Invariant: on success exactly `count` pairwise disjoint
    /// slots of class `round_up(len)` are returned (none for `count == 0`,
    /// which still validates `len`).
    pub fn allocate_batch(&mut self, len: u64, count: usize) -> Result<Vec<Slot>, AllocError> {
        match self.plan(len, count)? {
            None => Ok(Vec::new()),
            Some(plan) => self.execute(plan, len, count),
        }
    }

    /// Whether allocate_batch(len, count) would succeed right now (no state
    /// change). Invariant: agrees exactly with `allocate_batch`.
    pub fn can_allocate(&self, len: u64, count: usize) -> bool {
        self.plan(len, count).is_ok()
    }

    /// Return a slot. Err(NotAllocated) for a slot that is not live (double
    /// free, wrong offset or wrong class); state unchanged then. Invariant: on
    /// success `allocated_bytes()` drops by `slot.class_bytes` and the slot's
    /// bytes may be handed out again.
    pub fn free(&mut self, slot: Slot) -> Result<(), AllocError> {
        let (sid, i) = self.locate(&slot)?;
        let Some(slab) = self.slab_mut(sid) else {
            return Err(AllocError::NotAllocated {
                offset: slot.offset,
            });
        };
        let ci = slab.class;
        let start_page = slab.start_page;
        let objs = slab.objs;
        let old_free = slab.free_count();
        slab.push(i);
        let new_free = slab.free_count();

        self.allocated_bytes -= slot.class_bytes;
        self.live_slots -= 1;
        let other_start = self
            .class(ci)
            .and_then(|c| c.cached)
            .and_then(|o| self.slab(o))
            .map(|s| s.start_page);
        let mut release = None;
        if let Some(class) = self.class_mut(ci) {
            if old_free > 0 {
                class.partial.remove(&(old_free, start_page));
            }
            class.live -= 1;
            class.free_slots += 1;
            if new_free < objs {
                class.partial.insert((new_free, start_page));
            } else {
                // Completely free: becomes the cached slab, keeping the
                // lower-addressed one if the class already has one.
                match (class.cached, other_start) {
                    (None, _) => class.cached = Some(sid),
                    (Some(other), Some(os)) if start_page < os => {
                        class.cached = Some(sid);
                        release = Some(other);
                    }
                    (Some(_), _) => release = Some(sid),
                }
            }
        } else {
            debug_assert!(false, "slab {sid} has no class");
        }
        if let Some(r) = release {
            self.drop_empty_slab(ci, r);
        }
        Ok(())
    }

    /// Full consistency check: internal structures agree (page ownership, free
    /// runs disjoint and coalesced, counters), and the given set of live slots
    /// is exactly the allocator's live set, with no two overlapping. Returns a
    /// description of the first violation. Invariant: never changes state;
    /// `Ok(())` after every public call when `live` mirrors the caller's slots.
    pub fn check(&self, live: &[Slot]) -> Result<(), String> {
        self.check_internal()?;
        for s in live {
            if let Err(e) = self.locate(s) {
                return Err(format!("slot {s:?} is not live in the allocator: {e}"));
            }
        }
        let mut sorted: Vec<&Slot> = live.iter().collect();
        sorted.sort_by_key(|s| s.offset);
        for w in sorted.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a.offset.saturating_add(a.class_bytes) > b.offset {
                return Err(format!("slots overlap: {a:?} and {b:?}"));
            }
        }
        if live.len() != self.live_slots {
            return Err(format!(
                "caller holds {} live slots, allocator has {}",
                live.len(),
                self.live_slots
            ));
        }
        Ok(())
    }

    /// Whether `slot` is a live allocation, exactly as handed out (offset and class). O(1).
    pub fn is_live(&self, slot: &Slot) -> bool {
        self.locate(slot).is_ok()
    }

    /// The allocator's internal consistency alone (page ownership, free runs, slabs, classes,
    /// counters), without comparing its live set with a caller's: O(pages + slabs). Never
    /// changes state.
    pub fn check_structure(&self) -> Result<(), String> {
        self.check_internal()
    }

    /// Per-class stats for status reports: (class_bytes, live slots, slabs),
    /// sorted by class_bytes. Invariant: one entry per existing class; the sum
    /// of `class_bytes * live` over entries equals `allocated_bytes()`.
    pub fn class_stats(&self) -> Vec<(u64, usize, usize)> {
        self.class_by_size
            .values()
            .filter_map(|&ci| self.class(ci))
            .map(|c| (c.class_bytes, c.live, c.slabs))
            .collect()
    }

    // ----- lookups --------------------------------------------------------

    fn class(&self, ci: u32) -> Option<&Class> {
        self.classes.get(ci as usize).and_then(Option::as_ref)
    }

    fn class_mut(&mut self, ci: u32) -> Option<&mut Class> {
        self.classes.get_mut(ci as usize).and_then(Option::as_mut)
    }

    fn slab(&self, sid: u32) -> Option<&Slab> {
        self.slabs.get(sid as usize).and_then(Option::as_ref)
    }

    fn slab_mut(&mut self, sid: u32) -> Option<&mut Slab> {
        self.slabs.get_mut(sid as usize).and_then(Option::as_mut)
    }

    fn owner_of(&self, page: u64) -> Option<u32> {
        let sid = *self.page_owner.get(usize::try_from(page).ok()?)?;
        (sid != NO_SLAB).then_some(sid)
    }

    /// Finds the live object a slot names: `(slab id, object index)`.
    fn locate(&self, slot: &Slot) -> Result<(u32, u32), AllocError> {
        let err = AllocError::NotAllocated {
            offset: slot.offset,
        };
        let Some(sid) = self.owner_of(slot.offset / PAGE) else {
            return Err(err);
        };
        let Some(slab) = self.slab(sid) else {
            return Err(err);
        };
        let Some(class) = self.class(slab.class) else {
            return Err(err);
        };
        let cb = class.class_bytes;
        if slot.class_bytes != cb
            || slot.len == 0
            || slot.len > cb
            || slot.len <= cb.saturating_sub(ALIGN)
        {
            return Err(err);
        }
        let Some(rel) = slot.offset.checked_sub(slab.start_page * PAGE) else {
            return Err(err);
        };
        if !rel.is_multiple_of(cb) {
            return Err(err);
        }
        let Ok(i) = u32::try_from(rel / cb) else {
            return Err(err);
        };
        if i >= slab.objs || !slab.is_live(i) {
            return Err(err);
        }
        Ok((sid, i))
    }
}
