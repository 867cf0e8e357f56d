//! Opening a device: judging it (ours, empty or foreign), sizing it, starting the block
//! engines, and formatting it or recovering its index.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

use kvnode_hw::{BlockEngine, EngineKind, HwError, SharedPool};
use parking_lot::Mutex;

use super::{
    hw, recover, Counters, L2Tier, Staging, Unsynced, BLOCK_U64, READ_RINGS, STAGING_BYTES,
};
use crate::config::L2Config;
use crate::error::{Error, Result};
use crate::l2::format::{default_extent_bytes, extent_count, Superblock, BLOCK};
use crate::l2::gate::ClearGate;
use crate::l2::identity::Identity;
use crate::l2::iowatch::IoWatch;
use crate::l2::space::L2Index;
use crate::l2::writer::WriteQueue;
use crate::storage::Namespaces;

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

/// The error of an opening the node gave up on (see [`IoWatch::abandon`]).
fn left_out() -> OpenFailure {
    OpenFailure::Failed(Error::new(
        crate::error::ErrorKind::Io,
        "the L2 device was left out at start-up",
    ))
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
        let io = Arc::new(IoWatch::default());
        Self::open_watched(cfg, path, pool, staging_base, namespaces, wrap, &io)
    }

    /// [`L2Tier::open_classified`] registering every device call of the opening in `io`, so
    /// that another thread can tell a device that stopped answering from a long recovery.
    pub fn open_watched(
        cfg: &L2Config,
        path: &Path,
        pool: Arc<SharedPool>,
        staging_base: u64,
        namespaces: &Namespaces,
        wrap: &dyn Fn(Box<dyn BlockEngine>) -> Box<dyn BlockEngine>,
        io: &Arc<IoWatch>,
    ) -> std::result::Result<L2Tier, OpenFailure> {
        let started = std::time::Instant::now();
        // Nothing is written and nothing is resized before the device was judged ours or empty.
        // Opening waits up to l2.lock_wait_ms for the device's lock: allowed on top.
        let lock_wait_bytes = cfg
            .lock_wait_ms
            .saturating_mul(crate::l2::iowatch::SLOWEST_RATE)
            / 1000;
        let mut dev = {
            let _call = io.start(lock_wait_bytes);
            crate::l2::device::open(cfg, path)?
        };
        let found = {
            let _call =
                io.start(crate::l2::device::MAX_EMPTY_SCAN_BYTES + crate::l2::format::EXTENT_BASE);
            crate::l2::device::identify(&dev).map_err(OpenFailure::Failed)?
        };
        let crate::l2::device::Accepted { previous, wipe } =
            crate::l2::device::accept(cfg, &dev, found)?;
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
                crate::l2::format::EXTENT_BASE + extent_bytes.max(2 << 20)
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
            recovery_ms: 0,
            sealed: AtomicBool::new(false),
            writes_in_flight: AtomicUsize::new(0),
            headed: Mutex::new(vec![
                0;
                (extent_count(file_bytes, extent_bytes) as usize)
                    .div_ceil(64)
            ]),
            path: dev.path.clone(),
            policy: cfg.write_policy,
            queue: WriteQueue::new(cfg.write_queue),
            unsynced: Mutex::new(Unsynced::default()),
            sync_lock: Mutex::new(()),
            deferred: Mutex::new(Vec::new()),
            clear_gate: ClearGate::default(),
            io: io.clone(),
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
                {
                    if io.abandoned() {
                        return Err(left_out());
                    }
                    // Allocating the rest of the file: granted its bytes at the slowest rate.
                    let _call = io.start(file_bytes.saturating_sub(dev.len));
                    dev.grow()?;
                }
                tier.identity = Identity::open(sb, &|o, b| tier.write_durable(o, b))
                    .map_err(|e| OpenFailure::Failed(e.context("writing the L2 superblock")))?;
                let rebuilding = std::time::Instant::now();
                tier.recover(namespaces).map_err(OpenFailure::Failed)?;
                tier.recovery_ms = rebuilding.elapsed().as_millis() as u64;
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
                {
                    if io.abandoned() {
                        return Err(left_out());
                    }
                    // Allocating the rest of the file: granted its bytes at the slowest rate.
                    let _call = io.start(file_bytes.saturating_sub(dev.len));
                    dev.grow()?;
                }
                tier.index
                    .get_mut()
                    .note_epoch(tier.identity.first_epoch().saturating_sub(1));
            }
        }
        tier.startup_ms = started.elapsed().as_millis() as u64;
        tracing::info!(
            path = %tier.path.display(),
            startup_ms = tier.startup_ms,
            recovery_ms = tier.recovery_ms,
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
        let blocks: Vec<(u64, Vec<u8>)> = (0..crate::l2::format::EXTENT_BASE / BLOCK_U64)
            .map(|i| (i * BLOCK_U64, zero.clone()))
            .collect();
        for r in self.write_blocks(&blocks) {
            r?;
        }
        let _call = self.io.start(crate::l2::format::EXTENT_BASE);
        self.write_engine
            .sync()
            .map_err(hw("syncing the L2 reserved area"))
    }
}
