//! Smoke run of `kvnode-bench --gpu` on a host without a GPU, through the stand-in CUDA driver
//! (`tests/gpu_stub/libcuda_stub.c`, device memory in host memory): the real CUDA code path of
//! the client and the bench, every retrieved chunk verified, every documented JSON field
//! present. The stub copies with memcpy: no figure from it means anything about a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

fn stub_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvnode-bench-gpu-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/gpu_stub/libcuda_stub.c");
    let out = Command::new("cc")
        .args([
            "-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Werror", "-o",
        ])
        .arg(d.join("libcuda.so.1"))
        .arg(&src)
        .output()
        .expect("cc (scripts/setup.sh installs build-essential)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::os::unix::fs::symlink("libcuda.so.1", d.join("libcuda.so")).unwrap();
    d
}

const FIELDS: &[&str] = &[
    "gpu",
    "gpu_backend",
    "gpu_store_gbps",
    "gpu_retrieve_gbps",
    "raw_registered_d2h_gbps",
    "raw_registered_h2d_gbps",
    "raw_pageable_d2h_gbps",
    "raw_pageable_h2d_gbps",
    "gpu_store_vs_raw",
    "gpu_retrieve_vs_raw",
    "gpu_store_p50_us",
    "gpu_retrieve_p99_us",
    "chunk_bytes",
    "instances",
    "verified",
    "corrupt_chunks",
    "misses",
];

#[test]
fn the_gpu_bench_runs_and_verifies_on_the_stub_driver() {
    let dir = stub_dir("run");
    let json = dir.join("gpu.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args([
            "--spawn",
            "--pool-size",
            "128MiB",
            "--preset",
            "tiny",
            "--gpu",
        ])
        .args([
            "--instances",
            "2",
            "--ops",
            "40",
            "--warmup",
            "3",
            "--gpu-batch",
            "3",
        ])
        .args(["--baseline-secs", "0.05", "--json"])
        .arg(&json)
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{stderr}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for f in FIELDS {
        assert!(!j[f].is_null(), "missing {f} in {j:#}");
    }
    assert_eq!(j["gpu"], "kvnode stub GPU");
    assert_eq!(j["gpu_backend"], "cuda");
    assert_eq!(j["verified"], true, "{j:#}");
    assert_eq!(j["gpu_store_requests"], 80);
    assert_eq!(j["gpu_retrieve_requests"], 80);
    assert_eq!(
        j["checked_headers"], 240,
        "every retrieved chunk's header checked"
    );
    assert!(j["checked_full_chunks"].as_u64().unwrap() >= 6);
    for f in [
        "gpu_store_gbps",
        "raw_registered_h2d_gbps",
        "raw_pageable_d2h_gbps",
    ] {
        assert!(j[f].as_f64().unwrap() > 0.0, "{f}: {j:#}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_a_gpu_the_bench_says_why() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args(["--spawn", "--pool-size", "64MiB", "--gpu", "--ops", "1"])
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("kvnode stub GPU") || out.status.success() {
        eprintln!("this host has a CUDA driver: the no-GPU path is not exercised");
        return;
    }
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--gpu: no GPU:"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
