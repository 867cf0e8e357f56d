//! Shared helpers for integration tests: start the real `kvnode` binary on a private socket,
//! connect clients, poll status. Polling waits for a condition with a generous deadline; tests
//! never assert on elapsed time.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::protocol::{ChunkRange, RegisterRequest};

/// Model name used by the tests.
pub const MODEL: &str = "test-model";
/// Tokens per chunk the tests start nodes with (small chunks keep objects small).
pub const CHUNK: u32 = 16;

/// A running `kvnode serve` process, killed on drop.
pub struct NodeProc {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: PathBuf,
}

fn unique_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("kvnode-it-{}-{tag}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

impl NodeProc {
    /// Starts a node with a 64 MiB pool, chunk size [`CHUNK`], plus `extra` flags.
    pub fn start(tag: &str, extra: &[&str]) -> NodeProc {
        let dir = unique_dir(tag);
        let socket = dir.join("kvnode.sock");
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--socket".into(),
            socket.display().to_string(),
            "--chunk-size".into(),
            CHUNK.to_string(),
        ];
        if !extra.contains(&"--pool-size") {
            args.extend(["--pool-size".into(), "64MiB".into()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = std::fs::File::create(dir.join("node.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_kvnode"))
            .args(&args)
            .env("RUST_LOG", "kvnode=debug,info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start kvnode");
        let mut node = NodeProc { child, socket, dir };
        node.wait_ready();
        node
    }

    /// Starts a node whose configuration file holds `toml` (written into the node's own
    /// directory, removed with it), plus `extra` flags.
    pub fn start_with_config(tag: &str, toml: &str, extra: &[&str]) -> NodeProc {
        let cfg = std::env::temp_dir().join(format!("kvnode-it-{}-{tag}.toml", std::process::id()));
        std::fs::write(&cfg, toml).unwrap();
        let mut args = vec!["--config", cfg.to_str().unwrap()];
        args.extend_from_slice(extra);
        let node = NodeProc::start(tag, &args);
        let _ = std::fs::remove_file(&cfg); // read at start-up
        node
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut c) = Client::connect(&self.socket) {
                if c.noop().is_ok() {
                    return;
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("kvnode exited early ({status}); log:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "kvnode did not come up; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect")
    }

    pub fn status(&self) -> serde_json::Value {
        self.client().status().expect("status")
    }

    /// Polls status until `pred` holds (panics with the last status after 20 s).
    pub fn wait_status(
        &self,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = self.status();
            if pred(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; last status: {s:#}\nlog:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A registration for `instance_id` with a small layout: [2, 2, CHUNK, 64] float32 = 16 KiB.
pub fn reg(instance_id: u64) -> RegisterRequest {
    RegisterRequest {
        instance_id,
        model: MODEL.into(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim: 64,
        dtype: "float32".into(),
        use_mla: false,
    }
}

/// Worker-0 range over the given token list.
pub fn range(tokens: &[u32]) -> ChunkRange {
    ChunkRangeBuilder::worker(MODEL, 1, 0).tokens(tokens, CHUNK)
}

/// Tokens for `chunks` chunks of conversation `conv`.
pub fn tokens(conv: u32, chunks: u32) -> Vec<u32> {
    (0..chunks * CHUNK)
        .map(|i| conv.wrapping_mul(1_000_003).wrapping_add(i))
        .collect()
}

/// A deterministic chunk payload derived from its hash (so any reader can verify it).
pub fn payload(hash: &[u8; 32], len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut state = u64::from_le_bytes(hash[..8].try_into().unwrap()) | 1;
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Payloads for every chunk of a range.
pub fn payloads(r: &ChunkRange, len: usize) -> Vec<Vec<u8>> {
    r.chunk_hashes.iter().map(|h| payload(h, len)).collect()
}

/// Runs this test binary again as a child process executing the test named `name`, with `env`.
pub fn spawn_child(name: &str, env: &[(&str, String)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", name, "--nocapture", "--test-threads", "1"]);
    for (k, v) in env {
        c.env(k, v);
    }
    c.stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child")
}

/// u64 from a status JSON path.
pub fn num(v: &serde_json::Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for p in path {
        cur = &cur[*p];
    }
    cur.as_u64()
        .unwrap_or_else(|| panic!("{path:?} not a number in {v:#}"))
}

/// Status of a node reached through its native socket.
pub struct NodeStatus;

impl NodeStatus {
    /// Fetches the status JSON from `socket`.
    pub fn of(socket: &std::path::Path) -> serde_json::Value {
        Client::connect(socket)
            .expect("connect")
            .status()
            .expect("status")
    }
}
