//! Regression tests of the LMCache frontend's state (each failed before its fix), in-process
//! against a node on a manual clock.

use std::sync::Arc;

use super::frontend::{ClientId, LmFrontend, LmLimits, LmReply};
use super::wire::{IpcKey, LmRequest, RegisterPayload};
use crate::clock::Clock;
use crate::modules::NodeContext;
use crate::sim::world::{self, CHUNK_TOKENS};
use crate::storage::index::ObjectState;

const MODEL: &str = "lm-model";

struct Lm {
    clock: Clock,
    ctx: Arc<NodeContext>,
    fe: LmFrontend,
    /// The worker's connection (it registers instance 5).
    worker: ClientId,
}

fn tokens() -> Vec<u32> {
    (0..4 * CHUNK_TOKENS).collect()
}

fn key(start_chunk: u64, end_chunk: u64, worker: Option<u32>) -> IpcKey {
    key_of(tokens(), start_chunk, end_chunk, worker, "req")
}

fn key_of(
    token_ids: Vec<u32>,
    start_chunk: u64,
    end_chunk: u64,
    worker: Option<u32>,
    request_id: &str,
) -> IpcKey {
    IpcKey {
        model_name: MODEL.into(),
        world_size: 1,
        worker_id: worker,
        token_ids,
        start: start_chunk * u64::from(CHUNK_TOKENS),
        end: end_chunk * u64::from(CHUNK_TOKENS),
        request_id: request_id.into(),
        cache_salt: String::new(),
        num_kv_readers: 1,
    }
}

fn registration(instance_id: u64) -> LmRequest {
    LmRequest::RegisterEngineDriven(RegisterPayload {
        instance_id,
        model_name: MODEL.into(),
        world_size: 1,
        block_size: 16,
        num_layers: world::NUM_LAYERS,
        hidden_dim_size: world::HIDDEN,
        dtype_str: world::DTYPE.into(),
        use_mla: false,
        num_physical_slots: None,
    })
}

impl Lm {
    fn new() -> Lm {
        Lm::with_limits(LmLimits::default())
    }

    fn with_limits(limits: LmLimits) -> Lm {
        let clock = Clock::manual(1_000);
        let ctx = world::build_node(&clock);
        let fe = LmFrontend::with_limits(ctx.clone(), limits);
        let lm = Lm {
            clock,
            ctx,
            fe,
            worker: ClientId::new(b"worker", Some(1000)),
        };
        let r = lm.call(registration(5));
        assert!(matches!(r, LmReply::Register { .. }), "{r:?}");
        lm
    }

    /// One request of the worker.
    fn call(&self, req: LmRequest) -> LmReply {
        self.fe.handle_typed(&self.worker, req)
    }

    fn prepare_store(&self, a: u64, b: u64) -> Vec<u64> {
        match self.call(LmRequest::PrepareStore {
            key: key(a, b, Some(0)),
            instance_id: 5,
        }) {
            LmReply::PrepareStore(Some((slots, _))) => slots.iter().map(|s| s.offset).collect(),
            r => panic!("{r:?}"),
        }
    }

    fn commit_store(&self, a: u64, b: u64) -> LmReply {
        self.call(LmRequest::CommitStore {
            key: key(a, b, Some(0)),
            instance_id: 5,
            cpu_data: Vec::new(),
        })
    }

    /// (state, readers) of every object, by slot offset.
    fn objects(&self) -> Vec<(u64, ObjectState, u32)> {
        let mut v: Vec<_> = self
            .ctx
            .storage
            .snapshot()
            .into_iter()
            .map(|(_, e)| (e.slot.offset, e.state, e.readers))
            .collect();
        v.sort_unstable_by_key(|o| o.0);
        v
    }
}

/// Defect 2, stores: a second PREPARE_STORE of the same key while the first is in flight
/// freed the first reservation (the worker was still writing into it). Now the two queue, and
/// each COMMIT pairs with the oldest.
#[test]
fn a_repeated_prepare_store_never_frees_the_one_in_flight() {
    let lm = Lm::new();
    // Chunk 0 is cached, so the first prepare of [0, 2) reserves chunk 1 only.
    assert_eq!(lm.prepare_store(0, 1).len(), 1);
    assert_eq!(lm.commit_store(0, 1), LmReply::Bool(true));
    let first = lm.prepare_store(0, 2);
    assert_eq!(first.len(), 1, "chunk 1 only");
    // Chunk 0 is evicted: the second prepare of the same key reserves it.
    let keys: Vec<_> = lm
        .ctx
        .storage
        .snapshot()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(lm.ctx.storage.evict_if_idle(&keys), 1);
    let second = lm.prepare_store(0, 2);
    assert_eq!(second.len(), 1, "chunk 0 only");
    let held = lm.objects();
    assert!(
        held.iter()
            .any(|o| o.0 == first[0] && o.1 == ObjectState::WriteReserved),
        "the first reservation is still the worker's: {held:?}"
    );
    assert_eq!(lm.commit_store(0, 2), LmReply::Bool(true));
    assert_eq!(lm.commit_store(0, 2), LmReply::Bool(true));
    assert_eq!(
        lm.commit_store(0, 2),
        LmReply::Bool(false),
        "nothing left to pair"
    );
    let all = lm.objects();
    assert_eq!(all.len(), 2);
    assert!(all.iter().all(|o| o.1 == ObjectState::Ready), "{all:?}");
    assert_eq!(lm.fe.pending_transfers(), 0);
}

/// Defect 2, retrieves: a second PREPARE_RETRIEVE of the same key committed the first (its
/// read lock released while the worker was still copying). Now each holds its own lock.
#[test]
fn a_repeated_prepare_retrieve_keeps_the_first_locked() {
    let lm = Lm::new();
    lm.prepare_store(0, 1);
    assert_eq!(lm.commit_store(0, 1), LmReply::Bool(true));
    lm.call(LmRequest::Lookup {
        key: key(0, 4, None),
        tp_size: 1,
    });
    let retrieve = || {
        lm.call(LmRequest::PrepareRetrieve {
            key: key(0, 1, Some(0)),
            instance_id: 5,
        })
    };
    assert!(matches!(retrieve(), LmReply::PrepareRetrieve(Some(_))));
    assert!(matches!(retrieve(), LmReply::PrepareRetrieve(Some(_))));
    assert_eq!(lm.objects()[0].2, 2, "both retrieves hold a lock");
    let commit = || {
        lm.call(LmRequest::CommitRetrieve {
            key: key(0, 1, Some(0)),
            instance_id: 5,
        })
    };
    commit();
    assert_eq!(lm.objects()[0].2, 1, "the second is still copying");
    commit();
    assert_eq!(lm.objects()[0].2, 0);
}

/// Defect 8: what the frontend kept for an instance is dropped when the node reaps it (not only
/// on UNREGISTER), and a new registration of the same id does not inherit it.
#[test]
fn a_reaped_instance_leaves_no_frontend_state() {
    let lm = Lm::new();
    lm.prepare_store(0, 2);
    assert_eq!(lm.fe.pending_transfers(), 1);
    let inst = lm.ctx.instances.get(5).unwrap();
    lm.ctx.release(&inst, "reaped");
    assert_eq!(lm.fe.pending_transfers(), 0);
}

/// The rolling-hash cache is never reused for other tokens under the same request id (two
/// schedulers reusing an id, or a hostile one seeding it): the keys follow the tokens.
#[test]
fn cached_hashes_follow_the_tokens_not_the_request_id() {
    let lm = Lm::new();
    lm.prepare_store(0, 2);
    assert_eq!(lm.commit_store(0, 2), LmReply::Bool(true));
    let mut other = key(0, 2, Some(0));
    other.token_ids = (1000..1000 + 4 * CHUNK_TOKENS).collect();
    let r = lm.call(LmRequest::PrepareRetrieve {
        key: other,
        instance_id: 5,
    });
    assert_eq!(r, LmReply::PrepareRetrieve(None), "other tokens are a miss");
}

/// Review finding: a worker restarted under the same instance id re-registers while its dead
/// predecessor's half-written reservation is still queued; the new process's COMMIT must never
/// be paired with (and publish) the predecessor's transfer.
#[test]
fn a_restarted_worker_never_commits_its_predecessors_transfer() {
    let lm = Lm::new();
    assert_eq!(lm.prepare_store(0, 1).len(), 1);
    assert_eq!(lm.commit_store(0, 1), LmReply::Bool(true));
    let dead = lm.prepare_store(0, 2); // chunk 1, then the process dies mid-copy
    assert_eq!(dead.len(), 1);
    let keys: Vec<_> = lm
        .ctx
        .storage
        .snapshot()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(lm.ctx.storage.evict_if_idle(&keys), 1, "chunk 0 evicted");
    // The new process registers the same id and layout (over a new connection of the same
    // user: it takes the instance over).
    let restarted = ClientId::new(b"worker-restarted", Some(1000));
    let r = lm.fe.handle_typed(&restarted, registration(5));
    assert!(matches!(r, LmReply::Register { .. }), "{r:?}");
    let lm = Lm {
        worker: restarted,
        ..lm
    };
    let fresh = lm.prepare_store(0, 2);
    assert_eq!(
        fresh.len(),
        1,
        "chunk 0 only: chunk 1 is still the old reservation"
    );
    assert_eq!(lm.commit_store(0, 2), LmReply::Bool(true));
    let all = lm.objects();
    let state = |off: u64| all.iter().find(|o| o.0 == off).map(|o| o.1);
    assert_eq!(
        state(fresh[0]),
        Some(ObjectState::Ready),
        "the new process's chunk"
    );
    assert_eq!(
        state(dead[0]),
        Some(ObjectState::WriteReserved),
        "the dead process's half-written chunk is never published (freed at its TTL)"
    );
    assert_eq!(lm.fe.pending_transfers(), 0);
}

/// Issue 11: an instance is its registering connection's. Another user's connection can
/// neither use, keep alive, unregister nor re-register it.
#[test]
fn another_users_connection_cannot_use_keep_alive_or_take_an_instance() {
    let lm = Lm::new();
    let other = ClientId::new(b"other", Some(2000));
    let call = |req| lm.fe.handle_typed(&other, req);
    assert_eq!(
        call(LmRequest::PrepareStore {
            key: key(0, 2, Some(0)),
            instance_id: 5,
        }),
        LmReply::PrepareStore(None),
        "nothing reserved for a non-owner"
    );
    assert!(lm.objects().is_empty());
    assert_eq!(lm.fe.state_bytes().0, 0, "no hashes cached for a non-owner");
    let inst = lm.ctx.instances.get(5).unwrap();
    let seen = inst.last_seen_ms.load(std::sync::atomic::Ordering::Relaxed);
    lm.clock.advance(5_000);
    assert_eq!(
        call(LmRequest::Ping {
            instance_id: Some(5)
        }),
        LmReply::Bool(true)
    );
    assert_eq!(
        inst.last_seen_ms.load(std::sync::atomic::Ordering::Relaxed),
        seen,
        "another connection's ping does not keep the instance alive"
    );
    assert_eq!(
        call(LmRequest::UnregisterEngineDriven { instance_id: 5 }),
        LmReply::Nothing
    );
    assert!(lm.ctx.instances.get(5).is_some(), "not unregistered");
    let r = call(registration(5));
    assert!(
        matches!(r, LmReply::Register { pool_bytes: 0, .. }),
        "another user's REGISTER is refused: {r:?}"
    );
    assert_eq!(lm.prepare_store(0, 2).len(), 2, "the owner is unaffected");
    assert_eq!(lm.commit_store(0, 2), LmReply::Bool(true));
    assert!(
        lm.fe
            .counters()
            .not_owner
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 3
    );
}

/// Issue 11, hash-cache poisoning: hashes cached for a request id by one connection are never
/// consulted for another's request under the same id (not even to find they do not match).
#[test]
fn hash_caches_are_kept_per_connection() {
    let lm = Lm::new();
    let b = ClientId::new(b"b", Some(1000));
    assert!(matches!(
        lm.fe.handle_typed(&b, registration(6)),
        LmReply::Register { .. }
    ));
    let t4: Vec<u32> = (5000..5000 + 4 * CHUNK_TOKENS).collect();
    let r = lm.fe.handle_typed(
        &b,
        LmRequest::PrepareStore {
            key: key_of(t4, 0, 4, Some(0), "victim-req"),
            instance_id: 6,
        },
    );
    assert!(matches!(r, LmReply::PrepareStore(Some((ref s, _))) if s.len() == 4));
    let r = lm.call(LmRequest::PrepareStore {
        key: key_of(tokens(), 0, 4, Some(0), "victim-req"),
        instance_id: 5,
    });
    assert!(matches!(r, LmReply::PrepareStore(Some((ref s, _))) if s.len() == 4));
    assert_eq!(
        lm.fe
            .counters()
            .hash_mismatches
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the worker never looked at b's entry"
    );
}

/// Issue 11, budgets: a connection's lookup sessions beyond its byte budget are ended (their
/// locks released), oldest first; another connection's are untouched.
#[test]
fn a_connection_over_its_session_budget_ends_its_oldest_sessions() {
    let lm = Lm::with_limits(LmLimits {
        session_bytes_per_client: 2048,
        ..LmLimits::default()
    });
    lm.prepare_store(0, 1);
    assert_eq!(lm.commit_store(0, 1), LmReply::Bool(true));
    let (flood, calm) = (
        ClientId::new(b"f", Some(1001)),
        ClientId::new(b"c", Some(1002)),
    );
    let lookup = |c: &ClientId, id: &str| {
        lm.fe.handle_typed(
            c,
            LmRequest::Lookup {
                key: key_of(tokens(), 0, 4, None, id),
                tp_size: 1,
            },
        )
    };
    lookup(&calm, "calm");
    for i in 0..50 {
        lookup(&flood, &format!("flood-{i}"));
    }
    let open = lm.ctx.sessions.len();
    assert!(open < 20, "{open} sessions open");
    assert!(lm.fe.state_bytes().2 <= 2048 + 4096);
    assert_eq!(
        lm.objects()[0].2 as usize,
        open,
        "one lock per open session"
    );
    let held: Vec<String> = lm
        .ctx
        .sessions
        .held_locks()
        .into_iter()
        .map(|h| h.0)
        .collect();
    assert!(held.iter().any(|n| n.ends_with(":calm")), "{held:?}");
    assert!(
        held.iter().any(|n| n.ends_with(":flood-49")),
        "the newest is kept"
    );
    assert!(
        !held.iter().any(|n| n.ends_with(":flood-0")),
        "the oldest was ended"
    );
}

/// Issue 11, budgets: cached hashes and unqueried LOOKUP results expire after the state TTL.
#[test]
fn per_request_state_expires_after_its_ttl() {
    let lm = Lm::with_limits(LmLimits {
        state_ttl_secs: 1,
        ..LmLimits::default()
    });
    lm.prepare_store(0, 1);
    assert_eq!(lm.commit_store(0, 1), LmReply::Bool(true));
    let cached = lm.fe.state_bytes().0;
    assert!(cached > 0);
    lm.call(LmRequest::Lookup {
        key: key(0, 4, None),
        tp_size: 1,
    });
    lm.clock.advance(1_500);
    let q = lm.call(LmRequest::QueryPrefetchStatus {
        request_id: "req".into(),
    });
    assert_eq!(q, LmReply::Uint(0), "an expired LOOKUP result is a miss");
    // The next insertion drops the expired entry first.
    lm.call(LmRequest::PrepareStore {
        key: key_of(tokens(), 0, 1, Some(0), "other"),
        instance_id: 5,
    });
    assert_eq!(
        lm.fe.state_bytes().0,
        cached - "req".len() + "other".len(),
        "only the new entry is held"
    );
}

/// Issue 11, budgets: a request id longer than `max_request_id_bytes` gets a negative answer.
#[test]
fn a_request_id_beyond_its_limit_is_refused() {
    let lm = Lm::with_limits(LmLimits {
        max_request_id_bytes: 8,
        ..LmLimits::default()
    });
    let r = lm.call(LmRequest::PrepareStore {
        key: key_of(tokens(), 0, 2, Some(0), "123456789"),
        instance_id: 5,
    });
    assert_eq!(r, LmReply::PrepareStore(None));
    assert!(lm.objects().is_empty());
    assert_eq!(
        lm.fe
            .counters()
            .long_request_ids
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let r = lm.call(LmRequest::PrepareStore {
        key: key_of(tokens(), 0, 2, Some(0), "12345678"),
        instance_id: 5,
    });
    assert!(matches!(r, LmReply::PrepareStore(Some((ref s, _))) if s.len() == 2));
}
