//! Smoke runs of `kvnode-bench l2` (small objects, 16 MiB, one engine per test) against private
//! nodes: every documented JSON field is present and the counts match (every object written
//! behind, recovered after the restart and verified). No timing assertions.

use std::process::Command;

fn run(engine: &str) -> serde_json::Value {
    let dir = std::env::temp_dir().join(format!(
        "kvnode-bench-l2-smoke-{}-{engine}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join(format!("l2-{engine}.json"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args([
            "l2",
            "--object-size",
            "256KiB",
            "--total",
            "16MiB",
            "--engines",
            engine,
        ])
        .arg("--json")
        .arg(&json)
        .output()
        .expect("run kvnode-bench l2");
    assert!(
        out.status.success(),
        "kvnode-bench l2 --engines {engine} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    j
}

fn number(j: &serde_json::Value, path: &str) {
    let v = path.split('.').fold(j, |v, k| &v[k]);
    assert!(
        v.as_f64().is_some_and(f64::is_finite),
        "{path} missing or not a number: {v}"
    );
}

fn check(j: &serde_json::Value, engine: &str) {
    let chunks = 64u64;
    assert_eq!(j["mode"], "l2");
    assert_eq!(j["verified"], true, "{j:#}");
    let l2 = &j["l2"];
    assert_eq!(l2["object_bytes"], 256 << 10);
    assert_eq!(l2["total_bytes"], 16 << 20);
    assert_eq!(l2["objects"], chunks);
    assert_eq!(l2["engines"], serde_json::json!([engine]));
    assert_eq!(l2["verified"], true);
    for k in ["layers", "hidden", "chunk_tokens"] {
        number(l2, &format!("layout.{k}"));
    }
    for k in [
        "batch_chunks",
        "clock_ticks",
        "device.write_gbps",
        "device.read_gbps",
    ] {
        number(l2, k);
    }
    assert_eq!(l2["device"]["write_engine"], engine);
    assert!(l2["dir"].is_string() && l2["fs"].is_string());
    let raw = &l2["raw"][engine];
    for k in [
        "queue_depth",
        "batch_ios",
        "ring_buffers",
        "io_bytes",
        "bytes",
        "write_gbps",
        "read_gbps",
        "write_s",
        "sync_s",
        "read_s",
        "write_cpu_s_per_gb",
        "read_cpu_s_per_gb",
    ] {
        number(raw, k);
    }
    assert_eq!(raw["bytes"], 16 << 20);
    let n = &l2["node"][engine];
    for k in [
        "objects",
        "bytes",
        "l2_size",
        "startup_s",
        "store_gbps",
        "store_s",
        "write_behind_gbps",
        "write_behind_s",
        "write_cpu_s_per_gb",
        "write_node_cpu_s",
        "max_queued",
        "writes",
        "shutdown_s",
        "restart_s",
        "recovered",
        "read_gbps",
        "retrieve_gbps",
        "read_s",
        "read_prepare_share",
        "read_cpu_s_per_gb",
        "read_node_cpu_s",
        "verified_chunks",
        "corrupt_chunks",
        "misses",
        "write_vs_raw",
        "write_vs_device",
        "read_vs_raw",
        "read_vs_device",
        "paired_raw_read_gbps",
        "read_vs_paired",
        "paired_raw_checksum_read_gbps",
        "read_vs_paired_checksum",
    ] {
        number(n, k);
    }
    assert_eq!(n["engine"], engine);
    assert!(n["paired_raw_engine"] == "uring" || n["paired_raw_engine"] == "pread");
    assert!(n["paired_raw_read_gbps"].as_f64().unwrap() > 0.0);
    assert!(n["drop_caches"].is_boolean());
    assert_eq!(n["verified"], true);
    assert_eq!(n["objects"], chunks);
    assert_eq!(n["writes"], chunks);
    assert_eq!(n["recovered"], chunks);
    assert_eq!(n["verified_chunks"], chunks);
    assert_eq!(n["corrupt_chunks"], 0);
    assert_eq!(n["misses"], 0);
    let w = &n["status_after_write"];
    assert_eq!(w["engine"], engine);
    assert_eq!(w["write_policy"], "always");
    assert_eq!(w["writes"], chunks);
    assert_eq!(w["bytes_written"], 16 << 20);
    for k in ["errors", "skipped", "corrupt", "evictions"] {
        assert_eq!(w[k], 0, "status_after_write.{k}");
    }
    let r = &n["status_after_read"];
    assert_eq!(r["recovered"], chunks);
    assert_eq!(r["hits"], chunks);
    assert_eq!(r["bytes_read"], 16 << 20);
    assert_eq!(r["corrupt"], 0);
    for k in ["raw_write", "raw_read", "node_write", "node_read"] {
        // One engine: no uring/pread ratio, but the field is there.
        assert!(l2["cpu_uring_over_pread"][k].is_null(), "{k}");
    }
    let t = &l2["targets"];
    assert_eq!(
        t["applies"], false,
        "256 KiB objects are below the 2 MiB target size"
    );
    for k in ["write_met", "read_met"] {
        assert!(t[k].is_boolean(), "targets.{k}");
    }
    number(t, "node_vs_device_min");
}

#[test]
fn l2_uring() {
    check(&run("uring"), "uring");
}

#[test]
fn l2_pread() {
    check(&run("pread"), "pread");
}

#[test]
fn l2_bad_object_size_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args(["l2", "--object-size", "100KiB", "--total", "1MiB"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("multiple of 128KiB"));
}
