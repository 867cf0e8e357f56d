//! The memcheck that never stops the hot path ([`StorageCore::memcheck_incremental`], what the
//! wire's MEMCHECK runs), the node-wide turn every memcheck takes, and the record STATUS shows.
//!
//! # What the incremental check proves
//!
//! It visits the index one shard at a time, holding only that shard's lock (and, for a bounded
//! number of slots at once, the allocator's), and pauses between shards. Objects never change
//! shards (a key's shard is a function of the key), but between two shard visits objects are
//! created, freed and their slots reused elsewhere, so each proof holds at the instant of its own
//! step:
//!
//! * **Per shard, exact at the visit:** write reservations hold no read locks; the recency lists
//!   hold exactly the evictable entries; every key is in its own shard; the shard's counters equal
//!   a recount; no two of its entries share or overlap a slot; every one of its slots is a live
//!   allocation in the allocator (checked while the shard's lock is held, so none of them can be
//!   freed meanwhile).
//! * **The allocator's own structures**, exact under its lock.
//! * **Totals at one instant:** with the write gate held for a moment (no batch in flight, so no
//!   slot is between its allocation and its index entry), the allocator's live slots and bytes
//!   equal the objects and bytes the shards' counters hold and the core's object counter.
//!
//! Together these catch a leaked slot (allocated, in no entry: the totals differ), a slot held by
//! two entries (the totals differ the other way, or the shard's own overlap check fires) and any
//! entry naming memory the allocator does not hold. What it cannot prove: that no two entries of
//! *different* shards share a slot while, at the same instant, another slot of exactly the same
//! size has leaked (the totals then agree); and it reports per-shard figures taken at different
//! instants. [`StorageCore::memcheck`] (stop-the-world, for tests and the simulator) proves all of
//! it on one snapshot.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};
use serde::Serialize;

use super::{MemcheckReport, StorageCore, INDEX_SHARDS};
use crate::storage::allocator::Slot;

/// Most problems one check reports (a line saying how many more were found follows them):
/// bounds the reply of a check on a badly broken index.
pub const MEMCHECK_MAX_PROBLEMS: usize = 64;
/// Slots checked against the allocator per hold of its lock.
const ALLOC_CHECK_CHUNK: usize = 256;
/// After each shard the check pauses as long as the shard took (at most this long), so it holds
/// each lock at most about half of the time even when a client runs it in a loop.
const MAX_PACE: Duration = Duration::from_millis(10);
/// Shards checked faster than this are followed by a yield instead of a pause.
const MIN_PACE: Duration = Duration::from_micros(50);
/// How long one try waits for the write gate (the totals' instant) ...
const GATE_WAIT: Duration = Duration::from_millis(20);
/// ... and how many tries the check makes before it reports the totals unchecked.
const GATE_TRIES: u32 = 5;

/// Problems found by a check, at most [`MEMCHECK_MAX_PROBLEMS`] kept. Invariant: `omitted`
/// counts the problems found beyond the cap.
#[derive(Debug, Default)]
pub(super) struct Problems {
    list: Vec<String>,
    omitted: u64,
}

impl Problems {
    /// Records a problem (kept if fewer than the cap are kept).
    pub(super) fn push(&mut self, p: String) {
        if self.list.len() < MEMCHECK_MAX_PROBLEMS {
            self.list.push(p);
        } else {
            self.omitted += 1;
        }
    }

    /// The problems, with a last line counting those beyond the cap.
    pub(super) fn into_vec(mut self) -> Vec<String> {
        if self.omitted > 0 {
            self.list.push(format!(
                "... and {} more problems (at most {MEMCHECK_MAX_PROBLEMS} are listed)",
                self.omitted
            ));
        }
        self.list
    }
}

/// The last finished check, as STATUS shows it.
#[derive(Debug, Clone)]
struct LastCheck {
    ok: bool,
    problems: Vec<String>,
    at_ms: u64,
}

/// One memcheck at a time node-wide, and the outcome of the last. Invariant: `running` is true
/// only while a [`CheckTurn`] exists (from its start until its outcome is recorded); `runs`
/// counts recorded outcomes.
#[derive(Default)]
pub(super) struct CheckRecord {
    turn: Mutex<()>,
    running: AtomicBool,
    runs: AtomicU64,
    last: Mutex<Option<LastCheck>>,
}

/// The right to run a memcheck (others wait for it); dropping it ends the run.
pub(super) struct CheckTurn<'a> {
    record: &'a CheckRecord,
    _turn: MutexGuard<'a, ()>,
}

impl Drop for CheckTurn<'_> {
    fn drop(&mut self) {
        self.record.running.store(false, Ordering::Release);
    }
}

impl CheckRecord {
    /// Waits for the node's memcheck turn (one check at a time: a second caller waits for the
    /// first to finish, so checks never pile up on the index's locks).
    pub(super) fn begin(&self) -> CheckTurn<'_> {
        let turn = self.turn.lock();
        self.running.store(true, Ordering::Release);
        CheckTurn {
            record: self,
            _turn: turn,
        }
    }

    /// Records `r` as the last outcome (at `now_ms`) and ends the run: STATUS sees `running`
    /// turn false before `runs` counts the run, so two STATUS reports that both say `running`
    /// with the same `runs` saw one and the same check. Caller holds the turn.
    fn finish(&self, r: &MemcheckReport, now_ms: u64) {
        *self.last.lock() = Some(LastCheck {
            ok: r.ok,
            problems: r.problems.clone(),
            at_ms: now_ms,
        });
        self.running.store(false, Ordering::Release);
        self.runs.fetch_add(1, Ordering::Release);
    }
}

/// The memcheck part of STATUS: STATUS never runs a check itself, it shows the last one.
#[derive(Debug, Clone, Serialize)]
pub struct MemcheckStatus {
    /// Whether a check is running now.
    pub running: bool,
    /// Checks finished since start-up.
    pub runs: u64,
    /// Whether the last check found nothing wrong (true when none has run).
    pub last_ok: bool,
    /// What the last check found (STATUS shows it as `memcheck_problems`).
    #[serde(skip)]
    pub last_problems: Vec<String>,
    /// Milliseconds since the last check finished (`None`: none has run).
    pub last_age_ms: Option<u64>,
}

impl StorageCore {
    /// The memcheck record for STATUS: reads a few counters and the last outcome; runs nothing.
    pub fn memcheck_status(&self) -> MemcheckStatus {
        let last = self.checks.last.lock().clone();
        MemcheckStatus {
            running: self.checks.running.load(Ordering::Acquire),
            runs: self.checks.runs.load(Ordering::Relaxed),
            last_ok: last.as_ref().is_none_or(|l| l.ok),
            last_age_ms: last.as_ref().map(|l| self.now_ms().saturating_sub(l.at_ms)),
            last_problems: last.map(|l| l.problems).unwrap_or_default(),
        }
    }

    /// Runs `check` (a check of the core, plus whatever the caller adds to its report, e.g. the
    /// L2 index) under the node's memcheck turn, one check at a time (a second caller waits for
    /// the first), and records its outcome for STATUS.
    pub fn run_memcheck(&self, check: impl FnOnce() -> MemcheckReport) -> MemcheckReport {
        let _turn = self.checks.begin();
        let r = check();
        self.checks.finish(&r, self.now_ms());
        r
    }

    /// The check the wire's MEMCHECK runs: shard by shard, never holding more than one shard's
    /// lock, pausing between shards, with the write gate held only for a moment at the end (see
    /// the module docs for what it proves and what it cannot). Run it through
    /// [`StorageCore::run_memcheck`], so checks never overlap and STATUS sees the outcome.
    pub fn memcheck_incremental(&self) -> MemcheckReport {
        let mut problems = Problems::default();
        let (mut objects, mut index_bytes) = (0u64, 0u64);
        let mut slots: Vec<Slot> = Vec::new();
        for si in 0..INDEX_SHARDS {
            let started = Instant::now();
            {
                let shard = self.shards[si].lock();
                self.check_shard_locked(si, &shard, &mut problems);
                slots.clear();
                slots.extend(shard.map.values().map(|e| e.slot));
                objects += slots.len() as u64;
                index_bytes += slots.iter().map(|s| s.class_bytes).sum::<u64>();
                slots.sort_unstable_by_key(|s| s.offset);
                for w in slots.windows(2) {
                    if w[0].offset.saturating_add(w[0].class_bytes) > w[1].offset {
                        problems.push(format!(
                            "shard {si}: slots at offsets {} and {} overlap",
                            w[0].offset, w[1].offset
                        ));
                    }
                }
                // Shard -> allocator is the lock order; the shard's entries cannot be freed
                // while its lock is held, so a slot found not live is a real problem.
                for chunk in slots.chunks(ALLOC_CHECK_CHUNK) {
                    let alloc = self.alloc.lock();
                    for s in chunk.iter().filter(|s| !alloc.is_live(s)) {
                        problems.push(format!(
                            "shard {si}: the slot at offset {} ({} bytes) is not live in the allocator",
                            s.offset, s.class_bytes
                        ));
                    }
                }
            }
            pace(started.elapsed());
        }
        if let Err(e) = self.alloc.lock().check_structure() {
            problems.push(format!("allocator: {e}"));
        }
        let allocated_bytes = match self.check_totals(&mut problems) {
            Some((objs, bytes, allocated)) => {
                (objects, index_bytes) = (objs, bytes);
                allocated
            }
            None => self.used_bytes(),
        };
        let problems = problems.into_vec();
        MemcheckReport {
            ok: problems.is_empty(),
            objects,
            index_bytes,
            allocated_bytes,
            problems,
        }
    }

    /// Compares the totals at one instant (write gate held for a moment, no batch in flight):
    /// allocator live slots and bytes against the shards' counters and the object counter.
    /// Returns (objects, index bytes, allocated bytes), or `None` when the gate stayed busy
    /// through every try (the totals are then left unchecked, and the log says so).
    fn check_totals(&self, problems: &mut Problems) -> Option<(u64, u64, u64)> {
        for _ in 0..GATE_TRIES {
            let Some(_g) = self.gate.try_write_for(GATE_WAIT) else {
                std::thread::sleep(GATE_WAIT);
                continue;
            };
            let (objects, bytes) = self.tallied_totals();
            let counter = self.object_count.load(Ordering::Relaxed);
            let alloc = self.alloc.lock();
            let (live, allocated) = (alloc.live_slots() as u64, alloc.allocated_bytes());
            drop(alloc);
            if allocated != bytes {
                problems.push(format!(
                    "allocator holds {allocated} bytes, index accounts for {bytes}"
                ));
            }
            if live != objects {
                problems.push(format!(
                    "allocator holds {live} slots, the index {objects} objects"
                ));
            }
            if counter != objects {
                problems.push(format!(
                    "object counter {counter} != {objects} objects in the index"
                ));
            }
            return Some((objects, bytes, allocated));
        }
        tracing::warn!(
            tries = GATE_TRIES,
            wait_ms = GATE_WAIT.as_millis() as u64,
            "memcheck: storage stayed busy; allocator totals left unchecked this time"
        );
        None
    }
}

/// The pause after a shard step that took `took`.
fn pace(took: Duration) {
    if took < MIN_PACE {
        std::thread::yield_now();
    } else {
        std::thread::sleep(took.min(MAX_PACE));
    }
}
