//! Several `kvnode-bench --socket` runs against ONE running `kvnode serve`: at the same time, and
//! one after another. Every run must verify every byte it reads with zero corrupt chunks: keys are
//! unique per run (random run nonce) and a chunk's bytes are a function of its key only, so runs
//! never read each other's data as "corrupt". No timing assertions.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A private scratch directory for one test (socket, JSON files, node log); removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!(
            "kvnode-bench-shared-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `kvnode serve` (the binary next to `kvnode-bench`); killed on drop.
struct Node {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Node {
    fn start(dir: &Path) -> Node {
        let bin = Path::new(env!("CARGO_BIN_EXE_kvnode-bench")).with_file_name("kvnode");
        assert!(
            bin.is_file(),
            "{} is missing: build it first (cargo build --workspace --all-targets)",
            bin.display()
        );
        let socket = dir.join("kvnode.sock");
        let log = dir.join("node.log");
        let child = Command::new(&bin)
            .args(["serve", "--socket"])
            .arg(&socket)
            .args(["--pool-size", "64MiB", "--chunk-size", "16", "--workers", "2"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start kvnode serve");
        let mut node = Node { child, socket, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut c) = kvnode::client::Client::connect(&node.socket) {
                if c.noop().is_ok() {
                    return node;
                }
            }
            if let Ok(Some(st)) = node.child.try_wait() {
                panic!("kvnode exited ({st}) during start-up:\n{}", node.log());
            }
            assert!(
                Instant::now() < deadline,
                "kvnode did not answer:\n{}",
                node.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `kvnode-bench --socket` command against `node` writing its JSON to `json`.
fn bench(node: &Node, json: &Path, workload: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"));
    c.arg("--socket")
        .arg(&node.socket)
        .args(["--preset", "tiny", "--workload", workload])
        .args(["--instances", "2", "--ops", "40", "--warmup", "5"])
        .args(["--working-set", "0.2", "--baseline-secs", "0.05"])
        .arg("--json")
        .arg(json)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// The run's JSON report, after checking that it exited successfully and verified every byte.
fn verified_report(node: &Node, name: &str, json: &Path, out: Output) -> serde_json::Value {
    let text = std::fs::read_to_string(json).unwrap_or_default();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    assert!(
        out.status.success() && j["verified"] == true && j["corrupt_chunks"] == 0,
        "run {name}: {} (corrupt_chunks {}, verified_chunks {}, verified {})\nstdout:\n{}\nstderr:\n{}\nnode log:\n{}",
        out.status,
        j["corrupt_chunks"],
        j["verified_chunks"],
        j["verified"],
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        node.log()
    );
    assert!(j["verified_chunks"].as_u64().unwrap() > 0, "{name}: {j:#}");
    j
}

#[test]
fn two_runs_at_once_against_one_node_both_verify() {
    let dir = Scratch::new("concurrent");
    let node = Node::start(&dir.0);
    let ja = dir.0.join("a.json");
    let jb = dir.0.join("b.json");
    // Both fill a working set of fresh single-chunk conversations and read it back while the
    // other does the same: identical keys across the two runs would read the other run's bytes.
    let a = bench(&node, &ja, "retrieve", &[]).spawn().unwrap();
    let b = bench(&node, &jb, "mixed", &["--hit-ratio", "0.7"])
        .spawn()
        .unwrap();
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let ra = verified_report(&node, "retrieve", &ja, a);
    let rb = verified_report(&node, "mixed", &jb, b);
    assert!(ra["hits"].as_u64().unwrap() > 0);
    assert!(rb["hits"].as_u64().unwrap() > 0);
    // One after another on the same node too: a third run (multiturn, in processes).
    let jc = dir.0.join("c.json");
    let c = bench(&node, &jc, "multiturn", &["--processes"])
        .output()
        .unwrap();
    verified_report(&node, "multiturn", &jc, c);
}
