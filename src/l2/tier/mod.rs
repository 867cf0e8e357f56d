//! [`L2Tier`]: opening and recovering the data file, write-behind batches (pool slot -> disk with
//! no copy), prefetch loads (disk -> a fresh L1 slot, checksum verified before publication), and
//! clearing.
//!
//! Headers are staged in a small node-private area at the end of the pool (clients never get
//! offsets there), so every I/O, header or payload, goes through the registered pool buffers.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use kvnode_hw::{BlockEngine, BlockIo, EngineKind, HwError, SharedPool, BLOCK_ALIGN};
use parking_lot::Mutex;
use serde::Serialize;

use super::format::{
    default_extent_bytes, extent_count, extent_offset, payload_checksum, ExtentHeader, SlotHeader,
    Superblock, BLOCK,
};
use super::gate::{ClearGate, GateToken};
use super::identity::Identity;
use super::iowatch::IoWatch;
use super::space::{L2Index, ReserveError};
use super::writer::WriteQueue;
use crate::config::{L2Config, WritePolicy};
use crate::error::{Error, ErrorKind, Result};
use crate::storage::{Grant, KeyError, Layout, Namespaces, StorageCore, StorageKey};

/// Bytes at the end of the pool reserved for staging headers (512 blocks of 4 KiB).
pub const STAGING_BYTES: u64 = 2 << 20;

mod checkpoint;
mod recover;

pub use checkpoint::CheckpointStats;
/// Header reads per batch at start-up (nothing else uses the staging area then).
const RECOVERY_READS: usize = 256;
pub use super::device::DATA_FILE;

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
    /// Milliseconds the start-up took to open the device, judge it and rebuild the index.
    pub startup_ms: u64,
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

/// Why a device could not be opened. Invariant: `Refused` for what the operator must change
/// (another program's data, a device in use, a size or configuration that does not fit);
/// `Failed` for a device that did not read or write (the node runs without it).
#[derive(Debug)]
pub enum OpenFailure {
    /// Refused: the node must not start.
    Refused(Error),
    /// The device failed: the node can run without it.
    Failed(Error),
}

impl OpenFailure {
    /// The error, whichever kind of failure.
    pub fn into_error(self) -> Error {
        match self {
            OpenFailure::Refused(e) | OpenFailure::Failed(e) => e,
        }
    }
}

impl From<Error> for OpenFailure {
    fn from(e: Error) -> Self {
        OpenFailure::Refused(e)
    }
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
    /// Set by [`L2Tier::checkpoint`]: no object is written any more.
    sealed: AtomicBool,
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
    io: IoWatch,
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

/// The block engine for one role: `rings` io_uring rings (the writer has one I/O thread, loads
/// come from many request threads), or the pread engine when asked for or, with `auto`, when
/// io_uring is unavailable.
fn make_engine(
    kind: Option<EngineKind>,
    pool: &Arc<SharedPool>,
    file: &File,
    cfg: &L2Config,
    queue_depth: u32,
    rings: usize,
) -> Result<Box<dyn BlockEngine>> {
    let dup = || {
        file.try_clone().map_err(|e| {
            Error::from(HwError::Os {
                op: "dup",
                source: e,
            })
        })
    };
    if kind != Some(EngineKind::Pread) {
        // SQPOLL if asked for, else (or if the kernel refuses it) plain io_uring.
        let modes: &[bool] = if cfg.sqpoll { &[true, false] } else { &[false] };
        let mut last = None;
        for &sqpoll in modes {
            match kvnode_hw::UringEngine::with_rings(
                pool.clone(),
                dup()?,
                queue_depth,
                sqpoll,
                rings,
            ) {
                Ok(e) => return Ok(Box::new(e)),
                Err(e) => {
                    tracing::warn!(error = %e, sqpoll, "io_uring ring setup failed");
                    last = Some(e);
                }
            }
        }
        if let (Some(e), Some(_)) = (last, kind) {
            return Err(hw("starting the io_uring L2 engine")(e));
        }
        tracing::warn!("io_uring block engine unavailable, using pread");
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(4);
    Ok(Box::new(
        kvnode_hw::PreadEngine::new(pool.clone(), dup()?, threads)
            .map_err(hw("starting the pread L2 engine"))?,
    ))
}

/// Whether the L2 copy `l` is the object of length `len` committed under layout fingerprint
/// `layout` (0 = unknown: any copy of that length).
fn same_object(l: &super::space::Located, len: u64, layout: u64) -> bool {
    l.object_len == len && (layout == 0 || l.layout == layout)
}

/// Whether an L2 object can be served under `layout`: same size, and the same layout if one
/// was recorded (objects written while the model had no registered layout carry 0).
fn layout_matches(layout: &Layout, l: &super::space::Located) -> bool {
    l.object_len == layout.object_bytes() && (l.layout == 0 || l.layout == layout.fingerprint())
}

/// Payload bytes per write batch at most (besides `l2.batch_objects`): batch k+1 is locked and
/// checksummed while batch k is on the disk, which only overlaps when one batch is a small part
/// of the work (64 objects of 32 MiB would be one 2 GiB batch, checksummed before any of it is
/// written).
pub const WRITE_BATCH_BYTES: u64 = 128 << 20;

/// What an fdatasync is granted beyond `l2.io_timeout_ms` before the device counts as stuck:
/// the time to move this many bytes at [`super::iowatch::SLOWEST_RATE`] (a full write batch).
const SYNC_ALLOWANCE_BYTES: u64 = WRITE_BATCH_BYTES;

/// Objects written since the last good fdatasync, and how many fdatasyncs have failed.
/// Invariant: `objects` in commit order; `failed_syncs` only grows, and a batch whose I/O
/// overlapped a failure (the count moved) commits nothing.
#[derive(Default)]
struct Unsynced {
    objects: Vec<(StorageKey, super::space::SlotRef)>,
    failed_syncs: u64,
}

/// Most keys waiting for an older, busy entry of the same key to go (see `L2Tier::deferred`).
pub const DEFERRED_MAX: usize = 4096;

/// Splits `keys` into consecutive parts of at most `max_objects` keys whose lengths (`len_of`)
/// reach at most [`WRITE_BATCH_BYTES`] (a part ends with the key that reaches it; every part
/// holds at least one key).
pub(crate) fn byte_bounded_parts<'k>(
    keys: &'k [StorageKey],
    max_objects: usize,
    len_of: &dyn Fn(&StorageKey) -> u64,
) -> Vec<&'k [StorageKey]> {
    let mut parts = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, k) in keys.iter().enumerate() {
        bytes += len_of(k);
        if i + 1 - start >= max_objects.max(1) || bytes >= WRITE_BATCH_BYTES {
            parts.push(&keys[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < keys.len() {
        parts.push(&keys[start..]);
    }
    parts
}

/// How long a load waits, in all, for keys another request is loading or storing into L1.
#[cfg(not(test))]
const WAIT_CONTENDED: std::time::Duration = std::time::Duration::from_secs(2);
/// Unit tests share two cores with stress tests: a starved loader must not fail them.
#[cfg(test)]
const WAIT_CONTENDED: std::time::Duration = std::time::Duration::from_secs(20);

/// Waits until `deadline` for a key that another request is loading or storing into L1 to
/// become readable, then takes `1 + extra` read locks on it. `None` if it vanished or time ran
/// out.
fn wait_readable(
    storage: &StorageCore,
    key: &StorageKey,
    extra: u32,
    deadline: std::time::Instant,
) -> Option<u64> {
    let mut pause = std::time::Duration::from_micros(50);
    loop {
        match storage
            .reserve_read(std::slice::from_ref(key), extra)
            .pop()?
        {
            Ok(g) => return Some(g.lease),
            Err(KeyError::KeyNotReadable) if std::time::Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(5));
            }
            Err(_) => return None,
        }
    }
}

/// What a load holds while its I/O runs: the prefetch budget, the L2 pins, the L1 reservations
/// not yet published or aborted, and (until its reservations are made, never across I/O) its
/// place in the CLEAR gate. All of it is given back on
/// drop, on the normal path and if a bug panics mid-load, so nothing stays pinned or reserved
/// (the reservations never expire by themselves).
struct LoadGuard<'a> {
    tier: &'a L2Tier,
    storage: &'a StorageCore,
    keys: &'a [StorageKey],
    budget: usize,
    pinned: Vec<Option<super::space::Located>>,
    grants: Vec<Option<Grant>>,
    gate: Option<GateToken<'a>>,
}

impl Drop for LoadGuard<'_> {
    fn drop(&mut self) {
        for (k, g) in self.keys.iter().zip(&mut self.grants) {
            if let Some(g) = g.take() {
                self.storage.abort_write(&[(*k, g)]);
            }
        }
        {
            let mut index = self.tier.index.lock();
            for (k, l) in self.keys.iter().zip(&self.pinned) {
                if let Some(l) = l {
                    let _ = index.unpin(k, l.slot);
                }
            }
        }
        self.tier
            .prefetch_budget()
            .fetch_sub(self.budget, Ordering::AcqRel);
    }
}

/// A planned write-behind batch: the L1 I/O holds it keeps on its objects, the objects, their I/Os (header
/// then payload, per object) and the staging blocks of the headers. Invariant: every lock and
/// block is released by `complete_write`, exactly once. The batch was planned inside the CLEAR
/// gate but holds no place in it during its I/O: a CLEAR meanwhile dooms its index entries
/// (never committed) and its headers carry the format id the CLEAR replaced.
pub(super) struct WriteBatch<'a> {
    tier: &'a L2Tier,
    storage: &'a StorageCore,
    locked: Vec<(StorageKey, Grant)>,
    plans: Vec<PlannedWrite>,
    ios: Vec<BlockIo>,
    blocks: Vec<u64>,
}

impl Drop for WriteBatch<'_> {
    /// Only does something when the batch was never completed (a bug panicked, or the thread
    /// meant to complete it is gone): its objects are not written, their L2 slots, staging
    /// blocks and L1 locks are released.
    fn drop(&mut self) {
        if !self.plans.is_empty() {
            let mut index = self.tier.index.lock();
            for p in &self.plans {
                let _ = index.abort(p.key, p.slot);
            }
            self.tier
                .counters
                .errors
                .fetch_add(self.plans.len() as u64, Ordering::Relaxed);
        }
        self.tier.staging.give(std::mem::take(&mut self.blocks));
        self.storage.release_io_holds(&self.locked);
    }
}

/// One planned object write of a batch.
struct PlannedWrite {
    key: StorageKey,
    slot: super::space::SlotRef,
    checksum: u64,
    layout: u64,
    len: u64,
    extent_ok: bool,
}

impl L2Tier {
    /// Opens (creating if needed) the data file or device, takes its lock, starts the engines,
    /// and rebuilds the index from the on-disk headers (or formats an empty tier).
    /// `staging_base` is the pool offset of [`STAGING_BYTES`] reserved for the tier.
    /// Namespaces found on disk are interned into `namespaces`.
    pub fn open(
        cfg: &L2Config,
        path: &Path,
        pool: Arc<SharedPool>,
        staging_base: u64,
        namespaces: &Namespaces,
    ) -> Result<L2Tier> {
        Self::open_wrapped(cfg, path, pool, staging_base, namespaces, &|e| e)
    }

    /// [`L2Tier::open`] with each block engine passed through `wrap` (fault-injection tests).
    pub fn open_wrapped(
        cfg: &L2Config,
        path: &Path,
        pool: Arc<SharedPool>,
        staging_base: u64,
        namespaces: &Namespaces,
        wrap: &dyn Fn(Box<dyn BlockEngine>) -> Box<dyn BlockEngine>,
    ) -> Result<L2Tier> {
        Self::open_classified(cfg, path, pool, staging_base, namespaces, wrap)
            .map_err(OpenFailure::into_error)
    }

    /// [`L2Tier::open_wrapped`] telling a refusal (the node must not start) from a device that
    /// failed (it can run without it).
    pub fn open_classified(
        cfg: &L2Config,
        path: &Path,
        pool: Arc<SharedPool>,
        staging_base: u64,
        namespaces: &Namespaces,
        wrap: &dyn Fn(Box<dyn BlockEngine>) -> Box<dyn BlockEngine>,
    ) -> std::result::Result<L2Tier, OpenFailure> {
        let started = std::time::Instant::now();
        // Nothing is written and nothing is resized before the device was judged ours or empty.
        let mut dev = super::device::open(cfg, path)?;
        let found = super::device::identify(&dev).map_err(OpenFailure::Failed)?;
        let super::device::Accepted { previous, wipe } = super::device::accept(cfg, &dev, found)?;
        let file_bytes = dev.bytes;
        if !dev.block_device && dev.len > file_bytes {
            return Err(OpenFailure::Refused(Error::invalid(format!(
                "{} is {} bytes, larger than the {file_bytes} configured (l2.bytes / \
                 --l2-size); refusing to truncate it (pass the size the file was created with, \
                 or remove it)",
                dev.path.display(),
                dev.len
            ))));
        }
        let write_engine = wrap(make_engine(
            cfg.engine_kind()?,
            &pool,
            &dev.file,
            cfg,
            cfg.queue_depth,
            1,
        )?);
        let read_engine = wrap(make_engine(
            Some(write_engine.kind()),
            &pool,
            &dev.file,
            cfg,
            cfg.read_queue_depth,
            READ_RINGS,
        )?);
        let same_geometry = |sb: &Superblock| {
            sb.file_bytes == file_bytes
                && (cfg.extent_bytes == 0 || cfg.extent_bytes == sb.extent_bytes)
        };
        let extent_bytes = match &previous {
            Some(sb) if same_geometry(sb) => sb.extent_bytes,
            _ if cfg.extent_bytes > 0 => cfg.extent_bytes,
            _ => default_extent_bytes(file_bytes),
        };
        if extent_bytes == 0
            || !extent_bytes.is_multiple_of(2 << 20)
            || extent_count(file_bytes, extent_bytes) == 0
        {
            return Err(OpenFailure::Refused(Error::invalid(format!(
                "L2 size {file_bytes} bytes is too small for one extent of {extent_bytes} bytes \
                 (need at least {} bytes; extents are multiples of 2 MiB)",
                super::format::EXTENT_BASE + extent_bytes.max(2 << 20)
            ))));
        }
        let mut tier = L2Tier {
            write_engine,
            read_engine,
            staging: Staging::new(staging_base, STAGING_BYTES),
            pool,
            index: Mutex::new(
                L2Index::with_limit(
                    extent_count(file_bytes, extent_bytes),
                    extent_bytes,
                    cfg.max_index_bytes,
                )
                .map_err(|e| {
                    Error::invalid(format!(
                        "{}: {e} (raise l2.max_index_bytes, or give the device fewer bytes)",
                        dev.path.display()
                    ))
                })?,
            ),
            file_bytes,
            extent_bytes,
            identity: Identity::unformatted(),
            prefetching: parking_lot::RwLock::new(Arc::new(AtomicUsize::new(0))),
            max_prefetch: cfg.max_prefetch_objects,
            batch_objects: cfg.batch_objects.min(STAGING_BYTES as usize / BLOCK / 4),
            counters: Counters::default(),
            recovered: 0,
            startup: recover::RecoveryReads::default(),
            startup_ms: 0,
            sealed: AtomicBool::new(false),
            path: dev.path.clone(),
            policy: cfg.write_policy,
            queue: WriteQueue::new(cfg.write_queue),
            unsynced: Mutex::new(Unsynced::default()),
            sync_lock: Mutex::new(()),
            deferred: Mutex::new(Vec::new()),
            clear_gate: ClearGate::default(),
            io: IoWatch::default(),
            io_timeout: std::time::Duration::from_millis(cfg.io_timeout_ms),
            _lock: dev.file.try_clone().map_err(|e| {
                Error::from(HwError::Os {
                    op: "dup",
                    source: e,
                })
            })?,
        };
        match previous {
            Some(sb) if same_geometry(&sb) => {
                // A file cut short by a crash during its first sizing is ours: grown again.
                dev.grow()?;
                tier.identity = Identity::open(sb, &|o, b| tier.write_durable(o, b))
                    .map_err(|e| OpenFailure::Failed(e.context("writing the L2 superblock")))?;
                tier.recover(namespaces).map_err(OpenFailure::Failed)?;
            }
            previous => {
                if let Some(sb) = &previous {
                    tracing::warn!(
                        old_bytes = sb.file_bytes,
                        old_extent_bytes = sb.extent_bytes,
                        file_bytes,
                        extent_bytes,
                        "L2 geometry changed: starting with an empty tier"
                    );
                }
                if wipe {
                    // Old data in the area a kvnode tier keeps empty (and its superblock
                    // blocks) goes first: afterwards the device is judged ours by that rule.
                    tier.wipe_reserved_area().map_err(|e| {
                        OpenFailure::Failed(e.context("zeroing the L2 reserved area"))
                    })?;
                }
                // The superblock first, then the size: a crash in between leaves a file that
                // is recognisably ours, never an unlabelled one.
                tier.identity =
                    Identity::format(previous.as_ref(), file_bytes, extent_bytes, &|o, b| {
                        tier.write_durable(o, b)
                    })
                    .map_err(|e| OpenFailure::Failed(e.context("formatting the L2 tier")))?;
                dev.grow()?;
                tier.index
                    .get_mut()
                    .note_epoch(tier.identity.first_epoch().saturating_sub(1));
            }
        }
        tier.startup_ms = started.elapsed().as_millis() as u64;
        tracing::info!(
            path = %tier.path.display(),
            startup_ms = tier.startup_ms,
            engine = tier.write_engine.kind().as_str(),
            bytes = file_bytes,
            extent_bytes,
            recovered = tier.recovered,
            max_index_bytes = cfg.max_index_bytes,
            index_max_objects = tier.index.get_mut().max_entries(),
            write_policy = tier.policy.as_str(),
            "L2 tier ready"
        );
        Ok(tier)
    }

    /// Zeroes everything before the first extent (superblock blocks included) and syncs.
    fn wipe_reserved_area(&self) -> Result<()> {
        let zero = vec![0u8; BLOCK];
        let blocks: Vec<(u64, Vec<u8>)> = (0..super::format::EXTENT_BASE / BLOCK_U64)
            .map(|i| (i * BLOCK_U64, zero.clone()))
            .collect();
        for r in self.write_blocks(&blocks) {
            r?;
        }
        let _call = self.io.start(super::format::EXTENT_BASE);
        self.write_engine
            .sync()
            .map_err(hw("syncing the L2 reserved area"))
    }

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

    /// Writes committed L1 objects to L2 (those not already there): each is held in L1 (an I/O hold)
    /// for the duration of its write, so its slot is neither freed nor reused under the I/O.
    /// Batches are pipelined: while one batch is on the disk (an I/O thread), the next one is
    /// checksummed and staged. Returns the number written.
    pub fn persist(
        &self,
        storage: &StorageCore,
        namespaces: &Namespaces,
        keys: &[StorageKey],
    ) -> u64 {
        if self.stuck() {
            // The device has not answered for a while: nothing is locked for it meanwhile.
            return 0;
        }
        if self.sealed() {
            // The checkpoint's tables describe the tier: nothing may change it any more.
            self.counters
                .skipped
                .fetch_add(keys.len() as u64, Ordering::Relaxed);
            return 0;
        }
        let parts = byte_bounded_parts(keys, self.batch_objects, &|k| {
            storage.ready_object(k).map_or(0, |(len, _)| len)
        });
        if parts.len() <= 1 {
            return parts
                .into_iter()
                .filter_map(|part| self.prepare_write(storage, namespaces, part))
                .map(|batch| self.complete_write(storage, batch))
                .sum();
        }
        std::thread::scope(|scope| {
            // One batch on the disk, one staged: at most three hold staging blocks at once.
            let (tx, rx) = std::sync::mpsc::sync_channel::<WriteBatch>(1);
            let io = std::thread::Builder::new()
                .name("kvnode-l2-batch".into())
                .spawn_scoped(scope, move || {
                    rx.iter()
                        .map(|batch| self.complete_write(storage, batch))
                        .sum::<u64>()
                });
            let io = match io {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(error = %e, "no L2 I/O thread: writing without pipelining");
                    return parts
                        .into_iter()
                        .filter_map(|part| self.prepare_write(storage, namespaces, part))
                        .map(|batch| self.complete_write(storage, batch))
                        .sum();
                }
            };
            for part in parts {
                if let Some(batch) = self.prepare_write(storage, namespaces, part) {
                    if let Err(back) = tx.send(batch) {
                        // The I/O thread is gone (a bug): finish here so nothing stays locked.
                        self.complete_write(storage, back.0);
                    }
                }
            }
            drop(tx);
            io.join().unwrap_or_else(|_| {
                tracing::error!("L2 I/O thread panicked (bug)");
                0
            })
        })
    }

    /// Locks `part` in L1 (the objects not already on L2), checksums each payload, reserves
    /// its L2 slot, writes the headers of newly assigned extents, and stages the slot headers.
    /// `None` when nothing is left to write.
    pub(super) fn prepare_write<'a>(
        &'a self,
        storage: &'a StorageCore,
        namespaces: &Namespaces,
        part: &[StorageKey],
    ) -> Option<WriteBatch<'a>> {
        // Leases for this batch's numbers, extended (a superblock write) outside the gate.
        let next_epoch = self.index.lock().next_epoch();
        if let Err(e) = self
            .identity
            .prepare(part.len() as u64, next_epoch, &|o, b| {
                self.write_durable(o, b)
            })
        {
            tracing::warn!(error = %e, "L2 leases not extended: batch not written");
            self.counters
                .errors
                .fetch_add(part.len() as u64, Ordering::Relaxed);
            return None;
        }
        let gate = self.clear_gate.enter();
        // Already on L2 as this very object (same length and layout): nothing to write. A copy
        // stored under another layout is dropped and replaced (loads would never serve it).
        let todo: Vec<StorageKey> = {
            let mut index = self.index.lock();
            part.iter()
                .filter(|k| {
                    let Some(l) = index.get(k) else { return true };
                    match storage.ready_object(k) {
                        Some((len, layout)) if !same_object(&l, len, layout) => {
                            index.remove(k);
                            true
                        }
                        _ => false,
                    }
                })
                .copied()
                .collect()
        };
        if todo.is_empty() {
            return None;
        }
        // An I/O hold, not a timed read lock: the slot is neither freed nor reused until the
        // device has finished reading it, however slow the device is.
        let grants = storage.hold_for_io(&todo);
        let locked: Vec<(StorageKey, Grant)> = todo
            .iter()
            .zip(grants)
            .filter_map(|(k, g)| g.ok().map(|g| (*k, g)))
            .collect();
        // Evicted (or cleared) from L1 before its turn came: it cannot be written any more.
        self.counters
            .skipped
            .fetch_add((todo.len() - locked.len()) as u64, Ordering::Relaxed);
        Some(self.plan_write(storage, namespaces, locked, gate))
    }

    /// Plans the writes of read-locked objects (at most `batch_objects`): extent headers of
    /// newly assigned extents are written first (synchronously, they are small), then each
    /// object's header is staged; the returned batch holds the header and payload I/Os.
    fn plan_write<'a>(
        &'a self,
        storage: &'a StorageCore,
        namespaces: &Namespaces,
        locked: Vec<(StorageKey, Grant)>,
        gate: GateToken<'a>,
    ) -> WriteBatch<'a> {
        let items = &locked;
        let format_id = self.identity.format_id();
        let mut extent_headers: Vec<(u32, u64, Vec<u8>)> = Vec::new();
        let mut plans: Vec<PlannedWrite> = Vec::new();
        let mut slot_headers: Vec<Vec<u8>> = Vec::new();
        for (key, grant) in items {
            let Some((model, cache_salt)) = namespaces.name(key.namespace) else {
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let len = grant.slot.len;
            let checksum =
                match self
                    .pool
                    .region()
                    .with_bytes(grant.slot.offset, len, payload_checksum)
                {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::error!(error = %e, "L1 slot outside the pool (bug)");
                        continue;
                    }
                };
            // Numbers come from leases prepared before the gate: no I/O in here. Should another
            // batch have used them up meanwhile, the object waits for the next round.
            let next_epoch = self.index.lock().next_epoch();
            let seq = match self.identity.try_next_seq() {
                Some(s) if self.identity.epochs_leased(next_epoch) => s,
                _ => {
                    self.defer(*key);
                    continue;
                }
            };
            let reserved = self.index.lock().reserve(*key, len, seq);
            let reservation = match reserved {
                Ok(r) => r,
                Err(ReserveError::Exists) => {
                    // An older entry of this key is still being loaded or written (doomed, or
                    // racing another writer): write this one once that is over.
                    if !self.index.lock().contains(key) {
                        self.defer(*key);
                    }
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "object not written to L2");
                    self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            self.counters
                .evictions
                .fetch_add(reservation.evicted.len() as u64, Ordering::Relaxed);
            if let Some((extent, epoch, stride)) = reservation.new_extent {
                let mut b = vec![0u8; BLOCK];
                ExtentHeader {
                    format_id,
                    extent_index: extent,
                    epoch,
                    stride,
                }
                .encode(&mut b);
                extent_headers.push((extent, extent_offset(self.extent_bytes, extent), b));
            }
            let header = SlotHeader {
                format_id,
                extent_epoch: reservation.slot.epoch,
                file_offset: reservation.slot.file_offset,
                seq,
                chunk_hash: key.chunk_hash,
                kv_rank: key.kv_rank,
                object_group: key.object_group,
                model,
                cache_salt,
                object_len: len,
                payload_checksum: checksum,
                // Read under the batch's L1 I/O hold: the layout of exactly these bytes.
                layout: storage.ready_object(key).map_or(0, |(_, layout)| layout),
            };
            let mut b = vec![0u8; BLOCK];
            if let Err(e) = header.encode(&mut b) {
                tracing::debug!(error = %e, "object key does not fit an L2 header");
                let _ = self.index.lock().abort(*key, reservation.slot);
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            slot_headers.push(b);
            plans.push(PlannedWrite {
                key: *key,
                slot: reservation.slot,
                checksum,
                layout: header.layout,
                len,
                extent_ok: true,
            });
        }
        // Reserved and staged under the gate (in memory, but for a rare lease extension); the
        // extent headers' I/O runs outside it.
        drop(gate);
        // Extent headers first, so a slot is never written into an extent whose header says
        // otherwise (a crash in between leaves at worst an extent with no readable slots).
        if !extent_headers.is_empty() {
            let writes: Vec<(u64, Vec<u8>)> = extent_headers
                .iter()
                .map(|(_, off, b)| (*off, b.clone()))
                .collect();
            for ((extent, _, _), r) in extent_headers.iter().zip(self.write_blocks(&writes)) {
                if let Err(e) = r {
                    tracing::warn!(extent, error = %e, "L2 extent header write failed");
                    // The next reservation in this extent rewrites the header; until then
                    // nothing is written into it.
                    self.index.lock().header_lost(*extent);
                    for p in plans.iter_mut().filter(|p| p.slot.extent == *extent) {
                        p.extent_ok = false;
                    }
                }
            }
            // Durable before any slot of the extent is written: a crash must never leave slot
            // headers of a new assignment without the extent header that carries its epoch
            // (recovery would not know the epoch, could hand it out again, and the old slot
            // headers would then look current).
            let synced = {
                let _call = self.io.start(SYNC_ALLOWANCE_BYTES);
                self.write_engine.sync()
            };
            if let Err(e) = synced {
                tracing::warn!(error = %e, "L2 fdatasync after extent headers failed");
                // Nothing written since the last good sync is known durable any more (their
                // keys are written again only if the writer meets them again).
                self.drop_unsynced();
                for (extent, _, _) in &extent_headers {
                    self.index.lock().header_lost(*extent);
                }
                for p in plans.iter_mut() {
                    if extent_headers.iter().any(|(e, _, _)| *e == p.slot.extent) {
                        p.extent_ok = false;
                    }
                }
            }
        }
        // Objects of extents without a header are not written (they could not be recovered).
        let (plans, dropped): (Vec<_>, Vec<_>) = plans
            .into_iter()
            .zip(slot_headers)
            .partition(|(p, _)| p.extent_ok);
        for (p, _) in &dropped {
            let _ = self.index.lock().abort(p.key, p.slot);
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        let (plans, slot_headers): (Vec<PlannedWrite>, Vec<Vec<u8>>) = plans.into_iter().unzip();
        let grants: std::collections::HashMap<StorageKey, Grant> = items.iter().copied().collect();
        let blocks = self.staging.take(plans.len());
        let mut ios = Vec::with_capacity(plans.len() * 2);
        for ((p, hdr), &b) in plans.iter().zip(&slot_headers).zip(&blocks) {
            self.pool
                .region()
                .write_at(b, hdr)
                .expect("staging block in the pool");
            ios.push(BlockIo {
                pool_offset: b,
                file_offset: p.slot.file_offset,
                len: BLOCK_U64,
            });
            ios.push(BlockIo {
                pool_offset: grants[&p.key].slot.offset,
                file_offset: p.slot.file_offset + BLOCK_U64,
                len: round_block(p.len),
            });
        }
        if blocks.len() < plans.len() {
            ios.clear(); // staging exhausted (cannot happen): everything aborts in complete_write
        }
        WriteBatch {
            tier: self,
            storage,
            locked,
            plans,
            ios,
            blocks,
        }
    }

    /// Runs a planned batch's I/O, commits what was written, aborts what was not, and releases
    /// the staging blocks and the L1 I/O holds. Returns the number written.
    pub(super) fn complete_write(&self, storage: &StorageCore, mut batch: WriteBatch<'_>) -> u64 {
        debug_assert!(std::ptr::eq(batch.tier, self) && std::ptr::eq(batch.storage, storage));
        // Taken out of the batch: its Drop (the panic path) then has nothing left to release.
        let locked = std::mem::take(&mut batch.locked);
        let plans = std::mem::take(&mut batch.plans);
        let ios = std::mem::take(&mut batch.ios);
        let blocks = std::mem::take(&mut batch.blocks);
        // A failed fdatasync while this batch is on the device may lose its payloads even if its
        // headers land after it: then nothing of the batch is committed (written again later).
        let failed_syncs = self.unsynced.lock().failed_syncs;
        let results = self.write_payloads_then_headers(&ios);
        self.staging.give(blocks);
        let (mut written, mut bytes_written) = (0u64, 0u64);
        for (i, p) in plans.iter().enumerate() {
            let io_ok = match (results.get(2 * i), results.get(2 * i + 1)) {
                (Some(Ok(_)), Some(Ok(_))) => Ok(()),
                (Some(Err(e)), _) | (_, Some(Err(e))) => Err(e.to_string()),
                _ => Err("not submitted".to_owned()),
            };
            // Lock order: unsynced, then index (as in `drop_unsynced`).
            let mut unsynced = self.unsynced.lock();
            let io_ok = match io_ok {
                Ok(()) if unsynced.failed_syncs != failed_syncs => {
                    self.defer(p.key);
                    Err("an fdatasync failed while the batch was on the device".to_owned())
                }
                other => other,
            };
            let mut index = self.index.lock();
            match io_ok {
                Ok(()) => {
                    if index.commit(p.key, p.slot, p.checksum, p.layout).is_ok() {
                        written += 1;
                        bytes_written += p.len;
                        unsynced.objects.push((p.key, p.slot));
                    }
                }
                other => {
                    drop(unsynced);
                    let _ = index.abort(p.key, p.slot);
                    drop(index);
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        error = other.err().as_deref().unwrap_or_default(),
                        file_offset = p.slot.file_offset,
                        "L2 write failed: object kept in L1 only"
                    );
                }
            }
        }
        storage.release_io_holds(&locked);
        // Counted only now: STATUS never shows a write as done while L1 still holds its lock.
        self.counters.writes.fetch_add(written, Ordering::Relaxed);
        self.counters
            .bytes_written
            .fetch_add(bytes_written, Ordering::Relaxed);
        written
    }

    /// Runs a batch's I/Os (`[header, payload]` per object): every payload first, then the
    /// headers of the objects whose payload was written, so a header on the device always
    /// describes a payload that was completely written before it (a crash between the two
    /// leaves an object without a header, never a header without its payload). Results in the
    /// order of `ios`; a header not attempted reports its payload's error.
    fn write_payloads_then_headers(&self, ios: &[BlockIo]) -> Vec<kvnode_hw::HwResult<u64>> {
        if ios.is_empty() {
            return Vec::new();
        }
        let payloads: Vec<BlockIo> = ios.iter().skip(1).step_by(2).copied().collect();
        let written = {
            let _call = self.io.start(payloads.iter().map(|io| io.len).sum());
            self.write_engine.write_batch(&payloads)
        };
        let headers: Vec<BlockIo> = ios
            .iter()
            .step_by(2)
            .zip(&written)
            .filter(|(_, w)| w.is_ok())
            .map(|(h, _)| *h)
            .collect();
        let mut header_results = {
            let _call = self.io.start(headers.iter().map(|io| io.len).sum());
            self.write_engine.write_batch(&headers).into_iter()
        };
        let mut out = Vec::with_capacity(ios.len());
        for w in written {
            match w {
                Ok(n) => {
                    out.push(
                        header_results.next().unwrap_or_else(|| {
                            Err(HwError::Invalid("header write not run".into()))
                        }),
                    );
                    out.push(Ok(n));
                }
                Err(e) => {
                    out.push(Err(HwError::Invalid(format!(
                        "not written: payload failed ({e})"
                    ))));
                    out.push(Err(e));
                }
            }
        }
        out
    }

    /// Loads objects that are on L2 but not in L1 into fresh L1 slots and publishes them with
    /// `1 + extra` read locks. Returns, per key, the lease of the lock taken, or `None` when the
    /// key was not loaded (not on L2, L1 full, prefetch bound reached, device error, corrupt
    /// payload: the last two also drop it from L2). At most `max_prefetch_objects` objects are
    /// in flight node-wide; keys beyond the budget are not loaded (callers cut their prefix there).
    /// With `expected` (the layout the model is registered with now), objects of another size
    /// or another recorded layout are not loaded: they were stored under an earlier layout.
    pub fn load(
        &self,
        storage: &StorageCore,
        keys: &[StorageKey],
        extra: u32,
        expected: Option<&Layout>,
    ) -> Vec<Option<u64>> {
        let mut out = vec![None; keys.len()];
        if self.stuck() {
            self.count_stalled(keys.len() as u64);
            return out;
        }
        let gate = self.clear_gate.enter();
        let budget = self.acquire_prefetch(keys.len());
        if budget == 0 {
            return out;
        }
        let keys = &keys[..budget];
        // Copies that cannot be served under `expected` are not pinned (nor made recent).
        let pinned: Vec<Option<super::space::Located>> = {
            let mut index = self.index.lock();
            keys.iter()
                .map(|k| index.pin_if(k, |l| expected.is_none_or(|e| layout_matches(e, l))))
                .collect()
        };
        let mut held = LoadGuard {
            tier: self,
            storage,
            keys,
            budget,
            grants: vec![None; keys.len()],
            pinned,
            gate: Some(gate),
        };
        let contended = self.load_pinned(&mut held, extra, expected, &mut out);
        // Pins, budget, gate and every unpublished reservation go back before any waiting.
        drop(held);
        // Keys another request was loading or storing: wait for them, together at most
        // `WAIT_CONTENDED`, and only until the first one fails (callers cut their prefix there).
        let deadline = std::time::Instant::now() + WAIT_CONTENDED;
        for i in contended {
            out[i] = wait_readable(storage, &keys[i], extra, deadline);
            if out[i].is_none() {
                break;
            }
        }
        out
    }

    /// The I/O part of [`L2Tier::load`]: reserves L1 slots for the pinned keys, reads and
    /// verifies them, publishes the good ones with their locks (into `out`) and aborts the rest.
    /// Returns the keys that someone else holds in L1 right now (to wait for).
    fn load_pinned(
        &self,
        held: &mut LoadGuard<'_>,
        extra: u32,
        expected: Option<&Layout>,
        out: &mut [Option<u64>],
    ) -> Vec<usize> {
        let (storage, keys) = (held.storage, held.keys);
        let located: Vec<Option<super::space::Located>> = held
            .pinned
            .iter()
            .map(|l| l.filter(|l| expected.is_none_or(|e| layout_matches(e, l))))
            .collect();
        // Reserve L1 slots, grouped by object length (one allocator call per group).
        let mut contended: Vec<usize> = Vec::new();
        let mut lens: Vec<u64> = located.iter().flatten().map(|l| l.object_len).collect();
        lens.sort_unstable();
        lens.dedup();
        for len in lens {
            let idx: Vec<usize> = (0..keys.len())
                .filter(|&i| located[i].as_ref().is_some_and(|l| l.object_len == len))
                .collect();
            let group: Vec<StorageKey> = idx.iter().map(|&i| keys[i]).collect();
            for (&i, r) in idx.iter().zip(storage.reserve_write_untimed(&group, len)) {
                match r {
                    Ok(g) => held.grants[i] = Some(g),
                    Err(KeyError::OutOfMemory) => {
                        tracing::debug!("L1 full: L2 object not loaded")
                    }
                    // Present in L1 meanwhile, or being loaded/stored by someone else.
                    Err(_) => contended.push(i),
                }
            }
        }
        // Pinned in L2 and reserved in L1 under the gate: a CLEAR from now on dooms both (the
        // reservation is then never published). The I/O runs outside the gate, so a CLEAR never
        // waits for a device.
        drop(held.gate.take());
        let grants = held.grants.clone();
        let plan: Vec<usize> = (0..keys.len()).filter(|&i| grants[i].is_some()).collect();
        let ios: Vec<BlockIo> = plan
            .iter()
            .map(|&i| {
                let l = located[i].as_ref().expect("granted implies located");
                BlockIo {
                    pool_offset: grants[i].expect("planned").slot.offset,
                    file_offset: l.slot.file_offset + BLOCK_U64,
                    len: round_block(l.object_len),
                }
            })
            .collect();
        // Checksums are verified as each read completes, while the rest are still on the disk;
        // with the io_uring engine (callbacks on the ring's thread) every other object goes to a
        // helper thread, so a batch whose reads finish together is verified twice as fast.
        let checksum_ok: Vec<std::sync::atomic::AtomicBool> =
            plan.iter().map(|_| Default::default()).collect();
        let verify = |j: usize| {
            let i = plan[j];
            let l = located[i].as_ref().expect("planned");
            let g = grants[i].expect("planned");
            let sum = self
                .pool
                .region()
                .with_bytes(g.slot.offset, l.object_len, payload_checksum);
            checksum_ok[j].store(sum.ok() == Some(l.checksum), Ordering::Relaxed);
        };
        let _call = self.io.start(ios.iter().map(|io| io.len).sum());
        let results = if plan.len() < 4 || self.read_engine.kind() != EngineKind::Uring {
            self.read_engine.read_batch_then(&ios, &verify)
        } else {
            std::thread::scope(|scope| {
                let (tx, rx) = std::sync::mpsc::channel::<usize>();
                let helper = std::thread::Builder::new()
                    .name("kvnode-l2-verify".into())
                    .spawn_scoped(scope, || rx.into_iter().for_each(verify));
                match helper {
                    Ok(_) => self.read_engine.read_batch_then(&ios, &|j| {
                        if j % 2 == 1 {
                            if let Err(back) = tx.send(j) {
                                verify(back.0);
                            }
                        } else {
                            verify(j);
                        }
                    }),
                    Err(_) => self.read_engine.read_batch_then(&ios, &verify),
                }
                // The scope joins the helper (after the sender is dropped) before returning.
            })
        };
        drop(_call);
        let mut loaded = 0u64;
        for (j, (&i, r)) in plan.iter().zip(results).enumerate() {
            let l = located[i].as_ref().expect("planned");
            let Some(g) = held.grants[i].take() else {
                continue;
            };
            if self.verdict(r, checksum_ok[j].load(Ordering::Relaxed), l) {
                // An error here means the object was cleared meanwhile (and freed by publish).
                if let Some(Ok(lease)) = storage
                    .finish_write_locked(&[(keys[i], g)], extra, l.layout)
                    .pop()
                {
                    out[i] = Some(lease);
                    loaded += 1;
                    self.counters
                        .bytes_read
                        .fetch_add(l.object_len, Ordering::Relaxed);
                }
            } else {
                storage.abort_write(&[(keys[i], g)]);
                self.index.lock().remove(&keys[i]);
            }
        }
        self.counters.hits.fetch_add(loaded, Ordering::Relaxed);
        contended
    }

    /// Judges one loaded payload: the read succeeded and its checksum matched. Failures are
    /// counted and logged here; the caller drops the object.
    fn verdict(
        &self,
        read: kvnode_hw::HwResult<u64>,
        checksum_ok: bool,
        l: &super::space::Located,
    ) -> bool {
        if let Err(e) = read {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, file_offset = l.slot.file_offset, "L2 read failed: object dropped from L2");
            return false;
        }
        if !checksum_ok {
            if l.seq < self.identity.torn_below() {
                self.counters.torn.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    file_offset = l.slot.file_offset,
                    "L2 object written before an unclean stop failed its checksum (torn by \
                     the stop): dropped, not served"
                );
            } else {
                self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    file_offset = l.slot.file_offset,
                    "L2 object failed its checksum: dropped, not served"
                );
            }
            return false;
        }
        true
    }

    /// The prefetch budget counter (objects being loaded).
    pub(super) fn prefetch_budget(&self) -> Arc<AtomicUsize> {
        self.prefetching.read().clone()
    }

    /// Uses `budget` (another device's) instead of this device's own counter, so a set of
    /// devices has one node-wide bound. Only at opening, before any load.
    pub(super) fn share_prefetch_budget(&self, budget: &Arc<AtomicUsize>) {
        *self.prefetching.write() = budget.clone();
    }

    /// Takes up to `want` units of the node-wide prefetch budget.
    fn acquire_prefetch(&self, want: usize) -> usize {
        let counter = self.prefetch_budget();
        let mut cur = counter.load(Ordering::Acquire);
        loop {
            let n = want.min(self.max_prefetch.saturating_sub(cur));
            if n == 0 {
                return 0;
            }
            match counter.compare_exchange_weak(cur, cur + n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return n,
                Err(c) => cur = c,
            }
        }
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
    fn defer(&self, key: StorageKey) {
        let mut d = self.deferred.lock();
        if d.len() < DEFERRED_MAX {
            d.push(key);
        } else {
            self.counters.skipped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// After a failed fdatasync (any of them): nothing written since the last good one is known
    /// to be durable; those objects leave the index (counted) and are returned.
    fn drop_unsynced(&self) -> Vec<StorageKey> {
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
