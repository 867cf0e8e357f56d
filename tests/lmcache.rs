//! The LMCache frontend against a Rust ZMQ DEALER speaking LMCache's frames: every supported
//! request type round-trips with the exact reply types, data stored through the shared segment
//! reads back byte for byte, the session and lock semantics hold, unsupported and malformed
//! requests get well-typed negative answers, and the native socket reports LMCache clients.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::lm::{free_port, get};
use common::num;
use kvnode::lmcache::wire::{self, IpcKey, Op, RegisterPayload};
use rmpv::Value;

struct LmNode {
    child: Child,
    port: u16,
    socket: std::path::PathBuf,
    shm: String,
    dir: std::path::PathBuf,
}

impl Drop for LmNode {
    fn drop(&mut self) {
        // SIGTERM first so the node unlinks its segment; SIGKILL and unlink as a fallback.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.shm));
        let _ = std::fs::remove_file(format!("/dev/shm/{}.lock", self.shm));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(tag: &str) -> LmNode {
    start_with(tag, &[])
}

fn start_with(tag: &str, extra: &[&str]) -> LmNode {
    let dir = std::env::temp_dir().join(format!("kvnode-lm-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let socket = dir.join("native.sock");
    let shm_arg = format!("it{}{tag}", std::process::id());
    let child = Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args([
            "lmcache-server",
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args([
            "--chunk-size",
            "16",
            "--l1-size-gb",
            "0.0625",
            "--shm-name",
            &shm_arg,
        ])
        .args([
            "--supported-transfer-mode",
            "engine_driven",
            "--eviction-policy",
            "LRU",
            "--no-l1-use-lazy",
        ])
        .arg("--socket")
        .arg(&socket)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("node.log")).unwrap())
        .spawn()
        .unwrap();
    let node = LmNode {
        child,
        port,
        socket,
        shm: format!("lmcache_l1_pool_{shm_arg}"),
        dir,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while kvnode::client::Client::connect(&node.socket).is_err() {
        assert!(Instant::now() < deadline, "lmcache-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    node
}

struct Dealer {
    sock: zmq::Socket,
    _ctx: zmq::Context,
    uid: u64,
}

impl Dealer {
    fn connect(port: u16) -> Dealer {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::DEALER).unwrap();
        sock.set_rcvtimeo(10_000).unwrap();
        sock.set_linger(0).unwrap();
        sock.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
        Dealer {
            sock,
            _ctx: ctx,
            uid: 0,
        }
    }

    /// Sends one request with raw type frame and payload frames; returns the reply's third frame
    /// (None when the server sent only the echoed prefix).
    fn raw(&mut self, typ: Vec<u8>, payload: Vec<Vec<u8>>) -> Option<Vec<u8>> {
        let uid = wire::encode_uint(self.uid);
        self.uid += 1;
        let mut frames = vec![uid.clone(), typ.clone()];
        frames.extend(payload);
        self.sock.send_multipart(frames, 0).unwrap();
        let reply = self
            .sock
            .recv_multipart(0)
            .expect("a reply within 10 s (never silence)");
        assert!(
            reply.len() == 2 || reply.len() == 3,
            "{} frames",
            reply.len()
        );
        assert_eq!(reply[0], uid, "uid echoed");
        assert_eq!(reply[1], typ, "type echoed");
        reply.get(2).cloned()
    }

    fn call(&mut self, op: Op, payload: Vec<Vec<u8>>) -> Option<Value> {
        self.raw(wire::encode_op(op), payload)
            .map(|f| rmpv::decode::read_value(&mut f.as_slice()).expect("reply decodes"))
    }
}

fn key(tokens: &[u32], start: u64, end: u64, worker: Option<u32>, req: &str) -> Vec<u8> {
    wire::encode_key(
        &IpcKey {
            model_name: "lm-model".into(),
            world_size: 1,
            worker_id: worker,
            token_ids: tokens.to_vec(),
            start,
            end,
            request_id: req.into(),
            cache_salt: String::new(),
            num_kv_readers: 1,
        },
        true,
    )
}

/// An engine-driven registration of the test model: 2 layers, hidden 8, chunk 16.
fn registration(instance_id: u64, dtype: &str) -> RegisterPayload {
    RegisterPayload {
        instance_id,
        model_name: "lm-model".into(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim_size: 8,
        dtype_str: dtype.into(),
        use_mla: false,
        num_physical_slots: None,
    }
}

#[test]
fn lmcache_protocol_end_to_end() {
    let node = start("e2e");
    let mut d = Dealer::connect(node.port);
    assert_eq!(d.call(Op::GetChunkSize, vec![]), Some(Value::from(16)));
    assert_eq!(d.call(Op::Noop, vec![]), Some(Value::from("OK")));
    assert_eq!(
        d.raw(wire::encode_uint(40), vec![]),
        Some(vec![0x90]),
        "GET_EXPERIMENTAL (0.5.4 id)"
    );
    assert_eq!(
        d.raw(wire::encode_uint(32), vec![]),
        Some(vec![0x90]),
        "GET_EXPERIMENTAL (0.5.5+ id)"
    );
    assert_eq!(
        d.raw(wire::encode_str("noop"), vec![]),
        Some(wire::encode_str("OK")),
        "0.5.6 string op"
    );

    // Register: the reply names the shm segment and its size; duplicate registration is identical.
    let reg = registration(1234567890123, "bfloat16");
    let r1 = d
        .call(
            Op::RegisterEngineDriven,
            vec![wire::encode_register_payload(&reg)],
        )
        .unwrap();
    let r2 = d
        .call(
            Op::RegisterEngineDriven,
            vec![wire::encode_register_payload(&reg)],
        )
        .unwrap();
    assert_eq!(r1, r2);
    assert_eq!(get(&r1, "shm_name").as_str(), Some(node.shm.as_str()));
    let pool_size = get(&r1, "pool_size").as_u64().unwrap();
    assert_eq!(pool_size, 64 << 20);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(format!("/dev/shm/{}", node.shm))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    let pool = kvnode_hw::PoolMapping::open_posix_shm(&node.shm, pool_size).unwrap();

    let inst = wire::encode_uint(reg.instance_id);
    let tokens: Vec<u32> = (0..64).collect(); // 4 chunks of 16
                                              // Store chunks [0, 2) first, then [0, 4): only the missing chunks 2 and 3 are reserved.
    let p = d
        .call(
            Op::PrepareStore,
            vec![key(&tokens, 0, 32, Some(0), "s1"), inst.clone()],
        )
        .unwrap();
    let ctx = get(&p, "context");
    let slots = get(ctx, "slots").as_array().unwrap().clone();
    assert_eq!(slots.len(), 2);
    assert_eq!(
        get(ctx, "chunk_indices"),
        &Value::Array(vec![0.into(), 1.into()])
    );
    let obj = 2 * 2 * 16 * 8 * 2;
    let write = |slot: &Value, byte: u8| {
        assert_eq!(get(slot, "length").as_u64(), Some(obj));
        assert_eq!(get(slot, "dtype").as_str(), Some("bfloat16"));
        assert_eq!(
            get(slot, "shape"),
            &Value::Array(vec![2.into(), 2.into(), 16.into(), 8.into()])
        );
        pool.region()
            .fill_at(get(slot, "offset").as_u64().unwrap(), obj, byte)
            .unwrap();
    };
    write(&slots[0], 10);
    write(&slots[1], 11);
    assert_eq!(
        d.call(
            Op::CommitStore,
            vec![
                key(&tokens, 0, 32, Some(0), "s1"),
                inst.clone(),
                vec![0xc4, 0x00]
            ]
        ),
        Some(Value::Boolean(true))
    );
    let p = d
        .call(
            Op::PrepareStore,
            vec![key(&tokens, 0, 64, Some(0), "s1"), inst.clone()],
        )
        .unwrap();
    let ctx = get(&p, "context");
    assert_eq!(
        get(ctx, "chunk_indices"),
        &Value::Array(vec![2.into(), 3.into()])
    );
    let slots2 = get(ctx, "slots").as_array().unwrap().clone();
    write(&slots2[0], 12);
    write(&slots2[1], 13);
    assert_eq!(
        d.call(
            Op::CommitStore,
            vec![
                key(&tokens, 0, 64, Some(0), "s1"),
                inst.clone(),
                vec![0xc4, 0x00]
            ]
        ),
        Some(Value::Boolean(true))
    );
    // A second commit finds nothing pending.
    assert_eq!(
        d.call(
            Op::CommitStore,
            vec![
                key(&tokens, 0, 64, Some(0), "s1"),
                inst.clone(),
                vec![0xc4, 0x00]
            ]
        ),
        Some(Value::Boolean(false))
    );
    // Everything cached: empty slots, no commit needed.
    let p = d
        .call(
            Op::PrepareStore,
            vec![key(&tokens, 0, 64, Some(0), "s1"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(get(&p, "context"), "slots"), &Value::Array(vec![]));
    assert_eq!(d.call(Op::EndSession, vec![wire::encode_str("s1")]), None);

    // A retrieve whose session holds no lookup locks (no LOOKUP ran) takes locks of its own,
    // released by its commit (LMCache misses here, W5; it never borrows another reader's lock).
    let own = d
        .call(
            Op::PrepareRetrieve,
            vec![key(&tokens, 0, 64, Some(0), "r0"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(&own, "success"), &Value::Boolean(true));
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["objects", "read_locked"]), 4);
    assert_eq!(
        d.call(
            Op::CommitRetrieve,
            vec![key(&tokens, 0, 64, Some(0), "r0"), inst.clone()]
        ),
        Some(Value::Boolean(true))
    );
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["objects", "read_locked"]), 0);
    // A retrieve of chunks that are not stored misses as a whole.
    let absent: Vec<u32> = (5000..5064).collect();
    let miss = d
        .call(
            Op::PrepareRetrieve,
            vec![key(&absent, 0, 64, Some(0), "r0"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(&miss, "success"), &Value::Boolean(false));
    assert_eq!(get(&miss, "data"), &Value::Binary(vec![]));
    assert_eq!(
        d.call(
            Op::CommitRetrieve,
            vec![key(&absent, 0, 64, Some(0), "r0"), inst.clone()]
        ),
        Some(Value::Boolean(true))
    );

    // LOOKUP (no reply frame) then QUERY_PREFETCH_STATUS exactly once.
    let more: Vec<u32> = (0..80).collect(); // 5 chunks, 4 stored
    assert_eq!(
        d.call(
            Op::Lookup,
            vec![key(&more, 0, 80, None, "r1"), wire::encode_uint(1)]
        ),
        None
    );
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["objects", "read_locked"]), 4);
    assert_eq!(
        d.call(Op::QueryPrefetchStatus, vec![wire::encode_str("r1")]),
        Some(Value::from(4))
    );
    assert_eq!(
        d.call(Op::QueryPrefetchStatus, vec![wire::encode_str("r1")]),
        Some(Value::from(0))
    );
    // LOOKUP honours `end` as LMCache 0.5.6 does: the chunks the client left out are neither
    // counted nor locked (issue 12: kvnode answered 4 here and locked all of them).
    assert_eq!(
        d.call(
            Op::Lookup,
            vec![key(&more, 0, 32, None, "r1end"), wire::encode_uint(1)]
        ),
        None
    );
    assert_eq!(
        d.call(Op::QueryPrefetchStatus, vec![wire::encode_str("r1end")]),
        Some(Value::from(2))
    );
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(
        num(&st, &["objects", "read_locked"]),
        4,
        "r1end locks 2 of r1's 4 again"
    );
    assert_eq!(
        d.call(Op::EndSession, vec![wire::encode_str("r1end")]),
        None
    );
    let p = d
        .call(
            Op::PrepareRetrieve,
            vec![key(&more, 0, 64, Some(0), "r1"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(&p, "success"), &Value::Boolean(true));
    let rslots = get(get(&p, "context"), "slots").as_array().unwrap().clone();
    assert_eq!(rslots.len(), 4);
    for (slot, byte) in rslots.iter().zip([10u8, 11, 12, 13]) {
        let mut buf = vec![0u8; obj as usize];
        pool.region()
            .read_at(get(slot, "offset").as_u64().unwrap(), &mut buf)
            .unwrap();
        assert!(
            buf.iter().all(|b| *b == byte),
            "chunk bytes read back exactly"
        );
    }
    assert_eq!(
        d.call(
            Op::CommitRetrieve,
            vec![key(&more, 0, 64, Some(0), "r1"), inst.clone()]
        ),
        Some(Value::Boolean(true))
    );
    assert_eq!(
        d.call(
            Op::FreeLookupLocks,
            vec![key(&more, 0, 80, None, "r1"), wire::encode_uint(1)]
        ),
        None
    );
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["objects", "read_locked"]), 0, "no lock leaked");

    // Partial miss: a retrieve over a range with a missing chunk fails as a whole.
    assert_eq!(
        d.call(
            Op::Lookup,
            vec![key(&more, 0, 80, None, "r2"), wire::encode_uint(1)]
        ),
        None
    );
    let p = d
        .call(
            Op::PrepareRetrieve,
            vec![key(&more, 0, 80, Some(0), "r2"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(&p, "success"), &Value::Boolean(false));
    assert_eq!(
        d.call(
            Op::WaitPrefetchStatus,
            vec![
                wire::encode_str("r2"),
                vec![0xcb, 0x40, 0x3e, 0, 0, 0, 0, 0, 0]
            ]
        ),
        Some(Value::from(4))
    );
    assert_eq!(
        d.call(
            Op::FreeLookupLocks,
            vec![key(&more, 0, 80, None, "r2"), wire::encode_uint(1)]
        ),
        None
    );
    assert_eq!(
        num(
            &common::NodeStatus::of(&node.socket),
            &["objects", "read_locked"]
        ),
        0
    );

    // vLLM frees up to its block-aligned hit (24 tokens = 1.5 chunks): the straddling chunk 1
    // stays locked, so a retrieve of [16, 64) still hits.
    assert_eq!(
        d.call(
            Op::Lookup,
            vec![key(&more, 0, 80, None, "r4"), wire::encode_uint(1)]
        ),
        None
    );
    assert_eq!(
        d.call(
            Op::FreeLookupLocks,
            vec![key(&more, 0, 24, None, "r4"), wire::encode_uint(1)]
        ),
        None
    );
    let p = d
        .call(
            Op::PrepareRetrieve,
            vec![key(&more, 16, 64, Some(0), "r4"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(&p, "success"), &Value::Boolean(true));
    assert_eq!(
        d.call(
            Op::CommitRetrieve,
            vec![key(&more, 16, 64, Some(0), "r4"), inst.clone()]
        ),
        Some(Value::Boolean(true))
    );
    assert_eq!(d.call(Op::EndSession, vec![wire::encode_str("r4")]), None);
    assert_eq!(
        num(
            &common::NodeStatus::of(&node.socket),
            &["objects", "read_locked"]
        ),
        0
    );

    // Management.
    assert_eq!(
        d.call(Op::Ping, vec![inst.clone()]),
        Some(Value::Boolean(true))
    );
    assert_eq!(
        d.call(Op::Ping, vec![vec![0xc0]]),
        Some(Value::Boolean(true))
    );
    let rec = vec![
        0x91, 0x83, 0xa6, b'r', b'e', b'q', b'_', b'i', b'd', 0xa1, b'r', 0xad, b'n', b'e', b'w',
        b'_', b'b', b'l', b'o', b'c', b'k', b'_', b'i', b'd', b's', 0x91, 0x01, 0xad, b'n', b'e',
        b'w', b'_', b't', b'o', b'k', b'e', b'n', b'_', b'i', b'd', b's', 0x91, 0x02,
    ];
    assert_eq!(
        d.call(
            Op::ReportBlockAllocation,
            vec![wire::encode_uint(42), wire::encode_str("lm-model"), rec]
        ),
        None
    );

    // Unsupported and malformed requests: typed negative answers, never silence.
    assert_eq!(
        d.call(Op::Store, vec![]),
        Some(Value::Array(vec![
            Value::Binary(vec![0; 64]),
            Value::Boolean(false)
        ]))
    );
    assert_eq!(
        d.raw(wire::encode_uint(25), vec![vec![0x01]]),
        None,
        "CacheBlend op: bare prefix"
    );
    let bad = d
        .call(Op::PrepareStore, vec![vec![0xff, 0xff], inst.clone()])
        .unwrap();
    // No slot list (the client's "could not reserve"), never the empty one of "already cached".
    assert_eq!(get(&bad, "context"), &Value::Map(vec![]), "{bad}");
    assert_eq!(
        d.call(
            Op::CommitStore,
            vec![
                key(&tokens, 0, 64, Some(0), "x"),
                inst.clone(),
                vec![0xc4, 0x02, 1, 2]
            ]
        ),
        Some(Value::Boolean(false)),
        "pickle data refused"
    );
    // That client is now known to be in pickle mode: its retrieves are misses, not slots it
    // would not read.
    assert_eq!(
        d.call(
            Op::Lookup,
            vec![key(&more, 0, 80, None, "r3"), wire::encode_uint(1)]
        ),
        None
    );
    let p = d
        .call(
            Op::PrepareRetrieve,
            vec![key(&more, 0, 64, Some(0), "r3"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(&p, "success"), &Value::Boolean(false));
    assert_eq!(
        d.call(
            Op::FreeLookupLocks,
            vec![key(&more, 0, 80, None, "r3"), wire::encode_uint(1)]
        ),
        None
    );
    assert_eq!(
        num(
            &common::NodeStatus::of(&node.socket),
            &["objects", "read_locked"]
        ),
        0
    );
    // Unaligned range: negative (no slot list), not a hang.
    let p = d
        .call(
            Op::PrepareStore,
            vec![key(&tokens, 0, 20, Some(0), "x"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(&p, "context"), &Value::Map(vec![]), "{p}");

    // The native socket reports the LMCache instance.
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(st["instances"][0]["id"], 1234567890123u64);
    assert_eq!(num(&st, &["objects", "ready"]), 4);
    assert_eq!(st["memcheck_ok"], true);

    // CLEAR without payload (0.5.4) and with force (0.5.6), and UNREGISTER: no reply frame.
    assert_eq!(d.call(Op::Clear, vec![]), None);
    assert_eq!(d.call(Op::Clear, vec![wire::encode_bool(true)]), None);
    assert_eq!(d.call(Op::UnregisterEngineDriven, vec![inst.clone()]), None);
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["objects", "ready"]), 0);
    assert!(st["instances"].as_array().unwrap().is_empty());
}

#[test]
fn unregister_releases_pending_and_sigterm_unlinks_the_segment() {
    let mut node = start("unreg");
    let mut d = Dealer::connect(node.port);
    let reg = registration(7, "float32");
    d.call(
        Op::RegisterEngineDriven,
        vec![wire::encode_register_payload(&reg)],
    )
    .unwrap();
    let tokens: Vec<u32> = (0..48).collect();
    let p = d
        .call(
            Op::PrepareStore,
            vec![key(&tokens, 0, 48, Some(0), "s"), wire::encode_uint(7)],
        )
        .unwrap();
    assert_eq!(
        get(get(&p, "context"), "slots").as_array().unwrap().len(),
        3
    );
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["pending_writes"]), 1);
    // Unregister with a pending write: freed, never published (LMCache published it: W3).
    assert_eq!(
        d.call(Op::UnregisterEngineDriven, vec![wire::encode_uint(7)]),
        None
    );
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["pending_writes"]), 0);
    assert_eq!(num(&st, &["used_bytes"]), 0);
    assert_eq!(num(&st, &["objects", "ready"]), 0);
    let shm = format!("/dev/shm/{}", node.shm);
    assert!(std::path::Path::new(&shm).exists());
    Command::new("kill")
        .args(["-TERM", &node.child.id().to_string()])
        .status()
        .unwrap();
    assert!(node.child.wait().unwrap().success());
    assert!(
        !std::path::Path::new(&shm).exists(),
        "segment unlinked on SIGTERM"
    );
    assert!(
        !std::path::Path::new(&format!("{shm}.lock")).exists(),
        "the lock file the node created is removed on SIGTERM"
    );
}

#[test]
fn silent_lmcache_worker_is_reaped_and_its_reservation_freed() {
    let node = start_with(
        "reap",
        &[
            "--worker-reap-timeout-seconds",
            "3",
            "--worker-registration-grace-seconds",
            "3",
        ],
    );
    let mut d = Dealer::connect(node.port);
    let reg = registration(99, "float16");
    d.call(
        Op::RegisterEngineDriven,
        vec![wire::encode_register_payload(&reg)],
    )
    .unwrap();
    assert_eq!(
        d.call(Op::Ping, vec![wire::encode_uint(99)]),
        Some(Value::Boolean(true))
    );
    let tokens: Vec<u32> = (0..32).collect();
    let p = d
        .call(
            Op::PrepareStore,
            vec![key(&tokens, 0, 32, Some(0), "s"), wire::encode_uint(99)],
        )
        .unwrap();
    assert_eq!(
        get(get(&p, "context"), "slots").as_array().unwrap().len(),
        2
    );
    // Silence: the timer wheel reaps the worker; its reservation is freed, never published.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = common::NodeStatus::of(&node.socket);
        if num(&st, &["liveness", "reaped"]) == 1 {
            assert_eq!(num(&st, &["used_bytes"]), 0);
            assert_eq!(num(&st, &["objects", "ready"]), 0);
            assert!(st["instances"].as_array().unwrap().is_empty());
            break;
        }
        assert!(Instant::now() < deadline, "not reaped: {st:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The reaped worker's commit is answered (false), not left hanging.
    assert_eq!(
        d.call(
            Op::CommitStore,
            vec![
                key(&tokens, 0, 32, Some(0), "s"),
                wire::encode_uint(99),
                vec![0xc4, 0x00]
            ]
        ),
        Some(Value::Boolean(false))
    );
}

/// Registers `reg` engine-driven and maps the pool segment the reply names.
fn register_mapped(d: &mut Dealer, node: &LmNode, reg: &RegisterPayload) -> kvnode_hw::PoolMapping {
    let r = d
        .call(
            Op::RegisterEngineDriven,
            vec![wire::encode_register_payload(reg)],
        )
        .unwrap();
    kvnode_hw::PoolMapping::open_posix_shm(&node.shm, get(&r, "pool_size").as_u64().unwrap())
        .unwrap()
}

#[test]
fn lmcache_clients_get_l2_hits_after_a_restart() {
    let l2 = std::env::temp_dir().join(format!("kvnode-lm-l2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&l2);
    let l2_args = ["--l2-path", l2.to_str().unwrap(), "--l2-size", "64MiB"];
    let reg = registration(5, "float32");
    let inst = wire::encode_uint(reg.instance_id);
    let tokens: Vec<u32> = (0..64).collect(); // 4 chunks
    let obj = 2 * 2 * 16 * 8 * 4;
    {
        let node = start_with("l2a", &l2_args);
        let mut d = Dealer::connect(node.port);
        let pool = register_mapped(&mut d, &node, &reg);
        let p = d
            .call(
                Op::PrepareStore,
                vec![key(&tokens, 0, 64, Some(0), "s"), inst.clone()],
            )
            .unwrap();
        let slots = get(get(&p, "context"), "slots").as_array().unwrap().clone();
        for (i, slot) in slots.iter().enumerate() {
            pool.region()
                .fill_at(get(slot, "offset").as_u64().unwrap(), obj, 40 + i as u8)
                .unwrap();
        }
        assert_eq!(
            d.call(
                Op::CommitStore,
                vec![
                    key(&tokens, 0, 64, Some(0), "s"),
                    inst.clone(),
                    vec![0xc4, 0x00]
                ]
            ),
            Some(Value::Boolean(true))
        );
        // Dropping the node stops it with SIGTERM, which drains the write-behind queue.
    }
    let node = start_with("l2b", &l2_args);
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["l2", "recovered"]), 4, "{st:#}");
    let mut d = Dealer::connect(node.port);
    let pool = register_mapped(&mut d, &node, &reg);
    assert_eq!(
        d.call(
            Op::Lookup,
            vec![key(&tokens, 0, 64, None, "r"), wire::encode_uint(1)]
        ),
        None
    );
    assert_eq!(
        d.call(Op::QueryPrefetchStatus, vec![wire::encode_str("r")]),
        Some(Value::from(4)),
        "all four chunks found on L2 and prefetched"
    );
    let p = d
        .call(
            Op::PrepareRetrieve,
            vec![key(&tokens, 0, 64, Some(0), "r"), inst.clone()],
        )
        .unwrap();
    assert_eq!(get(&p, "success"), &Value::Boolean(true));
    let rslots = get(get(&p, "context"), "slots").as_array().unwrap().clone();
    for (i, slot) in rslots.iter().enumerate() {
        let mut buf = vec![0u8; obj as usize];
        pool.region()
            .read_at(get(slot, "offset").as_u64().unwrap(), &mut buf)
            .unwrap();
        assert!(buf.iter().all(|b| *b == 40 + i as u8), "chunk {i} from L2");
    }
    assert_eq!(
        d.call(
            Op::CommitRetrieve,
            vec![key(&tokens, 0, 64, Some(0), "r"), inst.clone()]
        ),
        Some(Value::Boolean(true))
    );
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(num(&st, &["l2", "hits"]), 4);
    assert_eq!(num(&st, &["objects", "read_locked"]), 0, "no lock leaked");
    drop(node);
    let _ = std::fs::remove_dir_all(&l2);
}
