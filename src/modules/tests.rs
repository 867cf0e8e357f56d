//! Regression tests of the request-level defects found by review (each failed before its fix),
//! run in-process against a node on a manual clock.

use std::sync::Arc;

use crate::clock::Clock;
use crate::modules::NodeContext;
use crate::protocol::{ChunkRange, RegisterRequest, Request, Response};
use crate::server::dispatch;
use crate::sim::world::{self, CaptureSink};
use crate::storage::index::ObjectState;
use crate::transport::ReplySink;

/// One client connection to an in-process node.
struct Harness {
    ctx: Arc<NodeContext>,
    clock: Clock,
    conn: Arc<CaptureSink>,
    registered: dispatch::Registered,
}

const MODEL: &str = "m";

fn hash(i: u8) -> [u8; 32] {
    [i; 32]
}

impl Harness {
    fn new() -> Harness {
        let clock = Clock::manual(1_000);
        Harness {
            ctx: world::build_node(&clock),
            clock,
            conn: CaptureSink::new(7),
            registered: Default::default(),
        }
    }

    fn call(&mut self, req: Request) -> Response {
        let sink: Arc<dyn ReplySink> = self.conn.clone();
        dispatch::dispatch(&self.ctx, &sink, 1, req, &mut self.registered);
        self.conn.take().expect("every request is answered inline")
    }

    fn register(&mut self, id: u64) {
        let r = self.call(Request::Register(RegisterRequest {
            instance_id: id,
            model: MODEL.into(),
            world_size: 1,
            block_size: 16,
            num_layers: world::NUM_LAYERS,
            hidden_dim: world::HIDDEN,
            dtype: world::DTYPE.into(),
            use_mla: false,
            physical_slots: None,
        }));
        assert!(matches!(r, Response::Registered(_)), "{r:?}");
    }

    fn range(hashes: &[u8], worker: Option<u32>) -> ChunkRange {
        ChunkRange {
            model: MODEL.into(),
            world_size: 1,
            worker_id: worker,
            cache_salt: String::new(),
            first_chunk: 0,
            chunk_hashes: hashes.iter().map(|h| hash(*h)).collect(),
        }
    }

    /// Stores chunks `hashes` through instance `id`; returns their slot offsets.
    fn store(&mut self, id: u64, hashes: &[u8]) -> Vec<u64> {
        let r = self.call(Request::PrepareStore {
            instance_id: id,
            range: Self::range(hashes, Some(0)),
        });
        let Response::StorePrepared {
            transfer_id, slots, ..
        } = r
        else {
            panic!("{r:?}")
        };
        let c = self.call(Request::CommitStore {
            instance_id: id,
            transfer_id,
        });
        assert!(matches!(c, Response::StoreCommitted { .. }), "{c:?}");
        slots.iter().map(|s| s.offset).collect()
    }

    fn lookup(&mut self, session: &str, hashes: &[u8]) -> u32 {
        match self.call(Request::Lookup {
            request_id: session.into(),
            range: Self::range(hashes, None),
            tp_size: 1,
            readers: 0,
        }) {
            Response::LookupHits { chunks } => chunks,
            r => panic!("{r:?}"),
        }
    }

    /// Prepares a retrieve; returns (transfer id, slot offsets) of a hit.
    fn prepare_retrieve(
        &mut self,
        id: u64,
        hashes: &[u8],
        session: Option<&str>,
    ) -> (u64, Vec<u64>) {
        match self.call(Request::PrepareRetrieve {
            instance_id: id,
            range: Self::range(hashes, Some(0)),
            lookup_session: session.map(str::to_owned),
        }) {
            Response::RetrievePrepared {
                hit: true,
                transfer_id,
                slots,
                ..
            } => (transfer_id, slots.iter().map(|s| s.offset).collect()),
            r => panic!("expected a hit: {r:?}"),
        }
    }

    fn commit_retrieve(&mut self, id: u64, transfer_id: u64) {
        let r = self.call(Request::CommitRetrieve {
            instance_id: id,
            transfer_id,
        });
        assert_eq!(r, Response::Ok);
    }

    /// (state, readers) of the object with chunk hash `h`.
    fn object(&self, h: u8) -> Option<(ObjectState, u32)> {
        self.ctx
            .storage
            .snapshot()
            .into_iter()
            .find(|(k, _)| k.chunk_hash == hash(h))
            .map(|(_, e)| (e.state, e.readers))
    }
}

/// Defect 1: a retrieve relying on a lookup session that holds no lock for its keys (used up)
/// borrowed another session's lock, and its commit released that lock: CLEAR then freed the
/// slot another client was still copying out of, and the next store was handed it.
#[test]
fn a_retrieve_never_borrows_another_sessions_read_lock() {
    let mut h = Harness::new();
    h.register(1);
    let k = h.store(1, &[1])[0];
    assert_eq!(h.lookup("A", &[1]), 1);
    assert_eq!(h.lookup("B", &[1]), 1);
    assert_eq!(h.object(1), Some((ObjectState::Ready, 2)));
    let (a1, _) = h.prepare_retrieve(1, &[1], Some("A"));
    h.commit_retrieve(1, a1);
    assert_eq!(h.object(1), Some((ObjectState::Ready, 1)));
    let (_b, b_slots) = h.prepare_retrieve(1, &[1], Some("B")); // B is copying
    assert_eq!(b_slots, vec![k]);
    // A's lock is used up: this retrieve must take a lock of its own.
    let (a2, _) = h.prepare_retrieve(1, &[1], Some("A"));
    assert_eq!(h.object(1), Some((ObjectState::Ready, 2)));
    h.commit_retrieve(1, a2);
    assert_eq!(
        h.object(1),
        Some((ObjectState::Ready, 1)),
        "B still holds its lock"
    );
    let r = h.call(Request::Clear);
    assert_eq!(
        r,
        Response::Cleared {
            deleted: 0,
            deferred: 1
        }
    );
    let fresh = h.store(1, &[2]);
    assert!(
        !fresh.contains(&k),
        "B's slot {k} was handed to a new store"
    );
}

/// Defect 1, miss path: a retrieve that misses releases only the locks it holds itself, never
/// the locks of the session it names when that session does not cover its keys.
#[test]
fn a_missing_retrieve_releases_only_its_own_locks() {
    let mut h = Harness::new();
    h.register(1);
    h.store(1, &[1]);
    assert_eq!(h.lookup("A", &[1]), 1);
    // Session "other" never looked up chunk 1; chunk 9 is absent: a miss.
    let r = h.call(Request::PrepareRetrieve {
        instance_id: 1,
        range: Harness::range(&[1, 9], Some(0)),
        lookup_session: Some("other".into()),
    });
    assert!(
        matches!(r, Response::RetrievePrepared { hit: false, .. }),
        "{r:?}"
    );
    assert_eq!(
        h.object(1),
        Some((ObjectState::Ready, 1)),
        "A's lock is intact"
    );
}

/// Defect 3: a retrieve that adopts a lookup lock refreshes its deadline; a lock that expired
/// is not adopted (the retrieve takes its own).
#[test]
fn an_adopted_lookup_lock_covers_the_retrieve() {
    let mut h = Harness::new();
    h.register(1);
    h.store(1, &[1]);
    assert_eq!(h.lookup("A", &[1]), 1);
    let ttl = world::READ_TTL_MS;
    h.clock.advance(ttl * 3 / 4);
    let (t, _) = h.prepare_retrieve(1, &[1], Some("A"));
    h.clock.advance(ttl * 3 / 4); // past the lookup's deadline, within the retrieve's
    crate::server::maintenance::ttl_sweep(&h.ctx);
    assert_eq!(
        h.object(1),
        Some((ObjectState::Ready, 1)),
        "the retrieve's lock outlives the lookup's deadline"
    );
    assert_eq!(
        h.call(Request::Clear),
        Response::Cleared {
            deleted: 0,
            deferred: 1
        }
    );
    h.commit_retrieve(1, t);
    // An expired lookup lock is not adopted: the retrieve takes a fresh one.
    h.store(1, &[3]);
    assert_eq!(h.lookup("C", &[3]), 1);
    h.clock.advance(ttl + 1);
    let (t, _) = h.prepare_retrieve(1, &[3], Some("C"));
    assert_eq!(h.object(3), Some((ObjectState::Ready, 1)));
    h.commit_retrieve(1, t);
    assert_eq!(h.object(3), Some((ObjectState::Ready, 0)));
}

/// Defect 4: an instance that registered, pinged and fell silent was examined only at
/// registration + grace (PING never touches the wheel); it must go at its reap timeout.
#[test]
fn a_pinged_instance_is_reaped_at_its_timeout_not_the_grace() {
    let mut h = Harness::new();
    let mut reaper = crate::liveness::reaper::Reaper::new(&*h.ctx);
    h.register(1);
    reaper.step(&*h.ctx);
    assert_eq!(
        h.call(Request::Ping {
            instance_id: Some(1)
        }),
        Response::Ok
    );
    let step = world::TICK_MS;
    let mut waited = 0;
    while h.ctx.instances.get(1).is_some() && waited < world::GRACE_MS {
        h.clock.advance(step);
        waited += step;
        reaper.step(&*h.ctx);
    }
    assert!(h.ctx.instances.get(1).is_none(), "never reaped");
    assert!(
        waited <= world::REAP_TIMEOUT_MS + 2 * step,
        "reaped after {waited} ms of silence, timeout {} ms",
        world::REAP_TIMEOUT_MS
    );
    assert!(
        waited >= world::REAP_TIMEOUT_MS,
        "reaped early, after {waited} ms"
    );
}

/// Defect 5: released instances' timers were never cancelled, so registering and releasing
/// more instances than the wheel holds left a new instance unwatched ("liveness wheel full").
#[test]
fn released_instances_leave_no_timer_and_new_ones_are_always_watched() {
    let mut h = Harness::new();
    let mut reaper = crate::liveness::reaper::Reaper::new(&*h.ctx);
    // More distinct instances than the wheel holds, each watched and then released.
    for id in 100..400u64 {
        h.register(id);
        reaper.step(&*h.ctx);
        let r = h.call(Request::Unregister { instance_id: id });
        assert!(matches!(r, Response::Unregistered { .. }), "{r:?}");
        reaper.step(&*h.ctx);
    }
    assert!(
        reaper.watched().is_empty(),
        "stale timers: {:?}",
        reaper.watched()
    );
    assert_eq!(h.ctx.liveness.tracked(), 0);
    h.register(7);
    reaper.step(&*h.ctx);
    assert_eq!(reaper.watched(), vec![7]);
    assert_eq!(h.ctx.liveness.tracked(), 1);
}

/// Defect 6: LOOKUP and PREPARE_RETRIEVE with a (model, salt) nothing was stored under
/// interned it forever; they are a miss and leave the table as it was.
#[test]
fn lookups_and_retrieves_of_unknown_namespaces_intern_nothing() {
    let mut h = Harness::new();
    h.register(1);
    let before = h.ctx.namespaces.len();
    for i in 0..50 {
        let mut range = Harness::range(&[1], None);
        range.cache_salt = format!("lookup-{i}");
        let r = h.call(Request::Lookup {
            request_id: format!("s{i}"),
            range: range.clone(),
            tp_size: 1,
            readers: 0,
        });
        assert_eq!(r, Response::LookupHits { chunks: 0 });
        range.worker_id = Some(0);
        range.cache_salt = format!("retrieve-{i}");
        let r = h.call(Request::PrepareRetrieve {
            instance_id: 1,
            range,
            lookup_session: None,
        });
        assert!(
            matches!(r, Response::RetrievePrepared { hit: false, .. }),
            "{r:?}"
        );
    }
    assert_eq!(h.ctx.namespaces.len(), before);
}

/// Defect 7: a REGISTER that raced a release (between the release marking the instance and
/// removing it from the table) was handed the released instance, and every later request of
/// the client failed with NotRegistered.
#[test]
fn a_registration_racing_a_release_gets_a_live_instance() {
    let mut h = Harness::new();
    h.register(1);
    let old = h.ctx.instances.get(1).unwrap();
    // The window inside `release`: marked released, not yet removed from the table.
    old.released
        .store(true, std::sync::atomic::Ordering::SeqCst);
    h.register(1);
    let new = h.ctx.instances.get(1).unwrap();
    assert!(!Arc::ptr_eq(&old, &new) && !new.is_released());
    // The release finishing afterwards leaves the new registration alone.
    assert!(!h.ctx.instances.remove_exact(&old));
    let r = h.call(Request::PrepareStore {
        instance_id: 1,
        range: Harness::range(&[4], Some(0)),
    });
    assert!(matches!(r, Response::StorePrepared { .. }), "{r:?}");
    assert_eq!(h.ctx.instances.len(), 1);
}

fn wide_hashes(from: u32, n: u32) -> Vec<[u8; 32]> {
    (from..from + n)
        .map(|i| {
            let mut h = [0xA5u8; 32];
            h[..4].copy_from_slice(&i.to_le_bytes());
            h
        })
        .collect()
}

/// Defect 8: a large PREPARE_STORE evicted the cached chunks of its own prefix to make room
/// for its new chunks, leaving the prefix with holes. The request's own cached objects are held
/// while it allocates; other objects are evicted instead.
#[test]
fn a_large_store_never_evicts_its_own_cached_prefix() {
    let mut h = Harness::new();
    h.register(1);
    let object = u64::from(world::HIDDEN) * 2 * 16 * 2;
    let capacity = h.ctx.storage.capacity() / object;
    let store = |h: &mut Harness, hashes: Vec<[u8; 32]>| -> usize {
        let mut range = Harness::range(&[], Some(0));
        range.chunk_hashes = hashes;
        let r = h.call(Request::PrepareStore {
            instance_id: 1,
            range,
        });
        let Response::StorePrepared {
            transfer_id, slots, ..
        } = r
        else {
            panic!("{r:?}")
        };
        if transfer_id != 0 {
            let c = h.call(Request::CommitStore {
                instance_id: 1,
                transfer_id,
            });
            assert!(matches!(c, Response::StoreCommitted { .. }), "{c:?}");
        }
        slots.len()
    };
    // The prefix is stored first (so it is the oldest), then other prompts fill the pool.
    let prefix = wide_hashes(0, 10);
    assert_eq!(store(&mut h, prefix.clone()), 10);
    let mut next = 1_000;
    let mut filled = 10;
    while filled + 50 <= capacity {
        assert_eq!(store(&mut h, wide_hashes(next, 50)), 50);
        next += 50;
        filled += 50;
    }
    // The prompt grows: its whole range, prefix included, is stored again.
    let mut grown = prefix.clone();
    grown.extend(wide_hashes(900_000, 40));
    assert_eq!(store(&mut h, grown), 40, "only the new chunks are reserved");
    let present: std::collections::HashSet<[u8; 32]> = h
        .ctx
        .storage
        .snapshot()
        .into_iter()
        .map(|(k, _)| k.chunk_hash)
        .collect();
    let lost = prefix.iter().filter(|p| !present.contains(*p)).count();
    assert_eq!(
        lost, 0,
        "{lost} chunks of the request's own prefix were evicted"
    );
}

/// Defect 8: the list of instances registered over a connection grew for the connection's
/// life (and was searched linearly); it stays bounded by the instance limit.
#[test]
fn a_connections_registered_list_stays_bounded() {
    let mut h = Harness::new();
    let limit = h.ctx.config.limits.max_instances;
    for id in 0..(4 * limit as u64) {
        h.register(1_000 + id);
        let r = h.call(Request::Unregister {
            instance_id: 1_000 + id,
        });
        assert!(matches!(r, Response::Unregistered { .. }), "{r:?}");
    }
    assert!(
        h.registered.len() <= limit + 1,
        "{} ids kept",
        h.registered.len()
    );
    h.register(1);
    assert!(h.registered.contains(1));
}

/// Defect 7 under real concurrency: one connection registers and closes in a loop while
/// another registers the same instance; a registration must never return an instance whose
/// release has begun (it would answer every later request with NotRegistered).
#[test]
fn concurrent_registration_and_close_never_hand_out_a_released_instance() {
    let h = Harness::new();
    let ctx = h.ctx.clone();
    let req = RegisterRequest {
        instance_id: 42,
        model: MODEL.into(),
        world_size: 1,
        block_size: 16,
        num_layers: world::NUM_LAYERS,
        hidden_dim: world::HIDDEN,
        dtype: world::DTYPE.into(),
        use_mla: false,
        physical_slots: None,
    };
    std::thread::scope(|s| {
        for conn in [100u64, 200] {
            let ctx = ctx.clone();
            let req = req.clone();
            s.spawn(move || {
                // Two connections of one engine process (same pid): either may join.
                let peer = kvnode_hw::PeerCred {
                    pid: Some(7),
                    uid: kvnode_hw::effective_uid(),
                    gid: kvnode_hw::effective_gid(),
                };
                let caller = crate::modules::Caller::new(&ctx, conn, Some(peer));
                for _ in 0..3_000 {
                    let inst = ctx.register(&req, &caller).expect("registration");
                    assert!(
                        !inst.is_released(),
                        "connection {conn} was handed a released instance"
                    );
                    ctx.connection_closed(conn, &[42], false);
                }
            });
        }
    });
    assert!(ctx.storage.memcheck().ok);
    assert!(ctx.instances.len() <= 1);
}

/// Review finding: objects recovered from disk are never refused for the namespace limit
/// (their slots would otherwise be treated as free and overwritten).
#[test]
fn recovered_namespaces_are_never_refused() {
    let ns = crate::storage::Namespaces::default();
    ns.configure(&Clock::manual(0), 2);
    for i in 0..5 {
        ns.intern_recovered("m", &format!("s{i}")).unwrap();
    }
    assert_eq!(ns.len(), 5);
    assert!(ns.intern("m", "new").is_err(), "new ones wait for reclaims");
    assert!(ns.intern("m", "s3").is_ok(), "held ones still resolve");
}

/// An object stored under one layout is a miss for a reader registered under another layout
/// of the same byte size (same shape, other dtype of the same width): its bytes mean something
/// else. The reader of the storing layout still hits.
#[test]
fn a_retrieve_under_another_layout_of_the_same_size_misses() {
    let mut h = Harness::new();
    h.register(1);
    let other = if world::DTYPE == "float16" {
        "bfloat16"
    } else {
        "float16"
    };
    let r = h.call(Request::Register(RegisterRequest {
        instance_id: 2,
        model: MODEL.into(),
        world_size: 1,
        block_size: 16,
        num_layers: world::NUM_LAYERS,
        hidden_dim: world::HIDDEN,
        dtype: other.into(),
        use_mla: false,
        physical_slots: None,
    }));
    let Response::Registered(reg2) = r else {
        panic!("{r:?}")
    };
    h.store(1, &[1, 2]);
    let miss = h.call(Request::PrepareRetrieve {
        instance_id: 2,
        range: Harness::range(&[1, 2], Some(0)),
        lookup_session: None,
    });
    assert!(
        matches!(miss, Response::RetrievePrepared { hit: false, .. }),
        "layout {:?} read an object of another dtype: {miss:?}",
        reg2.layout
    );
    // No lock left behind by the miss; the storing layout still reads it.
    assert_eq!(h.object(1).map(|o| o.1), Some(0));
    let (t, _) = h.prepare_retrieve(1, &[1, 2], None);
    h.commit_retrieve(1, t);
}
