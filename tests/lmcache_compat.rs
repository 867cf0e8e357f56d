//! Where kvnode must answer like LMCache 0.5.6 (issue 12 §2), each from a minimal sequence that
//! a differential test against LMCache's own server found: read locks per declared reader
//! (`num_kv_readers`, MLA ranks sharing worker 0), slots sized by `num_physical_slots`, and a
//! worker whose instance the node released learning it (no "already cached" answer for a store
//! nobody will keep; one failed PING so its heartbeat registers again).

mod common;

use std::time::{Duration, Instant};

use common::lm::{self, get, Dealer, LmNode};
use kvnode::lmcache::wire::{self, IpcKey, Op, RegisterPayload};
use rmpv::Value;

/// A key of the test model with `readers` declared (0.5.6 form).
fn key_readers(
    model: &str,
    tokens: &[u32],
    end: u64,
    worker: Option<u32>,
    req: &str,
    readers: u32,
) -> Vec<u8> {
    wire::encode_key(
        &IpcKey {
            model_name: model.into(),
            world_size: 1,
            worker_id: worker,
            token_ids: tokens.to_vec(),
            start: 0,
            end,
            request_id: req.into(),
            cache_salt: String::new(),
            num_kv_readers: readers,
        },
        true,
    )
}

fn register_as(d: &mut Dealer, reg: &RegisterPayload) -> Value {
    d.call(
        Op::RegisterEngineDriven,
        vec![wire::encode_register_payload(reg)],
    )
    .expect("register reply")
}

fn mla_registration(instance_id: u64) -> RegisterPayload {
    RegisterPayload {
        model_name: "mla-model".into(),
        use_mla: true,
        ..lm::registration(instance_id)
    }
}

/// PREPARE_STORE + COMMIT_STORE of `tokens[..end]` for worker 0 of `model`.
fn store(d: &mut Dealer, model: &str, id: u64, tokens: &[u32], end: u64) {
    let p = d
        .call(
            Op::PrepareStore,
            vec![
                key_readers(model, tokens, end, Some(0), "store", 1),
                wire::encode_uint(id),
            ],
        )
        .unwrap();
    let n = get(get(&p, "context"), "slots").as_array().unwrap().len();
    assert_eq!(n as u64, end / 16, "slots for every chunk: {p}");
    assert_eq!(
        d.call(
            Op::CommitStore,
            vec![
                key_readers(model, tokens, end, Some(0), "store", 1),
                wire::encode_uint(id),
                vec![0xc4, 0x00],
            ],
        ),
        Some(Value::Boolean(true))
    );
}

fn prepare_retrieve(d: &mut Dealer, model: &str, id: u64, tokens: &[u32], req: &str) -> Value {
    d.call(
        Op::PrepareRetrieve,
        vec![
            key_readers(model, tokens, tokens.len() as u64, Some(0), req, 1),
            wire::encode_uint(id),
        ],
    )
    .unwrap()
}

fn commit_retrieve(d: &mut Dealer, model: &str, id: u64, tokens: &[u32], req: &str) {
    assert_eq!(
        d.call(
            Op::CommitRetrieve,
            vec![
                key_readers(model, tokens, tokens.len() as u64, Some(0), req, 1),
                wire::encode_uint(id),
            ],
        ),
        Some(Value::Boolean(true))
    );
}

fn retrieved(reply: &Value) -> bool {
    get(reply, "success").as_bool().unwrap()
}

/// Locks held on the node's objects now (sessions and prepared retrieves).
fn read_locks(node: &LmNode) -> u64 {
    lm::status(node)["objects"]["read_locked"]
        .as_u64()
        .unwrap_or_else(|| panic!("no objects.read_locked in status"))
}

/// SGLang's MLA sequence: world 1, two ranks both worker 0, `num_kv_readers` 2, tp argument 1.
/// Rank 0 retrieves and commits; rank 1 must still find its lock (LMCache 0.5.6 does), and once
/// both committed nothing stays locked.
#[test]
fn mla_ranks_sharing_worker_zero_each_get_a_read_lock() {
    let node = lm::start("mla", "", &[]);
    let mut sched = Dealer::connect(node.port);
    let mut rank0 = Dealer::connect(node.port);
    let mut rank1 = Dealer::connect(node.port);
    register_as(&mut rank0, &mla_registration(100));
    register_as(&mut rank1, &mla_registration(101));
    let tokens: Vec<u32> = (0..32).collect();
    store(&mut rank0, "mla-model", 100, &tokens, 32);

    assert_eq!(
        sched.call(
            Op::Lookup,
            vec![
                key_readers("mla-model", &tokens, 32, None, "r1", 2),
                wire::encode_uint(1)
            ]
        ),
        None
    );
    assert_eq!(lm::query(&mut sched, "r1"), 2, "two chunks hit");
    assert_eq!(
        read_locks(&node),
        2,
        "two objects locked (for two readers each)"
    );

    let r0 = prepare_retrieve(&mut rank0, "mla-model", 100, &tokens, "r1");
    assert!(retrieved(&r0), "rank 0 retrieves: {r0}");
    commit_retrieve(&mut rank0, "mla-model", 100, &tokens, "r1");
    let r1 = prepare_retrieve(&mut rank1, "mla-model", 101, &tokens, "r1");
    assert!(
        retrieved(&r1),
        "rank 1's retrieve after rank 0's commit must still hit (num_kv_readers 2): {r1}"
    );
    // While rank 1 copies, its objects stay read-locked.
    assert_eq!(
        read_locks(&node),
        2,
        "rank 1 holds its locks while it copies"
    );
    commit_retrieve(&mut rank1, "mla-model", 101, &tokens, "r1");
    assert_eq!(
        sched.call(Op::EndSession, vec![wire::encode_str("r1")]),
        None
    );
    assert_eq!(
        read_locks(&node),
        0,
        "both readers done: nothing stays locked"
    );

    // A 0.5.6 client declaring one reader gets one lock per object, as declared (the tp
    // argument 4 would give 4 by the 0.5.4 rule): one reader's retrieve consumes it.
    assert_eq!(
        sched.call(
            Op::Lookup,
            vec![
                key_readers("mla-model", &tokens, 32, None, "r2", 1),
                wire::encode_uint(4)
            ]
        ),
        None
    );
    assert_eq!(lm::query(&mut sched, "r2"), 2);
    let r = prepare_retrieve(&mut rank0, "mla-model", 100, &tokens, "r2");
    assert!(retrieved(&r), "{r}");
    commit_retrieve(&mut rank0, "mla-model", 100, &tokens, "r2");
    assert_eq!(
        read_locks(&node),
        0,
        "one declared reader, one lock per object"
    );
}

/// `num_physical_slots` 8 with a chunk of 16 tokens: slots of [2, 2, 8, 8] float32 = 1 KiB (the
/// chunk-sized slot would be 2 KiB). 0 is refused like LMCache does, and a reader registered
/// with the other slot count misses rather than copying a slot of another size.
#[test]
fn num_physical_slots_sizes_the_slots() {
    let node = lm::start("slots", "", &[]);
    let mut d = Dealer::connect(node.port);
    let dcp = RegisterPayload {
        num_physical_slots: Some(8),
        ..lm::registration(200)
    };
    register_as(&mut d, &dcp);
    let tokens: Vec<u32> = (0..32).collect();
    let p = d
        .call(
            Op::PrepareStore,
            vec![
                key_readers("lm-model", &tokens, 32, Some(0), "s", 1),
                wire::encode_uint(200),
            ],
        )
        .unwrap();
    let slots = get(get(&p, "context"), "slots").as_array().unwrap().clone();
    assert_eq!(slots.len(), 2);
    for s in &slots {
        assert_eq!(get(s, "length").as_u64(), Some(1024), "slot {s}");
        let shape: Vec<u64> = get(s, "shape")
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(shape, vec![2, 2, 8, 8], "slot {s}");
    }
    assert_eq!(
        d.call(
            Op::CommitStore,
            vec![
                key_readers("lm-model", &tokens, 32, Some(0), "s", 1),
                wire::encode_uint(200),
                vec![0xc4, 0x00],
            ],
        ),
        Some(Value::Boolean(true))
    );

    // num_physical_slots 0: refused (LMCache: "must be positive"), answered negatively.
    let mut bad = Dealer::connect(node.port);
    let zero = RegisterPayload {
        num_physical_slots: Some(0),
        ..lm::registration(201)
    };
    let r = register_as(&mut bad, &zero);
    assert_eq!(get(&r, "shm_name").as_str(), Some(""), "refused: {r}");

    // A chunk-sized reader of the same model: the 1 KiB objects are not its layout: a miss.
    let mut other = Dealer::connect(node.port);
    register_as(&mut other, &lm::registration(202));
    let r = prepare_retrieve(&mut other, "lm-model", 202, &tokens, "x");
    assert!(
        !retrieved(&r),
        "a slot of another size is never handed out: {r}"
    );
    commit_retrieve(&mut other, "lm-model", 202, &tokens, "x");
    // The DCP worker itself hits.
    let r = prepare_retrieve(&mut d, "lm-model", 200, &tokens, "y");
    assert!(retrieved(&r), "{r}");
    commit_retrieve(&mut d, "lm-model", 200, &tokens, "y");
    assert!(node.log().contains("another layout"), "the miss is logged");
}

/// A worker whose instance the node reaped: its PREPARE_STORE gets no slot list (never the
/// empty list that means "already cached"), the request is counted, and its next PING is
/// answered false once, so its heartbeat's recovery registers it again.
#[test]
fn a_reaped_worker_is_told_and_registers_again() {
    let node = lm::start(
        "lost",
        "",
        &[
            "--worker-reap-timeout-seconds",
            "2",
            "--worker-registration-grace-seconds",
            "2",
        ],
    );
    let mut d = Dealer::connect(node.port);
    lm::register(&mut d, 300);
    assert_eq!(
        d.call(Op::Ping, vec![wire::encode_uint(300)]),
        Some(Value::Boolean(true))
    );
    // Another user-less prober's PING of an unknown id is answered true, as LMCache does.
    assert_eq!(
        d.call(Op::Ping, vec![wire::encode_uint(999)]),
        Some(Value::Boolean(true))
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while lm::status(&node)["liveness"]["reaped"].as_u64() != Some(1) {
        assert!(Instant::now() < deadline, "not reaped: {}", node.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let tokens: Vec<u32> = (0..32).collect();
    let p = d
        .call(
            Op::PrepareStore,
            vec![
                key_readers("lm-model", &tokens, 32, Some(0), "s", 1),
                wire::encode_uint(300),
            ],
        )
        .unwrap();
    let ctx = get(&p, "context");
    assert!(
        ctx.as_map()
            .unwrap()
            .iter()
            .all(|(k, _)| k.as_str() != Some("slots")),
        "no slot list for an unregistered instance (an empty one reads as 'already cached'): {p}"
    );
    let st = lm::status(&node);
    assert!(
        st["lmcache"]["unregistered_requests"].as_u64().unwrap_or(0) >= 1,
        "counted: {st:#}"
    );
    // The heartbeat: false once, then true; the worker registers again and stores.
    let mut d2 = Dealer::connect(node.port); // a reconnect (new identity) of the same user
    assert_eq!(
        d2.call(Op::Ping, vec![wire::encode_uint(300)]),
        Some(Value::Boolean(false)),
        "the first PING after the release fails"
    );
    assert_eq!(
        d2.call(Op::Ping, vec![wire::encode_uint(300)]),
        Some(Value::Boolean(true)),
        "then the server looks healthy again (the client's recovery re-registers)"
    );
    let r = lm::register(&mut d2, 300);
    assert!(!get(&r, "shm_name").as_str().unwrap().is_empty());
    store(&mut d2, "lm-model", 300, &tokens, 32);
    assert!(node
        .log()
        .contains("answering false once, so the worker registers it again"));
}
