//! Object counters kept per index shard, so STATUS reads them without any lock.
//!
//! Every entry counts towards a fixed set of counters decided by its state ([`Tally::of`]).
//! Each operation that inserts, removes or changes an entry computes the entry's tally before
//! and after, under the shard's lock, and applies the difference to that shard's
//! [`ShardTally`]. Only the holder of a shard's lock writes its counters, so a plain load and
//! store suffices (no read-modify-write instruction on the hot path); readers sum the shards'
//! counters with relaxed loads: each shard's figures are exact at some instant, the sum across
//! shards is a snapshot that moving objects may blur by the operations in flight.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{ObjectCounts, StorageCore};
use crate::storage::index::{Entry, ObjectState};

/// Counter positions in a [`ShardTally`].
const READY: usize = 0;
const WRITE_RESERVED: usize = 1;
const READ_LOCKED: usize = 2;
const TEMPORARY: usize = 3;
const DOOMED: usize = 4;
const UNWRITTEN: usize = 5;
/// Counters selected by [`Tally::bits`].
const FLAG_COUNTERS: usize = 6;
/// Entries in the shard.
const OBJECTS: usize = 6;
/// Sum of the entries' `slot.class_bytes`.
const BYTES: usize = 7;
const COUNTERS: usize = 8;

/// What one entry (or its absence) contributes to its shard's counters. Invariant: `bits` has
/// exactly one of READY, WRITE_RESERVED, READ_LOCKED set for a present entry and none for an
/// absent one; `bytes` is the entry's slot size (0 when absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tally {
    bits: u8,
    present: bool,
    bytes: u64,
}

impl Tally {
    /// The contribution of no entry.
    pub(super) const ABSENT: Tally = Tally {
        bits: 0,
        present: false,
        bytes: 0,
    };

    /// The contribution of `e`, by the same rules as a recount ([`ShardTally::recount`]).
    pub(super) fn of(e: &Entry) -> Tally {
        let state = match (e.state, e.unheld()) {
            (ObjectState::WriteReserved, _) => WRITE_RESERVED,
            (ObjectState::Ready, true) => READY,
            (ObjectState::Ready, false) => READ_LOCKED,
        };
        let bits = (1u8 << state)
            | (u8::from(e.temporary) << TEMPORARY)
            | (u8::from(e.doomed) << DOOMED)
            | (u8::from(e.unwritten) << UNWRITTEN);
        Tally {
            bits,
            present: true,
            bytes: e.slot.class_bytes,
        }
    }
}

/// One shard's counters, on a cache line of their own (shards change in parallel). Invariant:
/// written only by the holder of the shard's lock; between two operations on the shard they
/// equal [`ShardTally::recount`] of the shard's entries (memcheck checks it).
#[repr(align(64))]
#[derive(Default)]
pub(super) struct ShardTally {
    n: [AtomicU64; COUNTERS],
}

impl ShardTally {
    /// Adds `delta` (wrapping) to counter `i`. Caller holds the shard's lock: the only writer.
    pub(super) fn bump(&self, i: usize, delta: u64) {
        let c = &self.n[i];
        c.store(
            c.load(Ordering::Relaxed).wrapping_add(delta),
            Ordering::Relaxed,
        );
    }

    fn get(&self, i: usize) -> u64 {
        self.n[i].load(Ordering::Relaxed)
    }

    /// The counters as `(counts, objects, bytes)`.
    pub(super) fn read(&self) -> (ObjectCounts, u64, u64) {
        (
            ObjectCounts {
                ready: self.get(READY),
                write_reserved: self.get(WRITE_RESERVED),
                read_locked: self.get(READ_LOCKED),
                temporary: self.get(TEMPORARY),
                doomed: self.get(DOOMED),
                unwritten: self.get(UNWRITTEN),
            },
            self.get(OBJECTS),
            self.get(BYTES),
        )
    }

    /// What the counters must be for `entries`, counted from scratch.
    pub(super) fn recount<'a>(
        entries: impl Iterator<Item = &'a Entry>,
    ) -> (ObjectCounts, u64, u64) {
        let mut n = [0u64; COUNTERS];
        for e in entries {
            let t = Tally::of(e);
            for (i, c) in n.iter_mut().enumerate().take(FLAG_COUNTERS) {
                *c += u64::from(t.bits >> i & 1);
            }
            n[OBJECTS] += 1;
            n[BYTES] += t.bytes;
        }
        (
            ObjectCounts {
                ready: n[READY],
                write_reserved: n[WRITE_RESERVED],
                read_locked: n[READ_LOCKED],
                temporary: n[TEMPORARY],
                doomed: n[DOOMED],
                unwritten: n[UNWRITTEN],
            },
            n[OBJECTS],
            n[BYTES],
        )
    }
}

impl StorageCore {
    /// Moves one entry of shard `si` from `before` to `after` in the shard's counters. Caller
    /// holds shard `si`'s lock. A no-op when nothing counted changed (the common case for a
    /// recency refresh).
    pub(super) fn tally(&self, si: usize, before: Tally, after: Tally) {
        if before == after {
            return;
        }
        let t = &self.tallies[si];
        let changed = before.bits ^ after.bits;
        for i in 0..FLAG_COUNTERS {
            if changed >> i & 1 == 1 {
                let delta = if after.bits >> i & 1 == 1 {
                    1
                } else {
                    u64::MAX
                };
                t.bump(i, delta);
            }
        }
        if before.present != after.present {
            t.bump(OBJECTS, if after.present { 1 } else { u64::MAX });
        }
        if before.bytes != after.bytes {
            t.bump(BYTES, after.bytes.wrapping_sub(before.bytes));
        }
    }

    /// Objects by state, summed over the shards' counters: no shard lock, no gate. Each shard's
    /// figures are exact at some instant; the sum may be off by the operations in flight.
    pub fn counts(&self) -> ObjectCounts {
        let mut c = ObjectCounts::default();
        for t in self.tallies.iter() {
            let (s, _, _) = t.read();
            c.ready += s.ready;
            c.write_reserved += s.write_reserved;
            c.read_locked += s.read_locked;
            c.temporary += s.temporary;
            c.doomed += s.doomed;
            c.unwritten += s.unwritten;
        }
        c
    }

    /// Bytes in the slots of indexed objects (reserved or committed), summed over the shards'
    /// counters without any lock (see [`StorageCore::counts`]): between operations it equals
    /// [`StorageCore::used_bytes`], which takes the allocator's lock.
    pub fn slot_bytes(&self) -> u64 {
        self.tallied_totals().1
    }

    /// Objects and their slot bytes summed over the shards' counters (see [`StorageCore::counts`]).
    pub(super) fn tallied_totals(&self) -> (u64, u64) {
        self.tallies.iter().fold((0, 0), |(o, b), t| {
            let (_, objects, bytes) = t.read();
            (o + objects, b + bytes)
        })
    }
}
