//! In-memory index and space manager of the L2 disk tier. Pure logic, no I/O.
//!
//! The L2 file holds `extent_count` extents of `extent_bytes` each, extent `i`
//! starting at `EXTENT_BASE + i * extent_bytes`. An extent is free or assigned
//! to one stride; slot `j` of an assigned extent starts at
//! `extent start + BLOCK + j * stride` (a `BLOCK`-byte slot header, then the
//! payload). Every assignment of an extent bumps its epoch.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::Hash;

/// File offset of extent 0; extent `i` starts at `EXTENT_BASE + i * extent_bytes`.
pub const EXTENT_BASE: u64 = 2 << 20;
/// Size of an extent header and of a slot header; every stride is a multiple of it.
pub const BLOCK: u64 = 4096;
/// Smallest valid stride: one header block plus one payload block.
pub const MIN_STRIDE: u64 = 2 * BLOCK;

/// Recency stamp: (primary, unique tie-break). Unique per entry; larger = more recent.
type Stamp = (u64, u64);

/// Where a slot lives. Invariant: `file_offset == EXTENT_BASE + extent *
/// extent_bytes + BLOCK + index * stride`, and `epoch` is the extent's epoch
/// at the time the slot was handed out (stale if the extent was reassigned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotRef {
    /// Extent number, `< extent_count`.
    pub extent: u32,
    /// Slot number within the extent, `< (extent_bytes - BLOCK) / stride`.
    pub index: u32,
    /// Bytes per slot (header + payload), a multiple of `BLOCK`, `>= MIN_STRIDE`.
    pub stride: u64,
    /// Epoch of the extent's assignment, `>= 1`.
    pub epoch: u64,
    /// File offset of the slot header.
    pub file_offset: u64,
}

/// A visible (Ready, not doomed) entry as seen by readers. Invariant:
/// `0 < object_len <= slot.stride - BLOCK`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Located {
    /// The slot holding the object.
    pub slot: SlotRef,
    /// Payload length in bytes.
    pub object_len: u64,
    /// Payload checksum recorded at commit.
    pub checksum: u64,
    /// Caller's sequence number (higher = newer version).
    pub seq: u64,
    /// Caller's layout fingerprint recorded at commit (0 = unknown).
    pub layout: u64,
}

/// What recovery read from one slot header. Invariant: as found on disk, unvalidated;
/// `recover_entry` checks it against the slot before inserting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovered {
    /// Payload length in bytes.
    pub object_len: u64,
    /// Payload checksum from the header.
    pub checksum: u64,
    /// Write sequence number from the header.
    pub seq: u64,
    /// Layout fingerprint from the header (0 = unknown).
    pub layout: u64,
}

/// Result of [`L2Index::reserve`]. Invariant: `slot` is exclusively owned by the
/// new Writing entry; `new_extent`, when set, is `(extent, epoch, stride)` of an
/// extent just (re)assigned, whose header the caller must write first; no key
/// in `evicted` is in the index any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation<K> {
    /// The slot to write the payload into.
    pub slot: SlotRef,
    /// `(extent, epoch, stride)` of a newly assigned extent, if any.
    pub new_extent: Option<(u32, u64, u64)>,
    /// Keys evicted to make room (for counters and logs).
    pub evicted: Vec<K>,
}

/// Space usage snapshot. Invariant: `used_bytes <= capacity_bytes`,
/// `free_extents <= extents`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpaceStats {
    /// `extent_count * extent_bytes`.
    pub capacity_bytes: u64,
    /// Sum of the strides of all entries, Writing and doomed included.
    pub used_bytes: u64,
    /// Entries that are Ready and not doomed.
    pub objects: u64,
    /// Entries in the Writing state (doomed or not).
    pub writing: u64,
    /// Entries with at least one pin.
    pub pinned: u64,
    /// Extents assigned to no stride.
    pub free_extents: u32,
    /// Total extents.
    pub extents: u32,
}

/// Why [`L2Index::reserve`] failed. Invariant: a failed reserve changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveError {
    /// The key already has an entry (possibly Writing or doomed).
    Exists,
    /// `object_len` is 0 or above `max`.
    TooLarge {
        /// Requested length.
        object_len: u64,
        /// [`L2Index::max_object_len`].
        max: u64,
    },
    /// Every slot that could hold the object is pinned, Writing or doomed.
    NoSpace,
}

/// Why a state transition failed. Invariant: only `Doomed` comes with a change
/// (the doomed entry was freed); the others change nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateError {
    /// The key has no entry.
    NotFound,
    /// The entry is in another state, or its slot differs from the one given.
    WrongState,
    /// The entry was removed while in flight; it has now been freed.
    Doomed,
}

/// Why [`L2Index::recover_extent`] refused an extent. Invariant: nothing changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoverError {
    /// Extent out of range, already assigned, bad stride or bad epoch.
    BadExtent(String),
}

/// Outcome of [`L2Index::recover_entry`]. Invariant: only `Inserted` and
/// `ReplacedOlder` leave the given slot occupied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoverOutcome {
    /// New key, entry inserted.
    Inserted,
    /// The key had a lower seq; the old slot was freed, this one inserted.
    ReplacedOlder,
    /// The key has an equal or higher seq; this slot stays free.
    KeptNewer,
    /// The record does not fit the index; the slot stays free.
    Rejected(String),
}

impl fmt::Display for ReserveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exists => write!(f, "key already has an L2 entry"),
            Self::TooLarge { object_len, max } => {
                write!(
                    f,
                    "object of {object_len} bytes does not fit L2 (max {max})"
                )
            }
            Self::NoSpace => write!(f, "no evictable L2 space"),
        }
    }
}

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotFound => write!(f, "no L2 entry for key"),
            Self::WrongState => write!(f, "L2 entry in wrong state or slot mismatch"),
            Self::Doomed => write!(f, "L2 entry was removed while in flight"),
        }
    }
}

impl fmt::Display for RecoverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadExtent(why) => write!(f, "bad L2 extent: {why}"),
        }
    }
}

impl std::error::Error for ReserveError {}
impl std::error::Error for StateError {}
impl std::error::Error for RecoverError {}

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

#[derive(Debug, Clone)]
struct Extent<K> {
    /// 0 = free.
    stride: u64,
    epoch: u64,
    /// One per slot when assigned; empty when free.
    occupants: Vec<Option<K>>,
    /// Free slot numbers (stack; lowest on top after assignment).
    free: Vec<u32>,
    live: u32,
    /// Set by `clear` on extents with in-flight entries: takes no new entries,
    /// becomes free when its last entry goes.
    draining: bool,
    /// The on-disk extent header may not describe this assignment (its write
    /// failed): the next reservation in the extent reports it as `new_extent`
    /// again so the caller rewrites it.
    needs_header: bool,
}

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
/// held by exactly one entry; pinned, Writing and doomed entries are never
/// evicted and their slots never reused; per-stride LRU maps hold exactly the
/// evictable (Ready, unpinned, not doomed) entries; epochs of assigned
/// extents are `>= 1` and only grow.
#[derive(Debug, Clone)]
pub struct L2Index<K> {
    extent_bytes: u64,
    extents: Vec<Extent<K>>,
    free_extents: BTreeSet<u32>,
    strides: HashMap<u64, StrideSet<K>>,
    entries: HashMap<K, Entry>,
    counts: Counts,
    clock: u64,
    tick: u64,
    /// The epoch the next assignment gets: above every epoch assigned, recovered or noted,
    /// so an epoch is never reused for a different assignment (of any extent).
    next_epoch: u64,
    /// Between the first `recover_entry` and `finish_recovery`: free lists are rebuilt at the
    /// end instead of being searched per entry.
    recovering: bool,
}

fn stride_of(object_len: u64) -> u64 {
    BLOCK + object_len.div_ceil(BLOCK) * BLOCK
}

impl<K: Copy + Eq + Hash + fmt::Debug> L2Index<K> {
    /// An index with all `extent_count` extents free and epoch 0. Any geometry
    /// is accepted; if `extent_bytes < 3 * BLOCK` nothing fits (`max_object_len() == 0`).
    pub fn new(extent_count: u32, extent_bytes: u64) -> Self {
        let blank = Extent {
            stride: 0,
            epoch: 0,
            occupants: Vec::new(),
            free: Vec::new(),
            live: 0,
            draining: false,
            needs_header: false,
        };
        Self {
            extent_bytes,
            extents: vec![blank; extent_count as usize],
            free_extents: (0..extent_count).collect(),
            strides: HashMap::new(),
            entries: HashMap::new(),
            counts: Counts::default(),
            clock: 1,
            tick: 1,
            next_epoch: 1,
            recovering: false,
        }
    }

    /// Recovery: makes every later assignment use an epoch above `epoch` (seen in any header
    /// on disk, valid or stale), so stale slot headers never match a new assignment.
    pub fn note_epoch(&mut self, epoch: u64) {
        self.next_epoch = self.next_epoch.max(epoch.saturating_add(1));
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

    /// Largest `object_len` accepted by `reserve`: the stride
    /// `BLOCK + round_up(len, BLOCK)` must fit in `extent_bytes - BLOCK`.
    pub fn max_object_len(&self) -> u64 {
        self.extent_bytes.saturating_sub(2 * BLOCK) / BLOCK * BLOCK
    }

    fn slots_per(&self, stride: u64) -> u32 {
        let n = self.extent_bytes.saturating_sub(BLOCK) / stride.max(1);
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    fn slot_ref(&self, extent: u32, index: u32) -> SlotRef {
        let x = &self.extents[extent as usize];
        let file_offset = EXTENT_BASE
            .saturating_add(u64::from(extent).saturating_mul(self.extent_bytes))
            .saturating_add(BLOCK)
            .saturating_add(u64::from(index).saturating_mul(x.stride));
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

    /// Adds an entry's contribution to counters and LRU.
    fn link(&mut self, key: K, e: &Entry) {
        self.counts.add(Counts::of(e), true);
        if e.evictable() {
            let set = self.strides.entry(e.slot.stride).or_default();
            set.lru.insert(e.stamp, key);
        }
    }

    /// Removes an entry's contribution from counters and LRU.
    fn unlink(&mut self, e: &Entry) {
        self.counts.add(Counts::of(e), false);
        if e.evictable() {
            if let Some(set) = self.strides.get_mut(&e.slot.stride) {
                set.lru.remove(&e.stamp);
            }
        }
    }

    /// Applies `f` to an entry, keeping counters and LRU in step.
    fn modify(&mut self, key: &K, f: impl FnOnce(&mut Entry)) -> Option<Entry> {
        let old = *self.entries.get(key)?;
        let mut new = old;
        f(&mut new);
        self.unlink(&old);
        self.link(*key, &new);
        self.entries.insert(*key, new);
        Some(new)
    }

    fn insert(&mut self, key: K, e: Entry) {
        let x = &mut self.extents[e.slot.extent as usize];
        x.occupants[e.slot.index as usize] = Some(key);
        x.live += 1;
        self.link(key, &e);
        self.entries.insert(key, e);
    }

    /// Removes an entry and frees its slot.
    fn drop_entry(&mut self, key: &K) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        self.unlink(&e);
        let ext = e.slot.extent;
        let x = &mut self.extents[ext as usize];
        x.occupants[e.slot.index as usize] = None;
        x.live -= 1;
        x.free.push(e.slot.index);
        if !x.draining {
            let stride = x.stride;
            self.strides.entry(stride).or_default().partial.insert(ext);
        } else if x.live == 0 {
            self.release_extent(ext);
        }
        Some(e)
    }

    /// Pops a free slot of `ext` (lowest first after assignment).
    fn take_slot(&mut self, ext: u32) -> Option<u32> {
        let x = &mut self.extents[ext as usize];
        let index = x.free.pop()?;
        if x.free.is_empty() {
            if let Some(set) = self.strides.get_mut(&x.stride) {
                set.partial.remove(&ext);
            }
        }
        Some(index)
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
        x.occupants = vec![None; slots as usize];
        x.free = (0..slots).rev().collect();
        x.live = 0;
        x.draining = false;
        x.needs_header = false;
        let epoch = x.epoch;
        self.strides.entry(stride).or_default().partial.insert(ext);
        (ext, epoch, stride)
    }

    /// Returns an assigned extent with no entries to the free pool.
    fn release_extent(&mut self, ext: u32) {
        let x = &mut self.extents[ext as usize];
        debug_assert_eq!(x.live, 0);
        if let Some(set) = self.strides.get_mut(&x.stride) {
            set.partial.remove(&ext);
        }
        x.stride = 0;
        x.occupants = Vec::new();
        x.free = Vec::new();
        x.draining = false;
        self.free_extents.insert(ext);
    }

    /// The extent of another stride, with only evictable entries, whose newest
    /// stamp is the oldest (empty extents first; ties to the lowest number).
    fn reclaim_candidate(&self, stride: u64) -> Option<u32> {
        let mut best: Option<(Option<Stamp>, u32)> = None;
        for (i, x) in self.extents.iter().enumerate() {
            if x.stride == 0 || x.stride == stride || x.draining {
                continue;
            }
            let mut newest = None;
            let mut ok = true;
            for k in x.occupants.iter().flatten() {
                match self.entries.get(k) {
                    Some(e) if e.evictable() => newest = newest.max(Some(e.stamp)),
                    _ => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok && best.is_none_or(|(b, _)| newest < b) {
                best = Some((newest, i as u32));
            }
        }
        best.map(|(_, i)| i)
    }

    /// Reserves a slot for `key` and inserts it as Writing (invisible to
    /// readers). Tries, in order: a free slot of the stride, a free extent, the
    /// LRU evictable entry of the stride, a whole extent of another stride.
    /// On error nothing changed.
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
        let set = self.strides.get(&stride);
        let partial = set.and_then(|s| s.partial.first().copied());
        let victim = set.and_then(|s| s.lru.first_key_value().map(|(_, k)| *k));
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
        } else if let Some(key) = victim {
            let Some(e) = self.drop_entry(&key) else {
                return Err(ReserveError::NoSpace);
            };
            evicted.push(key);
            e.slot.extent
        } else if let Some(ext) = self.reclaim_candidate(stride) {
            let keys: Vec<K> = self.extents[ext as usize]
                .occupants
                .iter()
                .flatten()
                .copied()
                .collect();
            for k in keys {
                self.drop_entry(&k);
                evicted.push(k);
            }
            self.release_extent(ext);
            new_extent = Some(self.assign(ext, stride));
            ext
        } else {
            return Err(ReserveError::NoSpace);
        };
        let Some(index) = self.take_slot(ext) else {
            debug_assert!(false, "chosen extent {ext} has no free slot");
            return Err(ReserveError::NoSpace);
        };
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

    /// The entry of `key` if it is Ready and not doomed. Does not touch.
    pub fn get(&self, key: &K) -> Option<Located> {
        self.entries
            .get(key)
            .filter(|e| e.visible())
            .map(Entry::located)
    }

    /// Every key with an entry (any state).
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.entries.keys()
    }

    /// Whether `get(key)` would return `Some`.
    pub fn contains(&self, key: &K) -> bool {
        self.entries.get(key).is_some_and(Entry::visible)
    }

    /// Pins a visible entry (its slot is then neither evicted nor reused until
    /// `unpin`) and touches it. `None` if not visible (or at `u32::MAX` pins).
    pub fn pin(&mut self, key: &K) -> Option<Located> {
        let e = self.entries.get(key)?;
        if !e.visible() || e.pins == u32::MAX {
            return None;
        }
        let stamp = self.next_stamp();
        self.modify(key, |e| {
            e.pins += 1;
            e.stamp = stamp;
        })
        .map(|e| e.located())
    }

    /// [`L2Index::pin`] only if `wanted` accepts the visible entry: an entry refused is
    /// neither pinned nor touched (a copy nobody can use must not look recently used).
    pub fn pin_if(&mut self, key: &K, wanted: impl FnOnce(&Located) -> bool) -> Option<Located> {
        if !self.get(key).is_some_and(|l| wanted(&l)) {
            return None;
        }
        self.pin(key)
    }

    /// Drops one pin taken on `slot`; frees a doomed entry when its last pin goes.
    pub fn unpin(&mut self, key: &K, slot: SlotRef) -> Result<(), StateError> {
        let e = self.entries.get(key).ok_or(StateError::NotFound)?;
        if e.pins == 0 || e.slot != slot {
            return Err(StateError::WrongState);
        }
        if e.pins == 1 && e.doomed {
            self.drop_entry(key);
        } else {
            self.modify(key, |e| e.pins -= 1);
        }
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

    /// Marks a non-doomed entry as most recently used.
    pub fn touch(&mut self, key: &K) {
        if self.entries.get(key).is_some_and(|e| !e.doomed) {
            let stamp = self.next_stamp();
            self.modify(key, |e| e.stamp = stamp);
        }
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
                if let Some(set) = self.strides.get_mut(&x.stride) {
                    set.partial.remove(&ext);
                }
            }
        }
        (removed, deferred)
    }

    /// Recovery: assigns a free extent as found on disk. Requires `extent <
    /// extent_count`, the extent free, `stride` a multiple of `BLOCK` in
    /// `MIN_STRIDE..=extent_bytes - BLOCK`, and `epoch` above the extent's
    /// current epoch (and below `u64::MAX`).
    pub fn recover_extent(
        &mut self,
        extent: u32,
        epoch: u64,
        stride: u64,
    ) -> Result<(), RecoverError> {
        let bad = |s: String| Err(RecoverError::BadExtent(s));
        let Some(x) = self.extents.get(extent as usize) else {
            return bad(format!(
                "extent {extent} out of range ({})",
                self.extents.len()
            ));
        };
        if x.stride != 0 {
            return bad(format!("extent {extent} already assigned"));
        }
        if !stride.is_multiple_of(BLOCK)
            || stride < MIN_STRIDE
            || stride > self.extent_bytes.saturating_sub(BLOCK)
        {
            return bad(format!("extent {extent}: bad stride {stride}"));
        }
        if epoch <= x.epoch || epoch == u64::MAX {
            return bad(format!(
                "extent {extent}: bad epoch {epoch} (current {})",
                x.epoch
            ));
        }
        let next = self.next_epoch;
        self.assign(extent, stride);
        self.next_epoch = next; // the epoch comes from disk, not from the counter
        self.extents[extent as usize].epoch = epoch;
        self.note_epoch(epoch);
        Ok(())
    }

    /// Recovery: inserts a Ready entry found in slot `slot_index` of a
    /// recovered extent. The slot must exist and be free and `object_len` must
    /// fit the stride. For a key seen twice the higher seq wins (ties keep the
    /// existing entry). Recency follows seq; later stamps are newer than all.
    pub fn recover_entry(
        &mut self,
        key: K,
        slot_index: u32,
        extent: u32,
        found: Recovered,
    ) -> RecoverOutcome {
        let Recovered {
            object_len,
            checksum,
            seq,
            layout,
        } = found;
        let reject = |s: String| RecoverOutcome::Rejected(s);
        let Some(x) = self.extents.get(extent as usize) else {
            return reject(format!("extent {extent} out of range"));
        };
        if x.stride == 0 || x.draining {
            return reject(format!("extent {extent} not assigned"));
        }
        match x.occupants.get(slot_index as usize) {
            None => return reject(format!("slot {slot_index} outside extent {extent}")),
            Some(Some(_)) => return reject(format!("slot {slot_index} of extent {extent} taken")),
            Some(None) => {}
        }
        if object_len == 0 || object_len > x.stride - BLOCK {
            return reject(format!(
                "object_len {object_len} does not fit stride {}",
                x.stride
            ));
        }
        let mut outcome = RecoverOutcome::Inserted;
        if let Some(old) = self.entries.get(&key) {
            if !old.evictable() {
                return reject("key busy".to_string());
            }
            if old.seq >= seq {
                return RecoverOutcome::KeptNewer;
            }
            self.drop_entry(&key);
            outcome = RecoverOutcome::ReplacedOlder;
        }
        // Free lists are rebuilt by `finish_recovery` (searching them here is quadratic).
        self.recovering = true;
        let stamp = (seq, self.tick);
        self.tick = self.tick.saturating_add(1);
        self.clock = self.clock.max(seq.saturating_add(1));
        let entry = Entry {
            slot: self.slot_ref(extent, slot_index),
            object_len,
            checksum,
            seq,
            layout,
            state: State::Ready,
            pins: 0,
            doomed: false,
            stamp,
        };
        self.insert(key, entry);
        outcome
    }

    /// Recovery: frees every assigned extent that holds no entry.
    pub fn finish_recovery(&mut self) {
        for ext in 0..self.extents.len() as u32 {
            let x = &mut self.extents[ext as usize];
            if x.stride == 0 {
                continue;
            }
            if x.live == 0 {
                self.release_extent(ext);
                continue;
            }
            if self.recovering {
                x.free = (0..x.occupants.len() as u32)
                    .rev()
                    .filter(|&i| x.occupants[i as usize].is_none())
                    .collect();
                let stride = x.stride;
                let partial = !x.free.is_empty() && !x.draining;
                let set = self.strides.entry(stride).or_default();
                if partial {
                    set.partial.insert(ext);
                } else {
                    set.partial.remove(&ext);
                }
            }
        }
        self.recovering = false;
    }

    /// Current usage; O(1).
    pub fn stats(&self) -> SpaceStats {
        SpaceStats {
            capacity_bytes: (self.extents.len() as u64).saturating_mul(self.extent_bytes),
            used_bytes: self.counts.used_bytes,
            objects: self.counts.objects,
            writing: self.counts.writing,
            pinned: self.counts.pinned,
            free_extents: self.free_extents.len() as u32,
            extents: self.extents.len() as u32,
        }
    }

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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    const EB: u64 = 2 * MIB;
    /// Stride 256 KiB, 7 slots per 2 MiB extent.
    const SMALL: u64 = 256 * KIB - BLOCK;
    /// Stride 512 KiB, 3 slots.
    const MID: u64 = 512 * KIB - BLOCK;
    /// Stride 1 MiB, 1 slot.
    const BIG: u64 = MIB - BLOCK;

    fn ok(ix: &L2Index<u32>) {
        if let Err(e) = ix.check() {
            panic!("check failed: {e}");
        }
    }

    fn ready(ix: &mut L2Index<u32>, k: u32, len: u64) -> Reservation<u32> {
        let r = ix.reserve(k, len, u64::from(k)).unwrap();
        ix.commit(k, r.slot, 0xc0ffee, 0).unwrap();
        ok(ix);
        r
    }

    #[test]
    fn geometry_offsets_and_limits() {
        let mut ix = L2Index::<u32>::new(4, EB);
        assert_eq!(ix.max_object_len(), EB - 2 * BLOCK);
        assert_eq!(
            ix.reserve(1, 0, 0),
            Err(ReserveError::TooLarge {
                object_len: 0,
                max: EB - 2 * BLOCK
            })
        );
        assert!(matches!(
            ix.reserve(1, EB - 2 * BLOCK + 1, 0),
            Err(ReserveError::TooLarge { .. })
        ));
        assert!(matches!(
            ix.reserve(1, u64::MAX, 0),
            Err(ReserveError::TooLarge { .. })
        ));
        let r = ix.reserve(1, 1, 0).unwrap();
        assert_eq!(r.slot.stride, 2 * BLOCK);
        assert_eq!(r.new_extent, Some((0, 1, 2 * BLOCK)));
        assert_eq!(r.slot.file_offset, EXTENT_BASE + BLOCK);
        let r2 = ix.reserve(2, 4097, 0).unwrap();
        assert_eq!(r2.slot.stride, 3 * BLOCK);
        assert_eq!(r2.new_extent, Some((1, 2, 3 * BLOCK)), "epochs are global");
        assert_eq!(r2.slot.file_offset, EXTENT_BASE + EB + BLOCK);
        let r3 = ix.reserve(3, 4096, 0).unwrap();
        assert_eq!(r3.new_extent, None);
        assert_eq!((r3.slot.extent, r3.slot.index), (0, 1));
        assert_eq!(r3.slot.file_offset, EXTENT_BASE + BLOCK + 2 * BLOCK);
        let big = ix.reserve(4, ix.max_object_len(), 0).unwrap();
        assert_eq!(big.slot.stride, EB - BLOCK);
        ok(&ix);
        let s = ix.stats();
        assert_eq!(s.capacity_bytes, 4 * EB);
        assert_eq!(s.used_bytes, 2 * BLOCK + 3 * BLOCK + 2 * BLOCK + EB - BLOCK);
        assert_eq!(
            (s.writing, s.objects, s.free_extents, s.extents),
            (4, 0, 1, 4)
        );
        // Degenerate geometry: nothing fits, nothing panics.
        let mut tiny = L2Index::<u32>::new(0, 100);
        assert_eq!(tiny.max_object_len(), 0);
        assert!(matches!(
            tiny.reserve(1, 1, 0),
            Err(ReserveError::TooLarge { .. })
        ));
        ok(&tiny);
    }

    #[test]
    fn writing_is_invisible_and_commit_is_paired() {
        let mut ix = L2Index::<u32>::new(2, EB);
        let r = ix.reserve(1, SMALL, 9).unwrap();
        assert_eq!(ix.get(&1), None);
        assert!(!ix.contains(&1));
        assert_eq!(ix.pin(&1), None);
        assert_eq!(ix.reserve(1, SMALL, 9).unwrap_err(), ReserveError::Exists);
        let mut wrong = r.slot;
        wrong.epoch += 1;
        assert_eq!(ix.commit(1, wrong, 5, 0), Err(StateError::WrongState));
        assert_eq!(ix.abort(1, wrong), Err(StateError::WrongState));
        assert_eq!(ix.commit(2, r.slot, 5, 0), Err(StateError::NotFound));
        ix.commit(1, r.slot, 5, 0).unwrap();
        assert_eq!(ix.commit(1, r.slot, 5, 0), Err(StateError::WrongState));
        assert_eq!(ix.abort(1, r.slot), Err(StateError::WrongState));
        let l = ix.get(&1).unwrap();
        assert_eq!(
            (l.slot, l.object_len, l.checksum, l.seq),
            (r.slot, SMALL, 5, 9)
        );
        assert!(ix.contains(&1));
        // Abort frees the slot for reuse.
        let r2 = ix.reserve(2, SMALL, 0).unwrap();
        ix.abort(2, r2.slot).unwrap();
        assert_eq!(ix.abort(2, r2.slot), Err(StateError::NotFound));
        let r3 = ix.reserve(3, SMALL, 0).unwrap();
        assert_eq!(r3.slot, r2.slot);
        ok(&ix);
        assert_eq!(ix.stats().used_bytes, 2 * 256 * KIB);
    }

    #[test]
    fn lru_eviction_within_stride() {
        let mut ix = L2Index::<u32>::new(1, EB);
        let slots: Vec<SlotRef> = (0..7).map(|k| ready(&mut ix, k, SMALL).slot).collect();
        ix.touch(&0);
        let r = ix.reserve(7, SMALL, 0).unwrap();
        assert_eq!(r.evicted, vec![1]);
        assert_eq!(r.slot, slots[1]);
        assert_eq!(r.new_extent, None);
        assert_eq!(ix.get(&1), None);
        ix.commit(7, r.slot, 0, 0).unwrap();
        // pin refreshes recency and protects: 2 is pinned, so 3 goes, then 4.
        ix.pin(&2).unwrap();
        assert_eq!(ix.reserve(8, SMALL, 0).unwrap().evicted, vec![3]);
        assert_eq!(ix.reserve(9, SMALL, 0).unwrap().evicted, vec![4]);
        ix.unpin(&2, slots[2]).unwrap();
        // get does not touch; 5 is now the oldest.
        ix.get(&5).unwrap();
        assert_eq!(ix.reserve(10, SMALL, 0).unwrap().evicted, vec![5]);
        ok(&ix);
    }

    #[test]
    fn extent_reclaim_across_strides() {
        let mut ix = L2Index::<u32>::new(3, EB);
        for k in 0..7 {
            ready(&mut ix, k, SMALL); // extent 0
        }
        for k in 10..17 {
            ready(&mut ix, k, SMALL); // extent 1
        }
        let b = ready(&mut ix, 20, BIG); // extent 2
        assert_eq!(b.slot.extent, 2);
        ix.pin(&20).unwrap();
        // Extent 0 holds the newest stamp after this touch, so extent 1 is reclaimed.
        ix.touch(&3);
        let r = ix.reserve(21, BIG, 0).unwrap();
        assert_eq!(r.new_extent, Some((1, 4, MIB)), "a fresh global epoch");
        assert_eq!(r.slot.extent, 1);
        assert_eq!(r.slot.epoch, 4);
        let mut ev = r.evicted.clone();
        ev.sort();
        assert_eq!(ev, (10..17).collect::<Vec<_>>());
        assert!(ev.iter().all(|k| ix.get(k).is_none()));
        ok(&ix);
        // Extent 1 holds a Writing entry, extent 2 a pinned one: extent 0 is
        // the only candidate, even though it is the newest.
        let r = ix.reserve(22, BIG, 0).unwrap();
        assert_eq!(r.new_extent, Some((0, 5, MIB)));
        assert_eq!(r.evicted.len(), 7);
        ok(&ix);
        assert_eq!(ix.reserve(23, BIG, 0), Err(ReserveError::NoSpace));
        assert_eq!(ix.reserve(23, SMALL, 0), Err(ReserveError::NoSpace));
        ok(&ix);
    }

    #[test]
    fn pinned_and_writing_never_evicted_nospace() {
        let mut ix = L2Index::<u32>::new(1, EB);
        let a = ix.reserve(1, BIG, 0).unwrap();
        assert_eq!(ix.reserve(2, BIG, 0), Err(ReserveError::NoSpace));
        assert_eq!(ix.reserve(2, SMALL, 0), Err(ReserveError::NoSpace));
        ix.commit(1, a.slot, 0, 0).unwrap();
        let l = ix.pin(&1).unwrap();
        ix.pin(&1).unwrap();
        assert_eq!(ix.stats().pinned, 1);
        assert_eq!(ix.reserve(2, BIG, 0), Err(ReserveError::NoSpace));
        assert_eq!(ix.reserve(2, SMALL, 0), Err(ReserveError::NoSpace));
        ix.unpin(&1, l.slot).unwrap();
        assert_eq!(ix.reserve(2, BIG, 0), Err(ReserveError::NoSpace));
        ix.unpin(&1, l.slot).unwrap();
        assert_eq!(ix.unpin(&1, l.slot), Err(StateError::WrongState));
        assert_eq!(ix.unpin(&9, l.slot), Err(StateError::NotFound));
        ok(&ix);
        // Unpinned: evicted by a same-stride reserve, its slot reused.
        let r = ix.reserve(2, BIG, 0).unwrap();
        assert_eq!((r.evicted, r.slot), (vec![1], a.slot));
        ok(&ix);
    }

    #[test]
    fn doomed_freed_on_unpin_commit_and_abort() {
        let mut ix = L2Index::<u32>::new(1, EB);
        let a = ready(&mut ix, 1, MID);
        let l = ix.pin(&1).unwrap();
        assert!(ix.remove(&1));
        assert!(ix.remove(&1));
        assert_eq!(ix.get(&1), None);
        assert_eq!(ix.pin(&1), None);
        assert_eq!(ix.reserve(1, MID, 0), Err(ReserveError::Exists));
        let s = ix.stats();
        assert_eq!((s.objects, s.pinned, s.used_bytes), (0, 1, 512 * KIB));
        ok(&ix);
        ix.unpin(&1, l.slot).unwrap();
        assert_eq!(ix.stats().used_bytes, 0);
        ok(&ix);
        assert_eq!(ix.reserve(1, MID, 0).unwrap().slot, a.slot);

        let b = ix.reserve(2, MID, 0).unwrap();
        assert!(ix.remove(&2));
        assert_eq!(ix.commit(2, b.slot, 0, 0), Err(StateError::Doomed));
        assert_eq!(ix.commit(2, b.slot, 0, 0), Err(StateError::NotFound));
        let c = ix.reserve(3, MID, 0).unwrap();
        assert_eq!(c.slot, b.slot);
        assert!(ix.remove(&3));
        ix.abort(3, c.slot).unwrap();
        assert!(!ix.remove(&3));
        // Ready, unpinned: freed at once.
        ix.commit(1, a.slot, 0, 0).unwrap();
        assert!(ix.remove(&1));
        assert_eq!(ix.stats().used_bytes, 0);
        ok(&ix);
    }

    #[test]
    fn clear_frees_extents() {
        let mut ix = L2Index::<u32>::new(4, EB);
        for k in 0..3 {
            ready(&mut ix, k, SMALL); // extent 0
        }
        ready(&mut ix, 10, BIG); // extent 1
        ready(&mut ix, 11, MID); // extent 2
        let w = ix.reserve(12, SMALL, 0).unwrap(); // extent 0
        let l = ix.pin(&11).unwrap();
        assert_eq!(ix.clear(), (4, 2));
        ok(&ix);
        let s = ix.stats();
        assert_eq!(
            (s.objects, s.free_extents, s.used_bytes),
            (0, 2, 256 * KIB + 512 * KIB)
        );
        // Draining extents take no new entries: new reserves use free extents.
        let n = ix.reserve(20, MID, 0).unwrap();
        assert_eq!(n.new_extent, Some((1, 4, 512 * KIB)));
        ok(&ix);
        ix.unpin(&11, l.slot).unwrap();
        assert_eq!(ix.stats().free_extents, 2);
        assert_eq!(ix.commit(12, w.slot, 0, 0), Err(StateError::Doomed));
        assert_eq!(ix.stats().free_extents, 3);
        ok(&ix);
        // Reassignment bumps the epoch again.
        let again = ix.reserve(21, BIG, 0).unwrap();
        assert_eq!(again.new_extent, Some((0, 5, MIB)));
        assert_eq!(ix.clear(), (0, 2));
        ix.abort(20, n.slot).unwrap();
        ix.abort(21, again.slot).unwrap();
        assert_eq!(ix.stats().free_extents, 4);
        ok(&ix);
    }

    #[test]
    fn recovery() {
        let mut ix = L2Index::<u32>::new(4, EB);
        let bad =
            |r: Result<(), RecoverError>| assert!(matches!(r, Err(RecoverError::BadExtent(_))));
        bad(ix.recover_extent(4, 1, MIB));
        bad(ix.recover_extent(0, 0, MIB));
        bad(ix.recover_extent(0, u64::MAX, MIB));
        bad(ix.recover_extent(0, 1, MIB + 1));
        bad(ix.recover_extent(0, 1, BLOCK));
        bad(ix.recover_extent(0, 1, EB));
        ix.recover_extent(0, 5, 256 * KIB).unwrap();
        bad(ix.recover_extent(0, 6, 256 * KIB));
        ix.recover_extent(1, 3, 256 * KIB).unwrap();
        ix.recover_extent(2, 1, MIB).unwrap();
        ok(&ix);
        use RecoverOutcome::*;
        let rej = |o: RecoverOutcome| assert!(matches!(o, Rejected(_)), "{o:?}");
        assert_eq!(
            ix.recover_entry(
                1,
                0,
                0,
                Recovered {
                    object_len: SMALL,
                    checksum: 11,
                    seq: 10,
                    layout: 0
                }
            ),
            Inserted
        );
        rej(ix.recover_entry(
            2,
            0,
            0,
            Recovered {
                object_len: SMALL,
                checksum: 0,
                seq: 1,
                layout: 0,
            },
        )); // slot taken
        rej(ix.recover_entry(
            2,
            7,
            0,
            Recovered {
                object_len: SMALL,
                checksum: 0,
                seq: 1,
                layout: 0,
            },
        )); // outside extent
        rej(ix.recover_entry(
            2,
            1,
            0,
            Recovered {
                object_len: SMALL + 1,
                checksum: 0,
                seq: 1,
                layout: 0,
            },
        )); // too large
        rej(ix.recover_entry(
            2,
            1,
            0,
            Recovered {
                object_len: 0,
                checksum: 0,
                seq: 1,
                layout: 0,
            },
        )); // empty
        rej(ix.recover_entry(
            2,
            0,
            3,
            Recovered {
                object_len: SMALL,
                checksum: 0,
                seq: 1,
                layout: 0,
            },
        )); // unassigned extent
        rej(ix.recover_entry(
            2,
            0,
            9,
            Recovered {
                object_len: SMALL,
                checksum: 0,
                seq: 1,
                layout: 0,
            },
        )); // out of range
            // Same key elsewhere, newer: replaces, old slot freed.
        assert_eq!(
            ix.recover_entry(
                1,
                0,
                1,
                Recovered {
                    object_len: SMALL,
                    checksum: 12,
                    seq: 20,
                    layout: 0
                }
            ),
            ReplacedOlder
        );
        let l = ix.get(&1).unwrap();
        assert_eq!(
            (l.slot.extent, l.slot.index, l.slot.epoch, l.checksum, l.seq),
            (1, 0, 3, 12, 20)
        );
        // Older or equal: kept.
        assert_eq!(
            ix.recover_entry(
                1,
                1,
                0,
                Recovered {
                    object_len: SMALL,
                    checksum: 13,
                    seq: 15,
                    layout: 0
                }
            ),
            KeptNewer
        );
        assert_eq!(
            ix.recover_entry(
                1,
                1,
                0,
                Recovered {
                    object_len: SMALL,
                    checksum: 13,
                    seq: 20,
                    layout: 0
                }
            ),
            KeptNewer
        );
        assert_eq!(ix.get(&1).unwrap().checksum, 12);
        // Fill extent 1 with seqs out of order; recency follows seq.
        for (k, idx, seq) in [
            (2, 1, 50),
            (3, 2, 30),
            (4, 3, 40),
            (5, 4, 35),
            (6, 5, 60),
            (7, 6, 45),
        ] {
            assert_eq!(
                ix.recover_entry(
                    k,
                    idx,
                    1,
                    Recovered {
                        object_len: SMALL,
                        checksum: 0,
                        seq,
                        layout: 0
                    }
                ),
                Inserted
            );
        }
        ok(&ix);
        ix.finish_recovery();
        ok(&ix);
        let s = ix.stats();
        // Extents 0 (now empty) and 2 (never filled) are free; extent 3 was never assigned.
        assert_eq!((s.free_extents, s.objects), (3, 7));
        // Next small reserve takes a free extent (epochs keep growing).
        let r = ix.reserve(100, SMALL, 0).unwrap();
        assert_eq!(r.new_extent, Some((0, 6, 256 * KIB)));
        ix.abort(100, r.slot).unwrap();
        // Fill the 21 free slots left (4 extents x 7, extent 1 full).
        let mut k = 200;
        while k < 221 {
            let r = ix.reserve(k, SMALL, 0).unwrap();
            assert!(r.evicted.is_empty());
            ix.commit(k, r.slot, 0, 0).unwrap();
            k += 1;
        }
        assert_eq!(ix.stats().free_extents, 0);
        ok(&ix);
        // Evictions follow seq order of the recovered entries, which are older
        // than anything created after recovery.
        let mut order = Vec::new();
        for _ in 0..7 {
            let r = ix.reserve(k, SMALL, 0).unwrap();
            order.extend(r.evicted);
            ix.commit(k, r.slot, 0, 0).unwrap();
            k += 1;
        }
        assert_eq!(order, vec![1, 3, 5, 4, 7, 2, 6]);
        ok(&ix);
    }

    #[test]
    fn error_display() {
        let e: &dyn std::error::Error = &ReserveError::TooLarge {
            object_len: 5,
            max: 4,
        };
        assert!(e.to_string().contains("max 4"));
        assert!(!ReserveError::Exists.to_string().is_empty());
        assert!(!ReserveError::NoSpace.to_string().is_empty());
        for e in [
            StateError::NotFound,
            StateError::WrongState,
            StateError::Doomed,
        ] {
            assert!(!e.to_string().is_empty());
        }
        assert!(RecoverError::BadExtent("x".into())
            .to_string()
            .contains('x'));
    }

    // ---- property test against a model ----

    #[derive(Debug, Clone)]
    enum Op {
        Reserve(u32, usize),
        Commit(u32),
        Abort(u32),
        Pin(u32),
        Unpin(u32),
        Remove(u32),
        Touch(u32),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        let k = 0u32..10;
        prop_oneof![
            6 => (k.clone(), 0usize..3).prop_map(|(k, s)| Op::Reserve(k, s)),
            4 => k.clone().prop_map(Op::Commit),
            1 => k.clone().prop_map(Op::Abort),
            2 => k.clone().prop_map(Op::Pin),
            2 => k.clone().prop_map(Op::Unpin),
            1 => k.clone().prop_map(Op::Remove),
            1 => k.prop_map(Op::Touch),
            1 => Just(Op::Clear),
        ]
    }

    #[derive(Debug, Clone)]
    struct M {
        slot: SlotRef,
        ready: bool,
        pins: u32,
        doomed: bool,
    }

    fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
        const SIZES: [u64; 3] = [SMALL, MID, BIG];
        let mut ix = L2Index::<u32>::new(4, EB);
        let mut m: HashMap<u32, M> = HashMap::new();
        let mut epochs = [0u64; 4];
        for op in ops {
            match op {
                Op::Reserve(k, s) => match ix.reserve(k, SIZES[s], 1) {
                    Ok(r) => {
                        prop_assert!(!m.contains_key(&k));
                        for v in &r.evicted {
                            let e = m.remove(v);
                            prop_assert!(
                                matches!(
                                    e,
                                    Some(M {
                                        ready: true,
                                        pins: 0,
                                        doomed: false,
                                        ..
                                    })
                                ),
                                "evicted {v}: {e:?}"
                            );
                            prop_assert!(ix.get(v).is_none());
                        }
                        if let Some((x, epoch, stride)) = r.new_extent {
                            prop_assert!(epoch > epochs[x as usize]);
                            prop_assert_eq!(stride, r.slot.stride);
                            epochs[x as usize] = epoch;
                        }
                        prop_assert_eq!(r.slot.epoch, epochs[r.slot.extent as usize]);
                        m.insert(
                            k,
                            M {
                                slot: r.slot,
                                ready: false,
                                pins: 0,
                                doomed: false,
                            },
                        );
                    }
                    Err(ReserveError::Exists) => prop_assert!(m.contains_key(&k)),
                    Err(ReserveError::NoSpace) => {
                        prop_assert!(!m.contains_key(&k));
                        prop_assert!(r_nospace_plausible(&m));
                    }
                    Err(e) => prop_assert!(false, "unexpected {e:?}"),
                },
                Op::Commit(k) => {
                    let slot = m.get(&k).map(|e| e.slot);
                    let res = ix.commit(k, slot.unwrap_or(DUMMY), 3, 0);
                    match m.get_mut(&k) {
                        None => prop_assert_eq!(res, Err(StateError::NotFound)),
                        Some(e) if e.ready => prop_assert_eq!(res, Err(StateError::WrongState)),
                        Some(e) if e.doomed => {
                            prop_assert_eq!(res, Err(StateError::Doomed));
                            m.remove(&k);
                        }
                        Some(e) => {
                            prop_assert_eq!(res, Ok(()));
                            e.ready = true;
                        }
                    }
                }
                Op::Abort(k) => {
                    let slot = m.get(&k).map(|e| e.slot);
                    let res = ix.abort(k, slot.unwrap_or(DUMMY));
                    match m.get(&k) {
                        None => prop_assert_eq!(res, Err(StateError::NotFound)),
                        Some(e) if e.ready => prop_assert_eq!(res, Err(StateError::WrongState)),
                        Some(_) => {
                            prop_assert_eq!(res, Ok(()));
                            m.remove(&k);
                        }
                    }
                }
                Op::Pin(k) => {
                    let res = ix.pin(&k);
                    match m.get_mut(&k) {
                        Some(e) if e.ready && !e.doomed => {
                            prop_assert_eq!(res.map(|l| l.slot), Some(e.slot));
                            e.pins += 1;
                        }
                        _ => prop_assert!(res.is_none()),
                    }
                }
                Op::Unpin(k) => {
                    let slot = m.get(&k).map(|e| e.slot);
                    let res = ix.unpin(&k, slot.unwrap_or(DUMMY));
                    match m.get_mut(&k) {
                        None => prop_assert_eq!(res, Err(StateError::NotFound)),
                        Some(e) if e.pins == 0 => prop_assert_eq!(res, Err(StateError::WrongState)),
                        Some(e) => {
                            prop_assert_eq!(res, Ok(()));
                            e.pins -= 1;
                            if e.pins == 0 && e.doomed {
                                m.remove(&k);
                            }
                        }
                    }
                }
                Op::Remove(k) => {
                    prop_assert_eq!(ix.remove(&k), m.contains_key(&k));
                    if let Some(e) = m.get_mut(&k) {
                        if e.ready && e.pins == 0 {
                            m.remove(&k);
                        } else {
                            e.doomed = true;
                        }
                    }
                }
                Op::Touch(k) => ix.touch(&k),
                Op::Clear => {
                    let before = m.len() as u64;
                    m.retain(|_, e| !(e.ready && e.pins == 0));
                    for e in m.values_mut() {
                        e.doomed = true;
                    }
                    let kept = m.len() as u64;
                    prop_assert_eq!(ix.clear(), (before - kept, kept));
                }
            }
            if let Err(e) = ix.check() {
                prop_assert!(false, "check: {}", e);
            }
            let mut slots = HashSet::new();
            for k in 0..10u32 {
                let vis = m.get(&k).is_some_and(|e| e.ready && !e.doomed);
                prop_assert_eq!(ix.get(&k).is_some(), vis, "key {}", k);
                prop_assert_eq!(ix.contains(&k), vis);
                if let Some(e) = m.get(&k) {
                    prop_assert!(slots.insert((e.slot.extent, e.slot.index)), "shared slot");
                }
                if let Some(l) = ix.get(&k) {
                    prop_assert_eq!(Some(l.slot), m.get(&k).map(|e| e.slot));
                }
            }
            let s = ix.stats();
            let count = |f: fn(&M) -> bool| m.values().filter(|e| f(e)).count() as u64;
            prop_assert_eq!(s.objects, count(|e| e.ready && !e.doomed));
            prop_assert_eq!(s.writing, count(|e| !e.ready));
            prop_assert_eq!(s.pinned, count(|e| e.pins > 0));
            prop_assert_eq!(s.used_bytes, m.values().map(|e| e.slot.stride).sum::<u64>());
        }
        Ok(())
    }

    /// NoSpace needs at least one blocked entry (4 extents can hold any single object).
    fn r_nospace_plausible(m: &HashMap<u32, M>) -> bool {
        m.values().any(|e| !e.ready || e.pins > 0 || e.doomed)
    }

    const DUMMY: SlotRef = SlotRef {
        extent: 99,
        index: 0,
        stride: 0,
        epoch: 0,
        file_offset: 0,
    };

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn model_check(ops in proptest::collection::vec(op(), 1..120)) {
            run(ops)?;
        }
    }
}
