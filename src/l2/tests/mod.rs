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
        self.hang_while(Fault::StuckPayloadReads, ios);
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

/// Opens a rig on `dir` with the unit-test configuration as `configure` changes it.
fn try_open_rig(
    dir: std::path::PathBuf,
    fault: Fault,
    configure: impl FnOnce(&mut L2Config),
) -> crate::error::Result<Rig> {
    let pool = Arc::new(
        SharedPool::create(&PoolOptions {
            bytes: 8 << 20,
            prefer: PagePreference::Pages4K,
            prefault: true,
            name: "l2-unit".into(),
            posix_shm_name: None,
            cancel: None,
        })
        .unwrap(),
    );
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

#[test]
fn write_then_load_round_trip() {
    both(|engine| {
        let r = rig(&format!("rt-{engine}"), engine);
        let keys = r.keys(10);
        r.store(&keys);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 10);
        assert_eq!(
            r.tier.persist(&r.storage, &r.namespaces, &keys),
            0,
            "already on L2"
        );
        r.drop_l1();
        let leases = r.tier.load(&r.storage, &keys, 0, None);
        assert_eq!(r.unlock(&keys, &leases, 0), keys.len());
        assert!(keys.iter().all(|k| r.bytes_ok(k)));
        let s = r.tier.status();
        assert_eq!((s.writes, s.hits, s.errors, s.corrupt), (10, 10, 0, 0));
        r.check_clean();
    });
}

#[test]
fn failed_writes_are_counted_and_leave_l1_intact() {
    both(|engine| {
        let r = rig(&format!("wfail-{engine}"), engine);
        let keys = r.keys(8);
        r.store(&keys);
        r.fault
            .store(Fault::EveryOtherWrite as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
        let s = r.tier.status();
        assert_eq!((s.writes, s.errors, s.objects), (4, 4, 4));
        r.fault.store(Fault::AllWrites as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 0);
        assert_eq!(r.tier.status().errors, 8);
        assert!(keys.iter().all(|k| r.bytes_ok(k)), "L1 keeps serving");
        r.check_clean();
        // Once the device recovers, the failed objects are written on the next attempt.
        r.fault.store(Fault::None as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
        assert_eq!(r.tier.status().objects, 8);
        r.check_clean();
    });
}

#[test]
fn objects_are_not_written_into_an_extent_whose_header_is_not_durable() {
    let r = rig("syncfail", "pread");
    let keys = r.keys(4);
    r.store(&keys);
    // The first write assigns an extent; its header cannot be made durable: no slot of it
    // is written (recovery could not tell its epoch), and the failure is counted per object.
    r.fault.store(Fault::SyncEio as u32, Ordering::Relaxed);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 0);
    let s = r.tier.status();
    assert_eq!((s.writes, s.errors, s.objects), (0, 4, 0));
    assert!(keys.iter().all(|k| r.bytes_ok(k)), "L1 keeps serving");
    r.check_clean();
    r.fault.store(Fault::None as u32, Ordering::Relaxed);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
    r.check_clean();
}

#[test]
fn read_errors_and_corruption_drop_objects_and_never_publish() {
    both(|engine| {
        let r = rig(&format!("rfail-{engine}"), engine);
        let keys = r.keys(6);
        r.store(&keys);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 6);
        r.drop_l1();
        r.fault.store(Fault::ReadEio as u32, Ordering::Relaxed);
        assert!(r
            .tier
            .load(&r.storage, &keys[..3], 0, None)
            .iter()
            .all(Option::is_none));
        r.fault.store(Fault::ReadFlip as u32, Ordering::Relaxed);
        assert!(r
            .tier
            .load(&r.storage, &keys[3..5], 0, None)
            .iter()
            .all(Option::is_none));
        let s = r.tier.status();
        assert_eq!((s.errors, s.corrupt, s.objects, s.hits), (3, 2, 1, 0));
        assert!(!r.storage.contains_ready(&keys[0]) && !r.storage.contains_ready(&keys[3]));
        r.check_clean();
        // The healthy one still loads.
        r.fault.store(Fault::None as u32, Ordering::Relaxed);
        let l = r.tier.load(&r.storage, &keys[5..], 2, None);
        let lease = l[0].expect("loads");
        r.storage.finish_read(&[(keys[5], lease)], 2);
        assert!(r.bytes_ok(&keys[5]));
        r.check_clean();
    });
}

#[test]
fn prefetch_bound_and_missing_keys() {
    let r = rig_with("bound", "pread", 3);
    let keys = r.keys(5);
    r.store(&keys[..4]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..4]), 4);
    r.drop_l1();
    // Budget 3: only the first three keys are loaded; the rest are left for a later call.
    let l = r.tier.load(&r.storage, &keys, 0, None);
    assert_eq!(
        l.iter().map(Option::is_some).collect::<Vec<_>>(),
        [true, true, true, false, false]
    );
    r.unlock(&keys, &l, 0);
    // The budget is returned: the fourth loads now; the fifth was never on L2.
    let l = r.tier.load(&r.storage, &keys[3..], 0, None);
    assert!(l[0].is_some() && l[1].is_none());
    r.storage.finish_read(&[(keys[3], l[0].unwrap())], 0);
    assert_eq!(r.tier.status().hits, 4);
    r.check_clean();
}

#[test]
fn concurrent_loads_of_a_shared_prefix_all_hit() {
    let r = rig("shared", "uring");
    let keys = r.keys(16);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 16);
    r.drop_l1();
    // Four lookups of the same prefix at once: whoever loads a key first publishes it; the
    // others wait for it instead of reporting a miss.
    let results: Vec<Vec<Option<u64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| r.tier.load(&r.storage, &keys, 0, None)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for leases in &results {
        assert_eq!(r.unlock(&keys, leases, 0), keys.len(), "{leases:?}");
    }
    assert_eq!(r.tier.status().hits, 16, "each object read from disk once");
    assert!(keys.iter().all(|k| r.bytes_ok(k)));
    r.check_clean();
}

#[test]
fn unreadable_headers_at_start_up_are_skipped_not_fatal() {
    let mut r = rig("hdr", "pread");
    let keys = r.keys(5);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 5);
    let owner = r.dir.take().expect("first rig owns the directory");
    let dir = owner.0.clone();
    drop(r);
    // Reopen with every slot-header read failing: the node starts, empty, and says why.
    let r2 = open_rig(dir.clone(), "pread", 1024, Fault::HeaderReadEio);
    let s = r2.tier.status();
    assert_eq!((s.recovered, s.objects), (0, 0));
    assert!(
        s.errors >= 5,
        "each unreadable header block is counted: {}",
        s.errors
    );
    r2.tier.check().unwrap();
    drop(r2);
    // A healthy reopen finds all five.
    let r3 = open_rig(dir, "pread", 1024, Fault::None);
    assert_eq!(r3.tier.status().recovered, 5, "{:?}", r3.tier.status());
    drop(owner);
}

#[test]
fn pipelined_batches_write_and_load_everything() {
    both(|engine| {
        let dir = std::env::temp_dir().join(format!(
            "kvnode-l2unit-{}-pipe-{engine}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        // Batches of 8: 60 objects are 8 write batches (pipelined on the I/O thread) and two
        // load sub-batches (32 + 28, the second read while the first is verified).
        let mut r = open_rig_batched(dir.clone(), engine, 1024, Fault::None, 8);
        r.dir = Some(tempdir::Dir(dir));
        let keys = r.keys(60);
        r.store(&keys);
        r.fault
            .store(Fault::EveryOtherWrite as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 30);
        r.check_clean();
        r.fault.store(Fault::None as u32, Ordering::Relaxed);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 30);
        r.check_clean();
        r.drop_l1();
        let leases = r.tier.load(&r.storage, &keys, 1, None);
        assert_eq!(r.unlock(&keys, &leases, 1), keys.len());
        assert!(keys.iter().all(|k| r.bytes_ok(k)));
        let s = r.tier.status();
        assert_eq!((s.writes, s.errors, s.hits, s.corrupt), (60, 30, 60, 0));
        r.check_clean();
    });
}

#[test]
fn objects_of_another_layout_are_not_loaded() {
    use crate::storage::{Dtype, Layout};
    let r = rig("layout", "pread");
    let keys = r.keys(3);
    // Committed under [2, 2, 16, 256] float32 (64 KiB): the L2 copy carries that layout.
    let f32_layout = Layout::new(vec![2, 2, 16, 256], Dtype::Float32).unwrap();
    r.store_as(&keys, f32_layout.fingerprint(), 0xa5);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 3);
    r.drop_l1();
    // Registered now with another size, or the same size in another dtype: not loaded.
    for other in [
        Layout::new(vec![2, 2, 16, 128], Dtype::Float32).unwrap(),
        Layout::new(vec![2, 2, 16, 512], Dtype::Bfloat16).unwrap(),
    ] {
        let l = r.tier.load(&r.storage, &keys, 0, Some(&other));
        assert!(l.iter().all(Option::is_none), "{other:?}");
    }
    let s = r.tier.status();
    assert_eq!(
        (s.hits, s.errors, s.corrupt, s.objects),
        (0, 0, 0, 3),
        "kept, not counted as faults"
    );
    r.check_clean();
    // Under the layout they were stored with, they load.
    let l = r.tier.load(&r.storage, &keys, 0, Some(&f32_layout));
    assert_eq!(r.unlock(&keys, &l, 0), 3);
    r.check_clean();
}

#[test]
fn an_uncompleted_write_batch_releases_everything_it_holds() {
    let r = rig("dropbatch", "pread");
    let keys = r.keys(5);
    r.store(&keys);
    // Planned (L1 locks, L2 slots, staging blocks taken) but never completed, as when the
    // thread meant to complete it is gone: dropping it gives everything back.
    let batch = r
        .tier
        .prepare_write(&r.storage, &r.namespaces, &keys)
        .expect("five objects to write");
    assert_eq!(r.storage.counts().read_locked, 5);
    drop(batch);
    r.check_clean();
    let s = r.tier.status();
    assert_eq!((s.objects, s.writes, s.errors), (0, 0, 5));
    // Nothing is stuck: the next attempt writes them all.
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 5);
    r.check_clean();
}

#[test]
fn write_batches_are_bounded_by_objects_and_bytes() {
    use super::tier::{byte_bounded_parts, WRITE_BATCH_BYTES};
    let keys: Vec<StorageKey> = (0..10u8)
        .map(|i| StorageKey {
            chunk_hash: [i; 32],
            kv_rank: 0,
            object_group: 0,
            namespace: crate::storage::NamespaceId(0),
        })
        .collect();
    let sizes = |parts: &[&[StorageKey]]| parts.iter().map(|p| p.len()).collect::<Vec<_>>();
    // Small objects: the object bound.
    let small = byte_bounded_parts(&keys, 4, &|_| 1 << 20);
    assert_eq!(sizes(&small), vec![4, 4, 2]);
    // 32 MiB objects: four reach the byte bound, whatever the object bound.
    let big = byte_bounded_parts(&keys, 64, &|_| WRITE_BATCH_BYTES / 4);
    assert_eq!(sizes(&big), vec![4, 4, 2]);
    // An object over the bound is a batch of its own; nothing is lost or reordered.
    let huge = byte_bounded_parts(&keys, 64, &|_| WRITE_BATCH_BYTES * 2);
    assert_eq!(sizes(&huge), vec![1; 10]);
    assert_eq!(huge.concat(), keys);
    assert!(byte_bounded_parts(&[], 4, &|_| 1).is_empty());
}

#[test]
fn an_object_stored_again_under_another_layout_replaces_its_l2_copy() {
    use crate::storage::{Dtype, Layout};
    let r = rig("relayout", "pread");
    let keys = r.keys(3);
    let f32_layout = Layout::new(vec![2, 2, 16, 256], Dtype::Float32).unwrap();
    let bf16_layout = Layout::new(vec![2, 2, 16, 512], Dtype::Bfloat16).unwrap();
    assert_eq!(f32_layout.object_bytes(), bf16_layout.object_bytes());
    r.store_as(&keys, f32_layout.fingerprint(), 0xa5);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 3);
    // The same object again under the same layout: nothing to write.
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 0);
    assert!(keys
        .iter()
        .all(|k| r.tier.holds_as(k, OBJ, f32_layout.fingerprint())));
    r.drop_l1();
    // The model comes back in bf16 and stores the same prefixes (other bytes).
    r.store_as(&keys, bf16_layout.fingerprint(), 0x3c);
    assert!(keys
        .iter()
        .all(|k| !r.tier.holds_as(k, OBJ, bf16_layout.fingerprint())));
    assert_eq!(
        r.tier.persist(&r.storage, &r.namespaces, &keys),
        3,
        "replaced"
    );
    r.drop_l1();
    let l = r.tier.load(&r.storage, &keys, 0, Some(&f32_layout));
    assert!(l.iter().all(Option::is_none), "the f32 copy is gone");
    let l = r.tier.load(&r.storage, &keys, 0, Some(&bf16_layout));
    assert_eq!(r.unlock(&keys, &l, 0), 3);
    // Loaded objects keep the layout they were written under (a later write-behind of them
    // would stamp it again).
    for k in &keys {
        assert_eq!(
            r.storage.ready_object(k),
            Some((OBJ, bf16_layout.fingerprint()))
        );
        assert!(r.pool_bytes_are(k, 0x3c));
    }
    let s = r.tier.status();
    assert_eq!((s.objects, s.writes, s.errors, s.corrupt), (3, 6, 0, 0));
    r.check_clean();
}

/// Issue 10, defect 2: an extent header unreadable at one start-up must not let that run reuse
/// the extent's epoch or restart sequence numbers below those already on disk; otherwise, at the
/// next start, the old slot headers of the extent look current again (objects come back from
/// an extent reassigned meanwhile) and an old copy of a replaced object outranks the new one.
#[test]
fn an_unreadable_extent_header_never_brings_back_stale_objects() {
    let mut r = rig("stale", "pread");
    let keys = r.keys(6);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 6);
    let owner = r.dir.take().expect("first rig owns the directory");
    let dir = owner.0.clone();
    drop(r);
    // Run 2: the extent header cannot be read at start-up (a transient EIO): the tier starts
    // empty and gives the extent out again. Key 5 is stored again with other bytes.
    let r2 = open_rig(dir.clone(), "pread", 1024, Fault::ExtentHeaderReadEio);
    assert_eq!(r2.tier.status().recovered, 0);
    r2.fault.store(Fault::None as u32, Ordering::Relaxed);
    let keys2 = r2.keys(6);
    r2.store_as(&keys2[5..], 0, 0x5a);
    assert_eq!(r2.tier.persist(&r2.storage, &r2.namespaces, &keys2[5..]), 1);
    drop(r2);
    // Run 3, healthy: only what run 2 wrote is current.
    let r3 = open_rig(dir, "pread", 1024, Fault::None);
    let keys3 = r3.keys(6);
    let back: Vec<usize> = (0..5).filter(|&i| r3.tier.contains(&keys3[i])).collect();
    assert!(
        back.is_empty(),
        "objects of the reassigned extent came back: keys {back:?}"
    );
    let l = r3.tier.load(&r3.storage, &keys3[5..], 0, None);
    assert!(l[0].is_some(), "key 5 is on L2");
    assert!(
        r3.pool_bytes_are(&keys3[5], 0x5a),
        "key 5 came back with the bytes it had before it was replaced"
    );
    r3.unlock(&keys3[5..], &l, 0);
    r3.check_clean();
    drop(owner);
}

/// Issue 10, defect 6: the write-behind reads an L1 slot with O_DIRECT; the hold it keeps on the
/// object must outlive the read TTL (a slow device), or the slot is freed and reused while the
/// device still reads it.
#[test]
fn a_write_behind_holds_its_slot_past_the_read_ttl() {
    let r = rig("iohold", "pread");
    let keys = r.keys(3);
    r.store(&keys);
    let batch = r
        .tier
        .prepare_write(&r.storage, &r.namespaces, &keys)
        .expect("three objects to write");
    let held: Vec<u64> = keys
        .iter()
        .map(|k| r.storage.ready_object(k).map(|_| 0).unwrap_or(1))
        .collect();
    assert_eq!(held, vec![0, 0, 0]);
    // Much later (every timed lock has expired), CLEAR: the objects must stay allocated.
    r.storage.expire_locks(u64::MAX / 2);
    r.storage.clear();
    let fresh: Vec<StorageKey> = (100..103u8)
        .map(|i| StorageKey {
            chunk_hash: [i; 32],
            ..keys[0]
        })
        .collect();
    let grants = r.storage.reserve_write(&fresh, OBJ, false);
    let in_flight: Vec<u64> = keys
        .iter()
        .filter_map(|k| {
            r.storage
                .snapshot()
                .into_iter()
                .find(|(x, _)| x == k)
                .map(|(_, e)| e.slot.offset)
        })
        .collect();
    assert_eq!(in_flight.len(), 3, "the objects being written were freed");
    for g in grants.iter().flatten() {
        assert!(
            !in_flight.contains(&g.slot.offset),
            "a slot being written to disk was handed out again"
        );
    }
    let items: Vec<_> = fresh
        .iter()
        .copied()
        .zip(grants)
        .filter_map(|(k, g)| g.ok().map(|g| (k, g)))
        .collect();
    r.storage.abort_write(&items);
    assert_eq!(r.tier.complete_write(&r.storage, batch), 3);
    // Written, and freed now that the device is done with them (they were cleared).
    assert_eq!(r.storage.counts().doomed, 0);
    r.check_clean();
}

/// Issue 10, defect 6: after a failed fdatasync, the objects written since the last good sync
/// are not known to be durable (a later sync may succeed without them): they leave the index,
/// counted, and the caller learns which to write again.
#[test]
fn a_failed_sync_drops_what_it_should_have_made_durable() {
    let r = rig("syncdrop", "pread");
    let keys = r.keys(6);
    r.store(&keys[..3]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..3]), 3);
    r.tier.sync().unwrap();
    r.store(&keys[3..]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[3..]), 3);
    r.fault.store(Fault::SyncEio as u32, Ordering::Relaxed);
    let (_, mut dropped) = r.tier.sync().unwrap_err();
    dropped.sort();
    let mut want = keys[3..].to_vec();
    want.sort();
    assert_eq!(
        dropped, want,
        "exactly the objects written since the good sync"
    );
    assert!(
        keys[..3].iter().all(|k| r.tier.contains(k)),
        "synced ones stay"
    );
    assert!(keys[3..].iter().all(|k| !r.tier.contains(k)));
    assert_eq!(r.tier.status().errors, 3);
    // Written again, they count once the device syncs.
    r.fault.store(Fault::None as u32, Ordering::Relaxed);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[3..]), 3);
    r.tier.sync().unwrap();
    assert!(keys.iter().all(|k| r.tier.contains(k)));
    r.check_clean();
}

/// Issue 10, defect 6: an object stored again while its older L2 entry is still busy (being
/// loaded, and dropped meanwhile) was neither written nor counted; it is now written once the
/// older entry is gone.
#[test]
fn a_store_that_meets_a_busy_older_entry_is_written_later() {
    use crate::storage::{Dtype, Layout};
    let r = rig("deferred", "pread");
    let keys = r.keys(1);
    let a = Layout::new(vec![2, 2, 16, 256], Dtype::Float32).unwrap();
    let b = Layout::new(vec![2, 2, 16, 512], Dtype::Bfloat16).unwrap();
    r.store_as(&keys, a.fingerprint(), 0xa5);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 1);
    r.drop_l1();
    // A load is in flight on the old copy (pinned) when the object comes back under layout b.
    let pinned = r.tier.pin_for_tests(&keys[0]).expect("on L2");
    r.store_as(&keys, b.fingerprint(), 0x3c);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 0);
    assert!(!r.tier.holds_as(&keys[0], OBJ, b.fingerprint()));
    // The load ends; the writer, idle, tries the deferred key again.
    r.tier.unpin_for_tests(&keys[0], pinned);
    assert_eq!(r.tier.requeue_deferred(), 1);
    assert_eq!(r.tier.queue.len(), 1);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 1);
    assert!(r.tier.holds_as(&keys[0], OBJ, b.fingerprint()));
    r.check_clean();
}

/// Issue 10, defect 6: a slot header may reach the device only after its payload was written
/// completely, so a crash never leaves a header whose payload is missing (recovered, then
/// reported corrupt).
#[test]
fn slot_headers_are_written_after_their_payloads() {
    let r = rig("order", "pread");
    let keys = r.keys(4);
    r.store(&keys);
    r.writes.lock().unwrap().clear();
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 4);
    let batches = r.writes.lock().unwrap().clone();
    let batch_of = |off: u64, len_is_header: bool| {
        batches
            .iter()
            .position(|b| {
                b.iter()
                    .any(|io| io.file_offset == off && (io.len == HEADER) == len_is_header)
            })
            .expect("written")
    };
    let mut payloads = 0;
    for io in batches.iter().flatten().filter(|io| io.len > HEADER) {
        payloads += 1;
        let header_at = io.file_offset - HEADER;
        assert!(
            batch_of(io.file_offset, false) < batch_of(header_at, true),
            "the header at {header_at} went to the device with or before its payload"
        );
    }
    assert_eq!(payloads, 4);
    r.check_clean();
}

/// The index budget of the unit-test device (`l2.max_index_bytes`) that holds `objects`.
fn index_budget_for(r: &Rig, objects: u64) -> u64 {
    let s = r.tier.status();
    let extents = super::format::extent_count(s.bytes, s.extent_bytes);
    L2Index::<StorageKey>::fixed_bytes(extents, s.extent_bytes) + objects * INDEX_BYTES_PER_OBJECT
}

/// Issue 10, defect 5: a device whose index would not fit `l2.max_index_bytes` with even one
/// object is refused at start-up, naming the limit and what the geometry needs; the default
/// leaves the small device unconstrained.
#[test]
fn a_device_whose_index_exceeds_max_index_bytes_is_refused() {
    let mut r = rig("capopen", "pread");
    let s = r.tier.status();
    assert_eq!(s.index_limit_bytes, 1 << 30);
    assert!(s.index_bytes <= s.index_limit_bytes);
    let extents = super::format::extent_count(s.bytes, s.extent_bytes);
    let slots_at_min_stride = extents as u64 * ((s.extent_bytes - 4096) / 8192);
    assert!(
        s.index_max_objects > slots_at_min_stride,
        "the default never binds here"
    );
    let (one, fixed) = (index_budget_for(&r, 1), index_budget_for(&r, 0));
    let owner = r.dir.take().expect("first rig owns the directory");
    let dir = owner.0.clone();
    drop(r);
    let too_small = one - 1;
    let err = match try_open_rig(dir.clone(), Fault::None, |c| c.max_index_bytes = too_small) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("opened with {too_small} bytes of index"),
    };
    for needle in [
        too_small.to_string(),
        fixed.to_string(),
        one.to_string(),
        "l2.max_index_bytes".to_string(),
    ] {
        assert!(err.contains(&needle), "{needle:?} not in {err:?}");
    }
    // One object's worth opens, with a cap of one object.
    let r = try_open_rig(dir, Fault::None, |c| c.max_index_bytes = one).unwrap();
    let s = r.tier.status();
    assert_eq!((s.index_max_objects, s.index_limit_bytes), (1, one));
    let keys = r.keys(3);
    r.store(&keys);
    // In one batch the second object finds the first still being written (not evictable):
    // skipped. One at a time, each evicts the one before.
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..2]), 1);
    assert_eq!(r.tier.status().skipped, 1);
    for k in &keys[1..] {
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &[*k]), 1);
    }
    let s = r.tier.status();
    assert_eq!(
        (s.objects, s.evictions),
        (1, 2),
        "at the cap, each write evicts"
    );
    assert!(r.tier.contains(&keys[2]));
    r.check_clean();
    drop(r);
    drop(owner);
}

/// Issue 10, defect 5: recovery indexes at most the cap, the objects written last; the others
/// are treated as evicted: their slots are reused (a header overwritten there never brings
/// the old object back), and those not overwritten come back under a larger limit.
#[test]
fn recovery_beyond_the_index_cap_keeps_the_newest_and_reuses_the_rest() {
    let mut r = rig("caprec", "pread");
    let keys = r.keys(14);
    r.store(&keys[..10]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..10]), 10);
    let cap4 = index_budget_for(&r, 4);
    let owner = r.dir.take().expect("first rig owns the directory");
    let dir = owner.0.clone();
    drop(r);
    // Run 2: room for 4 entries; keys were written in order, so 6..10 are the newest.
    let r2 = try_open_rig(dir.clone(), Fault::None, |c| c.max_index_bytes = cap4).unwrap();
    let s = r2.tier.status();
    assert_eq!(
        (s.recovered, s.objects, s.unindexed, s.index_max_objects),
        (4, 4, 6, 4)
    );
    assert!(s.index_bytes <= s.index_limit_bytes && s.index_limit_bytes == cap4);
    let keys2 = r2.keys(14);
    let held: Vec<usize> = (0..14).filter(|&i| r2.tier.contains(&keys2[i])).collect();
    assert_eq!(held, [6, 7, 8, 9]);
    r2.check_clean();
    // New objects at the cap evict the least recently used and take the lowest free slots:
    // those of the unindexed keys 0..4.
    r2.store(&keys2[10..]);
    assert_eq!(
        r2.tier.persist(&r2.storage, &r2.namespaces, &keys2[10..]),
        4
    );
    let s = r2.tier.status();
    assert_eq!((s.objects, s.evictions), (4, 4));
    let held: Vec<usize> = (0..14).filter(|&i| r2.tier.contains(&keys2[i])).collect();
    assert_eq!(held, [10, 11, 12, 13]);
    r2.check_clean();
    drop(r2);
    // Run 3, default limit: keys 0..4 were overwritten and stay gone; 4..10 (unindexed or
    // evicted, intact) come back; every object loads with its own bytes.
    let r3 = open_rig(dir, "pread", 1024, Fault::None);
    let keys3 = r3.keys(14);
    let back: Vec<usize> = (0..14).filter(|&i| r3.tier.contains(&keys3[i])).collect();
    assert_eq!(back, (4..14).collect::<Vec<_>>());
    assert_eq!(r3.tier.status().unindexed, 0);
    let l = r3.tier.load(&r3.storage, &keys3[4..], 0, None);
    assert!(l.iter().all(Option::is_some));
    assert!(keys3[4..].iter().all(|k| r3.bytes_ok(k)));
    r3.unlock(&keys3[4..], &l, 0);
    r3.check_clean();
    drop(owner);
}

/// Runs `f` on a thread and waits at most 20 s for it; if it has not returned by then, lifts
/// `fault` (so the stuck I/O ends and every thread can finish) and fails with `what`.
fn within<T: Send>(fault: &AtomicU32, what: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(20)) {
            Ok(v) => v,
            Err(_) => {
                fault.store(Fault::None as u32, Ordering::Relaxed);
                panic!("{what}");
            }
        }
    })
}

/// Waits (at most 20 s) until `cond` holds.
fn eventually(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Issue 10, defect 3: a write-behind batch stuck in the device must not hold a CLEAR, and a
/// CLEAR must not bar loads: both return while the write is still stuck; the stuck batch,
/// begun before the CLEAR, is never committed after it.
#[test]
fn a_clear_and_loads_never_wait_for_a_stuck_write() {
    both(|engine| {
        let r = rig(&format!("stuckw-{engine}"), engine);
        let keys = r.keys(6);
        r.store(&keys[..3]);
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..3]), 3);
        r.drop_l1();
        r.store(&keys[3..]);
        r.fault
            .store(Fault::StuckPayloadWrites as u32, Ordering::Relaxed);
        std::thread::scope(|s| {
            let writer = s.spawn(|| r.tier.persist(&r.storage, &r.namespaces, &keys[3..]));
            eventually("the write reaches the device", || {
                !r.tier.stuck_for().is_zero()
            });
            let l = within(&r.fault, "a load waited for a stuck write", || {
                r.tier.load(&r.storage, &keys[..3], 0, None)
            });
            assert_eq!(
                r.unlock(&keys[..3], &l, 0),
                3,
                "loads from the healthy reads"
            );
            within(&r.fault, "CLEAR waited for a stuck write", || {
                r.tier.clear_with(|| r.storage.clear()).unwrap()
            });
            let l = within(&r.fault, "a load after CLEAR waited", || {
                r.tier.load(&r.storage, &keys[..3], 0, None)
            });
            assert!(l.iter().all(Option::is_none), "cleared");
            // The device answers: the batch ends, and commits nothing (it began before CLEAR).
            r.fault.store(Fault::None as u32, Ordering::Relaxed);
            assert_eq!(writer.join().unwrap(), 0);
        });
        assert_eq!(r.tier.status().objects, 0);
        r.check_clean();
    });
}

/// Issue 10, defect 3: a load whose device does not answer costs its request misses after
/// `l2.io_timeout_ms`, not its thread; the worker stuck in the device releases the locks the
/// load took once the device answers; meanwhile later loads miss at once.
#[test]
fn a_load_on_a_stuck_device_misses_in_time_and_releases_its_locks_later() {
    let dir = std::env::temp_dir().join(format!("kvnode-l2unit-{}-stuckr", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let _owner = tempdir::Dir(dir.clone());
    let r = try_open_rig(dir, Fault::None, |c| {
        c.engine = "pread".into();
        c.io_timeout_ms = 200;
    })
    .unwrap();
    let keys = r.keys(3);
    r.store(&keys);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys), 3);
    r.drop_l1();
    let Rig {
        tier,
        storage,
        fault,
        ..
    } = r;
    let set = super::L2Set::from_tiers(vec![tier]);
    set.workers().start();
    let stop = std::sync::atomic::AtomicBool::new(false);
    fault.store(Fault::StuckPayloadReads as u32, Ordering::Relaxed);
    std::thread::scope(|s| {
        s.spawn(|| super::loader::serve(&set, &storage, &stop));
        let l = within(&fault, "a load waited for a stuck device", || {
            set.load(&storage, &keys, 0, None)
        });
        assert!(l.iter().all(Option::is_none));
        assert_eq!(set.status().total.stalled, 3);
        eventually("the tier is marked stuck", || set.tiers()[0].stuck());
        assert!(set.status().total.stuck);
        let l = within(&fault, "a load on a stuck device waited", || {
            set.load(&storage, &keys, 0, None)
        });
        assert!(l.iter().all(Option::is_none));
        assert_eq!(set.status().total.stalled, 6, "missed at once, counted");
        // The device answers: the abandoned load completes and gives its locks back.
        fault.store(Fault::None as u32, Ordering::Relaxed);
        eventually("the abandoned load releases everything", || {
            !set.tiers()[0].stuck()
                && storage.counts().read_locked == 0
                && storage.counts().write_reserved == 0
        });
        let l = set.load(&storage, &keys, 0, None);
        assert!(l.iter().all(Option::is_some), "healthy again");
        let held: Vec<(StorageKey, u64)> =
            keys.iter().zip(&l).map(|(k, l)| (*k, l.unwrap())).collect();
        storage.finish_read(&held, 0);
        stop.store(true, Ordering::Release);
    });
    assert!(storage.memcheck().ok);
    set.check().unwrap();
}

/// Issue 10, defect 6: a device that fails at start-up (its superblock cannot be written) is
/// left out and the node runs on the others, or without L2 when it was the only one; a device
/// holding another program's data still stops the start-up.
#[test]
fn a_failing_device_is_left_out_at_start_up_not_fatal() {
    let base = std::env::temp_dir().join(format!("kvnode-l2unit-{}-failed", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let _owner = tempdir::Dir(base.clone());
    let (good, bad) = (base.join("good"), base.join("bad"));
    let pool = Arc::new(
        SharedPool::create(&PoolOptions {
            bytes: 8 << 20,
            prefer: PagePreference::Pages4K,
            prefault: true,
            name: "l2-unit".into(),
            posix_shm_name: None,
            cancel: None,
        })
        .unwrap(),
    );
    let staging = pool.len() - 2 * STAGING_BYTES;
    let namespaces = Namespaces::default();
    // Engines are made two per device, in device order: the second device's always fail.
    let made = AtomicU32::new(0);
    let p = pool.clone();
    let wrap = move |inner: Box<dyn BlockEngine>| -> Box<dyn BlockEngine> {
        let n = made.fetch_add(1, Ordering::Relaxed);
        let fault = if n >= 2 {
            Fault::EveryWriteEio
        } else {
            Fault::None
        };
        Box::new(FaultyEngine {
            inner,
            pool: p.clone(),
            fault: Arc::new(AtomicU32::new(fault as u32)),
            writes: Default::default(),
        })
    };
    let cfg = L2Config {
        paths: vec![good.clone(), bad.clone()],
        bytes: 32 << 20,
        engine: "pread".into(),
        ..L2Config::default()
    };
    let set = super::L2Set::open_wrapped(&cfg, pool.clone(), staging, &namespaces, &wrap)
        .expect("a failed device does not stop the start-up")
        .expect("one device works");
    assert_eq!(set.tiers().len(), 1);
    let s = set.status();
    assert_eq!(s.failed_devices.len(), 1);
    assert_eq!(s.failed_devices[0].path, bad.display().to_string());
    assert!(
        s.failed_devices[0].error.contains("formatting the L2 tier"),
        "{:?}",
        s.failed_devices
    );
    drop(set);
    // Only the failing device: the node runs without L2.
    let made = AtomicU32::new(0);
    let p = pool.clone();
    let all_fail = move |inner: Box<dyn BlockEngine>| -> Box<dyn BlockEngine> {
        made.fetch_add(1, Ordering::Relaxed);
        Box::new(FaultyEngine {
            inner,
            pool: p.clone(),
            fault: Arc::new(AtomicU32::new(Fault::EveryWriteEio as u32)),
            writes: Default::default(),
        })
    };
    let only_bad = L2Config {
        paths: vec![bad.clone()],
        ..cfg.clone()
    };
    assert!(
        super::L2Set::open_wrapped(&only_bad, pool.clone(), staging, &namespaces, &all_fail)
            .unwrap()
            .is_none()
    );
    // Another program's data is a refusal, whatever the other devices do.
    let foreign = base.join("foreign.img");
    std::fs::write(&foreign, vec![9u8; 4 << 20]).unwrap();
    let refused = L2Config {
        paths: vec![good, foreign],
        ..cfg
    };
    let e = super::L2Set::open(&refused, pool, staging, &namespaces)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("not a kvnode L2 tier"), "{e}");
}

mod checkpoint;
