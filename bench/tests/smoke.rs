//! Smoke runs of the harness against a private node (`--spawn`): every workload, threads and
//! processes; asserts that every byte verified and that the JSON has every documented field.
//! No timing assertions.

use std::path::PathBuf;
use std::process::Command;

/// A private directory for one test's files, removed when the test ends (kept if it failed,
/// for its files).
struct TestDir(PathBuf);

impl TestDir {
    fn new(tag: &str) -> TestDir {
        let d =
            std::env::temp_dir().join(format!("kvnode-bench-smoke-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn run(workload: &str, extra: &[&str]) -> serde_json::Value {
    let dir = TestDir::new(&format!("{workload}-{}", extra.len()));
    let json = dir.path("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args([
            "--spawn",
            "--pool-size",
            "64MiB",
            "--preset",
            "tiny",
            "--workload",
            workload,
        ])
        .args([
            "--instances",
            "2",
            "--ops",
            "40",
            "--warmup",
            "5",
            "--baseline-secs",
            "0.05",
        ])
        .arg("--json")
        .arg(&json)
        .args(extra)
        .output()
        .expect("run kvnode-bench");
    assert!(
        out.status.success(),
        "kvnode-bench {workload} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

fn check_schema(j: &serde_json::Value) {
    assert_eq!(j["verified"], true, "{j:#}");
    assert!(j["ops"].as_u64().unwrap() >= 80);
    for op in [
        "prepare_store",
        "commit_store",
        "prepare_retrieve",
        "commit_retrieve",
        "lookup",
        "ping",
        "store",
        "retrieve",
    ] {
        for k in ["p50", "p90", "p99", "p999", "max"] {
            assert!(
                j["latency_us"][op][k].is_number(),
                "latency_us.{op}.{k} missing"
            );
        }
    }
    for k in [
        "store_gbps",
        "retrieve_gbps",
        "memcpy_gbps",
        "store_vs_memcpy",
        "retrieve_vs_memcpy",
        "uds_pingpong_p50_us",
    ] {
        assert!(j[k].as_f64().is_some_and(f64::is_finite), "{k} missing");
    }
    assert!(j["pool_backing"].is_string());
    assert_eq!(j["instances"], 2);
    assert_eq!(j["chunk_bytes"], 2 * 2 * 16 * 128 * 2);
    assert_eq!(j["corrupt_chunks"], 0);
}

#[test]
fn store_workload() {
    let j = run("store", &[]);
    check_schema(&j);
    assert!(j["latency_us"]["store"]["p50"].as_f64().unwrap() > 0.0);
}

#[test]
fn retrieve_workload_in_processes_with_plot() {
    let dir = TestDir::new("png");
    let png = dir.path("retrieve.png");
    let j = run(
        "retrieve",
        &["--processes", "--plot", png.to_str().unwrap()],
    );
    check_schema(&j);
    assert!(j["hits"].as_u64().unwrap() > 0);
    assert_eq!(j["processes"], true);
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
}

#[test]
fn mixed_workload() {
    let j = run("mixed", &["--hit-ratio", "0.7"]);
    check_schema(&j);
}

#[test]
fn multiturn_workload() {
    let j = run("multiturn", &[]);
    check_schema(&j);
    assert!(j["latency_us"]["lookup"]["count"].as_u64().unwrap() >= 80);
}

#[test]
fn bad_arguments_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args(["--spawn", "--preset", "nope", "--ops", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown preset"));
}
