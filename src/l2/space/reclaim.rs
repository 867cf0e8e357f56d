//! Reclaim: what `reserve` frees when its stride has no free slot and no extent is free,
//! and the per-extent summaries, kept in step with every entry change, that let it choose
//! without scanning slots.
//!
//! Policy (issue 10, defect 4): space goes to recently used objects whatever their stride.
//! The oldest evictable entry of the reserving stride (its LRU head) is weighed against the
//! reclaimable extent of another stride (all entries evictable, not draining) whose newest
//! entry is the oldest, empty extents first: if that whole extent is older than the head,
//! or the stride has no evictable entry, the extent is reclaimed (its entries evicted, the
//! extent reassigned with a new epoch); otherwise the head is evicted. Evicting only within
//! the stride kept a stride that arrived after the disk filled in a single extent.

use std::fmt;
use std::hash::Hash;

use super::{Entry, L2Index, Stamp};

/// Key of an extent in `L2Index::reclaimable`: its newest-stamp bound (`None` when it
/// holds no entry), then its number. Ordered oldest first, empty extents before all others,
/// ties to the lowest number.
pub(super) type ReclaimKey = (Option<Stamp>, u32);

/// What `reserve` frees when it finds no free slot and no free extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Victim<K> {
    /// The least recently used evictable entry of the reserving stride.
    Entry(K),
    /// A whole extent of another stride whose entries are all evictable.
    Extent(u32),
}

/// Reclaim summary of one extent, updated by `link`, `unlink`, `drop_entry`, `assign`,
/// `release_extent` and `clear`. Invariants (verified by `L2Index::check`):
/// * `busy` is the number of the extent's entries that are not evictable (Writing, pinned
///   or doomed);
/// * `newest` is `None` when the extent holds no entry, else at least the newest stamp of
///   its entries. It is an upper bound: it is not lowered when an entry leaves (that would
///   need a scan of the extent), which can only make the extent look newer than it is, so a
///   stale bound delays a reclaim but never allows one that the exact value forbids; any
///   stamp given later is above it, and it is exact again once the extent is empty;
/// * `listed` is `Some(newest)` exactly when the extent is assigned, not draining and
///   `busy == 0` (it holds only evictable entries), and then `(newest, extent)` is in
///   `L2Index::reclaimable`; no other key is there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Summary {
    pub(super) busy: u32,
    pub(super) newest: Option<Stamp>,
    pub(super) listed: Option<Option<Stamp>>,
}

impl<K: Copy + Eq + Hash + fmt::Debug> L2Index<K> {
    /// Adds an entry (already in its slot) to its extent's summary.
    pub(super) fn summary_add(&mut self, e: &Entry) {
        let s = &mut self.extents[e.slot.extent as usize].summary;
        s.busy += u32::from(!e.evictable());
        s.newest = s.newest.max(Some(e.stamp));
        self.relist(e.slot.extent);
    }

    /// Removes an entry from its extent's summary; `newest` stays (an upper bound).
    pub(super) fn summary_remove(&mut self, e: &Entry) {
        let s = &mut self.extents[e.slot.extent as usize].summary;
        s.busy -= u32::from(!e.evictable());
        self.relist(e.slot.extent);
    }

    /// Brings `ext`'s membership of `reclaimable` in line with its state (assigned, draining,
    /// busy, newest); an extent without entries gets the exact `newest`, `None`. O(log n).
    pub(super) fn relist(&mut self, ext: u32) {
        let x = &mut self.extents[ext as usize];
        if x.live == 0 {
            x.summary.newest = None;
        }
        let want =
            (x.stride != 0 && !x.draining && x.summary.busy == 0).then_some(x.summary.newest);
        if want != x.summary.listed {
            if let Some(old) = x.summary.listed {
                self.reclaimable.remove(&(old, ext));
            }
            if let Some(newest) = want {
                self.reclaimable.insert((newest, ext));
            }
            x.summary.listed = want;
        }
    }

    /// What to free for a reservation of `stride` that found no free slot and no free
    /// extent (the policy in the module doc); `None` when nothing may be evicted. O(log n).
    pub(super) fn victim(&self, stride: u64) -> Option<Victim<K>> {
        let head = self
            .strides
            .get(&stride)
            .and_then(|s| s.lru.first_key_value())
            .map(|(stamp, k)| (*stamp, *k));
        match self.reclaim_candidate(stride, head.map(|(stamp, _)| stamp)) {
            Some(ext) => Some(Victim::Extent(ext)),
            None => head.map(|(_, k)| Victim::Entry(k)),
        }
    }

    /// Evicts every entry of `ext` (all evictable), appending their keys to `evicted`, and
    /// reassigns it to `stride` with a new epoch; returns `(extent, epoch, stride)`.
    pub(super) fn reclaim_extent(
        &mut self,
        ext: u32,
        stride: u64,
        evicted: &mut Vec<K>,
    ) -> (u32, u64, u64) {
        let keys: Vec<K> = self
            .by_slot
            .range((ext, 0)..=(ext, u32::MAX))
            .map(|(_, k)| *k)
            .collect();
        for k in keys {
            debug_assert!(self.entries.get(&k).is_some_and(Entry::evictable));
            self.drop_entry(&k);
            evicted.push(k);
        }
        self.release_extent(ext);
        self.assign(ext, stride)
    }

    /// The extent of another stride than `stride` that holds only evictable entries and whose
    /// newest-stamp bound is the oldest (empty extents first), if that bound is older than
    /// `older_than` (when given); `None` otherwise.
    ///
    /// O(log n): an extent of `stride` itself in `reclaimable` is full (one with a free slot
    /// is in the stride's `partial` set, which `reserve` tries first) and holds only evictable
    /// entries, so it holds the stride's LRU head or newer entries: its bound is at least
    /// `older_than` and the walk stops there.
    pub(super) fn reclaim_candidate(&self, stride: u64, older_than: Option<Stamp>) -> Option<u32> {
        for &(newest, ext) in &self.reclaimable {
            if older_than.is_some_and(|head| newest >= Some(head)) {
                return None;
            }
            if self.extents[ext as usize].stride != stride {
                return Some(ext);
            }
        }
        None
    }
}
