//! Smoke run of the LMCache-wire load generator (`kvnode-bench lmcache`) against a
//! `kvnode lmcache-server` (the binary next to the bench's): a few ops, every byte verified,
//! the JSON has the per-call percentiles. Bounded (3 ops); no timing assertions.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_few_lmcache_ops_verify_and_report_percentiles() {
    let dir = std::env::temp_dir().join(format!("kvnode-lmbench-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bench = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kvnode-bench"));
    let node = bench.with_file_name("kvnode");
    let _server = Server(
        Command::new(&node)
            .args(["lmcache-server", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--chunk-size", "16", "--l1-size-gb", "0.0625"])
            .args(["--shm-name", &format!("lmbench{}", std::process::id())])
            .args(["--supported-transfer-mode", "engine_driven", "--socket"])
            .arg(dir.join("native.sock"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", node.display())),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "lmcache-server did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let json = dir.join("lm.json");
    let out = Command::new(&bench)
        .args(["lmcache", "--url", &format!("tcp://127.0.0.1:{port}")])
        .args(["--ops", "3", "--warmup", "1", "--pings", "3", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(j["verified"], serde_json::Value::Bool(true), "{j:#}");
    for op in [
        "prepare_store",
        "commit_store",
        "lookup",
        "prepare_retrieve",
        "ping",
        "noop",
    ] {
        assert_eq!(
            j["latency_us"][op]["count"],
            3 + u64::from(op == "noop") * 3,
            "{op}: {j:#}"
        );
        assert!(j["latency_us"][op]["p99"].as_f64().unwrap() > 0.0);
    }
    assert!(j["server_cost_us"]["prepare_store"]["p50"].is_number());
    assert!(j["store_GBps"].as_f64().unwrap() > 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}
