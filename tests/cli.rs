//! The command-line contract: `kvnode status [--json]`, `kvnode ping`, the socket's permissions,
//! and clear errors for bad flags.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use common::*;

fn kvnode(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn status_json_ping_and_socket_mode() {
    let node = NodeProc::start("cli", &[]);
    let sock = node.socket.to_str().unwrap();
    let mode = std::fs::metadata(&node.socket)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "socket file is private by default");

    let mut c = node.client();
    c.register(&reg(3)).unwrap();
    c.ping(Some(3)).unwrap();

    let out = kvnode(&["status", "--socket", sock, "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    for k in [
        "pool_backing",
        "pool_bytes",
        "used_bytes",
        "objects",
        "instances",
        "pending_writes",
        "pending_reads",
        "evictions",
        "memcheck_ok",
    ] {
        assert!(!v[k].is_null(), "status --json lacks {k}: {v:#}");
    }
    for k in ["ready", "write_reserved", "read_locked", "temporary"] {
        assert!(v["objects"][k].is_u64(), "objects.{k}");
    }
    let inst = &v["instances"][0];
    assert_eq!(inst["id"], 3);
    assert_eq!(inst["model"], MODEL);
    assert_eq!(inst["pinged"], true);
    assert!(inst["last_seen_ms_ago"].is_u64());

    let out = kvnode(&["status", "--socket", sock]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("memcheck  ok") && text.contains("instances 1"),
        "{text}"
    );

    let out = kvnode(&["ping", "--socket", sock]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("pong"));
}

#[test]
fn errors_are_clear_and_nonzero() {
    let out = kvnode(&["ping", "--socket", "/nonexistent/kvnode.sock"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("connecting to /nonexistent/kvnode.sock"));
    let out = kvnode(&["serve", "--pool-size", "lots"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("size"));
    let out = kvnode(&[
        "serve",
        "--socket",
        "/tmp/x.sock",
        "--pool-size",
        "8MiB",
        "--pages",
        "huge",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("pages must be one of"));
    let out = kvnode(&[
        "serve",
        "--reap-timeout",
        "100",
        "--registration-grace",
        "10",
        "--pool-size",
        "8MiB",
        "--socket",
        "/tmp/y.sock",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("registration grace"));
}
