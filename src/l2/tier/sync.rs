//! Durability: fdatasync and what a failed one drops, and stores deferred behind a busy
//! older copy of their key.

use std::sync::atomic::Ordering;

use super::write::WRITE_BATCH_BYTES;
use super::{hw, L2Tier};
use crate::error::Error;
use crate::storage::StorageKey;

/// What an fdatasync is granted beyond `l2.io_timeout_ms` before the device counts as stuck:
/// the time to move this many bytes at [`crate::l2::iowatch::SLOWEST_RATE`] (a full write batch).
pub(super) const SYNC_ALLOWANCE_BYTES: u64 = WRITE_BATCH_BYTES;

/// Objects written since the last good fdatasync, and how many fdatasyncs have failed.
/// Invariant: `objects` in commit order; `failed_syncs` only grows, and a batch whose I/O
/// overlapped a failure (the count moved) commits nothing.
#[derive(Default)]
pub(super) struct Unsynced {
    pub(super) objects: Vec<(StorageKey, crate::l2::space::SlotRef)>,
    pub(super) failed_syncs: u64,
}

/// Most keys waiting for an older, busy entry of the same key to go (see `L2Tier::deferred`).
pub const DEFERRED_MAX: usize = 4096;

impl L2Tier {
    /// `fdatasync` of the data file: completed writes become durable across power loss. When it
    /// fails, nothing written since the last good sync can be trusted to be durable (a later
    /// sync may report success without having written it): those objects are dropped from the
    /// index (counted as errors) and returned, so the caller can write them again.
    pub fn sync(&self) -> std::result::Result<(), (Error, Vec<StorageKey>)> {
        let _one = self.sync_lock.lock();
        // Headers written since a CLEAR carry its new format id: they are durable only once that
        // id is (a restart with the old one in the superblock ignores them).
        if self.identity.format_pending() {
            if let Err(e) = self.persist_format() {
                let dropped = self.drop_unsynced();
                return Err((e, dropped));
            }
        }
        let (covered, failed_before) = {
            let u = self.unsynced.lock();
            (u.objects.len(), u.failed_syncs)
        };
        let synced = {
            let _call = self.io.start(SYNC_ALLOWANCE_BYTES);
            self.write_engine.sync()
        };
        match synced {
            Ok(()) => {
                let mut u = self.unsynced.lock();
                // Another sync (extent headers, a superblock) failed meanwhile: it already took
                // the list, and what was added since is not covered by this one.
                if u.failed_syncs == failed_before {
                    let n = covered.min(u.objects.len());
                    u.objects.drain(..n);
                }
                Ok(())
            }
            Err(e) => {
                // Everything committed before the sync returned, not only before it began:
                // those writes completed before the failure too.
                let dropped = self.drop_unsynced();
                Err((hw("syncing the L2 file")(e), dropped))
            }
        }
    }

    /// Keeps `key` for a later round (see `deferred`); counted as skipped when that is full.
    pub(super) fn defer(&self, key: StorageKey) {
        let mut d = self.deferred.lock();
        if d.len() < DEFERRED_MAX {
            d.push(key);
        } else {
            self.counters.skipped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// After a failed fdatasync (any of them): nothing written since the last good one is known
    /// to be durable; those objects leave the index (counted) and are returned.
    pub(super) fn drop_unsynced(&self) -> Vec<StorageKey> {
        let lost = {
            let mut u = self.unsynced.lock();
            u.failed_syncs += 1;
            std::mem::take(&mut u.objects)
        };
        let mut dropped = Vec::new();
        {
            let mut index = self.index.lock();
            for (k, slot) in &lost {
                if index.slot_of(k) == Some(*slot) && index.remove(k) {
                    dropped.push(*k);
                }
            }
        }
        self.counters
            .errors
            .fetch_add(dropped.len() as u64, Ordering::Relaxed);
        dropped
    }

    /// Counts the keys still deferred as skipped and forgets them (the shutdown's drain, after
    /// its last round): they stay in L1 only.
    pub fn discard_deferred(&self) -> usize {
        let n = std::mem::take(&mut *self.deferred.lock()).len();
        self.counters.skipped.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Queues the deferred keys (see `deferred`) for write-behind again; returns how many.
    pub fn requeue_deferred(&self) -> usize {
        let keys = std::mem::take(&mut *self.deferred.lock());
        let n = keys.len();
        if n > 0 {
            let refused = self.queue.push(keys);
            self.counters
                .skipped
                .fetch_add(refused.len() as u64, Ordering::Relaxed);
        }
        n
    }
}
