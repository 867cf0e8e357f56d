//! Several `kvnode-bench --socket` runs against ONE running `kvnode serve`: at the same time, and
//! one after another. Every run must verify every byte it reads with zero corrupt chunks: keys are
//! unique per run (random run nonce), and a chunk's bytes are a function of its key only, so a
//! chunk another run wrote (a deduplicated store, `--run-nonce`) verifies too. No timing
//! assertions.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A private scratch directory for one test (socket, JSON files, node log); removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d =
            std::env::temp_dir().join(format!("kvnode-bench-shared-{}-{name}", std::process::id()));
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
            .args([
                "--pool-size",
                "64MiB",
                "--chunk-size",
                "16",
                "--workers",
                "2",
            ])
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
        .args(["--working-set", "0.05", "--baseline-secs", "0.05"])
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
    // Different random nonces: no key of one run was already on the node for the other.
    assert_ne!(ra["run_nonce"], rb["run_nonce"]);
    assert_eq!(ra["store_skipped_chunks"], 0, "{ra:#}");
    assert_eq!(rb["store_skipped_chunks"], 0, "{rb:#}");
    // One after another on the same node too: a third run (multiturn, in processes).
    let jc = dir.0.join("c.json");
    let c = bench(&node, &jc, "multiturn", &["--processes"])
        .output()
        .unwrap();
    verified_report(&node, "multiturn", &jc, c);
}

#[test]
fn a_deduplicated_store_verifies() {
    let dir = Scratch::new("dedup");
    let node = Node::start(&dir.0);
    let nonce = ["--run-nonce", "424242"];
    // Run 1 fills a working set of 2 x 102 chunks (0.05 of the 64 MiB pool in 16 KiB chunks).
    let j1 = dir.0.join("1.json");
    let r1 = bench(&node, &j1, "retrieve", &nonce).output().unwrap();
    let r1 = verified_report(&node, "first", &j1, r1);
    assert_eq!(r1["store_skipped_chunks"], 0, "{r1:#}");
    assert_eq!(r1["run_nonce"], 424242);
    // Run 2, same nonce, in processes (children share the run's nonce): its whole fill is already
    // on the node, so every chunk it reads was written by run 1.
    let j2 = dir.0.join("2.json");
    let mut args = nonce.to_vec();
    args.push("--processes");
    let r2 = bench(&node, &j2, "retrieve", &args).output().unwrap();
    let r2 = verified_report(&node, "second", &j2, r2);
    let capacity = r2["node_status"]["capacity_bytes"].as_u64().unwrap();
    let fill = 2 * (capacity as f64 * 0.05 / 16384.0 / 2.0).floor() as u64;
    assert_eq!(r2["store_skipped_chunks"], fill, "{r2:#}");
    assert!(r2["hits"].as_u64().unwrap() > 0);
    // Run 3, same nonce, store workload: conversations 0..45 of each instance (5 warm-up, 40
    // timed), all stored by run 1 already. Nothing is written; the post-run re-read verifies
    // run 1's bytes.
    let j3 = dir.0.join("3.json");
    let r3 = bench(&node, &j3, "store", &nonce).output().unwrap();
    let r3 = verified_report(&node, "third", &j3, r3);
    assert_eq!(r3["store_skipped_chunks"], 2 * 45, "{r3:#}");
    assert_eq!(r3["latency_us"]["commit_store"]["count"], 0, "{r3:#}");
}
