//! Smoke runs of the kill soak (`kvnode-bench soak`) against the `kvnode` binary next to the
//! bench binary: a short soak must PASS with kills of both kinds, no corrupt chunk and a clean
//! end state; the same soak with survivors that write wrong bytes must FAIL (the verification
//! is not vacuous). Small pool: debug nodes may run memcheck after every storage mutation.
//! No timing assertions: the soak's own waits poll with generous deadlines.

use std::process::{Command, Output};

fn soak(name: &str, extra: &[&str]) -> (Output, serde_json::Value) {
    let dir = std::env::temp_dir().join(format!("kvnode-soak-smoke-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("soak.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args(["soak", "--duration", "5", "--pool-gb", "0.03125"])
        .args(["--final-verify-limit", "256"])
        .arg("--json")
        .arg(&json)
        .args(extra)
        .output()
        .expect("run kvnode-bench soak");
    let text = std::fs::read_to_string(&json).unwrap_or_else(|e| {
        panic!(
            "no JSON from the soak ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let _ = std::fs::remove_dir_all(&dir);
    (out, serde_json::from_str(&text).unwrap())
}

fn n(j: &serde_json::Value, path: &[&str]) -> u64 {
    path.iter()
        .fold(j, |v, k| &v[*k])
        .as_u64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {j:#}"))
}

#[test]
fn a_short_kill_soak_passes_with_a_clean_end_state() {
    let (out, j) = soak("pass.json", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let diag = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "soak failed:\n{diag}");
    let line: Vec<&str> = stdout.lines().filter(|l| l.starts_with("SOAK: ")).collect();
    assert_eq!(line.len(), 1, "exactly one summary line:\n{diag}");
    assert!(line[0].starts_with("SOAK: PASS "), "{diag}");
    assert!(line[0].contains(" corrupt=0 "), "{diag}");
    assert_eq!(j["pass"], true, "{j:#}");
    assert!(n(&j, &["kills", "native"]) > 0, "{j:#}");
    assert!(n(&j, &["kills", "lmcache"]) > 0, "{j:#}");
    let t = &j["totals"];
    assert_eq!(n(t, &["corrupt"]), 0);
    assert_eq!(n(t, &["lookup_then_miss"]), 0);
    assert!(
        n(t, &["stores"]) > 0 && n(t, &["chunks_verified"]) > 0,
        "{j:#}"
    );
    assert!(
        n(t, &["final_convs"]) > 0,
        "the survivors re-read their chunks: {j:#}"
    );
    // The end state, as the node reported it.
    let st = &j["end_status"];
    assert_eq!(st["instances"].as_array().map(Vec::len), Some(0), "{st:#}");
    for path in [
        &["pending_writes"][..],
        &["pending_reads"],
        &["objects", "write_reserved"],
        &["objects", "read_locked"],
        &["sessions"],
    ] {
        assert_eq!(n(st, path), 0, "{path:?} in {st:#}");
    }
    assert_eq!(st["memcheck_ok"], true);
    assert_eq!(
        n(st, &["used_bytes"]),
        n(st, &["objects", "ready"]) * n(&j, &["object_bytes"]),
        "used bytes are the committed objects only"
    );
    assert_eq!(j["memcheck"]["ok"], true);
    assert_eq!(j["node_exit_code"], 0);
    assert!(j["rss"]["growth_bytes"].as_i64().unwrap() <= n(&j, &["rss", "bound_bytes"]) as i64);
}

#[test]
fn the_soak_fails_when_stored_bytes_are_wrong() {
    let (out, j) = soak("sabotage.json", &["--sabotage"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "a sabotaged soak must fail: {stdout}"
    );
    assert!(stdout.starts_with("SOAK: FAIL "), "{stdout}");
    assert_eq!(j["pass"], false);
    assert!(n(&j, &["totals", "corrupt"]) > 0, "{j:#}");
}

#[test]
fn a_worker_needs_its_endpoint() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args(["soak-worker", "--kind", "native", "--role", "killable"])
        .args(["--instance-id", "1", "--seed", "1", "--run-nonce", "1"])
        .args(["--conversations", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--socket"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
