//! Fault injection below the tier: a block engine that fails, shortens or corrupts I/Os on
//! demand, driving `persist` and `load` directly. Each fault must be counted, drop only the
//! affected objects from L2, leave L1 intact (no leaked reservation or lock) and return every
//! staging block.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvnode_hw::{
    BlockEngine, BlockIo, EngineKind, HwError, HwResult, PagePreference, PoolOptions, SharedPool,
};

use super::space::{L2Index, INDEX_BYTES_PER_OBJECT};
use super::tier::{L2Tier, STAGING_BYTES};
use crate::config::L2Config;
use crate::storage::{Namespaces, StorageConfig, StorageCore, StorageKey};

/// What the faulty engine does to the payload-sized I/Os (headers, 4 KiB, always pass).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u32)]
enum Fault {
    None = 0,
    /// Every other payload write fails with EIO.
    EveryOtherWrite = 1,
    /// Every payload write fails with ENOSPC.
    AllWrites = 2,
    /// Payload reads fail with EIO.
    ReadEio = 3,
    /// Payload reads succeed but one byte in the pool is flipped afterwards (a bad disk).
    ReadFlip = 4,
    /// Reads of slot headers (4 KiB, past the superblock) fail with EIO.
    HeaderReadEio = 5,
    /// `fdatasync` fails with EIO.
    SyncEio = 6,
    /// Reads of extent headers (4 KiB at a multiple of 2 MiB) fail with EIO.
    ExtentHeaderReadEio = 7,
    /// Payload writes do not return while this fault is in force (a device that stopped
    /// answering); they run once it is lifted.
    StuckPayloadWrites = 8,
    /// Payload reads do not return while this fault is in force.
    StuckPayloadReads = 9,
    /// Every write fails with EIO, headers and superblocks included (a dead device).
    EveryWriteEio = 10,
    /// Every read (headers included) does not return while this fault is in force.
    StuckAllReads = 11,
}

impl FaultyEngine {
    /// Blocks while `stuck` is the fault in force, if `ios` hold a payload-sized I/O.
    fn hang_while(&self, stuck: Fault, ios: &[BlockIo]) {
        if ios.iter().any(|io| io.len > HEADER) {
            while self.fault.load(Ordering::Relaxed) == stuck as u32 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

struct FaultyEngine {
    inner: Box<dyn BlockEngine>,
    pool: Arc<SharedPool>,
    fault: Arc<AtomicU32>,
    /// Every write batch, in order.
    writes: Arc<std::sync::Mutex<Vec<Vec<BlockIo>>>>,
    /// Read batches that reached the device.
    reads: Arc<AtomicU32>,
}

const HEADER: u64 = 4096;

impl BlockEngine for FaultyEngine {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }

    fn write_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>> {
        self.writes.lock().unwrap().push(ios.to_vec());
        self.hang_while(Fault::StuckPayloadWrites, ios);
        let fault = self.fault.load(Ordering::Relaxed);
        let mut out = self.inner.write_batch(ios);
        let mut n = 0;
        for (io, r) in ios.iter().zip(out.iter_mut()) {
            if fault == Fault::EveryWriteEio as u32 {
                *r = Err(HwError::Os {
                    op: "write_fixed",
                    source: std::io::Error::from_raw_os_error(libc::EIO),
                });
                continue;
            }
            if io.len == HEADER {
                continue;
            }
            n += 1;
            let errno = match fault {
                f if f == Fault::AllWrites as u32 => Some(libc::ENOSPC),
                f if f == Fault::EveryOtherWrite as u32 && n % 2 == 0 => Some(libc::EIO),
                _ => None,
            };
            if let Some(errno) = errno {
                *r = Err(HwError::Os {
                    op: "write_fixed",
                    source: std::io::Error::from_raw_os_error(errno),
                });
            }
        }
        out
    }

    fn read_batch(&self, ios: &[BlockIo]) -> Vec<HwResult<u64>> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.hang_while(Fault::StuckPayloadReads, ios);
        while self.fault.load(Ordering::Relaxed) == Fault::StuckAllReads as u32 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let fault = self.fault.load(Ordering::Relaxed);
        let mut out = self.inner.read_batch(ios);
        for (io, r) in ios.iter().zip(out.iter_mut()) {
            if io.len == HEADER {
                let extent_header = io.file_offset % (2 << 20) == 0 && io.file_offset > 0;
                if (fault == Fault::HeaderReadEio as u32 && !extent_header)
                    || (fault == Fault::ExtentHeaderReadEio as u32 && extent_header)
                {
                    *r = Err(HwError::Os {
                        op: "read_fixed",
                        source: std::io::Error::from_raw_os_error(libc::EIO),
                    });
                }
                continue;
            }
            if fault == Fault::ReadEio as u32 {
                *r = Err(HwError::Os {
                    op: "read_fixed",
                    source: std::io::Error::from_raw_os_error(libc::EIO),
                });
            } else if fault == Fault::ReadFlip as u32 {
                let mut b = [0u8; 1];
                let at = io.pool_offset + 17;
                self.pool.region().read_at(at, &mut b).unwrap();
                self.pool.region().write_at(at, &[b[0] ^ 0xff]).unwrap();
            }
        }
        out
    }

    fn sync(&self) -> HwResult<()> {
        if self.fault.load(Ordering::Relaxed) == Fault::SyncEio as u32 {
            return Err(HwError::Os {
                op: "fdatasync",
                source: std::io::Error::from_raw_os_error(libc::EIO),
            });
        }
        self.inner.sync()
    }

    fn release(&self) {
        self.inner.release()
    }
}

struct Rig {
    /// Removes the directory on drop (None for reopened rigs: the first one owns it).
    dir: Option<tempdir::Dir>,
    storage: StorageCore,
    namespaces: Namespaces,
    tier: L2Tier,
    pool: Arc<SharedPool>,
    fault: Arc<AtomicU32>,
    writes: Arc<std::sync::Mutex<Vec<Vec<BlockIo>>>>,
}

mod tempdir {
    /// A directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

const OBJ: u64 = 64 << 10;

fn rig(tag: &str, engine: &str) -> Rig {
    rig_with(tag, engine, 1024)
}

fn rig_with(tag: &str, engine: &str, max_prefetch_objects: usize) -> Rig {
    let dir = std::env::temp_dir().join(format!("kvnode-l2unit-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut r = open_rig(dir.clone(), engine, max_prefetch_objects, Fault::None);
    r.dir = Some(tempdir::Dir(dir));
    r
}

/// Opens (or reopens: the tier recovers what is on disk) a rig on `dir`, with `fault` in force
/// from the start.
fn open_rig(
    dir: std::path::PathBuf,
    engine: &str,
    max_prefetch_objects: usize,
    fault: Fault,
) -> Rig {
    open_rig_batched(dir, engine, max_prefetch_objects, fault, 64)
}

fn open_rig_batched(
    dir: std::path::PathBuf,
    engine: &str,
    max_prefetch_objects: usize,
    fault: Fault,
    batch_objects: usize,
) -> Rig {
    try_open_rig(dir, fault, |c| {
        c.engine = engine.into();
        c.max_prefetch_objects = max_prefetch_objects;
        c.batch_objects = batch_objects;
    })
    .unwrap()
}

/// The 8 MiB pool of the unit tests (4 KiB pages).
fn unit_pool() -> Arc<SharedPool> {
    Arc::new(
        SharedPool::create(&PoolOptions {
            bytes: 8 << 20,
            prefer: PagePreference::Pages4K,
            prefault: true,
            name: "l2-unit".into(),
            posix_shm_name: None,
            segment_bind_mount: false,
            cancel: None,
        })
        .unwrap(),
    )
}

/// A fresh directory for a test's devices, removed when the returned guard drops.
fn scratch_dir(tag: &str) -> (std::path::PathBuf, tempdir::Dir) {
    let base = std::env::temp_dir().join(format!("kvnode-l2unit-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    (base.clone(), tempdir::Dir(base))
}

impl FaultyEngine {
    /// An engine over `inner` with `fault` in force, recording nothing shared.
    fn with_fault(
        inner: Box<dyn BlockEngine>,
        pool: Arc<SharedPool>,
        fault: Arc<AtomicU32>,
    ) -> Self {
        FaultyEngine {
            inner,
            pool,
            fault,
            writes: Default::default(),
            reads: Default::default(),
        }
    }
}

/// Opens a rig on `dir` with the unit-test configuration as `configure` changes it.
fn try_open_rig(
    dir: std::path::PathBuf,
    fault: Fault,
    configure: impl FnOnce(&mut L2Config),
) -> crate::error::Result<Rig> {
    let pool = unit_pool();
    let staging = pool.len() - STAGING_BYTES;
    let namespaces = Namespaces::default();
    let fault = Arc::new(AtomicU32::new(fault as u32));
    let mut cfg = L2Config {
        bytes: 32 << 20,
        ..L2Config::default()
    };
    configure(&mut cfg);
    let writes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (p, f, w) = (pool.clone(), fault.clone(), writes.clone());
    let wrap = move |inner: Box<dyn BlockEngine>| -> Box<dyn BlockEngine> {
        Box::new(FaultyEngine {
            inner,
            pool: p.clone(),
            fault: f.clone(),
            writes: w.clone(),
            reads: Default::default(),
        })
    };
    let tier = L2Tier::open_wrapped(&cfg, &dir, pool.clone(), staging, &namespaces, &wrap)?;
    Ok(Rig {
        dir: None,
        storage: StorageCore::new(staging, StorageConfig::default()),
        namespaces,
        tier,
        pool,
        fault,
        writes,
    })
}

impl Rig {
    fn keys(&self, n: u8) -> Vec<StorageKey> {
        let ns = self.namespaces.intern("m", "").unwrap();
        (0..n)
            .map(|i| StorageKey {
                chunk_hash: [i; 32],
                kv_rank: 0,
                object_group: 0,
                namespace: ns,
            })
            .collect()
    }

    /// Stores each key in L1 with bytes derived from its hash (layout unknown).
    fn store(&self, keys: &[StorageKey]) {
        self.store_as(keys, 0, 0xa5);
    }

    /// Stores each key in L1 committed under layout fingerprint `layout`, with bytes derived
    /// from its hash and `salt`.
    fn store_as(&self, keys: &[StorageKey], layout: u64, salt: u8) {
        let grants: Vec<_> = self
            .storage
            .reserve_write(keys, OBJ, false)
            .into_iter()
            .map(Result::unwrap)
            .collect();
        for (k, g) in keys.iter().zip(&grants) {
            self.pool
                .region()
                .fill_at(g.slot.offset, OBJ, k.chunk_hash[0] ^ salt)
                .unwrap();
        }
        let items: Vec<_> = keys.iter().copied().zip(grants).collect();
        assert!(self
            .storage
            .finish_write_as(&items, layout, false)
            .iter()
            .all(Result::is_ok));
    }

    /// Drops every L1 copy (as if evicted), so loads must come from L2.
    fn drop_l1(&self) {
        let ready = self.storage.counts().ready;
        assert_eq!(self.storage.clear(), (ready, 0));
    }

    /// Releases the locks a load took (`extra` as given to it); returns how many it loaded.
    fn unlock(&self, keys: &[StorageKey], leases: &[Option<u64>], extra: u32) -> usize {
        let held: Vec<(StorageKey, u64)> = keys
            .iter()
            .zip(leases)
            .filter_map(|(k, l)| l.map(|l| (*k, l)))
            .collect();
        self.storage.finish_read(&held, extra);
        held.len()
    }

    fn check_clean(&self) {
        let m = self.storage.memcheck();
        assert!(m.ok, "{:?}", m.problems);
        self.tier.check().unwrap();
        let c = self.storage.counts();
        assert_eq!(
            (c.write_reserved, c.read_locked),
            (0, 0),
            "nothing leaked in L1"
        );
        assert_eq!(self.tier.staging_free() as u64, STAGING_BYTES / 4096);
    }

    fn bytes_ok(&self, key: &StorageKey) -> bool {
        self.pool_bytes_are(key, 0xa5)
    }

    /// Whether `key`'s L1 bytes are those [`Rig::store_as`] wrote with `salt`.
    fn pool_bytes_are(&self, key: &StorageKey, salt: u8) -> bool {
        let g = self
            .storage
            .reserve_read(&[*key], 0)
            .pop()
            .unwrap()
            .unwrap();
        let ok = self
            .pool
            .region()
            .with_bytes(g.slot.offset, OBJ, |b| {
                b.iter().all(|&x| x == key.chunk_hash[0] ^ salt)
            })
            .unwrap();
        self.storage.finish_read(&[(*key, g.lease)], 0);
        ok
    }
}

fn both(f: impl Fn(&str)) {
    f("uring");
    f("pread");
}

/// Waits (at most 20 s) until `cond` holds.
fn eventually(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

mod cap;
mod checkpoint;
mod io;
mod stuck;
