//! Who may use the LMCache endpoint, against the real binary: the node runs as root (as the
//! tests do), a probing LMCache client runs as the unprivileged user `nobody` (this test binary
//! re-executed with uid/gid 65534). By default nobody is refused everything and root's
//! instance and data survive its UNREGISTER and CLEAR; `--allow-uid 65534` makes it a client
//! (data path, never CLEAR); a non-loopback `--host` needs `--allow-remote`, and even then a
//! local peer is judged by its uid.

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::lm::{free_port, get};
use common::{num, TestDir};
use kvnode::lmcache::wire::{self, IpcKey, Op, RegisterPayload};
use rmpv::Value;

/// The unprivileged user the probe runs as.
const NOBODY: u32 = 65534;
/// The instance root registers (the probe targets it).
const ROOT_INSTANCE: u64 = 1001;
/// The instance the probe tries to register for itself.
const PROBE_INSTANCE: u64 = 2002;

struct LmNode {
    child: Child,
    port: u16,
    socket: std::path::PathBuf,
    shm: String,
    dir: TestDir,
}

impl Drop for LmNode {
    fn drop(&mut self) {
        // SIGTERM first so the node unlinks its segment; SIGKILL and unlink as a fallback.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        if common::wait_exit(&mut self.child, Duration::from_secs(10)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.shm));
        let _ = std::fs::remove_file(format!("/dev/shm/{}.lock", self.shm));
    }
}

impl LmNode {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }
}

/// `lmcache-server` on `host` (a free port) with `extra` flags, started once its native socket
/// answers and its LMCache endpoint listens.
fn start(tag: &str, host: &str, extra: &[&str]) -> LmNode {
    let dir = TestDir::new(&format!("lm-access-{tag}"));
    let port = free_port();
    let socket = dir.join("native.sock");
    let shm_arg = format!("acc{}{tag}", std::process::id());
    let child = Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args([
            "lmcache-server",
            "--host",
            host,
            "--port",
            &port.to_string(),
        ])
        .args(["--chunk-size", "16", "--l1-size-gb", "0.0625"])
        .args(["--shm-name", &shm_arg])
        .args(["--supported-transfer-mode", "engine_driven"])
        .arg("--socket")
        .arg(&socket)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("node.log")).unwrap())
        .spawn()
        .unwrap();
    let mut node = LmNode {
        child,
        port,
        socket,
        shm: format!("lmcache_l1_pool_{shm_arg}"),
        dir,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while kvnode::client::Client::connect(&node.socket).is_err()
        || !node.log().contains("LMCache frontend listening")
    {
        if let Ok(Some(st)) = node.child.try_wait() {
            panic!("lmcache-server exited ({st}): {}", node.log());
        }
        assert!(Instant::now() < deadline, "lmcache-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    node
}

/// A DEALER speaking LMCache's frames.
struct Dealer {
    sock: zmq::Socket,
    _ctx: zmq::Context,
    uid: u64,
}

impl Dealer {
    fn connect(endpoint: &str) -> Dealer {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::DEALER).unwrap();
        sock.set_rcvtimeo(30_000).unwrap();
        sock.set_linger(0).unwrap();
        sock.connect(endpoint).unwrap();
        Dealer {
            sock,
            _ctx: ctx,
            uid: 0,
        }
    }

    /// Sends one request; returns the reply's payload frame (None: the echoed prefix only).
    fn raw(&mut self, typ: Vec<u8>, payload: Vec<Vec<u8>>) -> Option<Vec<u8>> {
        let uid = wire::encode_uint(self.uid);
        self.uid += 1;
        let mut frames = vec![uid.clone(), typ.clone()];
        frames.extend(payload);
        self.sock.send_multipart(frames, 0).unwrap();
        let reply = self
            .sock
            .recv_multipart(0)
            .expect("a reply within 30 s (never silence)");
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

fn key(tokens: &[u32], end: u64, req: &str) -> Vec<u8> {
    wire::encode_key(
        &IpcKey {
            model_name: "lm-model".into(),
            world_size: 1,
            worker_id: Some(0),
            token_ids: tokens.to_vec(),
            start: 0,
            end,
            request_id: req.into(),
            cache_salt: String::new(),
            num_kv_readers: 1,
        },
        true,
    )
}

/// An engine-driven registration of the test model: 2 layers, hidden 8, chunk 16.
fn registration(instance_id: u64) -> Vec<u8> {
    wire::encode_register_payload(&RegisterPayload {
        instance_id,
        model_name: "lm-model".into(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim_size: 8,
        dtype_str: "float16".into(),
        use_mla: false,
        num_physical_slots: None,
    })
}

/// Bytes of one chunk object of the test model (2 layers × K/V × 16 tokens × 8 × fp16).
const OBJ: usize = 2 * 2 * 16 * 8 * 2;

/// Root's worker: registers [`ROOT_INSTANCE`], stores two chunks (bytes 0x51, 0x52) and keeps
/// the pool mapped to read them back.
struct RootWorker {
    d: Dealer,
    pool: kvnode_hw::PoolMapping,
    tokens: Vec<u32>,
}

impl RootWorker {
    fn start(node: &LmNode) -> RootWorker {
        let mut d = Dealer::connect(&format!("tcp://127.0.0.1:{}", node.port));
        assert_eq!(d.call(Op::GetChunkSize, vec![]), Some(Value::from(16)));
        let r = d
            .call(Op::RegisterEngineDriven, vec![registration(ROOT_INSTANCE)])
            .unwrap();
        assert_eq!(get(&r, "shm_name").as_str(), Some(node.shm.as_str()));
        let pool = kvnode_hw::PoolMapping::open_posix_shm(
            &node.shm,
            get(&r, "pool_size").as_u64().unwrap(),
        )
        .unwrap();
        let tokens: Vec<u32> = (0..32).collect();
        let inst = wire::encode_uint(ROOT_INSTANCE);
        let p = d
            .call(
                Op::PrepareStore,
                vec![key(&tokens, 32, "root-s"), inst.clone()],
            )
            .unwrap();
        let slots = get(get(&p, "context"), "slots").as_array().unwrap().clone();
        assert_eq!(slots.len(), 2);
        for (slot, byte) in slots.iter().zip([0x51u8, 0x52]) {
            pool.region()
                .fill_at(get(slot, "offset").as_u64().unwrap(), OBJ as u64, byte)
                .unwrap();
        }
        assert_eq!(
            d.call(
                Op::CommitStore,
                vec![key(&tokens, 32, "root-s"), inst, vec![0xc4, 0x00]]
            ),
            Some(Value::Boolean(true))
        );
        RootWorker { d, pool, tokens }
    }

    /// Root's instance is still registered and its two chunks read back byte for byte.
    fn assert_intact(&mut self, node: &LmNode) {
        let st = common::NodeStatus::of(&node.socket);
        let ids: Vec<u64> = st["instances"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|i| i["id"].as_u64())
            .collect();
        assert!(
            ids.contains(&ROOT_INSTANCE),
            "root's instance survives: {st:#}"
        );
        assert_eq!(
            num(&st, &["objects", "ready"]),
            2,
            "root's data survives: {st:#}"
        );
        let inst = wire::encode_uint(ROOT_INSTANCE);
        let p = self
            .d
            .call(
                Op::PrepareRetrieve,
                vec![key(&self.tokens, 32, "root-r"), inst.clone()],
            )
            .unwrap();
        assert_eq!(get(&p, "success"), &Value::Boolean(true), "{p}");
        let slots = get(get(&p, "context"), "slots").as_array().unwrap().clone();
        assert_eq!(slots.len(), 2);
        for (slot, byte) in slots.iter().zip([0x51u8, 0x52]) {
            let mut buf = vec![0u8; OBJ];
            self.pool
                .region()
                .read_at(get(slot, "offset").as_u64().unwrap(), &mut buf)
                .unwrap();
            assert!(buf.iter().all(|b| *b == byte), "chunk bytes intact");
        }
        assert_eq!(
            self.d.call(
                Op::CommitRetrieve,
                vec![key(&self.tokens, 32, "root-r"), inst]
            ),
            Some(Value::Boolean(true))
        );
        // Root may still run node-wide operations afterwards (checked last by the callers).
    }
}

/// Child role (runs as `nobody`): the probe. Sends, in order, GET_CHUNK_SIZE, PING, its own
/// REGISTER, PREPARE_STORE and UNREGISTER, UNREGISTER of root's instance (when
/// `KVNODE_LM_PROBE_UNREGISTER_ROOT` is set), CLEAR (both forms), then a final NOOP, and prints
/// each answer as `PROBE <name> <answer>`.
#[test]
#[ignore = "child role, run by the access tests as nobody"]
fn child_nobody_probe() {
    let endpoint = std::env::var("KVNODE_LM_PROBE_ENDPOINT").expect("run by its parent test");
    assert_eq!(
        kvnode_hw::effective_uid(),
        NOBODY,
        "the probe runs as nobody"
    );
    let mut d = Dealer::connect(&endpoint);
    let show = |v: Option<Value>| v.map_or_else(|| "none".to_owned(), |v| v.to_string());
    let own = wire::encode_uint(PROBE_INSTANCE);
    println!(
        "PROBE chunk_size {}",
        show(d.call(Op::GetChunkSize, vec![]))
    );
    println!("PROBE ping {}", show(d.call(Op::Ping, vec![own.clone()])));
    let r = d.call(Op::RegisterEngineDriven, vec![registration(PROBE_INSTANCE)]);
    println!(
        "PROBE register_shm {}",
        r.as_ref()
            .map_or("none", |r| get(r, "shm_name").as_str().unwrap_or("?"))
    );
    let tokens: Vec<u32> = (1000..1032).collect();
    let p = d.call(
        Op::PrepareStore,
        vec![key(&tokens, 32, "probe"), own.clone()],
    );
    println!(
        "PROBE prepare_slots {}",
        p.as_ref().map_or(0, |p| get(p, "context")
            .as_map()
            .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some("slots")))
            .and_then(|(_, v)| v.as_array())
            .map_or(0, Vec::len))
    );
    println!(
        "PROBE unregister_own {}",
        show(d.call(Op::UnregisterEngineDriven, vec![own]))
    );
    // Another user's instance is the ownership checks' business once the user is let in.
    if std::env::var_os("KVNODE_LM_PROBE_UNREGISTER_ROOT").is_some() {
        println!(
            "PROBE unregister_root {}",
            show(d.call(
                Op::UnregisterEngineDriven,
                vec![wire::encode_uint(ROOT_INSTANCE)]
            ))
        );
    }
    println!("PROBE clear {}", show(d.call(Op::Clear, vec![])));
    println!(
        "PROBE clear_force {}",
        show(d.call(Op::Clear, vec![wire::encode_bool(true)]))
    );
    println!("PROBE noop {}", show(d.call(Op::Noop, vec![])));
    println!("PROBE done");
}

/// Runs [`child_nobody_probe`] as uid/gid 65534 (no supplementary groups) against `endpoint`
/// and returns its answers by name.
/// `hostile` adds the UNREGISTER of root's instance.
fn probe_as_nobody(endpoint: &str, hostile: bool) -> HashMap<String, String> {
    probe_as_nobody_in(endpoint, hostile, None)
}

/// Like [`probe_as_nobody`], optionally inside network namespace `netns`.
fn probe_as_nobody_in(
    endpoint: &str,
    hostile: bool,
    netns: Option<&str>,
) -> HashMap<String, String> {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match netns {
        // Entering a namespace needs root: the user is dropped after it, by setpriv.
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args([
                "netns",
                "exec",
                ns,
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
            ])
            .args(["--clear-groups", "--"])
            .arg(&exe);
            c
        }
        None => {
            let mut c = Command::new(&exe);
            // std drops the supplementary groups (setgroups(0)) when root sets a uid.
            c.uid(NOBODY).gid(NOBODY);
            c
        }
    };
    cmd.args([
        "--exact",
        "child_nobody_probe",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env("KVNODE_LM_PROBE_ENDPOINT", endpoint)
    .env_remove("KVNODE_LM_PROBE_UNREGISTER_ROOT")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    if hostile {
        cmd.env("KVNODE_LM_PROBE_UNREGISTER_ROOT", "1");
    }
    let mut child = cmd.spawn().expect("spawn the probe");
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let st = child.wait().unwrap();
    assert!(st.success(), "probe failed ({st}):\n{out}\n{err}");
    let answers: HashMap<String, String> = out
        .lines()
        // The harness may print `test child_nobody_probe ... ` before the first line.
        .filter_map(|l| l.find("PROBE ").map(|i| &l[i + "PROBE ".len()..]))
        .filter_map(|l| l.split_once(' ').or(Some((l, ""))))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    assert!(
        answers.contains_key("done"),
        "the probe ran to its end:\n{out}\n{err}"
    );
    answers
}

#[test]
fn another_local_user_is_refused_and_roots_instance_and_data_survive() {
    let node = start("deny", "127.0.0.1", &[]);
    let mut root = RootWorker::start(&node);
    let a = probe_as_nobody(&format!("tcp://127.0.0.1:{}", node.port), true);
    // Every request got a negative answer, none a positive one.
    assert_eq!(a["chunk_size"], "none", "{a:?}");
    assert_eq!(a["ping"], "false", "{a:?}");
    assert_eq!(a["register_shm"], "", "no segment named: {a:?}");
    assert_eq!(a["prepare_slots"], "0", "{a:?}");
    assert_eq!(a["noop"], "none", "{a:?}");
    // Its UNREGISTER of root's instance and its CLEARs did nothing.
    root.assert_intact(&node);
    let st = common::NodeStatus::of(&node.socket);
    let ids: Vec<u64> = st["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["id"].as_u64())
        .collect();
    assert!(
        !ids.contains(&PROBE_INSTANCE),
        "nobody registered nothing: {st:#}"
    );
    // One rate-limited warning names the user.
    let log = node.log();
    assert!(
        log.contains("LMCache request refused: user 65534 may not use this node"),
        "{log}"
    );
    // Root itself may still clear.
    assert_eq!(root.d.call(Op::Clear, vec![]), None);
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(
        num(&st, &["objects", "ready"]),
        0,
        "root's CLEAR ran: {st:#}"
    );
}

#[test]
fn an_allowed_user_uses_the_data_path_but_may_not_clear() {
    let node = start("client", "127.0.0.1", &["--allow-uid", "65534"]);
    let mut root = RootWorker::start(&node);
    let a = probe_as_nobody(&format!("tcp://127.0.0.1:{}", node.port), false);
    assert_eq!(a["chunk_size"], "16", "{a:?}");
    assert_eq!(a["noop"], "\"OK\"", "{a:?}");
    assert_eq!(a["register_shm"], node.shm, "{a:?}");
    assert_eq!(a["prepare_slots"], "2", "the data path works: {a:?}");
    // Its CLEARs were refused: root's data survives.
    root.assert_intact(&node);
    let log = node.log();
    assert!(
        log.contains("LMCache request refused: user 65534 may not run node-wide operations"),
        "{log}"
    );
}

#[test]
fn a_non_loopback_host_needs_allow_remote_and_local_peers_are_still_judged_by_uid() {
    let dir = TestDir::new("lm-access-remote");
    let port = free_port().to_string();
    for host in ["0.0.0.0", "*"] {
        let f = common::kvnode_until_exit(
            &dir,
            &[
                "lmcache-server",
                "--host",
                host,
                "--port",
                &port,
                "--l1-size-gb",
                "0.0625",
                "--shm-name",
                &format!("accr{}", std::process::id()),
            ],
        );
        assert!(
            f.failed(),
            "refused at start-up: {:?} {}",
            f.status,
            f.stderr
        );
        assert!(
            f.stderr.contains("not a loopback address") && f.stderr.contains("--allow-remote"),
            "{}",
            f.stderr
        );
    }
    // With the flag it serves on every interface; a local user is still identified by uid.
    let node = start("remote", "0.0.0.0", &["--allow-remote"]);
    assert!(
        node.log().contains("--allow-remote"),
        "the start-up warning"
    );
    let mut root = RootWorker::start(&node);
    let a = probe_as_nobody(&format!("tcp://127.0.0.1:{}", node.port), true);
    assert_eq!(a["chunk_size"], "none", "{a:?}");
    assert_eq!(a["register_shm"], "", "{a:?}");
    root.assert_intact(&node);
}

/// Runs `kvnode args...` as nobody; returns whether it succeeded, and its output.
fn kvnode_as_nobody(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args(args)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .expect("run kvnode as nobody");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn serve_access_flags_let_a_listed_user_in() {
    // A socket every user may open: only [access] keeps others out.
    let open = common::NodeProc::start("serve-deny", &["--socket-mode", "0666"]);
    let sock = open.socket.display().to_string();
    let (ok, out) = kvnode_as_nobody(&["ping", "--socket", &sock]);
    assert!(!ok, "{out}");
    let log = open.log();
    assert!(
        log.contains("refused a peer not allowed by [access]"),
        "{log}"
    );
    let allowed = common::NodeProc::start(
        "serve-allow",
        &["--socket-mode", "0666", "--allow-uid", "1,65534"],
    );
    let sock = allowed.socket.display().to_string();
    let (ok, out) = kvnode_as_nobody(&["ping", "--socket", &sock]);
    assert!(ok && out.contains("pong"), "{out}");
}

#[test]
fn with_allow_remote_a_peer_of_another_network_namespace_is_a_client() {
    let ns = common::netns::Netns::new();
    let node = start("netns", "0.0.0.0", &["--allow-remote"]);
    let _root = RootWorker::start(&node);
    // The probe runs in the other namespace: its socket is not in the node's socket table.
    let a = probe_as_nobody_in(
        &format!("tcp://{}:{}", ns.host_ip, node.port),
        false,
        Some(&ns.name),
    );
    assert_eq!(a["chunk_size"], "16", "{a:?}");
    assert_eq!(a["register_shm"], node.shm, "{a:?}");
    assert_eq!(a["prepare_slots"], "2", "the data path works: {a:?}");
    let log = node.log();
    assert!(
        log.contains("LMCache request refused: user unknown may not run node-wide operations"),
        "{log}"
    );
    // Its CLEARs were refused.
    let st = common::NodeStatus::of(&node.socket);
    assert_eq!(
        num(&st, &["objects", "ready"]),
        2,
        "root's data survives: {st:#}"
    );
}
