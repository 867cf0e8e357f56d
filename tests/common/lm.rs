//! Helpers of the LMCache frontend's integration tests: a `kvnode lmcache-server` on a free port
//! with a TOML configuration, a Rust ZMQ DEALER speaking LMCache's frames, and the requests the
//! isolation tests send.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvnode::lmcache::wire::{self, IpcKey, Op, RegisterPayload};
use rmpv::Value;

pub struct LmNode {
    pub child: Child,
    pub port: u16,
    pub socket: std::path::PathBuf,
    pub shm: String,
    pub dir: std::path::PathBuf,
}

impl Drop for LmNode {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A root node bind-mounts its hugepage segment at the name and removes the mount at a
        // clean stop; a node that had to be killed leaves it (the next node of the name would
        // remove it): this test's node was the only one of its name, so its mount goes here.
        let path = format!("/dev/shm/{}", self.shm);
        let mounted = std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| {
            m.lines()
                .any(|l| l.split(' ').nth(4) == Some(path.as_str()))
        });
        if mounted {
            let _ = Command::new("umount").args(["-l", &path]).status();
        }
        let _ = std::fs::remove_file(format!("/dev/shm/{}", self.shm));
        let _ = std::fs::remove_file(format!("/dev/shm/{}.lock", self.shm));
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("test failed: kept {} for inspection", self.dir.display());
        }
    }
}

impl LmNode {
    /// The node's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }

    /// A field of `/proc/<pid>/status` in KiB (e.g. `VmRSS`, `VmHWM`).
    pub fn proc_kib(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc status"))
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `kvnode lmcache-server` (chunk 16, 64 MiB pool) with `toml` as its `--config` (empty:
/// none) and `extra` flags.
pub fn start(tag: &str, toml: &str, extra: &[&str]) -> LmNode {
    let dir = std::env::temp_dir().join(format!("kvnode-lmiso-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let port = free_port();
    let socket = dir.join("native.sock");
    let shm_arg = format!("iso{}{tag}", std::process::id());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvnode"));
    cmd.args(["lmcache-server", "--host", "127.0.0.1", "--port"])
        .arg(port.to_string())
        .args(["--chunk-size", "16", "--l1-size-gb", "0.0625", "--shm-name"])
        .arg(&shm_arg)
        .args([
            "--supported-transfer-mode",
            "engine_driven",
            "--no-l1-use-lazy",
        ])
        .arg("--socket")
        .arg(&socket)
        .args(extra);
    if !toml.is_empty() {
        let cfg = dir.join("node.toml");
        std::fs::write(&cfg, toml).unwrap();
        cmd.arg("--config").arg(cfg);
    }
    let child = cmd
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
    let deadline = Instant::now() + Duration::from_secs(60);
    while kvnode::client::Client::connect(&node.socket).is_err() {
        assert!(
            Instant::now() < deadline,
            "lmcache-server did not start: {}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    node
}

/// One LMCache client connection (one ZMQ identity).
pub struct Dealer {
    pub sock: zmq::Socket,
    pub _ctx: zmq::Context,
    pub uid: u64,
}

impl Dealer {
    pub fn connect(port: u16) -> Dealer {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::DEALER).unwrap();
        sock.set_rcvtimeo(60_000).unwrap();
        sock.set_linger(0).unwrap();
        sock.set_sndhwm(0).unwrap();
        sock.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
        Dealer {
            sock,
            _ctx: ctx,
            uid: 0,
        }
    }

    /// Sends one request without waiting; returns its uid.
    pub fn send(&mut self, op: Op, payload: Vec<Vec<u8>>) -> u64 {
        let uid = self.uid;
        self.uid += 1;
        let mut frames = vec![wire::encode_uint(uid), wire::encode_op(op)];
        frames.extend(payload);
        self.sock.send_multipart(frames, 0).unwrap();
        uid
    }

    /// Receives one reply: (uid, decoded third frame or None).
    pub fn recv(&mut self) -> (u64, Option<Value>) {
        let reply = self
            .sock
            .recv_multipart(0)
            .expect("a reply within 60 s (never silence)");
        assert!(
            reply.len() == 2 || reply.len() == 3,
            "{} frames",
            reply.len()
        );
        let uid = rmpv::decode::read_value(&mut reply[0].as_slice())
            .unwrap()
            .as_u64()
            .unwrap();
        let v = reply
            .get(2)
            .map(|f| rmpv::decode::read_value(&mut f.as_slice()).expect("reply decodes"));
        (uid, v)
    }

    pub fn call(&mut self, op: Op, payload: Vec<Vec<u8>>) -> Option<Value> {
        let uid = self.send(op, payload);
        let (got, v) = self.recv();
        assert_eq!(got, uid, "replies in order for one client");
        v
    }
}

pub fn key(tokens: &[u32], start: u64, end: u64, worker: Option<u32>, req: &str) -> Vec<u8> {
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

/// 2 layers, hidden 8, chunk 16, float32: 2 KiB objects.
pub fn registration(instance_id: u64) -> RegisterPayload {
    RegisterPayload {
        instance_id,
        model_name: "lm-model".into(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim_size: 8,
        dtype_str: "float32".into(),
        use_mla: false,
        num_physical_slots: None,
    }
}

pub fn get<'a>(v: &'a Value, k: &str) -> &'a Value {
    v.as_map()
        .unwrap_or_else(|| panic!("map expected, got {v}"))
        .iter()
        .find(|(kk, _)| kk.as_str() == Some(k))
        .map(|(_, vv)| vv)
        .unwrap_or_else(|| panic!("no field {k} in {v}"))
}

pub fn register(d: &mut Dealer, id: u64) -> Value {
    d.call(
        Op::RegisterEngineDriven,
        vec![wire::encode_register_payload(&registration(id))],
    )
    .expect("register reply")
}

/// PREPARE_STORE of `[start, end)`: the slots' offsets (none when the answer has no slot list,
/// i.e. nothing was reserved, or an empty one, i.e. all cached already).
pub fn prepare_store(d: &mut Dealer, id: u64, tokens: &[u32], end: u64, req: &str) -> Vec<u64> {
    let p = d
        .call(
            Op::PrepareStore,
            vec![key(tokens, 0, end, Some(0), req), wire::encode_uint(id)],
        )
        .unwrap();
    let ctx = get(&p, "context").as_map().expect("context is a map");
    let Some((_, slots)) = ctx.iter().find(|(k, _)| k.as_str() == Some("slots")) else {
        return Vec::new();
    };
    slots
        .as_array()
        .unwrap()
        .iter()
        .map(|s| get(s, "offset").as_u64().unwrap())
        .collect()
}

pub fn commit_store(d: &mut Dealer, id: u64, tokens: &[u32], end: u64, req: &str) -> Option<Value> {
    d.call(
        Op::CommitStore,
        vec![
            key(tokens, 0, end, Some(0), req),
            wire::encode_uint(id),
            vec![0xc4, 0x00],
        ],
    )
}

pub fn lookup(d: &mut Dealer, tokens: &[u32], req: &str) {
    assert_eq!(
        d.call(
            Op::Lookup,
            vec![
                key(tokens, 0, tokens.len() as u64, None, req),
                wire::encode_uint(1)
            ]
        ),
        None
    );
}

pub fn query(d: &mut Dealer, req: &str) -> u64 {
    d.call(Op::QueryPrefetchStatus, vec![wire::encode_str(req)])
        .and_then(|v| v.as_u64())
        .expect("an integer answer")
}

pub fn status(node: &LmNode) -> serde_json::Value {
    super::NodeStatus::of(&node.socket)
}
