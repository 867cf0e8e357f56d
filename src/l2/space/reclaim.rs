//! Reclaim: per-extent summaries, kept in step with every entry change, from which
//! `reserve` picks a whole extent of another stride to reclaim without scanning slots.

use std::fmt;
use std::hash::Hash;

use super::{Entry, L2Index, Stamp};

/// Key of an extent in `L2Index::reclaimable`: its newest-stamp bound (`None` when it
/// holds no entry), then its number. Ordered oldest first, empty extents before all others,
/// ties to the lowest number.
pub(super) type ReclaimKey = (Option<Stamp>, u32);

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

    /// The extent of another stride than `stride` that holds only evictable entries and whose
    /// newest-stamp bound is the oldest (empty extents first), if that bound is older than
    /// `older_than` (when given); `None` otherwise.
    ///
    /// O(log n): an extent of `stride` itself in `reclaimable` is full (one with a free slot
    /// is in the stride's `partial` set, which `reserve` tries first) and holds only evictable
    /// entries, so it holds the stride's LRU head or newer entries: its bound is at least
    /// `older_than` and the walk stops there. (During recovery, when `partial` sets are not
    /// maintained, the walk may skip more, never wrongly.)
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
