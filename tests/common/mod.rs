//! Shared helpers for integration tests: start the real `kvnode` binary on a private socket,
//! connect clients, poll status. Polling waits for a condition with a generous deadline; tests
//! never assert on elapsed time.

#![allow(dead_code)]

pub mod etcd;
pub mod gpu_stub;
pub mod lm;
pub mod netns;
pub mod remote;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::protocol::{ChunkRange, RegisterRequest};

/// Model name used by the tests.
pub const MODEL: &str = "test-model";
/// Tokens per chunk the tests start nodes with (small chunks keep objects small).
pub const CHUNK: u32 = 16;

/// A private temporary directory for one test. Invariant: created empty; removed with
/// everything in it when dropped, except while the thread panics (a failed test keeps it for
/// inspection and prints where it is).
pub struct TestDir {
    path: PathBuf,
}

impl TestDir {
    /// A fresh, empty directory under the system temp dir, unique to this process and call.
    pub fn new(tag: &str) -> TestDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kvnode-it-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TestDir { path }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path inside the directory.
    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.path.join(p)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test failed: kept {} for inspection", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The `kvnode` binary the tests start: `$KVNODE_BIN` when set (prebuilt binaries carried to
/// another machine, e.g. by scripts/gpu-check.sh), else the one cargo built with the tests.
pub fn kvnode_bin() -> std::ffi::OsString {
    std::env::var_os("KVNODE_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_kvnode").into())
}

/// A running `kvnode serve` process, killed on drop; its directory (log, socket, config) is a
/// [`TestDir`], removed after the process is gone.
pub struct NodeProc {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: PathBuf,
    // Dropped after `Drop::drop` has killed the process.
    _tmp: TestDir,
}

impl NodeProc {
    /// Starts a node with a 64 MiB pool, chunk size [`CHUNK`], plus `extra` flags.
    pub fn start(tag: &str, extra: &[&str]) -> NodeProc {
        let tmp = TestDir::new(tag);
        let socket = tmp.join("kvnode.sock");
        NodeProc::launch(tmp, socket, extra)
    }

    /// Like [`NodeProc::start`], but serving on `socket` (anywhere) instead of a path in its own
    /// directory.
    pub fn start_at(tag: &str, socket: &Path, extra: &[&str]) -> NodeProc {
        NodeProc::launch(TestDir::new(tag), socket.to_path_buf(), extra)
    }

    /// Starts a node whose configuration file holds `toml` (written into the node's own
    /// directory, removed with it), plus `extra` flags.
    pub fn start_with_config(tag: &str, toml: &str, extra: &[&str]) -> NodeProc {
        let tmp = TestDir::new(tag);
        let cfg = tmp.join("node.toml");
        std::fs::write(&cfg, toml).unwrap();
        let mut args = vec!["--config", cfg.to_str().unwrap()];
        args.extend_from_slice(extra);
        let socket = tmp.join("kvnode.sock");
        NodeProc::launch(tmp, socket, &args)
    }

    /// Like [`NodeProc::start`], with the process's open-file limit (`RLIMIT_NOFILE`, soft and
    /// hard) set to `nofile` by the shell that execs it.
    pub fn start_with_nofile(tag: &str, nofile: u64) -> NodeProc {
        let tmp = TestDir::new(tag);
        let socket = tmp.join("kvnode.sock");
        NodeProc::launch_limited(tmp, socket, &[], Some(nofile))
    }

    fn launch(tmp: TestDir, socket: PathBuf, extra: &[&str]) -> NodeProc {
        NodeProc::launch_limited(tmp, socket, extra, None)
    }

    /// Like [`NodeProc::start`], with the node in network namespace `netns` (its Unix socket
    /// stays reachable through the file system).
    pub fn start_in_netns(tag: &str, netns: &str, extra: &[&str]) -> NodeProc {
        let tmp = TestDir::new(tag);
        let socket = tmp.join("kvnode.sock");
        NodeProc::launch_with(tmp, socket, extra, None, Some(netns))
    }

    fn launch_limited(
        tmp: TestDir,
        socket: PathBuf,
        extra: &[&str],
        nofile: Option<u64>,
    ) -> NodeProc {
        NodeProc::launch_with(tmp, socket, extra, nofile, None)
    }

    fn launch_with(
        tmp: TestDir,
        socket: PathBuf,
        extra: &[&str],
        nofile: Option<u64>,
        netns: Option<&str>,
    ) -> NodeProc {
        let dir = tmp.path().to_path_buf();
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
        let mut cmd = match (nofile, netns) {
            // `ip netns exec` execs the node: the child's pid is the node's.
            (None, Some(ns)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(kvnode_bin());
                c
            }
            (None, None) => Command::new(kvnode_bin()),
            (Some(n), _) => {
                // `exec` keeps the pid: killing the child kills the node.
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(kvnode_bin());
                c
            }
        };
        let child = cmd
            .args(&args)
            .env("RUST_LOG", "kvnode=debug,info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start kvnode");
        let mut node = NodeProc {
            child,
            socket,
            dir,
            _tmp: tmp,
        };
        node.wait_ready();
        node
    }

    /// Sends SIGTERM and waits (up to 20 s) for the process to exit; panics with the log if it
    /// does not. Returns the exit status.
    pub fn sigterm_and_wait(&mut self) -> ExitStatus {
        sigterm(&self.child);
        match wait_exit(&mut self.child, Duration::from_secs(20)) {
            Some(st) => st,
            None => panic!(
                "kvnode did not stop within 20 s of SIGTERM; log:\n{}",
                self.log()
            ),
        }
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
        // Never signal a process that was already reaped (its pid may have been reused).
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sends SIGTERM to `child` (through kill(1), so the tests need no unsafe code).
pub fn sigterm(child: &Child) {
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill -TERM {}", child.id());
}

/// Polls `child` until it exits or `deadline` passes (`None`: still running).
pub fn wait_exit(child: &mut Child, deadline: Duration) -> Option<ExitStatus> {
    let end = Instant::now() + deadline;
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return Some(st);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What a `kvnode` command that was expected to stop on its own did.
pub struct Finished {
    /// Exit status; `None` if it was still running after the deadline (it was then killed).
    pub status: Option<ExitStatus>,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

impl Finished {
    /// Whether it exited by itself with a non-zero status.
    pub fn failed(&self) -> bool {
        matches!(self.status, Some(st) if !st.success())
    }
}

/// Runs `kvnode args...`, waiting up to 20 s for it to exit by itself (a command that should
/// fail but keeps running, e.g. a node that started after all, is killed and reported with
/// `status: None`). Output goes through files in `dir`, so a chatty process never blocks.
pub fn kvnode_until_exit(dir: &TestDir, args: &[&str]) -> Finished {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out_path = dir.join(format!("cmd-{n}.out"));
    let err_path = dir.join(format!("cmd-{n}.err"));
    let mut child = Command::new(kvnode_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("start kvnode");
    let status = wait_exit(&mut child, Duration::from_secs(20));
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    Finished {
        status,
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
    }
}

/// The kind names `Error`'s Display used to print before its context (`Io: ...`); users must
/// never see them.
pub const KIND_PREFIXES: [&str; 10] = [
    "InvalidRequest:",
    "NotRegistered:",
    "OutOfMemory:",
    "KeyState:",
    "LimitExceeded:",
    "Io:",
    "Unsupported:",
    "UnknownTransfer:",
    "ShuttingDown:",
    "Internal:",
];

/// Panics unless `text` is free of internal kind prefixes.
pub fn assert_no_kind_prefix(text: &str) {
    for k in KIND_PREFIXES {
        assert!(!text.contains(k), "internal kind prefix {k:?} in {text:?}");
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
        physical_slots: None,
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
    // Child roles are `#[ignore]`d (a plain `cargo test` never runs them without their
    // environment): the child runs exactly that ignored test.
    c.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ]);
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
