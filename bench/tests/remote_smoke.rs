//! Smoke runs of `kvnode-bench --remote` against a private node listening on loopback TCP
//! (`--spawn`, generated token): the workloads go through the remote client, every retrieved
//! byte is verified, and the JSON carries the raw TCP baselines, the ratios and the node's CPU
//! per GB with sane values. No timing thresholds.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// A private directory for one test's files, removed when the test passes.
struct TestDir(PathBuf);

impl TestDir {
    fn new(tag: &str) -> TestDir {
        let d = std::env::temp_dir().join(format!(
            "kvnode-bench-remote-smoke-{}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
}

/// Runs a tiny remote bench (a spawned node on 127.0.0.1, port 0) and returns its JSON.
fn run(tag: &str, workload: &str, extra: &[&str]) -> Value {
    let dir = TestDir::new(tag);
    let json = dir.0.join("out.json");
    let out = bench()
        .args(["--spawn", "--remote", "tcp://127.0.0.1:0"])
        .args(["--pool-size", "64MiB", "--preset", "tiny"])
        .args(["--workload", workload, "--instances", "2"])
        .args(["--ops", "30", "--warmup", "4"])
        .args(["--baseline-secs", "0.05", "--raw-secs", "0.06"])
        .arg("--json")
        .arg(&json)
        .args(extra)
        .output()
        .expect("run kvnode-bench");
    assert!(
        out.status.success(),
        "kvnode-bench --remote {workload} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("raw tcp"), "no remote line: {stdout}");
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

fn positive(j: &Value, key: &str) -> f64 {
    let v = j[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing: {j:#}"));
    assert!(v > 0.0 && v.is_finite(), "{key} = {v}");
    v
}

fn check_remote(j: &Value) {
    assert_eq!(j["verified"], true, "{j:#}");
    assert_eq!(j["corrupt_chunks"], 0);
    assert!(j["verified_chunks"].as_u64().unwrap() > 0);
    assert_eq!(j["fabric"], "tcp");
    assert!(j["remote_url"]
        .as_str()
        .unwrap()
        .starts_with("tcp://127.0.0.1:"));
    for k in [
        "raw_tcp_gbps",
        "raw_tcp_recv_gbps",
        "tcp_pingpong_p50_us",
        "tcp_pingpong_p99_us",
        "control_noop_p50_us",
        "control_noop_p99_us",
        "control_p50_vs_pingpong",
        "ping_vs_tcp_floor",
    ] {
        positive(j, k);
    }
    assert!(j["moved_bytes"].as_u64().unwrap() > 0);
    // Known: the bench spawned the node. CPU ticks are coarse: zero is possible on a tiny run.
    let cpu = j["node_cpu_s_per_gb"].as_f64().expect("node_cpu_s_per_gb");
    assert!(cpu >= 0.0 && cpu.is_finite());
    let raw = &j["raw_tcp"];
    // One sample per direction before the load, one after.
    assert_eq!(raw["send"]["samples_gbps"].as_array().unwrap().len(), 2);
    assert_eq!(raw["recv"]["samples_gbps"].as_array().unwrap().len(), 2);
    assert!(j["control_rounds"].as_u64().unwrap() > 0);
    assert!(raw["recv"]["peer_cpu_s_per_gb"].as_f64().unwrap() >= 0.0);
    for dir in ["send", "recv"] {
        let pages = raw[dir]["peer_pages"].as_str().unwrap();
        assert!(
            ["hugetlb-2m", "thp-advised", "4k"].contains(&pages),
            "{pages}"
        );
    }
    assert_eq!(raw["write_bytes"], j["chunk_bytes"]);
}

#[test]
fn remote_store_and_retrieve_verify_and_report_the_tcp_baselines() {
    let j = run("store", "store", &[]);
    check_remote(&j);
    positive(&j, "store_vs_raw");
    assert!(j["latency_us"]["write_slots"]["count"].as_u64().unwrap() >= 60);
    // A remote store's commit rides on WRITE_SLOTS.
    assert_eq!(j["latency_us"]["commit_store"]["count"], 0);
    assert!(["uring", "plain"].contains(&j["tcp_engine"].as_str().unwrap()));

    let j = run(
        "retrieve",
        "retrieve",
        &["--node-arg=--tcp-engine", "--node-arg=plain"],
    );
    check_remote(&j);
    positive(&j, "retrieve_vs_raw");
    assert_eq!(j["tcp_engine"], "plain");
    assert!(j["latency_us"]["read_slots"]["count"].as_u64().unwrap() >= 60);
    assert_eq!(
        j["hits"].as_u64().unwrap() + j["misses"].as_u64().unwrap(),
        60
    );
}

/// A raw peer started apart (as scripts/bench-remote.sh does beside a node in another
/// namespace); killed on drop.
struct Peer(Child, String);

impl Peer {
    fn start() -> Peer {
        let mut c = bench()
            .args(["--raw-peer", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().strip_prefix("LISTENING ").unwrap().to_string();
        Peer(c, addr)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn remote_multiturn_in_processes_with_a_given_raw_peer() {
    let peer = Peer::start();
    let j = run(
        "multiturn",
        "multiturn",
        &["--processes", "--raw-peer-addr", &peer.1],
    );
    check_remote(&j);
    assert_eq!(j["raw_tcp"]["peer"], peer.1.as_str());
    assert!(j["latency_us"]["lookup"]["count"].as_u64().unwrap() >= 60);
}

#[test]
fn rdma_fabric_is_refused_with_a_clear_message() {
    let out = bench()
        .args(["--remote", "tcp://127.0.0.1:9", "--fabric", "rdma"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("RDMA is not offered by this build/node"),
        "{err}"
    );
}
