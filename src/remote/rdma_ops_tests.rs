//! The RDMA data ops ([`super::rdma_ops`]) over `FakeFabric`: the fake peer holds the engine's
//! memory in-process and checks every access like a NIC. A store and a retrieve with every
//! byte verified, descriptors out of bounds refused before anything is posted, and failed ops
//! (injected errors, peer death) that free the store and never publish it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvnode_hw::fabric::{ConnSetup, Fabric, FakeFabric, FakeOptions, FakePeer, FakeRegion};
use kvnode_hw::{PagePreference, PoolOptions, SharedPool};
use parking_lot::Mutex;

use super::descriptors::RegionTable;
use super::mover::Mover;
use super::mover::Pace;
use super::rdma_ops::{read_remote, write_remote, RemoteDataOp, RemotePath};
use crate::access::Role;
use crate::client::ChunkRangeBuilder;
use crate::config::NodeConfig;
use crate::error::ErrorKind;
use crate::modules::{Caller, NodeContext};
use crate::protocol::{ChunkRange, RegisterRequest, RemoteBuf, RemoteRegion, Request, Response};
use crate::server::dispatch::{dispatch, Registered};
use crate::transport::ReplySink;

const POOL_BYTES: u64 = 16 << 20;
const CONN: u64 = 77;
/// The engine's memory: chunks to store at `SRC`, buffers to retrieve into at `DST`.
const SRC: (u32, u64, u32) = (1, 0x7f00_0010_0000, 0x51);
const DST: (u32, u64, u32) = (2, 0x7f00_0090_0000, 0x52);
const CHUNKS: usize = 4;

/// A reply sink that keeps the last reply (no fd passing: a remote connection).
#[derive(Default)]
struct Sink(Mutex<Option<Response>>);

impl ReplySink for Sink {
    fn send(&self, _: u64, _: u16, resp: &Response, _: Option<std::os::fd::BorrowedFd<'_>>) {
        *self.0.lock() = Some(resp.clone());
    }
    fn connection_id(&self) -> u64 {
        CONN
    }
    fn can_pass_fd(&self) -> bool {
        false
    }
    fn peer(&self) -> Option<kvnode_hw::PeerCred> {
        None
    }
}

/// A node context, a remote connection's identity and a fake fabric whose clock runs on a
/// thread until the value is dropped.
struct Rig {
    ctx: Arc<NodeContext>,
    caller: Caller,
    registered: Registered,
    sink: Arc<Sink>,
    fake: Arc<FakeFabric>,
    mover: Arc<Mover>,
    stop: Arc<AtomicBool>,
    clock: Option<std::thread::JoinHandle<()>>,
    object_bytes: u64,
}

impl Rig {
    fn new(opts: FakeOptions) -> Rig {
        let pool = Arc::new(
            SharedPool::create(&PoolOptions {
                bytes: POOL_BYTES,
                prefer: PagePreference::Pages4K,
                prefault: false,
                name: "kvnode-rdma-ops-test".into(),
                ..PoolOptions::default()
            })
            .unwrap(),
        );
        let config = NodeConfig {
            pool_bytes: POOL_BYTES,
            pages: "4k".into(),
            workers: 1,
            ..NodeConfig::default()
        };
        let ctx = Arc::new(NodeContext::new(config, pool.clone(), Arc::default(), None));
        let fake = Arc::new(FakeFabric::new(opts, pool.clone()).unwrap());
        fake.register(&pool).unwrap();
        let mover = Mover::start(fake.clone()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let clock = {
            let (fake, stop) = (fake.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut t = 0;
                while !stop.load(Ordering::Relaxed) {
                    t += 1;
                    fake.advance_to(t);
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };
        let caller = Caller::remote(CONN, Role::Client);
        let mut registered = Registered::default();
        registered.set_caller(caller.clone());
        let mut rig = Rig {
            ctx,
            caller,
            registered,
            sink: Arc::default(),
            fake,
            mover,
            stop,
            clock: Some(clock),
            object_bytes: 0,
        };
        let reply = rig.call(Request::Register(RegisterRequest {
            instance_id: 1,
            model: "m".into(),
            world_size: 1,
            block_size: 16,
            num_layers: 2,
            hidden_dim: 64,
            dtype: "bfloat16".into(),
            use_mla: false,
            physical_slots: None,
        }));
        let Response::Registered(r) = reply else {
            panic!("register: {reply:?}");
        };
        rig.object_bytes = r.object_bytes;
        rig
    }

    fn call(&mut self, req: Request) -> Response {
        let sink: Arc<dyn ReplySink> = self.sink.clone();
        dispatch(&self.ctx, &sink, 1, req, &mut self.registered);
        self.sink.0.lock().take().expect("a reply")
    }

    fn range(&self, seed: u32) -> ChunkRange {
        let chunk_tokens = self.ctx.config.chunk_tokens;
        let tokens: Vec<u32> = (0..CHUNKS as u32 * chunk_tokens)
            .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
            .collect();
        ChunkRangeBuilder::worker("m", 1, 0).tokens(&tokens, chunk_tokens)
    }

    /// The engine's memory: `CHUNKS` chunks of seeded bytes to store, and as many zeroed
    /// buffers to retrieve into; the connection's region table names both.
    fn connect(&self, seed: u8) -> (RemotePath, RegionTable, Vec<u8>) {
        let len = CHUNKS as u64 * self.object_bytes;
        let src: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
            .collect();
        let conn = self
            .mover
            .connect(ConnSetup::Fake(FakePeer {
                regions: vec![
                    FakeRegion {
                        addr: SRC.1,
                        rkey: SRC.2,
                        bytes: src.clone(),
                    },
                    FakeRegion {
                        addr: DST.1,
                        rkey: DST.2,
                        bytes: vec![0; len as usize],
                    },
                ],
            }))
            .unwrap();
        let mut regions = RegionTable::new(8);
        regions
            .register(&[
                RemoteRegion {
                    id: SRC.0,
                    addr: SRC.1,
                    len,
                    rkey: SRC.2,
                },
                RemoteRegion {
                    id: DST.0,
                    addr: DST.1,
                    len,
                    rkey: DST.2,
                },
            ])
            .unwrap();
        let path = RemotePath {
            mover: self.mover.clone(),
            conn,
        };
        (path, regions, src)
    }

    fn bufs(&self, region: u32, chunks: impl IntoIterator<Item = u32>) -> Vec<RemoteBuf> {
        chunks
            .into_iter()
            .map(|i| RemoteBuf {
                region,
                offset: u64::from(i) * self.object_bytes,
                len: self.object_bytes,
            })
            .collect()
    }

    fn prepare_store(&mut self, range: &ChunkRange) -> (u64, Vec<u32>) {
        match self.call(Request::PrepareStore {
            instance_id: 1,
            range: range.clone(),
        }) {
            Response::StorePrepared {
                transfer_id,
                chunk_indices,
                ..
            } => (transfer_id, chunk_indices),
            r => panic!("prepare store: {r:?}"),
        }
    }

    /// `Some(transfer_id)` on a hit.
    fn prepare_retrieve(&mut self, range: &ChunkRange) -> Option<u64> {
        match self.call(Request::PrepareRetrieve {
            instance_id: 1,
            range: range.clone(),
            lookup_session: None,
        }) {
            Response::RetrievePrepared {
                hit, transfer_id, ..
            } => hit.then_some(transfer_id),
            r => panic!("prepare retrieve: {r:?}"),
        }
    }

    fn deadline() -> Pace {
        Pace {
            stall: Duration::from_secs(60),
            min_bytes_per_sec: 1,
            cap: Instant::now() + Duration::from_secs(60),
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.clock.take() {
            let _ = t.join();
        }
        self.mover.stop();
    }
}

fn error_kind(r: &Response) -> Option<ErrorKind> {
    match r {
        Response::Error { kind, .. } => Some(ErrorKind::from_code(*kind)),
        _ => None,
    }
}

#[test]
fn a_store_and_a_retrieve_move_every_byte_through_the_fabric() {
    let mut rig = Rig::new(FakeOptions {
        seed: 3,
        ..FakeOptions::default()
    });
    let (path, regions, src) = rig.connect(0x5a);
    let range = rig.range(1);
    let (tid, idx) = rig.prepare_store(&range);
    assert_eq!(idx, (0..CHUNKS as u32).collect::<Vec<_>>());
    let bufs = rig.bufs(SRC.0, idx.iter().copied());
    let op = RemoteDataOp {
        instance_id: 1,
        transfer_id: tid,
        bufs: &bufs,
        commit: true,
    };
    let out = write_remote(
        &rig.ctx,
        &rig.caller,
        &regions,
        &path,
        &op,
        &Rig::deadline(),
    );
    let total = CHUNKS as u64 * rig.object_bytes;
    assert!(!out.broken);
    assert_eq!(out.moved, total);
    match out.resp {
        Response::SlotsWritten { bytes, published } => {
            assert_eq!(bytes, total);
            assert_eq!(published, Some(CHUNKS as u32));
        }
        r => panic!("store: {r:?}"),
    }

    // Retrieve into the engine's other buffers, in reverse order: each chunk lands where its
    // descriptor says, byte for byte.
    let rt = rig.prepare_retrieve(&range).expect("a hit after the store");
    let bufs = rig.bufs(DST.0, (0..CHUNKS as u32).rev());
    let op = RemoteDataOp {
        instance_id: 1,
        transfer_id: rt,
        bufs: &bufs,
        commit: true,
    };
    let out = read_remote(
        &rig.ctx,
        &rig.caller,
        &regions,
        &path,
        &op,
        &Rig::deadline(),
    );
    assert!(!out.broken, "{:?}", out.resp);
    assert_eq!(out.resp, Response::SlotsRead { bytes: total });
    let got = rig
        .fake
        .peer_region(path.conn, DST.2)
        .expect("the peer's buffers");
    let n = rig.object_bytes as usize;
    for i in 0..CHUNKS {
        let want = &src[i * n..(i + 1) * n];
        let at = CHUNKS - 1 - i;
        assert!(got[at * n..(at + 1) * n] == *want, "chunk {i} differs");
    }
    // The retrieve committed: its locks are gone, the objects stay published.
    assert!(rig.ctx.memcheck().ok, "{:?}", rig.ctx.memcheck());
    assert!(rig.prepare_retrieve(&range).is_some());
    rig.mover.teardown(path.conn);
}

#[test]
fn descriptors_out_of_bounds_are_refused_before_anything_is_posted() {
    let mut rig = Rig::new(FakeOptions::default());
    let (path, regions, _) = rig.connect(1);
    let range = rig.range(2);
    let (tid, idx) = rig.prepare_store(&range);
    let n = rig.object_bytes;
    let mut cases: Vec<(Vec<RemoteBuf>, &str)> = Vec::new();
    let mut past = rig.bufs(SRC.0, idx.iter().copied());
    past[CHUNKS - 1].offset = (CHUNKS as u64) * n - 1; // one byte past the region
    cases.push((past, "runs past region"));
    let mut unknown = rig.bufs(SRC.0, idx.iter().copied());
    unknown[0].region = 9;
    cases.push((unknown, "not registered"));
    cases.push((rig.bufs(SRC.0, [0, 1]), "buffers for a transfer"));
    let mut short = rig.bufs(SRC.0, idx.iter().copied());
    short[1].len = n - 1;
    cases.push((short, "its slot holds"));
    cases.push((rig.bufs(SRC.0, [0, 0, 1, 2]), "overlap"));
    let posted = rig.fake.stats().posted_ops;
    for (bufs, why) in cases {
        let op = RemoteDataOp {
            instance_id: 1,
            transfer_id: tid,
            bufs: &bufs,
            commit: true,
        };
        let out = write_remote(
            &rig.ctx,
            &rig.caller,
            &regions,
            &path,
            &op,
            &Rig::deadline(),
        );
        assert!(!out.broken, "{why}");
        assert_eq!(
            error_kind(&out.resp),
            Some(ErrorKind::InvalidRequest),
            "{why}: {:?}",
            out.resp
        );
        let Response::Error { message, .. } = &out.resp else {
            unreachable!()
        };
        assert!(message.contains(why), "{why}: {message}");
    }
    assert_eq!(rig.fake.stats().posted_ops, posted, "nothing was posted");
    // The store stayed prepared: it can still be aborted (and nothing was published).
    match rig.call(Request::AbortStore {
        instance_id: 1,
        transfer_id: tid,
    }) {
        Response::StoreAborted { freed } => assert_eq!(freed, CHUNKS as u32),
        r => panic!("abort: {r:?}"),
    }
    assert!(rig.prepare_retrieve(&range).is_none());
    assert_eq!(rig.ctx.storage.used_bytes(), 0);

    // A retrieve's descriptors are checked the same way; a refused one stays prepared.
    let regions2 = regions;
    let (tid, _) = rig.prepare_store(&range);
    let bufs = rig.bufs(SRC.0, 0..CHUNKS as u32);
    let op = RemoteDataOp {
        instance_id: 1,
        transfer_id: tid,
        bufs: &bufs,
        commit: true,
    };
    let out = write_remote(
        &rig.ctx,
        &rig.caller,
        &regions2,
        &path,
        &op,
        &Rig::deadline(),
    );
    assert!(
        matches!(out.resp, Response::SlotsWritten { .. }),
        "{:?}",
        out.resp
    );
    let rt = rig.prepare_retrieve(&range).unwrap();
    let mut bad = rig.bufs(DST.0, 0..CHUNKS as u32);
    bad[2].offset = u64::MAX - 10;
    let op = RemoteDataOp {
        instance_id: 1,
        transfer_id: rt,
        bufs: &bad,
        commit: true,
    };
    let posted = rig.fake.stats().posted_ops;
    let out = read_remote(
        &rig.ctx,
        &rig.caller,
        &regions2,
        &path,
        &op,
        &Rig::deadline(),
    );
    assert_eq!(
        error_kind(&out.resp),
        Some(ErrorKind::InvalidRequest),
        "{:?}",
        out.resp
    );
    assert_eq!(rig.fake.stats().posted_ops, posted);
    rig.call(Request::CommitRetrieve {
        instance_id: 1,
        transfer_id: rt,
    });
    assert!(rig.ctx.memcheck().ok);
    rig.mover.teardown(path.conn);
}

/// Every op fails (`error_pct = 100`, or the peer dies mid-batch): the store's slots may hold
/// any bytes, so it is freed, never published, and the connection must close.
#[test]
fn a_failed_op_frees_the_store_and_never_publishes_it() {
    for (what, opts) in [
        (
            "injected error",
            FakeOptions {
                error_pct: 100,
                ..FakeOptions::default()
            },
        ),
        (
            "peer death",
            FakeOptions {
                peer_death_pct: 100,
                ..FakeOptions::default()
            },
        ),
    ] {
        let mut rig = Rig::new(opts);
        let (path, regions, _) = rig.connect(2);
        let range = rig.range(3);
        let (tid, idx) = rig.prepare_store(&range);
        let bufs = rig.bufs(SRC.0, idx.iter().copied());
        let op = RemoteDataOp {
            instance_id: 1,
            transfer_id: tid,
            bufs: &bufs,
            commit: true,
        };
        let out = write_remote(
            &rig.ctx,
            &rig.caller,
            &regions,
            &path,
            &op,
            &Rig::deadline(),
        );
        assert!(out.broken, "{what}");
        assert_eq!(out.moved, 0);
        assert_eq!(
            error_kind(&out.resp),
            Some(ErrorKind::Io),
            "{what}: {:?}",
            out.resp
        );
        let Response::Error { message, .. } = &out.resp else {
            unreachable!()
        };
        assert!(message.contains("nothing published"), "{what}: {message}");
        // Freed: the transfer is gone, its slots are back, nothing was published.
        let abort = rig.call(Request::AbortStore {
            instance_id: 1,
            transfer_id: tid,
        });
        assert_eq!(
            error_kind(&abort),
            Some(ErrorKind::UnknownTransfer),
            "{what}: {abort:?}"
        );
        assert_eq!(rig.ctx.storage.used_bytes(), 0, "{what}");
        assert!(rig.prepare_retrieve(&range).is_none(), "{what}");
        assert!(rig.ctx.memcheck().ok, "{what}");
        assert!(rig.fake.inflight_ranges().is_empty(), "{what}");
        rig.mover.teardown(path.conn);
    }
}

/// A retrieve whose push fails is an error (the engine's buffers hold undefined bytes) and
/// breaks the connection; the objects stay published and their locks go with the transfer.
#[test]
fn a_failed_retrieve_is_an_error_and_the_objects_stay() {
    let mut rig = Rig::new(FakeOptions::default());
    let (path, regions, _) = rig.connect(3);
    let range = rig.range(4);
    let (tid, idx) = rig.prepare_store(&range);
    let bufs = rig.bufs(SRC.0, idx.iter().copied());
    let op = RemoteDataOp {
        instance_id: 1,
        transfer_id: tid,
        bufs: &bufs,
        commit: true,
    };
    let out = write_remote(
        &rig.ctx,
        &rig.caller,
        &regions,
        &path,
        &op,
        &Rig::deadline(),
    );
    assert!(matches!(out.resp, Response::SlotsWritten { .. }));
    // The engine lies about its buffer: the fake NIC refuses the access (bad rkey).
    let mut lying = regions.clone();
    lying
        .register(&[RemoteRegion {
            id: 5,
            addr: DST.1,
            len: CHUNKS as u64 * rig.object_bytes,
            rkey: 0xdead,
        }])
        .unwrap();
    let rt = rig.prepare_retrieve(&range).unwrap();
    let bufs = rig.bufs(5, 0..CHUNKS as u32);
    let op = RemoteDataOp {
        instance_id: 1,
        transfer_id: rt,
        bufs: &bufs,
        commit: true,
    };
    let out = read_remote(&rig.ctx, &rig.caller, &lying, &path, &op, &Rig::deadline());
    assert!(out.broken);
    assert_eq!(error_kind(&out.resp), Some(ErrorKind::Io), "{:?}", out.resp);
    // Not committed: the retrieve is back in the table; committing it releases the locks.
    match rig.call(Request::CommitRetrieve {
        instance_id: 1,
        transfer_id: rt,
    }) {
        Response::Ok => {}
        r => panic!("commit: {r:?}"),
    }
    assert!(rig.prepare_retrieve(&range).is_some(), "still published");
    assert!(rig.ctx.memcheck().ok);
    rig.mover.teardown(path.conn);
}
