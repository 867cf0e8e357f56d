//! The node under test: a small pool, an L1 [`StorageCore`] on the simulator's clock, and the
//! real [`L2Tier`] opened on a data file in a private directory through [`SimEngine`]s over one
//! [`SimDisk`]. L1 is rebuilt empty at every (re)open, as a restarted node's would be.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvnode_hw::{BlockEngine, PagePreference, PoolOptions, SharedPool};

use super::disk::SimDisk;
use super::engine::SimEngine;
use super::model::Version;
use super::payload::checksum;
use crate::clock::Clock;
use crate::config::L2Config;
use crate::l2::device::DATA_FILE;
use crate::l2::tier::{L2Tier, STAGING_BYTES};
use crate::storage::{KeyError, NamespaceId, Namespaces, StorageConfig, StorageCore, StorageKey};

/// Bytes of L1 (pool minus the tier's staging area): a few dozen objects, so stores evict.
pub const L1_BYTES: u64 = 4 << 20;

/// `(model, cache salt)` of the two namespaces keys alternate between.
pub const NAMESPACES: [(&str, &str); 2] = [("sim-l2-a", ""), ("sim-l2-b", "salt")];

/// What L1 holds for a key. Invariant: read under a read lock, so all fields describe one
/// object.
#[derive(Debug, Clone, Copy)]
pub struct L1Object {
    /// Its length in bytes.
    pub len: u64,
    /// The layout fingerprint it was published under.
    pub layout: u64,
    /// xxh3 of its bytes.
    pub checksum: u64,
    /// What its first bytes say it is (see [`super::payload::describe`]).
    pub head: Option<(u64, u64, u64)>,
}

/// Removes the run's directory on drop.
struct DirGuard(PathBuf);

impl Drop for DirGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The node. Invariant: `tier` is `Some` between a successful [`Node::open`] and the next
/// [`Node::close`], and nothing but the simulator (and a stuck-I/O worker it joins before
/// closing) holds it.
pub struct Node {
    /// The tier's configuration.
    pub cfg: L2Config,
    /// The pool (kept across restarts).
    pub pool: Arc<SharedPool>,
    /// The simulator's clock (L1 TTLs).
    pub clock: Clock,
    /// L1 of the current run.
    pub storage: Arc<StorageCore>,
    /// Namespaces of the current run.
    pub namespaces: Arc<Namespaces>,
    /// The tier, while open.
    pub tier: Option<Arc<L2Tier>>,
    /// The simulated device.
    pub disk: Arc<SimDisk>,
    dir: PathBuf,
    ns: [NamespaceId; 2],
    _dir: DirGuard,
}

/// Where runs put their data files by default: `/dev/shm` (tmpfs, which takes `O_DIRECT`
/// on current kernels, and is fast) when it is a writable directory, else the temp dir.
pub fn default_base_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let probe = shm.join(format!(".kvnode-l2sim-probe-{}", std::process::id()));
    if std::fs::create_dir_all(&probe).is_ok() {
        let _ = std::fs::remove_dir(&probe);
        return shm.to_path_buf();
    }
    std::env::temp_dir()
}

impl Node {
    /// A node for seed `seed` under `base` (nothing opened yet).
    pub fn new(base: &Path, seed: u64, cfg: L2Config, disk_seed: u64) -> Node {
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let dir = base.join(format!(
            "kvnode-l2sim-{}-{seed}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let pool = Arc::new(
            SharedPool::create(&PoolOptions {
                bytes: L1_BYTES + STAGING_BYTES,
                prefer: PagePreference::Pages4K,
                prefault: true,
                name: "kvnode-l2sim".into(),
                posix_shm_name: None,
                segment_bind_mount: false,
                cancel: None,
            })
            .expect("a small 4 KiB-page pool"),
        );
        let disk = SimDisk::new(
            pool.clone(),
            dir.join(DATA_FILE),
            cfg.bytes,
            cfg.extent_bytes,
            disk_seed,
        );
        let clock = Clock::manual(1_000);
        let namespaces = Arc::new(Namespaces::default());
        Node {
            storage: Arc::new(StorageCore::with_clock(
                L1_BYTES,
                StorageConfig::default(),
                clock.clone(),
            )),
            ns: intern(&namespaces),
            namespaces,
            cfg,
            pool,
            clock,
            tier: None,
            disk,
            _dir: DirGuard(dir.clone()),
            dir,
        }
    }

    /// Opens the tier (recovering what the device holds) with an empty L1.
    pub fn open(&mut self) -> crate::error::Result<()> {
        assert!(self.tier.is_none(), "open twice");
        self.storage = Arc::new(StorageCore::with_clock(
            L1_BYTES,
            StorageConfig::default(),
            self.clock.clone(),
        ));
        self.namespaces = Arc::new(Namespaces::default());
        let disk = self.disk.clone();
        let wrap = move |inner: Box<dyn BlockEngine>| -> Box<dyn BlockEngine> {
            Box::new(SimEngine::new(inner, disk.clone()))
        };
        self.disk.begin_open();
        let tier = L2Tier::open_wrapped(
            &self.cfg,
            &self.dir,
            self.pool.clone(),
            L1_BYTES,
            &self.namespaces,
            &wrap,
        )?;
        self.ns = intern(&self.namespaces);
        self.tier = Some(Arc::new(tier));
        Ok(())
    }

    /// Drops the tier (no sync: the caller syncs first for a clean stop).
    pub fn close(&mut self) {
        if let Some(t) = self.tier.take() {
            match Arc::try_unwrap(t) {
                Ok(t) => drop(t),
                Err(_) => panic!("the tier is still shared at close (a worker not joined)"),
            }
        }
    }

    /// The open tier.
    pub fn tier(&self) -> &L2Tier {
        self.tier.as_ref().expect("the tier is open")
    }

    /// The storage key of key number `key` with chunk hash `chunk`.
    pub fn key(&self, key: u32, chunk: &[u8; 32]) -> StorageKey {
        StorageKey {
            chunk_hash: *chunk,
            kv_rank: key % 3,
            object_group: 0,
            namespace: self.ns[key as usize % 2],
        }
    }

    /// Stores `bytes` (the payload of `ver`) under `key` in L1, committed under its layout and
    /// marked as waiting for write-behind.
    pub fn store(&self, key: &StorageKey, ver: &Version, bytes: &[u8]) -> Result<(), KeyError> {
        let g = self
            .storage
            .reserve_write(std::slice::from_ref(key), ver.bytes(), false)
            .pop()
            .expect("one result")?;
        self.pool
            .region()
            .write_at(g.slot.offset, bytes)
            .expect("an L1 slot lies in the pool");
        self.storage
            .finish_write_as(&[(*key, g)], ver.fp(), true)
            .pop()
            .expect("one result")
    }

    /// The L1 object of `key`, read under a lock of its own; `None` when it is not readable.
    pub fn l1_object(&self, key: &StorageKey) -> Option<L1Object> {
        let g = self
            .storage
            .reserve_read(std::slice::from_ref(key), 0)
            .pop()?
            .ok()?;
        let (len, fp) = self.storage.ready_object(key).expect("read-locked");
        let (sum, head) = self
            .pool
            .region()
            .with_bytes(g.slot.offset, len, |b| {
                (checksum(b), super::model::head_of(b))
            })
            .expect("an L1 slot lies in the pool");
        self.storage.finish_read(&[(*key, g.lease)], 0);
        Some(L1Object {
            len,
            layout: fp,
            checksum: sum,
            head,
        })
    }
}

fn intern(ns: &Namespaces) -> [NamespaceId; 2] {
    NAMESPACES.map(|(m, s)| ns.intern(m, s).expect("a valid simulated namespace"))
}
