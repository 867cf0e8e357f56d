//! In-memory index and space manager of the L2 disk tier. Pure logic, no I/O.
//!
//! The L2 file holds `extent_count` extents of `extent_bytes` each, extent `i`
//! starting at `EXTENT_BASE + i * extent_bytes`. An extent is free or assigned
//! to one stride; slot `j` of an assigned extent starts at
//! `extent start + slots_start(stride) + j * stride` (after the extent header and table; a
//! `BLOCK`-byte slot header, then the payload). Every assignment of an extent bumps its epoch.
//!
//! * `mod.rs`: the types, reservation, state transitions, eviction.
//! * `access.rs`: lookups, pins, recency touches, statistics.
//! * `budget.rs`: the memory bound (bytes per object and per slot, the entry cap).
//! * `reclaim.rs`: per-extent summaries, the reclaim candidates.
//! * `recover.rs`: rebuilding the index from headers read at start-up.
//! * `check.rs`: the invariant checker ([`L2Index::check`]).
//! * `types.rs`: the public types and errors.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::Hash;

pub use budget::{IndexLimitError, INDEX_BITS_PER_SLOT, INDEX_BYTES_PER_OBJECT};
use reclaim::{ReclaimKey, Summary, Victim};
pub use types::{
    Located, RecoverError, RecoverOutcome, Recovered, Reservation, ReserveError, SlotRef,
    SpaceStats, StateError,
};

/// File offset of extent 0; extent `i` starts at `EXTENT_BASE + i * extent_bytes`.
pub const EXTENT_BASE: u64 = 2 << 20;
/// Size of an extent header and of a slot header; every stride is a multiple of it.
pub const BLOCK: u64 = 4096;
/// Smallest valid stride: one header block plus one payload block.
pub const MIN_STRIDE: u64 = 2 * BLOCK;

/// Recency stamp: (primary, unique tie-break). Unique per entry; larger = more recent.
type Stamp = (u64, u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Writing,
    Ready,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: SlotRef,
    object_len: u64,
    checksum: u64,
    seq: u64,
    layout: u64,
    state: State,
    pins: u32,
    doomed: bool,
    stamp: Stamp,
}

impl Entry {
    fn visible(&self) -> bool {
        self.state == State::Ready && !self.doomed
    }
    fn evictable(&self) -> bool {
        self.visible() && self.pins == 0
    }
    fn located(&self) -> Located {
        Located {
            slot: self.slot,
            object_len: self.object_len,
            checksum: self.checksum,
            seq: self.seq,
            layout: self.layout,
        }
    }
}

/// Aggregates kept incrementally; `check` recomputes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Counts {
    used_bytes: u64,
    objects: u64,
    writing: u64,
    pinned: u64,
}

impl Counts {
    fn of(e: &Entry) -> Self {
        Self {
            used_bytes: e.slot.stride,
            objects: u64::from(e.visible()),
            writing: u64::from(e.state == State::Writing),
            pinned: u64::from(e.pins > 0),
        }
    }
    fn add(&mut self, o: Self, sign: bool) {
        let op = |a: u64, b: u64| {
            if sign {
                a.wrapping_add(b)
            } else {
                a.wrapping_sub(b)
            }
        };
        self.used_bytes = op(self.used_bytes, o.used_bytes);
        self.objects = op(self.objects, o.objects);
        self.writing = op(self.writing, o.writing);
        self.pinned = op(self.pinned, o.pinned);
    }
}

/// One extent. Per slot it keeps a single bit (issue 10, defect 5: a key per slot cost 56
/// bytes of every slot of the device, used or not); the keys are in `L2Index::by_slot`.
#[derive(Debug, Clone)]
struct Extent {
    /// 0 = free.
    stride: u64,
    epoch: u64,
    /// Slots of the assignment; 0 when free.
    slots: u32,
    /// Occupancy bitmap when assigned: bit `j % 64` of word `j / 64` is set when slot `j` is
    /// held by an entry; the bits at and above `slots` are set too (never free). Empty when free.
    used: Vec<u64>,
    /// Search hint: every word of `used` below it is full.
    first_free_word: u32,
    live: u32,
    /// Set by `clear` on extents with in-flight entries: takes no new entries,
    /// becomes free when its last entry goes.
    draining: bool,
    /// The on-disk extent header may not describe this assignment (its write
    /// failed): the next reservation in the extent reports it as `new_extent`
    /// again so the caller rewrites it.
    needs_header: bool,
    /// Reclaim summary (see [`Summary`]); default when free.
    summary: Summary,
}

impl Extent {
    fn is_used(&self, index: u32) -> bool {
        self.used
            .get(index as usize / 64)
            .is_some_and(|w| w & (1 << (index % 64)) != 0)
    }

    fn set_used(&mut self, index: u32, used: bool) {
        let (w, bit) = (index as usize / 64, 1u64 << (index % 64));
        if used {
            self.used[w] |= bit;
        } else {
            self.used[w] &= !bit;
            self.first_free_word = self.first_free_word.min(w as u32);
        }
    }

    /// The lowest free slot, if any; advances the hint over full words.
    fn lowest_free(&mut self) -> Option<u32> {
        let start = self.first_free_word as usize;
        let (w, word) = self
            .used
            .iter()
            .enumerate()
            .skip(start)
            .find(|(_, w)| **w != u64::MAX)?;
        self.first_free_word = w as u32;
        Some(w as u32 * 64 + (!word).trailing_zeros())
    }
}

/// Per-stride sets; a stride whose sets are both empty has no `StrideSet` (so there are at
/// most as many as assigned extents).
#[derive(Debug, Clone)]
struct StrideSet<K> {
    /// Evictable entries of this stride, oldest first.
    lru: BTreeMap<Stamp, K>,
    /// Non-draining extents of this stride with at least one free slot.
    partial: BTreeSet<u32>,
}

impl<K> Default for StrideSet<K> {
    fn default() -> Self {
        Self {
            lru: BTreeMap::new(),
            partial: BTreeSet::new(),
        }
    }
}

/// Index and space manager of the L2 tier. Invariants (verified by
/// [`L2Index::check`]): every slot of every assigned extent is either free or
/// held by exactly one entry (its bit is set and `by_slot` names the entry's key);
/// pinned, Writing and doomed entries are never evicted and their slots never
/// reused; per-stride LRU maps hold exactly the evictable (Ready, unpinned, not
/// doomed) entries, and `heads` the oldest of each; no stride set is empty; every
/// extent's reclaim summary (count of non-evictable entries, bound of the newest
/// stamp) matches its entries, and the set of reclaimable extents holds exactly the
/// assigned, non-draining extents without a non-evictable entry; epochs of assigned
/// extents are `>= 1` and only grow; the index holds at most `max_entries` entries,
/// so its memory stays within its limit (see `budget.rs`).
#[derive(Debug, Clone)]
pub struct L2Index<K> {
    extent_bytes: u64,
    extents: Vec<Extent>,
    free_extents: BTreeSet<u32>,
    strides: HashMap<u64, StrideSet<K>>,
    entries: HashMap<K, Entry>,
    /// The key of every entry by `(extent, slot)`: what reclaiming an extent evicts.
    by_slot: BTreeMap<(u32, u32), K>,
    /// `(oldest stamp, stride)` of every stride with an evictable entry: the least recently
    /// used evictable entry of the whole index is the LRU head of the first stride here.
    heads: BTreeSet<(Stamp, u64)>,
    counts: Counts,
    clock: u64,
    tick: u64,
    /// The epoch the next assignment gets: above every epoch assigned, recovered or noted,
    /// so an epoch is never reused for a different assignment (of any extent).
    next_epoch: u64,
    /// `(newest-stamp bound, extent)` of every assigned, non-draining extent whose entries
    /// are all evictable (see [`Summary`]): the reclaim candidates, oldest first.
    reclaimable: BTreeSet<ReclaimKey>,
    /// Most entries held at once (any state); `reserve` evicts and recovery stops at it.
    max_entries: u64,
    /// The memory limit `max_entries` was derived from (`u64::MAX`: none).
    limit_bytes: u64,
    /// Records `recover_entry` left out or displaced because of `max_entries`.
    unindexed: u64,
}

fn stride_of(object_len: u64) -> u64 {
    BLOCK + object_len.div_ceil(BLOCK) * BLOCK
}

impl<K: Copy + Eq + Hash + fmt::Debug> L2Index<K> {
    /// An index with all `extent_count` extents free and epoch 0, and no memory limit: it
    /// holds as many entries as the device has slots (tests and tools; the tier uses
    /// [`L2Index::with_limit`]). Any geometry is accepted; if `extent_bytes < 3 * BLOCK`
    /// nothing fits (`max_object_len() == 0`).
    pub fn new(extent_count: u32, extent_bytes: u64) -> Self {
        let blank = Extent {
            stride: 0,
            epoch: 0,
            slots: 0,
            used: Vec::new(),
            first_free_word: 0,
            live: 0,
            draining: false,
            needs_header: false,
            summary: Summary::default(),
        };
        Self {
            extent_bytes,
            extents: vec![blank; extent_count as usize],
            free_extents: (0..extent_count).collect(),
            strides: HashMap::new(),
            entries: HashMap::new(),
            by_slot: BTreeMap::new(),
            heads: BTreeSet::new(),
            counts: Counts::default(),
            clock: 1,
            tick: 1,
            next_epoch: 1,
            reclaimable: BTreeSet::new(),
            max_entries: u64::MAX,
            limit_bytes: u64::MAX,
            unindexed: 0,
        }
    }

    /// The epoch the next extent assignment gets (every later one is higher).
    pub fn next_epoch(&self) -> u64 {
        self.next_epoch
    }

    /// The extent header written for `extent`'s current assignment was lost (the write
    /// failed): the next reservation in it reports `new_extent` again.
    pub fn header_lost(&mut self, extent: u32) {
        if let Some(x) = self.extents.get_mut(extent as usize) {
            if x.stride != 0 {
                x.needs_header = true;
            }
        }
    }

    /// Largest `object_len` accepted by `reserve`: one slot of stride
    /// `BLOCK + round_up(len, BLOCK)` must fit after the extent header and a one-block table.
    pub fn max_object_len(&self) -> u64 {
        self.extent_bytes.saturating_sub(3 * BLOCK) / BLOCK * BLOCK
    }

    fn slots_per(&self, stride: u64) -> u32 {
        slots_in(self.extent_bytes, stride)
    }

    fn slot_ref(&self, extent: u32, index: u32) -> SlotRef {
        let x = &self.extents[extent as usize];
        // The extent keeps its slot count: a reservation recomputes no geometry.
        let file_offset =
            crate::l2::format::slot_offset_of(self.extent_bytes, extent, x.stride, x.slots, index);
        SlotRef {
            extent,
            index,
            stride: x.stride,
            epoch: x.epoch,
            file_offset,
        }
    }

    fn next_stamp(&mut self) -> Stamp {
        let s = (self.clock, self.tick);
        self.clock = self.clock.saturating_add(1);
        self.tick = self.tick.saturating_add(1);
        s
    }

    /// Adds an entry's contribution to counters, LRU (and `heads`) and its extent's summary.
    fn link(&mut self, key: K, e: &Entry) {
        self.counts.add(Counts::of(e), true);
        if e.evictable() {
            let stride = e.slot.stride;
            let set = self.strides.entry(stride).or_default();
            let head = set.lru.first_key_value().map(|(s, _)| *s);
            set.lru.insert(e.stamp, key);
            if head.is_none_or(|h| e.stamp < h) {
                if let Some(h) = head {
                    self.heads.remove(&(h, stride));
                }
                self.heads.insert((e.stamp, stride));
            }
        }
        self.summary_add(e);
    }

    /// Removes an entry's contribution from counters, LRU (and `heads`) and its extent's
    /// summary.
    fn unlink(&mut self, e: &Entry) {
        self.counts.add(Counts::of(e), false);
        if e.evictable() {
            let stride = e.slot.stride;
            if let Some(set) = self.strides.get_mut(&stride) {
                let was_head = set
                    .lru
                    .first_key_value()
                    .is_some_and(|(s, _)| *s == e.stamp);
                set.lru.remove(&e.stamp);
                if was_head {
                    self.heads.remove(&(e.stamp, stride));
                    if let Some((s, _)) = set.lru.first_key_value() {
                        self.heads.insert((*s, stride));
                    }
                }
            }
            self.prune(stride);
        }
        self.summary_remove(e);
    }

    /// Drops the stride's sets if both are empty (keeps their number within the extents').
    fn prune(&mut self, stride: u64) {
        if self
            .strides
            .get(&stride)
            .is_some_and(|s| s.lru.is_empty() && s.partial.is_empty())
        {
            self.strides.remove(&stride);
        }
    }

    /// Removes `ext` from its stride's partial set.
    fn unlist_partial(&mut self, ext: u32) {
        let stride = self.extents[ext as usize].stride;
        if let Some(set) = self.strides.get_mut(&stride) {
            set.partial.remove(&ext);
        }
        self.prune(stride);
    }

    /// The least recently used evictable entry of the whole index, any stride.
    fn oldest_evictable(&self) -> Option<(Stamp, K)> {
        let &(stamp, stride) = self.heads.first()?;
        let key = self.strides.get(&stride)?.lru.get(&stamp)?;
        Some((stamp, *key))
    }

    /// Applies `f` to an entry, keeping counters, LRU and summaries in step. In place: an
    /// insert into the table, even of a key it holds, may grow it (the memory bound counts
    /// on growth only for new keys).
    fn modify(&mut self, key: &K, f: impl FnOnce(&mut Entry)) -> Option<Entry> {
        let old = *self.entries.get(key)?;
        let mut new = old;
        f(&mut new);
        self.unlink(&old);
        self.link(*key, &new);
        *self.entries.get_mut(key)? = new;
        Some(new)
    }

    /// Puts an entry into its (free) slot; the extent leaves its partial set when full.
    fn insert(&mut self, key: K, e: Entry) {
        let (ext, index) = (e.slot.extent, e.slot.index);
        let x = &mut self.extents[ext as usize];
        debug_assert!(!x.is_used(index), "slot {ext}/{index} taken");
        x.set_used(index, true);
        x.live += 1;
        if x.live == x.slots {
            self.unlist_partial(ext);
        }
        self.by_slot.insert((ext, index), key);
        self.link(key, &e);
        self.entries.insert(key, e);
    }

    /// Removes an entry and frees its slot.
    fn drop_entry(&mut self, key: &K) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        self.unlink(&e);
        let ext = e.slot.extent;
        self.by_slot.remove(&(ext, e.slot.index));
        let x = &mut self.extents[ext as usize];
        x.set_used(e.slot.index, false);
        x.live -= 1;
        let (stride, draining, empty) = (x.stride, x.draining, x.live == 0);
        if !draining {
            self.strides.entry(stride).or_default().partial.insert(ext);
        }
        if empty && draining {
            self.release_extent(ext);
        } else if empty {
            self.relist(ext); // its summary's bound becomes exact: no entry
        }
        Some(e)
    }

    /// Assigns a free extent to `stride`, bumping its epoch.
    fn assign(&mut self, ext: u32, stride: u64) -> (u32, u64, u64) {
        debug_assert!(self.free_extents.contains(&ext));
        self.free_extents.remove(&ext);
        let slots = self.slots_per(stride);
        let x = &mut self.extents[ext as usize];
        x.stride = stride;
        x.epoch = self.next_epoch.max(x.epoch.saturating_add(1));
        self.next_epoch = x.epoch.saturating_add(1);
        x.slots = slots;
        x.used = vec![0; slots.div_ceil(64) as usize];
        if !slots.is_multiple_of(64) {
            // The bits above the last slot are never free.
            x.used[slots as usize / 64] = u64::MAX << (slots % 64);
        }
        x.first_free_word = 0;
        x.live = 0;
        x.draining = false;
        x.needs_header = false;
        debug_assert_eq!(x.summary.busy, 0);
        x.summary.newest = None;
        let epoch = x.epoch;
        self.strides.entry(stride).or_default().partial.insert(ext);
        self.relist(ext);
        (ext, epoch, stride)
    }

    /// Returns an assigned extent with no entries to the free pool.
    fn release_extent(&mut self, ext: u32) {
        debug_assert_eq!(self.extents[ext as usize].live, 0);
        self.unlist_partial(ext);
        let x = &mut self.extents[ext as usize];
        x.stride = 0;
        x.slots = 0;
        x.used = Vec::new();
        x.first_free_word = 0;
        x.draining = false;
        self.free_extents.insert(ext);
        self.relist(ext);
    }

    /// Reserves a slot for `key` and inserts it as Writing (invisible to
    /// readers). Tries, in order: a free slot of the stride, a free extent,
    /// then the older of the stride's LRU evictable entry and the whole extent
    /// of another stride whose newest entry is the oldest (the policy in
    /// `reclaim.rs`): space goes to recently used objects whatever their
    /// stride. If the index was at its entry cap (`max_entries`) and that found
    /// space without evicting, the least recently used evictable entry of any
    /// stride is evicted too, so the entries never exceed the cap; at the cap with
    /// no evictable entry it fails with `NoSpace`. Pinned, Writing and doomed
    /// entries are never evicted nor their slots reused. On error nothing changed.
    pub fn reserve(
        &mut self,
        key: K,
        object_len: u64,
        seq: u64,
    ) -> Result<Reservation<K>, ReserveError> {
        if self.entries.contains_key(&key) {
            return Err(ReserveError::Exists);
        }
        let max = self.max_object_len();
        if object_len == 0 || object_len > max {
            return Err(ReserveError::TooLarge { object_len, max });
        }
        let stride = stride_of(object_len);
        // At the cap, one entry must go: fail now, before anything changes, if none can.
        let at_cap = self.entries.len() as u64 >= self.max_entries;
        if at_cap && self.heads.is_empty() {
            return Err(ReserveError::NoSpace);
        }
        let partial = self
            .strides
            .get(&stride)
            .and_then(|s| s.partial.first().copied());
        let mut evicted = Vec::new();
        let mut new_extent = None;
        let ext = if let Some(ext) = partial {
            let x = &mut self.extents[ext as usize];
            if std::mem::take(&mut x.needs_header) {
                new_extent = Some((ext, x.epoch, x.stride));
            }
            ext
        } else if let Some(ext) = self.free_extents.first().copied() {
            new_extent = Some(self.assign(ext, stride));
            ext
        } else {
            match self.victim(stride) {
                Some(Victim::Entry(key)) => {
                    let Some(e) = self.drop_entry(&key) else {
                        return Err(ReserveError::NoSpace);
                    };
                    evicted.push(key);
                    e.slot.extent
                }
                Some(Victim::Extent(ext)) => {
                    new_extent = Some(self.reclaim_extent(ext, stride, &mut evicted));
                    ext
                }
                None => return Err(ReserveError::NoSpace),
            }
        };
        let Some(index) = self.extents[ext as usize].lowest_free() else {
            debug_assert!(false, "chosen extent {ext} has no free slot");
            return Err(ReserveError::NoSpace);
        };
        if at_cap && evicted.is_empty() {
            // The paths above that evict nothing leave every evictable entry in place: the
            // one found above is still there. Evicted before the insert, so the entries never
            // exceed the cap, not even for a moment (the tables would grow for it). The slot
            // chosen stays free: the evicted entry holds another one.
            if let Some((_, old)) = self.oldest_evictable() {
                self.drop_entry(&old);
                evicted.push(old);
            }
        }
        let slot = self.slot_ref(ext, index);
        let stamp = self.next_stamp();
        let entry = Entry {
            slot,
            object_len,
            checksum: 0,
            seq,
            layout: 0,
            state: State::Writing,
            pins: 0,
            doomed: false,
            stamp,
        };
        self.insert(key, entry);
        Ok(Reservation {
            slot,
            new_extent,
            evicted,
        })
    }

    /// Writing -> Ready (visible, most recent) if the entry's slot is `slot`.
    /// A doomed Writing entry is freed instead and `Err(Doomed)` returned.
    pub fn commit(
        &mut self,
        key: K,
        slot: SlotRef,
        checksum: u64,
        layout: u64,
    ) -> Result<(), StateError> {
        let e = self.entries.get(&key).ok_or(StateError::NotFound)?;
        if e.state != State::Writing || e.slot != slot {
            return Err(StateError::WrongState);
        }
        if e.doomed {
            self.drop_entry(&key);
            return Err(StateError::Doomed);
        }
        let stamp = self.next_stamp();
        self.modify(&key, |e| {
            e.state = State::Ready;
            e.checksum = checksum;
            e.layout = layout;
            e.stamp = stamp;
        });
        Ok(())
    }

    /// Removes a Writing entry (doomed or not) whose slot is `slot`, freeing the slot.
    pub fn abort(&mut self, key: K, slot: SlotRef) -> Result<(), StateError> {
        let e = self.entries.get(&key).ok_or(StateError::NotFound)?;
        if e.state != State::Writing || e.slot != slot {
            return Err(StateError::WrongState);
        }
        self.drop_entry(&key);
        Ok(())
    }

    /// Drops an entry: freed now if Ready and unpinned, else doomed (invisible,
    /// freed at the last unpin / at commit or abort). Returns whether it existed.
    pub fn remove(&mut self, key: &K) -> bool {
        let Some(e) = self.entries.get(key) else {
            return false;
        };
        if e.state == State::Ready && e.pins == 0 {
            self.drop_entry(key);
        } else {
            self.modify(key, |e| e.doomed = true);
        }
        true
    }

    /// Removes every entry (Writing and pinned ones are doomed) and frees every
    /// extent left without entries; extents still holding doomed entries take
    /// no new entries and become free when their last entry goes.
    /// Returns `(removed now, deferred)`.
    pub fn clear(&mut self) -> (u64, u64) {
        let keys: Vec<K> = self.entries.keys().copied().collect();
        let (mut removed, mut deferred) = (0, 0);
        for k in keys {
            self.remove(&k);
            if self.entries.contains_key(&k) {
                deferred += 1;
            } else {
                removed += 1;
            }
        }
        for ext in 0..self.extents.len() as u32 {
            let x = &mut self.extents[ext as usize];
            if x.stride == 0 {
                continue;
            }
            if x.live == 0 {
                self.release_extent(ext);
            } else {
                x.draining = true;
                self.unlist_partial(ext);
                self.relist(ext); // (already unlisted: its entries are all doomed)
            }
        }
        (removed, deferred)
    }
}

/// Slots of one stride in an extent of `extent_bytes` (after its header block and table).
fn slots_in(extent_bytes: u64, stride: u64) -> u32 {
    crate::l2::format::slots_per_extent(extent_bytes, stride)
}

mod access;
mod budget;
mod check;
mod reclaim;
mod recover;
mod types;

#[cfg(test)]
mod tests;
