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

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

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

/// Largest slab page count considered by the slab-choice search.
const MAX_SEARCH_PAGES: u64 = 16;

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

/// Rounds `len` up to a multiple of [`ALIGN`]; callers guarantee no overflow
/// (`len <= MAX_POOL_BYTES`).
fn round_up(len: u64) -> u64 {
    len.div_ceil(ALIGN) * ALIGN
}

/// Slab geometry of a class: `(pages per slab, objects per slab)`.
///
/// Applies the slab-choice rule of the module docs, with the page count
/// limited to the pool's page count so a small pool can still serve a class
/// that fits in it.
fn slab_geometry(class_bytes: u64, pool_pages: u64) -> (u64, u64) {
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
struct Slab {
    class: u32,
    start_page: u64,
    pages: u64,
    objs: u32,
    live: u32,
    /// Objects `next_fresh..objs` have never been handed out since the slab was last empty.
    next_fresh: u32,
    /// Freed object indices below `next_fresh` (a stack).
    freed: Vec<u32>,
    /// Bit `i` set <=> object `i` is live.
    bitmap: Vec<u64>,
}

impl Slab {
    fn new(class: u32, start_page: u64, pages: u64, objs: u32) -> Self {
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

    fn free_count(&self) -> u32 {
        self.objs - self.live
    }

    fn is_live(&self, i: u32) -> bool {
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
    fn pop(&mut self) -> Option<u32> {
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
    fn push(&mut self, i: u32) {
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
struct Class {
    class_bytes: u64,
    slab_pages: u64,
    objs_per_slab: u32,
    live: usize,
    slabs: usize,
    /// Free objects in partial slabs plus the cached empty slab.
    free_slots: u64,
    /// Slabs with `0 < live < objs`, keyed `(free objects, start page)`.
    partial: BTreeSet<(u32, u64)>,
    /// The one cached completely free slab.
    cached: Option<u32>,
}

/// What a planned request will do; produced by `plan` without touching state.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Existing class index, or `None` for a new class.
    class: Option<u32>,
    class_bytes: u64,
    slab_pages: u64,
    objs: u32,
    /// Class with no live slots to evict first (new class with a full table).
    evict: Option<u32>,
    /// Give back other classes' cached empty slabs before carving.
    reclaim: bool,
}

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

    // ----- planning -------------------------------------------------------

    fn oom(&self, class_bytes: u64, count: usize) -> AllocError {
        AllocError::OutOfMemory {
            requested_bytes: class_bytes.saturating_mul(u64::try_from(count).unwrap_or(u64::MAX)),
            free_bytes: self.free_bytes(),
        }
    }

    /// Decides whether `count` slots of `len` can be had, and how. `Ok(None)`
    /// for a valid `len` with `count == 0`. Pure.
    fn plan(&self, len: u64, count: usize) -> Result<Option<Plan>, AllocError> {
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

    // ----- carrying out ---------------------------------------------------

    fn execute(&mut self, plan: Plan, len: u64, count: usize) -> Result<Vec<Slot>, AllocError> {
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
    fn release_cached(&mut self, ci: u32) {
        let cached = self.class_mut(ci).and_then(|c| c.cached.take());
        if let Some(sid) = cached {
            self.drop_empty_slab(ci, sid);
        }
    }

    /// Releases empty slab `sid` of class `ci` (already unlinked from the
    /// class's partial set and cache); removes the class once it has no slabs.
    fn drop_empty_slab(&mut self, ci: u32, sid: u32) {
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

    // ----- free page runs -------------------------------------------------

    fn insert_run(&mut self, start: u64, len: u64) {
        self.runs.insert(start, len);
        self.runs_by_len.insert((len, start));
    }

    fn remove_run(&mut self, start: u64, len: u64) {
        self.runs.remove(&start);
        self.runs_by_len.remove(&(len, start));
    }

    /// Best fit: the smallest free run of at least `p` pages (lowest start
    /// among equals); its first `p` pages are taken.
    fn take_run(&mut self, p: u64) -> Option<u64> {
        let (len, start) = *self.runs_by_len.range((p, 0)..).next()?;
        self.remove_run(start, len);
        if len > p {
            self.insert_run(start + p, len - p);
        }
        Some(start)
    }

    /// Returns pages to the free runs, coalescing with both neighbours.
    fn release_run(&mut self, start: u64, len: u64) {
        let (mut s, mut l) = (start, len);
        if let Some((&ps, &pl)) = self.runs.range(..start).next_back() {
            if ps + pl == start {
                self.remove_run(ps, pl);
                s = ps;
                l += pl;
            }
        }
        if let Some(&nl) = self.runs.get(&(start + len)) {
            self.remove_run(start + len, nl);
            l += nl;
        }
        self.insert_run(s, l);
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

    // ----- consistency ----------------------------------------------------

    fn check_internal(&self) -> Result<(), String> {
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
    fn snapshot(&self) -> String {
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
    fn release_all_cached(&mut self) {
        for ci in 0..self.classes.len() as u32 {
            self.release_cached(ci);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * 1024;

    fn ok(a: &SlabAllocator, live: &[Slot]) {
        if let Err(e) = a.check(live) {
            panic!("check failed: {e}");
        }
    }

    /// Small deterministic PRNG (xorshift64*).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
    }

    #[test]
    fn alignment_and_rounding() {
        let mut a = SlabAllocator::new(256 * MIB);
        let mut live = Vec::new();
        for len in [
            1,
            4095,
            4096,
            4097,
            100_000,
            3 * MIB / 2,
            3 * MIB,
            32 * MIB,
            2 * MIB + 1,
        ] {
            let s = a.allocate(len).unwrap();
            assert_eq!(s.len, len);
            assert_eq!(s.class_bytes, round_up(len));
            assert_eq!(s.offset % ALIGN, 0);
            assert_eq!(s.class_bytes % ALIGN, 0);
            assert!(s.offset + s.class_bytes <= a.capacity());
            if s.class_bytes.is_multiple_of(PAGE) {
                assert_eq!(s.offset % PAGE, 0);
            }
            live.push(s);
            ok(&a, &live);
        }
        let big = a.allocate_batch(32 * MIB, 3).unwrap();
        assert!(big.iter().all(|s| s.offset.is_multiple_of(PAGE)));
    }

    #[test]
    fn class_selection() {
        assert_eq!(slab_geometry(3 * MIB / 2, 1024), (3, 4));
        assert_eq!(slab_geometry(32 * MIB, 1024), (16, 1));
        assert_eq!(slab_geometry(64 * KIB, 1024), (1, 32));
        assert_eq!(slab_geometry(4 * KIB, 1024), (1, 512));
        assert_eq!(slab_geometry(2 * MIB, 1024), (1, 1));
        assert_eq!(slab_geometry(3 * MIB, 1024), (3, 2));
        assert_eq!(slab_geometry(33 * MIB, 1024), (17, 1));
        assert_eq!(slab_geometry(100 * MIB, 1024), (50, 1));
        // 100 KiB: 20 per page, tail 48 KiB = 2.3% < 1/16 -> one page.
        assert_eq!(slab_geometry(100 * KIB, 1024), (1, 20));
        // Small pool: slab pages limited to the pool.
        assert_eq!(slab_geometry(3 * MIB / 2, 2), (1, 1));

        let mut a = SlabAllocator::new(64 * MIB);
        let s = a.allocate_batch(3 * MIB / 2, 4).unwrap();
        assert_eq!(a.class_stats(), vec![(3 * MIB / 2, 4, 1)]);
        let offs: Vec<u64> = s.iter().map(|s| s.offset).collect();
        assert_eq!(offs, vec![0, 3 * MIB / 2, 3 * MIB, 9 * MIB / 2]);
        a.allocate(3 * MIB / 2).unwrap();
        assert_eq!(a.class_stats(), vec![(3 * MIB / 2, 5, 2)]);
        a.allocate_batch(64 * KIB, 33).unwrap();
        assert_eq!(a.class_stats()[0], (64 * KIB, 33, 2));
    }

    #[test]
    fn oom_leaves_state_unchanged() {
        let mut a = SlabAllocator::new(16 * MIB); // 8 pages
        let mut live = a.allocate_batch(3 * MIB / 2, 5).unwrap(); // two 3-page slabs
        live.push(a.allocate(64 * KIB).unwrap()); // page 6
        let before = a.snapshot();
        // 4 MiB class needs 2 pages; only page 7 is free.
        let e = a.allocate(4 * MIB).unwrap_err();
        assert_eq!(
            e,
            AllocError::OutOfMemory {
                requested_bytes: 4 * MIB,
                free_bytes: a.free_bytes()
            }
        );
        assert!(!a.can_allocate(4 * MIB, 1));
        assert_eq!(a.snapshot(), before);
        ok(&a, &live);
        assert!(a.allocate_batch(64 * KIB, 64).is_err());
        assert_eq!(a.snapshot(), before);
        // Exactly what is left of this class still fits: 31 in page 6 + 32 in page 7.
        assert!(a.can_allocate(64 * KIB, 63));
        live.extend(a.allocate_batch(64 * KIB, 63).unwrap());
        ok(&a, &live);
    }

    #[test]
    fn batch_all_or_nothing() {
        let mut a = SlabAllocator::new(64 * MIB); // 32 pages
        let mut live = a.allocate_batch(3 * MIB / 2, 20).unwrap(); // 5 slabs = 15 pages
        ok(&a, &live);
        let before = a.snapshot();
        // 17 pages left: 5 more slabs of 4 -> 20 objects fit, 21 would not.
        assert!(!a.can_allocate(3 * MIB / 2, 21));
        assert!(matches!(
            a.allocate_batch(3 * MIB / 2, 21),
            Err(AllocError::OutOfMemory { .. })
        ));
        assert_eq!(a.snapshot(), before);
        assert!(matches!(
            a.allocate_batch(4096, usize::MAX),
            Err(AllocError::OutOfMemory { .. })
        ));
        assert_eq!(a.snapshot(), before);
        assert_eq!(a.allocate_batch(3 * MIB / 2, 0).unwrap(), vec![]);
        assert_eq!(a.allocate_batch(0, 0), Err(AllocError::ZeroLength));
        assert_eq!(a.snapshot(), before);
        let more = a.allocate_batch(3 * MIB / 2, 20).unwrap();
        assert_eq!(more.len(), 20);
        live.extend(more);
        ok(&a, &live);
    }

    #[test]
    fn bad_frees_rejected() {
        let mut a = SlabAllocator::new(64 * MIB);
        let s = a.allocate_batch(3 * MIB / 2, 2).unwrap();
        let before = a.snapshot();
        let na = |offset| Err(AllocError::NotAllocated { offset });
        let cases = [
            Slot {
                offset: s[0].offset + ALIGN,
                ..s[0]
            }, // inside an object
            Slot {
                offset: 3 * MIB,
                ..s[0]
            }, // boundary, never allocated
            Slot {
                offset: 6 * MIB - 4096,
                ..s[0]
            }, // slab tail area
            Slot {
                offset: 40 * MIB,
                ..s[0]
            }, // free page
            Slot {
                offset: u64::MAX - 4095,
                ..s[0]
            }, // beyond pool
            Slot {
                class_bytes: 2 * MIB,
                len: 2 * MIB,
                ..s[0]
            }, // wrong class
            Slot { len: 0, ..s[0] },   // bogus len
            Slot { len: MIB, ..s[0] }, // len of another class
            Slot {
                len: 2 * MIB,
                ..s[0]
            }, // len > class
        ];
        for c in cases {
            assert_eq!(a.free(c), na(c.offset), "{c:?}");
            assert_eq!(a.snapshot(), before);
        }
        a.free(s[0]).unwrap();
        let after = a.snapshot();
        assert_eq!(a.free(s[0]), na(s[0].offset)); // double free
        assert_eq!(a.snapshot(), after);
        ok(&a, &s[1..]);
        a.free(s[1]).unwrap();
        assert_eq!(a.free(s[1]), na(s[1].offset)); // double free of cached slab's object
        ok(&a, &[]);
    }

    #[test]
    fn fully_freed_pool_coalesces() {
        let mut a = SlabAllocator::new(128 * MIB);
        let mut live = Vec::new();
        let sizes = [64 * KIB, 3 * MIB / 2, 5 * MIB, 4096];
        let mut i = 0;
        let mut fails = 0;
        while fails < sizes.len() {
            match a.allocate(sizes[i % sizes.len()]) {
                Ok(s) => {
                    live.push(s);
                    fails = 0;
                }
                Err(AllocError::OutOfMemory { .. }) => fails += 1,
                Err(e) => panic!("{e}"),
            }
            i += 1;
        }
        ok(&a, &live);
        let mut rng = Rng(7);
        while !live.is_empty() {
            let k = (rng.next() % live.len() as u64) as usize;
            a.free(live.swap_remove(k)).unwrap();
        }
        ok(&a, &[]);
        assert_eq!(a.allocated_bytes(), 0);
        assert_eq!(a.live_slots(), 0);
        assert_eq!(a.free_bytes(), a.capacity());
        // Cached empty slabs are handed back when needed: a max-size object fits.
        let all = a.allocate(a.capacity()).unwrap();
        assert_eq!(all.offset, 0);
        ok(&a, &[all]);
        a.free(all).unwrap();
        a.release_all_cached();
        ok(&a, &[]);
        assert_eq!(a.runs, BTreeMap::from([(0, 64)]));
        assert!(a.class_stats().is_empty());
    }

    #[test]
    fn too_many_classes() {
        let mut a = SlabAllocator::new(1024 * MIB);
        let mut live = Vec::new();
        for k in 1..=MAX_SIZE_CLASSES as u64 {
            live.push(a.allocate(k * 4096).unwrap());
        }
        let before = a.snapshot();
        let e = a.allocate(65 * 4096).unwrap_err();
        assert_eq!(
            e,
            AllocError::TooManyClasses {
                limit: MAX_SIZE_CLASSES
            }
        );
        assert!(!a.can_allocate(65 * 4096, 1));
        assert_eq!(a.snapshot(), before);
        // Existing classes still work.
        live.push(a.allocate(4096).unwrap());
        // A class with no live slots is evicted for a new one.
        let s = live.remove(9); // 10 * 4096
        a.free(s).unwrap();
        assert_eq!(a.class_stats().len(), MAX_SIZE_CLASSES);
        live.push(a.allocate(65 * 4096).unwrap());
        assert_eq!(a.class_stats().len(), MAX_SIZE_CLASSES);
        assert!(a.class_stats().iter().all(|c| c.0 != 10 * 4096));
        ok(&a, &live);
    }

    #[test]
    fn zero_and_too_large() {
        let mut a = SlabAllocator::new(64 * MIB);
        assert_eq!(a.allocate(0), Err(AllocError::ZeroLength));
        assert_eq!(a.allocate_batch(0, 3), Err(AllocError::ZeroLength));
        let tl = |len| {
            Err(AllocError::TooLarge {
                len,
                pool_bytes: 64 * MIB,
            })
        };
        assert_eq!(a.allocate(64 * MIB + 1), tl(64 * MIB + 1));
        assert_eq!(a.allocate(u64::MAX), tl(u64::MAX));
        assert_eq!(
            a.allocate_batch(u64::MAX, usize::MAX).err(),
            tl(u64::MAX).err()
        );
        assert!(!a.can_allocate(u64::MAX, 1));
        assert!(a.can_allocate(64 * MIB, 1));
        assert!(!a.can_allocate(64 * MIB, 2));
        ok(&a, &[]);
        assert!(!AllocError::ZeroLength.to_string().is_empty());
    }

    #[test]
    fn tiny_and_odd_pools() {
        for bytes in [0, 1, 4096, PAGE - 1] {
            let mut a = SlabAllocator::new(bytes);
            assert_eq!(a.capacity(), 0);
            assert_eq!(a.free_bytes(), 0);
            assert_eq!(
                a.allocate(1),
                Err(AllocError::TooLarge {
                    len: 1,
                    pool_bytes: 0
                })
            );
            assert_eq!(a.allocate(0), Err(AllocError::ZeroLength));
            let bogus = Slot {
                offset: 0,
                len: 4096,
                class_bytes: 4096,
            };
            assert_eq!(a.free(bogus), Err(AllocError::NotAllocated { offset: 0 }));
            ok(&a, &[]);
        }
        let mut a = SlabAllocator::new(PAGE);
        let s = a.allocate(PAGE).unwrap();
        assert_eq!(
            a.allocate(1),
            Err(AllocError::OutOfMemory {
                requested_bytes: 4096,
                free_bytes: 0
            })
        );
        a.free(s).unwrap();
        // The 2 MiB class's cached slab is reclaimed for a new class.
        let t = a.allocate(1).unwrap();
        ok(&a, &[t]);
        assert_eq!(SlabAllocator::new(3 * PAGE + 5).capacity(), 3 * PAGE);
        // 1.5 MiB in a 2-page pool uses 1-page slabs.
        let mut b = SlabAllocator::new(2 * PAGE);
        let v = b.allocate_batch(3 * MIB / 2, 2).unwrap();
        ok(&b, &v);
        // Absurd pool sizes are clamped, and nothing is allocated up front.
        let mut c = SlabAllocator::new(u64::MAX);
        assert_eq!(c.capacity(), MAX_POOL_BYTES);
        let x = c.allocate(64 << 30).unwrap();
        let y = c.allocate(4096).unwrap();
        assert!(y.offset >= x.offset + x.class_bytes);
        c.free(x).unwrap();
        c.free(y).unwrap();
    }

    #[test]
    fn freed_class_pages_are_reused_by_another_class() {
        let mut a = SlabAllocator::new(256 * MIB);
        let (ca, cb, cc) = (64 * KIB, 3 * MIB / 2, 3 * MIB);
        let sizes = [ca, cb, cc];
        let mut live = Vec::new();
        let mut i = 0;
        let mut fails = 0;
        while fails < 3 {
            match a.allocate(sizes[i % 3]) {
                Ok(s) => {
                    live.push(s);
                    fails = 0;
                }
                Err(_) => fails += 1,
            }
            i += 1;
        }
        ok(&a, &live);
        // Free a random half.
        let mut rng = Rng(42);
        for _ in 0..live.len() / 2 {
            let k = (rng.next() % live.len() as u64) as usize;
            a.free(live.swap_remove(k)).unwrap();
        }
        ok(&a, &live);
        // Free everything of class B.
        let b_pages: BTreeSet<u64> = a
            .slabs
            .iter()
            .flatten()
            .filter(|s| a.class(s.class).is_some_and(|c| c.class_bytes == cb))
            .flat_map(|s| s.start_page..s.start_page + s.pages)
            .collect();
        assert!(!b_pages.is_empty());
        let (b, rest): (Vec<Slot>, Vec<Slot>) = live.into_iter().partition(|s| s.class_bytes == cb);
        live = rest;
        for s in b {
            a.free(s).unwrap();
        }
        ok(&a, &live);
        // Fill with class C (same 3-page slab size), then class A.
        for class in [cc, ca] {
            while let Ok(s) = a.allocate(class) {
                live.push(s);
            }
            ok(&a, &live);
        }
        // Every page that class B held now belongs to another class, and B is gone.
        for p in &b_pages {
            let sid = a.owner_of(*p).expect("page left unused");
            let c = a.class(a.slab(sid).unwrap().class).unwrap();
            assert_ne!(c.class_bytes, cb);
        }
        assert!(a.class_stats().iter().all(|c| c.0 != cb));
        assert!(a.runs.is_empty());
        // Neither class has slab tails and both ran out of free slots, so the
        // pool is completely used: nothing stayed stranded in B's old slabs.
        assert_eq!(a.free_bytes(), 0);
    }

    // ----- property test --------------------------------------------------

    #[derive(Debug, Clone)]
    enum Op {
        Alloc {
            class: usize,
            shave: u64,
        },
        Batch {
            class: usize,
            count: usize,
        },
        Free {
            pick: usize,
        },
        Bogus {
            pick: usize,
            kind: u8,
            page: u64,
            obj: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0usize..4, 0u64..4096).prop_map(|(class, shave)| Op::Alloc { class, shave }),
            2 => (0usize..4, 0usize..12).prop_map(|(class, count)| Op::Batch { class, count }),
            4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
            1 => (any::<usize>(), 0u8..5, 0u64..80, 0u64..40)
                .prop_map(|(pick, kind, page, obj)| Op::Bogus { pick, kind, page, obj }),
        ]
    }

    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![
            Just(64 * KIB),
            Just(3 * MIB / 2),
            Just(2 * MIB),
            Just(3 * MIB),
            Just(32 * MIB),
            4096u64..=(12 * MIB),
        ]
    }

    fn assert_model(a: &SlabAllocator, model: &[Slot]) -> Result<(), TestCaseError> {
        prop_assert_eq!(a.check(model), Ok(()));
        let sum: u64 = model.iter().map(|s| s.class_bytes).sum();
        prop_assert_eq!(a.allocated_bytes(), sum);
        prop_assert_eq!(a.free_bytes(), a.capacity() - sum);
        prop_assert_eq!(a.live_slots(), model.len());
        let mut v = model.to_vec();
        v.sort_by_key(|s| s.offset);
        for w in v.windows(2) {
            prop_assert!(
                w[0].offset + w[0].class_bytes <= w[1].offset,
                "overlap {:?}",
                w
            );
        }
        for s in &v {
            prop_assert!(s.offset.is_multiple_of(ALIGN) && s.len <= s.class_bytes);
            prop_assert!(s.offset + s.class_bytes <= a.capacity());
        }
        Ok(())
    }

    fn check_new(
        a: &SlabAllocator,
        model: &[Slot],
        new: &[Slot],
        len: u64,
    ) -> Result<(), TestCaseError> {
        for s in new {
            prop_assert_eq!(s.len, len);
            prop_assert_eq!(s.class_bytes, round_up(len));
            prop_assert!(s.offset + s.class_bytes <= a.capacity());
            for m in model {
                prop_assert!(
                    s.offset + s.class_bytes <= m.offset || m.offset + m.class_bytes <= s.offset,
                    "new {:?} overlaps live {:?}",
                    s,
                    m
                );
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn random_ops_match_model(
            pool_pages in 32u64..=64,
            sizes in prop::collection::vec(size(), 2..=4),
            ops in prop::collection::vec(op(), 1..120),
        ) {
            let mut a = SlabAllocator::new(pool_pages * PAGE);
            let mut model: Vec<Slot> = Vec::new();
            let mut dead: Vec<Slot> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc { class, shave } => {
                        let len = (sizes[class % sizes.len()] - shave).max(1);
                        let can = a.can_allocate(len, 1);
                        let before = a.snapshot();
                        match a.allocate(len) {
                            Ok(s) => {
                                prop_assert!(can);
                                check_new(&a, &model, &[s], len)?;
                                model.push(s);
                            }
                            Err(e) => {
                                prop_assert!(!can);
                                prop_assert!(matches!(e, AllocError::OutOfMemory { .. }), "{:?}", e);
                                prop_assert_eq!(a.snapshot(), before);
                                // An empty pool always has room for one object.
                                prop_assert!(!model.is_empty());
                            }
                        }
                    }
                    Op::Batch { class, count } => {
                        let len = sizes[class % sizes.len()];
                        let can = a.can_allocate(len, count);
                        let before = a.snapshot();
                        match a.allocate_batch(len, count) {
                            Ok(v) => {
                                prop_assert!(can);
                                prop_assert_eq!(v.len(), count);
                                check_new(&a, &model, &v, len)?;
                                let mut offs: Vec<u64> = v.iter().map(|s| s.offset).collect();
                                offs.sort_unstable();
                                offs.dedup();
                                prop_assert_eq!(offs.len(), count);
                                model.extend(v);
                            }
                            Err(e) => {
                                prop_assert!(!can);
                                prop_assert!(matches!(e, AllocError::OutOfMemory { .. }), "{:?}", e);
                                prop_assert_eq!(a.snapshot(), before);
                            }
                        }
                    }
                    Op::Free { pick } => {
                        if !model.is_empty() {
                            let s = model.swap_remove(pick % model.len());
                            prop_assert_eq!(a.free(s), Ok(()));
                            dead.push(s);
                        }
                    }
                    Op::Bogus { pick, kind, page, obj } => {
                        let base = if model.is_empty() || kind == 0 {
                            dead.get(pick % dead.len().max(1)).copied()
                        } else {
                            Some(model[pick % model.len()])
                        };
                        let cand = match (kind, base) {
                            (1, Some(b)) => Slot { offset: b.offset + ALIGN, ..b },
                            (2, Some(b)) => Slot { class_bytes: b.class_bytes + ALIGN, len: b.class_bytes + ALIGN, ..b },
                            (3, Some(b)) => Slot { offset: b.offset + b.class_bytes, ..b },
                            (_, Some(b)) if kind == 0 => b,
                            (_, b) => {
                                let cb = b.map_or(64 * KIB, |b| b.class_bytes);
                                Slot { offset: page * PAGE + obj * cb, len: cb, class_bytes: cb }
                            }
                        };
                        let before = a.snapshot();
                        let res = a.free(cand);
                        let pos = model.iter().position(|m| {
                            m.offset == cand.offset
                                && m.class_bytes == cand.class_bytes
                                && cand.len > 0
                                && cand.len <= cand.class_bytes
                                && cand.len > cand.class_bytes - ALIGN
                        });
                        match pos {
                            Some(i) => {
                                prop_assert_eq!(res, Ok(()));
                                dead.push(model.swap_remove(i));
                            }
                            None => {
                                prop_assert_eq!(res, Err(AllocError::NotAllocated { offset: cand.offset }));
                                prop_assert_eq!(a.snapshot(), before);
                            }
                        }
                    }
                }
                assert_model(&a, &model)?;
            }
            for s in model.drain(..) {
                prop_assert_eq!(a.free(s), Ok(()));
            }
            assert_model(&a, &model)?;
            prop_assert_eq!(a.allocated_bytes(), 0);
            prop_assert!(a.can_allocate(a.capacity(), 1));
            a.release_all_cached();
            prop_assert_eq!(a.check(&[]), Ok(()));
            prop_assert_eq!(a.runs.len(), 1);
        }
    }
}
