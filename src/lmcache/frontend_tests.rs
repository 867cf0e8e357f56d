//! Regression tests of the LMCache frontend's state (each failed before its fix), in-process
//! against a node on a manual clock.

use std::sync::Arc;

use super::frontend::{LmFrontend, LmReply};
use super::wire::{IpcKey, LmRequest, RegisterPayload};
use crate::clock::Clock;
use crate::modules::NodeContext;
use crate::sim::world::{self, CHUNK_TOKENS};
use crate::storage::index::ObjectState;

const MODEL: &str = "lm-model";

struct Lm {
    ctx: Arc<NodeContext>,
    fe: LmFrontend,
}

fn tokens() -> Vec<u32> {
    (0..4 * CHUNK_TOKENS).collect()
}

fn key(start_chunk: u64, end_chunk: u64, worker: Option<u32>) -> IpcKey {
    IpcKey {
        model_name: MODEL.into(),
        world_size: 1,
        worker_id: worker,
        token_ids: tokens(),
        start: start_chunk * u64::from(CHUNK_TOKENS),
        end: end_chunk * u64::from(CHUNK_TOKENS),
        request_id: "req".into(),
        cache_salt: String::new(),
    }
}

impl Lm {
    fn new() -> Lm {
        let ctx = world::build_node(&Clock::manual(1_000));
        let fe = LmFrontend::new(ctx.clone());
        let lm = Lm { ctx, fe };
        let r = lm
            .fe
            .handle_typed(LmRequest::RegisterEngineDriven(RegisterPayload {
                instance_id: 5,
                model_name: MODEL.into(),
                world_size: 1,
                block_size: 16,
                num_layers: world::NUM_LAYERS,
                hidden_dim_size: world::HIDDEN,
                dtype_str: world::DTYPE.into(),
                use_mla: false,
            }));
        assert!(matches!(r, LmReply::Register { .. }), "{r:?}");
        lm
    }

    fn prepare_store(&self, a: u64, b: u64) -> Vec<u64> {
        match self.fe.handle_typed(LmRequest::PrepareStore {
            key: key(a, b, Some(0)),
            instance_id: 5,
        }) {
            LmReply::PrepareStore(Some((slots, _))) => slots.iter().map(|s| s.offset).collect(),
            r => panic!("{r:?}"),
        }
    }

    fn commit_store(&self, a: u64, b: u64) -> LmReply {
        self.fe.handle_typed(LmRequest::CommitStore {
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
    lm.fe.handle_typed(LmRequest::Lookup {
        key: key(0, 4, None),
        tp_size: 1,
    });
    let retrieve = || {
        lm.fe.handle_typed(LmRequest::PrepareRetrieve {
            key: key(0, 1, Some(0)),
            instance_id: 5,
        })
    };
    assert!(matches!(retrieve(), LmReply::PrepareRetrieve(Some(_))));
    assert!(matches!(retrieve(), LmReply::PrepareRetrieve(Some(_))));
    assert_eq!(lm.objects()[0].2, 2, "both retrieves hold a lock");
    let commit = || {
        lm.fe.handle_typed(LmRequest::CommitRetrieve {
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
    let r = lm.fe.handle_typed(LmRequest::PrepareRetrieve {
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
    // The new process registers the same id and layout.
    let r = lm
        .fe
        .handle_typed(LmRequest::RegisterEngineDriven(RegisterPayload {
            instance_id: 5,
            model_name: MODEL.into(),
            world_size: 1,
            block_size: 16,
            num_layers: world::NUM_LAYERS,
            hidden_dim_size: world::HIDDEN,
            dtype_str: world::DTYPE.into(),
            use_mla: false,
        }));
    assert!(matches!(r, LmReply::Register { .. }), "{r:?}");
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
