//! [`L2Tier`]: opening and recovering the data file, write-behind batches (pool slot -> disk with
//! no copy), prefetch loads (disk -> a fresh L1 slot, checksum verified before publication), and
//! clearing.
//!
//! Headers are staged in a small node-private area at the end of the pool (clients never get
//! offsets there), so every I/O, header or payload, goes through the registered pool buffers.
//!
//! * `mod.rs`: the type, its counters and STATUS, block I/O through the staging area, CLEAR.
//! * `open.rs`: judging, sizing and opening a device; formatting it or recovering it.
//! * `recover.rs`: rebuilding the index from extent tables or slot headers.
//! * `write.rs`: write-behind batches. `sync.rs`: fdatasync and deferred stores.
//! * `load.rs`: loads into L1. `checkpoint.rs`: the clean stop's extent tables.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use kvnode_hw::{BlockEngine, BlockIo, HwError, SharedPool, BLOCK_ALIGN};
use parking_lot::Mutex;
use serde::Serialize;

use super::format::BLOCK;
use super::gate::ClearGate;
use super::identity::Identity;
use super::iowatch::IoWatch;
use super::space::L2Index;
use super::writer::WriteQueue;
use crate::config::WritePolicy;
use crate::error::{Error, ErrorKind, Result};
use crate::storage::StorageKey;

/// Bytes at the end of the pool reserved for staging headers (512 blocks of 4 KiB).
pub const STAGING_BYTES: u64 = 2 << 20;

mod checkpoint;
mod load;
mod open;
mod recover;
mod sync;
mod write;

pub use super::device::DATA_FILE;
pub use checkpoint::CheckpointStats;
pub use open::OpenFailure;
pub use sync::DEFERRED_MAX;
use sync::{Unsynced, SYNC_ALLOWANCE_BYTES};
#[cfg(test)]
pub(crate) use write::byte_bounded_parts;
pub(super) use write::WriteBatch;
pub use write::WRITE_BATCH_BYTES;

/// Header reads per batch at start-up (nothing else uses the staging area then).
const RECOVERY_READS: usize = 256;
const BLOCK_U64: u64 = BLOCK as u64;

/// Node-private 4 KiB blocks of the pool used to stage headers. Invariant: every block is in
/// `free` or held by exactly one caller between `take` and `give`.
struct Staging {
    free: Mutex<Vec<u64>>,
}

impl Staging {
    fn new(base: u64, bytes: u64) -> Staging {
        Staging {
            free: Mutex::new(
                (0..bytes / BLOCK_U64)
                    .map(|i| base + i * BLOCK_U64)
                    .collect(),
            ),
        }
    }

    /// Up to `n` blocks (fewer when others hold them).
    fn take(&self, n: usize) -> Vec<u64> {
        let mut f = self.free.lock();
        let k = n.min(f.len());
        let at = f.len() - k;
        f.split_off(at)
    }

    fn give(&self, blocks: Vec<u64>) {
        self.free.lock().extend(blocks);
    }
}

/// Counts one write-behind batch in [`L2Tier`]'s `writes_in_flight` from its start to its drop.
pub(super) struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        InFlight(count)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counters reported in STATUS. Invariant: monotonic.
#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    writes: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    errors: AtomicU64,
    corrupt: AtomicU64,
    torn: AtomicU64,
    evictions: AtomicU64,
    skipped: AtomicU64,
    stalled: AtomicU64,
}

/// The `l2` object of STATUS. Field names are a public contract.
#[derive(Debug, Clone, Serialize)]
pub struct L2Status {
    /// Data file or device in use.
    pub path: String,
    /// Block engine: `uring` or `pread`.
    pub engine: &'static str,
    /// `always` or `on-evict`.
    pub write_policy: &'static str,
    /// Size of the data file (or the part of the device) in use.
    pub bytes: u64,
    /// Bytes of slots holding or receiving objects.
    pub used_bytes: u64,
    /// Objects readable from L2.
    pub objects: u64,
    /// Objects loaded from L2 into L1 (prefetch hits).
    pub hits: u64,
    /// Objects written to L2.
    pub writes: u64,
    /// Device errors (ENOSPC, EIO, short transfers); each dropped its object from L2.
    pub errors: u64,
    /// Objects whose payload failed its checksum when loaded although the tier stopped cleanly
    /// since they were written: the medium changed them (dropped, never served).
    pub corrupt: u64,
    /// Objects written before an unclean stop (crash, power loss) whose payload failed its
    /// checksum when loaded: torn or overwritten by a reused slot at that stop (dropped, never
    /// served).
    pub torn: u64,
    /// Objects evicted from L2 to make room.
    pub evictions: u64,
    /// Objects not written: write-behind queue full, too large for an extent, or no space.
    pub skipped: u64,
    /// Payload bytes written.
    pub bytes_written: u64,
    /// Payload bytes loaded.
    pub bytes_read: u64,
    /// Objects found on disk at start-up.
    pub recovered: u64,
    /// Whether the tier had been stopped cleanly (a checkpoint): start-up read the extent
    /// tables, not every slot header.
    pub clean_start: bool,
    /// Blocks read at start-up to rebuild the index (extent headers, tables, slot headers).
    pub startup_blocks_read: u64,
    /// Milliseconds the start-up took to open the device, judge it, start its engines
    /// (registering the pool with io_uring) and rebuild the index.
    pub startup_ms: u64,
    /// Milliseconds of that spent rebuilding the index (reading tables or headers).
    pub recovery_ms: u64,
    /// Objects waiting in the write-behind queue.
    pub queued: usize,
    /// Extent size on disk.
    pub extent_bytes: u64,
    /// Memory charged to the in-memory index now (an upper bound: the geometry's share plus a
    /// worst case per object); at most `index_limit_bytes`.
    pub index_bytes: u64,
    /// The index's memory limit, `l2.max_index_bytes`.
    pub index_limit_bytes: u64,
    /// Most objects the index holds (derived from `index_limit_bytes`); at the cap, storing an
    /// object evicts the least recently used one.
    pub index_max_objects: u64,
    /// Objects found on disk at start-up but not indexed because of the cap (their slots are
    /// reused).
    pub unindexed: u64,
    /// Objects not loaded because the device had not answered within `l2.io_timeout_ms`
    /// (missed at once, or given up on by the request that asked).
    pub stalled: u64,
    /// Milliseconds the oldest device call in progress has been running (0 when none is).
    pub stuck_ms: u64,
    /// Whether a device call has run past `l2.io_timeout_ms` (the tier is degraded: loads miss,
    /// writes wait).
    pub stuck: bool,
    /// Whether a CLEAR's new format id is still waiting to be written (until it is, a restart
    /// would bring the cleared objects back).
    pub format_pending: bool,
}

/// The L2 tier. Invariants: an object is readable from L2 only after both its header and its
/// payload were written successfully; a payload is published into L1 only after its checksum
/// matched; a slot being written or loaded is never reused (the index pins it); the data file is
/// flocked by this node for its whole life.
pub struct L2Tier {
    write_engine: Box<dyn BlockEngine>,
    read_engine: Box<dyn BlockEngine>,
    pool: Arc<SharedPool>,
    staging: Staging,
    index: Mutex<L2Index<StorageKey>>,
    file_bytes: u64,
    extent_bytes: u64,
    /// The superblock in force and the sequence numbers and epochs leased under it.
    identity: Identity,
    /// Objects being loaded, node-wide: shared by every device of a set.
    prefetching: parking_lot::RwLock<Arc<AtomicUsize>>,
    max_prefetch: usize,
    batch_objects: usize,
    counters: Counters,
    recovered: u64,
    /// What the start-up read.
    startup: recover::RecoveryReads,
    /// How long opening took (device, superblock, index), in milliseconds.
    startup_ms: u64,
    /// How long rebuilding the index took, in milliseconds.
    recovery_ms: u64,
    /// Set by [`L2Tier::checkpoint`]: no object is written any more.
    sealed: AtomicBool,
    /// Write-behind batches between their start (inside the CLEAR gate) and their end:
    /// [`L2Tier::checkpoint`] waits for none to be left.
    writes_in_flight: AtomicUsize,
    /// One bit per extent whose on-disk header may describe an assignment under the format in
    /// force (found valid at start-up, or written by this run): the extents a checkpoint must
    /// zero when they are free in memory.
    headed: Mutex<Vec<u64>>,
    path: PathBuf,
    policy: WritePolicy,
    /// Write-behind queue (drained by the writer thread).
    pub queue: WriteQueue,
    /// Objects committed since the last successful `fdatasync` (in commit order), each with the
    /// slot it was written to: dropped from the index if the next sync fails. Bounded by what
    /// one sync period writes; syncs are serialised by `sync_lock`.
    unsynced: Mutex<Unsynced>,
    sync_lock: Mutex<()>,
    /// Keys whose write found an older entry of the same key still busy (being loaded or
    /// written, and doomed): written when the writer next finds its queue empty. At most
    /// [`DEFERRED_MAX`]; beyond, counted as skipped.
    deferred: Mutex<Vec<StorageKey>>,
    /// Held shared by every write-behind batch and load, exclusively by CLEAR: an object locked
    /// or pinned before a CLEAR can never be written or published after it.
    clear_gate: ClearGate,
    /// Device calls in progress, and how long one may take before the tier counts as stuck.
    io: Arc<IoWatch>,
    io_timeout: std::time::Duration,
    _lock: File,
}

fn hw(context: &str) -> impl FnOnce(HwError) -> Error + '_ {
    move |e| Error::from(e).context(context)
}

fn round_block(n: u64) -> u64 {
    n.div_ceil(BLOCK_ALIGN) * BLOCK_ALIGN
}

/// Rings of the read engine: loads from different request threads run side by side.
const READ_RINGS: usize = 4;

/// Whether the L2 copy `l` is the object of length `len` committed under layout fingerprint
/// `layout` (0 = unknown: any copy of that length).
fn same_object(l: &super::space::Located, len: u64, layout: u64) -> bool {
    l.object_len == len && (layout == 0 || l.layout == layout)
}

impl L2Tier {
    /// Writes one block at `file_offset` and syncs (superblock copies).
    fn write_durable(&self, file_offset: u64, block: &[u8]) -> Result<()> {
        self.write_blocks(&[(file_offset, block.to_vec())])
            .pop()
            .expect("one block")?;
        let synced = {
            let _call = self.io.start(SYNC_ALLOWANCE_BYTES);
            self.write_engine.sync()
        };
        synced.map_err(|e| {
            // The failed sync may have lost any write since the last good one.
            self.drop_unsynced();
            hw("syncing the L2 superblock")(e)
        })
    }

    /// Runs `f` on parts of at most `per_call` items, each with as many staging blocks as items, and
    /// collects its per-item results; a part that finds the staging area short (cannot happen
    /// with one writer) gets `LimitExceeded` for each item.
    fn staged<I, R>(
        &self,
        items: &[I],
        per_call: usize,
        f: impl Fn(&[I], &[u64]) -> Vec<Result<R>>,
    ) -> Vec<Result<R>> {
        let mut out = Vec::with_capacity(items.len());
        for part in items.chunks(per_call.max(1)) {
            if self.io.abandoned() {
                // Left out at start-up: its staging blocks may be the clients' now, and the
                // node reported the device failed; nothing more is read or written.
                out.extend(part.iter().map(|_| {
                    Err(Error::new(
                        ErrorKind::Io,
                        "the L2 device was left out at start-up: no more I/O",
                    ))
                }));
                continue;
            }
            let blocks = self.staging.take(part.len());
            if blocks.len() == part.len() {
                out.extend(f(part, &blocks));
            } else {
                out.extend(part.iter().map(|_| {
                    Err(Error::new(
                        ErrorKind::LimitExceeded,
                        "L2 staging area exhausted",
                    ))
                }));
            }
            self.staging.give(blocks);
        }
        out
    }

    /// Reads 4 KiB blocks at `file_offsets` through the staging area.
    fn read_blocks(&self, file_offsets: &[u64], per_call: usize) -> Vec<Result<Vec<u8>>> {
        self.staged(file_offsets, per_call, |part, blocks| {
            let ios: Vec<BlockIo> = part
                .iter()
                .zip(blocks)
                .map(|(&f, &b)| BlockIo {
                    pool_offset: b,
                    file_offset: f,
                    len: BLOCK_U64,
                })
                .collect();
            let done = {
                let _call = self.io.start(ios.iter().map(|io| io.len).sum());
                self.read_engine.read_batch(&ios)
            };
            done.into_iter()
                .zip(blocks)
                .map(|(r, &b)| {
                    r.map_err(hw("reading an L2 header"))?;
                    let mut buf = vec![0u8; BLOCK];
                    self.pool.region().read_at(b, &mut buf)?;
                    Ok(buf)
                })
                .collect()
        })
    }

    /// Writes 4 KiB blocks `(file_offset, bytes)` through the staging area.
    fn write_blocks(&self, items: &[(u64, Vec<u8>)]) -> Vec<Result<()>> {
        self.staged(items, 64, |part, blocks| {
            let mut ios = Vec::with_capacity(part.len());
            for ((f, bytes), &b) in part.iter().zip(blocks) {
                self.pool
                    .region()
                    .write_at(b, bytes)
                    .expect("staging block in the pool");
                ios.push(BlockIo {
                    pool_offset: b,
                    file_offset: *f,
                    len: BLOCK_U64,
                });
            }
            let done = {
                let _call = self.io.start(ios.iter().map(|io| io.len).sum());
                self.write_engine.write_batch(&ios)
            };
            done.into_iter()
                .map(|r| r.map(|_| ()).map_err(hw("writing an L2 header")))
                .collect()
        })
    }

    /// The write policy in force.
    pub fn policy(&self) -> WritePolicy {
        self.policy
    }

    /// Whether `key` is readable from L2.
    pub fn contains(&self, key: &StorageKey) -> bool {
        self.index.lock().contains(key)
    }

    /// Whether L2 holds `key` as the object of length `len` committed under layout fingerprint
    /// `layout` (0 = unknown: any copy of that length), i.e. writing it again would add nothing.
    pub fn holds_as(&self, key: &StorageKey, len: u64, layout: u64) -> bool {
        self.held_as(std::slice::from_ref(key), len, layout)[0]
    }

    /// [`L2Tier::holds_as`] for each of `keys` under one index lock.
    pub fn held_as(&self, keys: &[StorageKey], len: u64, layout: u64) -> Vec<bool> {
        let index = self.index.lock();
        keys.iter()
            .map(|k| index.get(k).is_some_and(|l| same_object(&l, len, layout)))
            .collect()
    }

    /// Objects per write batch.
    pub fn batch_objects(&self) -> usize {
        self.batch_objects
    }

    /// CLEAR of both tiers, in memory: runs `clear_l1`, empties the index and puts a new format
    /// id in force, inside the CLEAR gate. Write-behind batches and loads are in the gate only
    /// while they lock, pin and reserve (never during their I/O), so this waits for no device:
    /// nothing locked, pinned or reserved before it is written, committed or published after it
    /// (its index entries and L1 reservations are doomed, its headers carry the old format id).
    /// The CLEAR is durable only once [`L2Tier::persist_format`] has written the new id.
    /// Returns `clear_l1`'s result and (removed, deferred).
    pub fn clear_in_memory<T>(&self, clear_l1: impl FnOnce() -> T) -> (T, (u64, u64)) {
        self.clear_gate.exclusive(|| {
            let l1 = clear_l1();
            let r = self.index.lock().clear();
            self.identity.begin_reformat();
            (l1, r)
        })
    }

    /// Writes the format id in force durably (the second half of a CLEAR). Blocks while the
    /// device does; callers that must not block run it on an I/O thread (see [`super::loader`]).
    pub fn persist_format(&self) -> Result<()> {
        self.identity
            .persist_format(&|o, b| self.write_durable(o, b))
            .map_err(|e| {
                e.context(
                    "L2 emptied in memory, but the new format id was not written: cleared \
                     objects may reappear after a restart",
                )
            })
    }

    /// Whether a CLEAR's new format id is not durable yet.
    pub fn format_pending(&self) -> bool {
        self.identity.format_pending()
    }

    /// [`L2Tier::clear_in_memory`] then [`L2Tier::persist_format`] on this thread.
    pub fn clear_with<T>(&self, clear_l1: impl FnOnce() -> T) -> Result<(T, (u64, u64))> {
        let (l1, r) = self.clear_in_memory(clear_l1);
        self.persist_format()?;
        Ok((l1, r))
    }

    /// How long the oldest device call in progress has been running.
    pub fn stuck_for(&self) -> std::time::Duration {
        self.io.oldest()
    }

    /// Whether a device call has been running longer than `l2.io_timeout_ms` plus the time its
    /// bytes take at [`super::iowatch::SLOWEST_RATE`]: loads then miss at once and persisting
    /// writes nothing, until the device answers again.
    pub fn stuck(&self) -> bool {
        self.io.overdue(self.io_timeout)
    }

    /// `l2.io_timeout_ms`.
    pub fn io_timeout(&self) -> std::time::Duration {
        self.io_timeout
    }

    /// Counts `n` loads given up on because the device did not answer in time.
    pub(super) fn count_stalled(&self, n: u64) {
        self.counters.stalled.fetch_add(n, Ordering::Relaxed);
    }

    /// Releases the engines' pool registrations (shutdown, after the final drain): the pool's
    /// hugepages are then free as soon as the process exits, so a restart gets them again.
    pub fn release(&self) {
        self.write_engine.release();
        self.read_engine.release();
    }

    /// Adds the namespace of every key this device holds (any state) to `out`.
    pub fn namespaces_in_use(
        &self,
        out: &mut std::collections::HashSet<crate::storage::NamespaceId>,
    ) {
        out.extend(self.index.lock().keys().map(|k| k.namespace));
    }

    /// Index invariant check (part of MEMCHECK).
    pub fn check(&self) -> std::result::Result<(), String> {
        self.index.lock().check()
    }

    /// Usable bytes of this device (its data file, or its share of a block device).
    pub fn bytes(&self) -> u64 {
        self.file_bytes
    }

    /// The STATUS object.
    pub fn status(&self) -> L2Status {
        let s = self.index.lock().stats();
        let c = &self.counters;
        L2Status {
            path: self.path.display().to_string(),
            engine: self.write_engine.kind().as_str(),
            write_policy: self.policy.as_str(),
            bytes: self.file_bytes,
            used_bytes: s.used_bytes,
            objects: s.objects,
            hits: c.hits.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            torn: c.torn.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed) + self.queue.dropped(),
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            recovered: self.recovered,
            clean_start: self.identity.opened_checkpoint() != 0,
            startup_blocks_read: self.startup.blocks,
            startup_ms: self.startup_ms,
            recovery_ms: self.recovery_ms,
            queued: self.queue.len(),
            extent_bytes: self.extent_bytes,
            index_bytes: s.index_bytes,
            index_limit_bytes: s.index_limit_bytes,
            index_max_objects: s.max_entries,
            unindexed: s.unindexed,
            stalled: c.stalled.load(Ordering::Relaxed),
            stuck_ms: self.io.oldest().as_millis() as u64,
            stuck: self.stuck(),
            format_pending: self.identity.format_pending(),
        }
    }

    /// Records that extent `e`'s on-disk header may describe an assignment under the format in
    /// force (see `headed`).
    fn mark_headed(&self, e: u32) {
        let mut bits = self.headed.lock();
        if let Some(w) = bits.get_mut(e as usize / 64) {
            *w |= 1 << (e % 64);
        }
    }

    /// Whether extent `e` may hold a valid header (see `headed`).
    fn is_headed(&self, e: u32) -> bool {
        self.headed
            .lock()
            .get(e as usize / 64)
            .is_some_and(|w| w & (1 << (e % 64)) != 0)
    }

    /// Where `key`'s visible entry lies, and what it records (the simulator's checks).
    pub fn located(&self, key: &StorageKey) -> Option<super::space::Located> {
        self.index.lock().get(key)
    }

    /// Pins `key`'s L2 entry as a load does (tests).
    #[cfg(test)]
    pub(super) fn pin_for_tests(&self, key: &StorageKey) -> Option<super::space::SlotRef> {
        self.index.lock().pin(key).map(|l| l.slot)
    }

    /// Drops a pin taken by [`L2Tier::pin_for_tests`].
    #[cfg(test)]
    pub(super) fn unpin_for_tests(&self, key: &StorageKey, slot: super::space::SlotRef) {
        self.index.lock().unpin(key, slot).unwrap();
    }

    /// Staging blocks not in use (all of them whenever no I/O is running).
    pub fn staging_free(&self) -> usize {
        self.staging.free.lock().len()
    }
}
