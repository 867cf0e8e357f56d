//! Hierarchical hashed timer wheel in abstract ticks.
//!
//! The liveness reaper keeps one timer per registered engine instance here.
//! The wheel knows nothing about clocks: the caller decides what a tick is
//! (the reaper uses 100 ms since node start) and moves time forward with
//! [`TimerWheel::advance`].
//!
//! # Layout
//!
//! * A slab (`Vec` of entries plus a free list) owns every live timer. Each
//!   slab entry carries a generation counter, so a [`TimerId`] names exactly
//!   one scheduling for the life of the wheel.
//! * [`LEVELS`] levels of [`SLOTS`] slots each. A slot at level `k` spans
//!   `64^k` ticks. Every slot is the head of an intrusive doubly linked list
//!   threaded through the slab, so insert and cancel are O(1).
//! * A timer with deadline `d` lives on level `k`, where `6k..6k+6` is the bit
//!   group holding the most significant bit in which `d` and `now` differ, in
//!   slot `(d >> 6k) & 63`. Deadlines differing from `now` above bit 35 (in a
//!   later `2^36`-tick block than `now`, i.e. at least decades away at the
//!   reaper's 100 ms tick) sit in an ordered overflow set (`BTreeSet`, O(log n))
//!   and are moved into the wheel when `now` reaches their block.
//! * A timer whose deadline is already `<= now` sits on a ready list and fires
//!   on the next [`TimerWheel::advance`].
//! * One `u64` occupancy bitmap per level lets `advance` jump straight to the
//!   next non-empty slot, so a jump of any size costs
//!   O(levels × slots visited + expired + cascaded) and never loops per tick.

use std::collections::BTreeSet;
use std::fmt;

/// Number of wheel levels. Invariant: the wheel proper covers deadlines that
/// share all bits above bit `LEVELS * SLOT_BITS - 1` (that is, `2^36`) with `now`;
/// anything further out lives on the overflow list.
pub const LEVELS: usize = 6;

/// log2 of the number of slots per level. Invariant: `SLOTS == 1 << SLOT_BITS`.
pub const SLOT_BITS: u32 = 6;

/// Slots per level. Invariant: equals 64 so that one `u64` bitmap tracks a level's occupancy.
pub const SLOTS: usize = 1 << SLOT_BITS;

const SLOT_MASK: u64 = (SLOTS as u64) - 1;
/// Bits of tick space covered by the wheel levels (36).
const WHEEL_BITS: u32 = SLOT_BITS * LEVELS as u32;
/// Sentinel for "no slab index" in intrusive links and list heads.
const NIL: usize = usize::MAX;

/// Opaque handle for cancelling, rescheduling or inspecting one timer.
///
/// Invariant: unique for the wheel's life. It is a slab index tagged with that
/// slab entry's generation; the generation changes every time the entry is
/// freed (fired or cancelled), and an entry whose generation would wrap is
/// retired forever instead of reused. A stale id therefore never refers to a
/// later timer, even after its slab entry has been reused. Ids from one wheel
/// are meaningless for another wheel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerId {
    index: usize,
    generation: u64,
}

/// Error returned by [`TimerWheel::insert`] when the wheel already holds
/// `capacity` live timers.
///
/// Invariant: `item` is the exact value that was passed to `insert`, handed back
/// untouched; `capacity` is the limit given to [`TimerWheel::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WheelFull<T> {
    /// The wheel's hard limit on live timers (as given to [`TimerWheel::new`]).
    pub capacity: usize,
    /// The rejected item, returned to the caller.
    pub item: T,
}

impl<T> WheelFull<T> {
    /// Gives back the rejected item. Invariant: it is the value passed to `insert`.
    pub fn into_inner(self) -> T {
        self.item
    }
}

impl<T> fmt::Display for WheelFull<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "timer wheel full ({} live timers)", self.capacity)
    }
}

impl<T: fmt::Debug> std::error::Error for WheelFull<T> {}

/// Which intrusive list a live timer is linked into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListId {
    /// Wheel level `level`, slot `slot`.
    Wheel { level: u8, slot: u8 },
    /// Deadline in a later `2^36`-tick block than `now`: kept in the overflow set.
    Overflow,
    /// Deadline `<= now`: fires on the next advance.
    Ready,
}

struct Node<T> {
    deadline: u64,
    /// Insertion sequence number: tie-break for equal deadlines.
    seq: u64,
    item: T,
    list: ListId,
    prev: usize,
    next: usize,
}

enum State<T> {
    Vacant { next_free: usize },
    Occupied(Node<T>),
}

struct Entry<T> {
    generation: u64,
    state: State<T>,
}

/// Hierarchical timer wheel: [`LEVELS`] levels of 64 slots each (level `k`
/// slot width is `64^k` ticks), plus an overflow set for deadlines beyond the
/// top level's range and a ready list for deadlines already due.
///
/// Invariants (verified by [`TimerWheel::check_invariants`]):
/// * every live timer is in exactly one place, the one its deadline maps to
///   given the current `now`: the ready list if `deadline <= now`, else the
///   level/slot of the highest bit group in which `deadline` and `now` differ,
///   else (a later `2^36`-tick block) the overflow set;
/// * a level's occupancy bit is set iff that slot's list is non-empty;
/// * `len() <= capacity()` and `len()` equals the number of live slab entries.
///
/// Costs: insert, cancel, reschedule and deadline are O(1) for deadlines less
/// than `2^36` ticks ahead (O(log n) for overflow deadlines); advance is
/// O(LEVELS × non-empty slots visited + cascaded·log + expired·log(expired)).
/// No operation scans all timers, and none loops per elapsed tick.
pub struct TimerWheel<T> {
    now: u64,
    capacity: usize,
    len: usize,
    next_seq: u64,
    slab: Vec<Entry<T>>,
    free_head: usize,
    heads: [[usize; SLOTS]; LEVELS],
    occupied: [u64; LEVELS],
    /// `(deadline, seq, slab index)` of every overflow timer.
    overflow: BTreeSet<(u64, u64, usize)>,
    ready_head: usize,
    /// Reused buffer for slab indices during advance.
    scratch: Vec<usize>,
}

impl<T> fmt::Debug for TimerWheel<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimerWheel")
            .field("now", &self.now)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// The list a deadline belongs to when the current tick is `now`.
fn list_for(now: u64, deadline: u64) -> ListId {
    if deadline <= now {
        return ListId::Ready;
    }
    let masked = (deadline ^ now) | SLOT_MASK;
    let significant = 63 - masked.leading_zeros();
    let level = significant / SLOT_BITS;
    if level as usize >= LEVELS {
        ListId::Overflow
    } else {
        let slot = (deadline >> (level * SLOT_BITS)) & SLOT_MASK;
        ListId::Wheel {
            level: level as u8,
            slot: slot as u8,
        }
    }
}

/// First tick of the `2^36`-tick block containing `t`.
fn block_start(t: u64) -> u64 {
    t & !((1u64 << WHEEL_BITS) - 1)
}

impl<T> TimerWheel<T> {
    /// Creates an empty wheel whose current tick is `now`.
    ///
    /// `capacity` is a hard limit on live timers: an insert that would exceed it
    /// fails with [`WheelFull`]. Nothing is preallocated, so any capacity
    /// (including 0 and `usize::MAX`) is accepted.
    pub fn new(now: u64, capacity: usize) -> Self {
        TimerWheel {
            now,
            capacity,
            len: 0,
            next_seq: 0,
            slab: Vec::new(),
            free_head: NIL,
            heads: [[NIL; SLOTS]; LEVELS],
            occupied: [0; LEVELS],
            overflow: BTreeSet::new(),
            ready_head: NIL,
            scratch: Vec::new(),
        }
    }

    /// The current tick. Invariant: never decreases over the wheel's life.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Number of pending (not yet fired, not cancelled) timers.
    /// Invariant: `len() <= capacity()`.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True iff no timer is pending. Invariant: `is_empty() == (len() == 0)`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The hard limit on live timers given to [`TimerWheel::new`]. Invariant: constant.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Schedules `item` to fire at tick `deadline`; a deadline `<= now()` fires
    /// on the next [`advance`](Self::advance).
    ///
    /// Returns a fresh [`TimerId`] never issued before by this wheel. If
    /// `len() == capacity()` the wheel is unchanged and the item comes back
    /// inside `Err(WheelFull { capacity, item })`. O(1) (O(log n) for a
    /// deadline `2^36` or more ticks ahead, which goes to the overflow set).
    pub fn insert(&mut self, deadline: u64, item: T) -> Result<TimerId, WheelFull<T>> {
        if self.len >= self.capacity {
            return Err(WheelFull {
                capacity: self.capacity,
                item,
            });
        }
        let seq = self.next_seq;
        // 2^64 inserts cannot happen in practice; wrapping only weakens tie order.
        self.next_seq = self.next_seq.wrapping_add(1);
        let node = Node {
            deadline,
            seq,
            item,
            list: ListId::Ready,
            prev: NIL,
            next: NIL,
        };
        let index = self.free_head;
        let index = match self.slab.get_mut(index) {
            Some(entry) => match entry.state {
                State::Vacant { next_free } => {
                    self.free_head = next_free;
                    entry.state = State::Occupied(node);
                    index
                }
                State::Occupied(_) => {
                    // Corrupted free list; cannot happen. Fall back to a new entry.
                    debug_assert!(false, "free list points at an occupied entry");
                    self.free_head = NIL;
                    self.push_new_entry(node)
                }
            },
            None => {
                debug_assert_eq!(index, NIL, "free list index out of bounds");
                self.free_head = NIL;
                self.push_new_entry(node)
            }
        };
        Ok(self.finish_insert(index))
    }

    fn push_new_entry(&mut self, node: Node<T>) -> usize {
        let index = self.slab.len();
        self.slab.push(Entry {
            generation: 0,
            state: State::Occupied(node),
        });
        index
    }

    fn finish_insert(&mut self, index: usize) -> TimerId {
        self.len += 1;
        self.place(index);
        TimerId {
            index,
            generation: self.slab.get(index).map_or(u64::MAX, |e| e.generation),
        }
    }

    /// Removes a pending timer and returns its item; `None` if the id is stale
    /// (the timer already fired or was cancelled) or foreign. O(1) (O(log n)
    /// for a timer in the overflow set).
    pub fn cancel(&mut self, id: TimerId) -> Option<T> {
        self.node(id)?;
        self.unlink(id.index);
        self.release(id.index)
    }

    /// Moves a pending timer to `deadline`, keeping its id valid and its
    /// insertion order for tie-breaking. Returns false (and changes nothing) if
    /// the id is stale. A deadline `<= now()` fires on the next advance. O(1)
    /// (O(log n) if the old or new deadline is in the overflow set).
    pub fn reschedule(&mut self, id: TimerId, deadline: u64) -> bool {
        if self.node(id).is_none() {
            return false;
        }
        self.unlink(id.index);
        if let Some(State::Occupied(node)) = self.slab.get_mut(id.index).map(|e| &mut e.state) {
            node.deadline = deadline;
        }
        self.place(id.index);
        true
    }

    /// The deadline of a pending timer; `None` if the id is stale. O(1).
    pub fn deadline(&self, id: TimerId) -> Option<u64> {
        self.node(id).map(|n| n.deadline)
    }

    /// Advances the wheel to tick `now` and appends every timer with
    /// `deadline <= now` to `expired` as `(id, deadline, item)`.
    ///
    /// The appended batch is sorted by deadline, ties in insertion order (the
    /// order of the `insert` calls; `reschedule` keeps a timer's place).
    /// Entries already in `expired` are left alone. Fired timers are removed,
    /// so their ids become stale. A `now` smaller than [`now()`](Self::now)
    /// is a no-op (nothing fires, time does not move back). The cost is bounded
    /// by the non-empty slots passed and the timers cascaded or expired, never
    /// by the number of ticks jumped.
    pub fn advance(&mut self, now: u64, expired: &mut Vec<(TimerId, u64, T)>) {
        if now < self.now {
            return;
        }
        loop {
            if let Some((level, slot, start)) = self.next_expiration() {
                if start > now {
                    break;
                }
                self.now = self.now.max(start);
                let head = std::mem::replace(&mut self.heads[level][slot], NIL);
                self.occupied[level] &= !(1u64 << slot);
                self.replace_chain(head);
                continue;
            }
            // The wheel levels are empty: only the overflow set may hold timers.
            // Jump to the block of the earliest one and pull that whole block in.
            let Some(&(min, _, _)) = self.overflow.first() else {
                break;
            };
            let start = block_start(min);
            if start > now {
                break;
            }
            self.now = self.now.max(start);
            while let Some(&(deadline, _, index)) = self.overflow.first() {
                if block_start(deadline) != start {
                    break;
                }
                self.overflow.pop_first();
                self.place(index);
            }
        }
        self.now = now;
        self.drain_ready(expired);
    }

    /// Earliest pending deadline, or `None` when empty. Exact; computed on
    /// demand in O(LEVELS + size of the slot or ready list holding the
    /// earliest timer), or O(log n) when only overflow timers remain.
    pub fn next_deadline(&self) -> Option<u64> {
        if self.ready_head != NIL {
            return self.list_min(self.ready_head);
        }
        if let Some((level, slot, start)) = self.next_expiration() {
            if level == 0 {
                return Some(start);
            }
            return self.list_min(self.heads[level][slot]);
        }
        self.overflow.first().map(|&(deadline, _, _)| deadline)
    }

    /// The live node named by `id`, if the id is current.
    fn node(&self, id: TimerId) -> Option<&Node<T>> {
        let entry = self.slab.get(id.index)?;
        if entry.generation != id.generation {
            return None;
        }
        match &entry.state {
            State::Occupied(node) => Some(node),
            State::Vacant { .. } => None,
        }
    }

    fn node_mut(&mut self, index: usize) -> Option<&mut Node<T>> {
        match self.slab.get_mut(index).map(|e| &mut e.state) {
            Some(State::Occupied(node)) => Some(node),
            _ => None,
        }
    }

    fn head_mut(&mut self, list: ListId) -> &mut usize {
        match list {
            ListId::Wheel { level, slot } => &mut self.heads[level as usize][slot as usize],
            ListId::Ready => &mut self.ready_head,
            // Overflow timers live in the ordered set, never in a list; callers
            // handle that case before asking for a head.
            ListId::Overflow => {
                debug_assert!(false, "overflow has no list head");
                &mut self.ready_head
            }
        }
    }

    /// Links the (unlinked) live entry `index` into the list its deadline maps to.
    fn place(&mut self, index: usize) {
        let now = self.now;
        let Some(node) = self.node_mut(index) else {
            debug_assert!(false, "place on vacant entry {index}");
            return;
        };
        let list = list_for(now, node.deadline);
        node.list = list;
        node.prev = NIL;
        node.next = NIL;
        if list == ListId::Overflow {
            let key = (node.deadline, node.seq, index);
            self.overflow.insert(key);
            return;
        }
        let head_slot = self.head_mut(list);
        let old_head = std::mem::replace(head_slot, index);
        if let Some(node) = self.node_mut(index) {
            node.next = old_head;
        }
        if let Some(old) = self.node_mut(old_head) {
            old.prev = index;
        }
        if let ListId::Wheel { level, slot } = list {
            self.occupied[level as usize] |= 1u64 << slot;
        }
    }

    /// Unlinks the live entry `index` from its list, keeping bitmaps exact.
    fn unlink(&mut self, index: usize) {
        let Some(node) = self.node_mut(index) else {
            debug_assert!(false, "unlink on vacant entry {index}");
            return;
        };
        let (prev, next, list) = (node.prev, node.next, node.list);
        node.prev = NIL;
        node.next = NIL;
        if list == ListId::Overflow {
            let key = (node.deadline, node.seq, index);
            let removed = self.overflow.remove(&key);
            debug_assert!(removed, "overflow entry {index} missing from set");
            return;
        }
        if let Some(p) = self.node_mut(prev) {
            p.next = next;
        } else {
            debug_assert_eq!(*self.head_mut(list), index);
            *self.head_mut(list) = next;
            if next == NIL {
                if let ListId::Wheel { level, slot } = list {
                    self.occupied[level as usize] &= !(1u64 << slot);
                }
            }
        }
        if let Some(n) = self.node_mut(next) {
            n.prev = prev;
        }
    }

    /// Frees the (unlinked) live entry `index` and returns its item.
    fn release(&mut self, index: usize) -> Option<T> {
        let entry = self.slab.get_mut(index)?;
        if let State::Vacant { .. } = entry.state {
            return None;
        }
        let retire = entry.generation == u64::MAX - 1;
        entry.generation = entry.generation.saturating_add(1);
        let next_free = if retire { NIL } else { self.free_head };
        let old = std::mem::replace(&mut entry.state, State::Vacant { next_free });
        if !retire {
            self.free_head = index;
        }
        self.len = self.len.saturating_sub(1);
        match old {
            State::Occupied(node) => Some(node.item),
            State::Vacant { .. } => None,
        }
    }

    /// Re-places every entry of a detached chain relative to the current `now`.
    fn replace_chain(&mut self, mut cur: usize) {
        while cur != NIL {
            let next = match self.node_mut(cur) {
                Some(node) => node.next,
                None => {
                    debug_assert!(false, "vacant entry {cur} in chain");
                    return;
                }
            };
            self.place(cur);
            cur = next;
        }
    }

    /// Earliest non-empty wheel slot as `(level, slot, first tick of slot)`.
    /// Lower levels always precede higher ones, so the first hit is the earliest.
    fn next_expiration(&self) -> Option<(usize, usize, u64)> {
        for level in 0..LEVELS {
            let shift = level as u32 * SLOT_BITS;
            let now_slot = ((self.now >> shift) & SLOT_MASK) as u32;
            let bits = self.occupied[level] & (u64::MAX << now_slot);
            debug_assert_eq!(
                bits, self.occupied[level],
                "level {level} has slots at or behind now"
            );
            if bits != 0 {
                let slot = bits.trailing_zeros();
                let range_mask = (1u64 << (shift + SLOT_BITS)) - 1;
                let start = (self.now & !range_mask) | (u64::from(slot) << shift);
                return Some((level, slot as usize, start));
            }
        }
        None
    }

    /// Minimum deadline on the list starting at `head`.
    fn list_min(&self, head: usize) -> Option<u64> {
        let mut min: Option<u64> = None;
        let mut cur = head;
        while let Some(Entry {
            state: State::Occupied(node),
            ..
        }) = self.slab.get(cur)
        {
            min = Some(min.map_or(node.deadline, |m| m.min(node.deadline)));
            cur = node.next;
        }
        min
    }

    /// Removes every ready timer and appends them sorted by (deadline, seq).
    fn drain_ready(&mut self, expired: &mut Vec<(TimerId, u64, T)>) {
        let mut batch = std::mem::take(&mut self.scratch);
        batch.clear();
        let mut cur = std::mem::replace(&mut self.ready_head, NIL);
        while let Some(node) = self.node_mut(cur) {
            let next = node.next;
            node.prev = NIL;
            node.next = NIL;
            batch.push(cur);
            cur = next;
        }
        let slab = &self.slab;
        batch.sort_unstable_by_key(|&i| match slab.get(i).map(|e| &e.state) {
            Some(State::Occupied(node)) => (node.deadline, node.seq),
            _ => (u64::MAX, u64::MAX),
        });
        expired.reserve(batch.len());
        for &index in &batch {
            let (generation, deadline) = match self.slab.get(index) {
                Some(Entry {
                    generation,
                    state: State::Occupied(node),
                }) => (*generation, node.deadline),
                _ => continue,
            };
            if let Some(item) = self.release(index) {
                expired.push((TimerId { index, generation }, deadline, item));
            }
        }
        batch.clear();
        self.scratch = batch;
    }
}

mod check;
#[cfg(test)]
mod tests;
