//! Smoke runs of the L2 kill loop (`kvnode-bench l2-killloop`, pread engine, a few iterations on
//! a small tier) against the `kvnode` binary next to the bench binary: the plain and the CLEAR
//! variants must pass with kills, served objects and no wrong byte; a data file whose payloads
//! were damaged between a kill and the restart must be reported `corrupt` and never served; and
//! damage the node cannot detect (payload and header checksum rewritten together) must make the
//! loop fail with wrong bytes, so its verification is not vacuous. No timing assertions.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A private directory for one run, removed on drop.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the loop; returns its output, stdout + stderr, and its JSON.
fn killloop(name: &str, extra: &[&str]) -> (Output, String, serde_json::Value) {
    let dir = Dir(std::env::temp_dir().join(format!(
        "kvnode-l2-killloop-smoke-{}-{name}",
        std::process::id()
    )));
    std::fs::create_dir_all(&dir.0).unwrap();
    let json = dir.0.join("killloop.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvnode-bench"))
        .args(["l2-killloop", "--engine", "pread", "--seed", "7"])
        .args(["--l2-size", "64MiB", "--pool-size", "8MiB"])
        .args(["--max-objects", "160", "--hidden", "64"])
        .arg("--l2-dir")
        .arg(&dir.0)
        .arg("--json")
        .arg(&json)
        .args(extra)
        .output()
        .expect("run kvnode-bench l2-killloop");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let diag = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&json)
        .unwrap_or_else(|e| panic!("no JSON from the kill loop ({e}):\n{diag}"));
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    // Only the run's own working directory may be left inside ours (on failure): none else.
    let left: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "killloop.json")
        .collect();
    if j["pass"] == true || extra.contains(&"--sabotage") {
        assert!(
            left.is_empty(),
            "working directory not removed: {left:?}\n{diag}"
        );
    }
    (out, diag, j)
}

fn n(j: &serde_json::Value, path: &[&str]) -> u64 {
    path.iter()
        .fold(j, |v, k| &v[*k])
        .as_u64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {j:#}"))
}

/// The summary line: exactly one on stdout.
fn summary(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("L2-KILLLOOP: "))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "exactly one summary line on stdout:\n{stdout}"
    );
    lines[0].to_owned()
}

#[test]
fn the_kill_loop_passes_and_serves_only_exact_bytes() {
    let (out, diag, j) = killloop("store", &["--iterations", "3"]);
    assert!(out.status.success(), "kill loop failed:\n{diag}");
    let line = summary(&out);
    assert!(
        line.starts_with("L2-KILLLOOP: 3 iterations, 3 kills, "),
        "{line}"
    );
    assert!(line.contains(" 0 wrong, "), "{line}");
    assert!(line.ends_with(": PASS"), "{line}");
    assert_eq!(j["pass"], true, "{j:#}");
    assert_eq!(j["engine_used"], "pread");
    let t = &j["totals"];
    assert_eq!(n(t, &["kills"]), 3);
    assert_eq!(n(t, &["wrong"]), 0);
    assert_eq!(n(t, &["memcheck_failures"]), 0);
    assert!(n(t, &["committed"]) > 0, "{j:#}");
    assert!(n(t, &["recovered"]) > 0, "objects survive the kills: {j:#}");
    assert!(n(t, &["served"]) > 0, "{j:#}");
    let iters = j["iterations"].as_array().unwrap();
    assert_eq!(iters.len(), 3);
    for it in iters {
        for k in [
            "recovered",
            "served",
            "missing",
            "corrupt",
            "errors",
            "committed",
            "queued_at_kill",
        ] {
            n(it, &[k]);
        }
        assert_eq!(it["memcheck_ok"], true, "{it:#}");
        assert!(n(it, &["served"]) <= n(it, &["recovered"]), "{it:#}");
        assert!(
            n(it, &["served_committed"]) + n(it, &["missing"]) == n(it, &["committed"]),
            "{it:#}"
        );
    }
}

#[test]
fn the_clear_variant_never_serves_what_a_returned_clear_dropped() {
    let (out, diag, j) = killloop("clear", &["--iterations", "3", "--clear"]);
    assert!(out.status.success(), "kill loop failed:\n{diag}");
    let line = summary(&out);
    assert!(line.contains(" 0 wrong, "), "{line}");
    assert!(line.contains(" 0 resurrected"), "{line}");
    assert!(line.contains("variant clear"), "{line}");
    let t = &j["totals"];
    assert_eq!(n(t, &["clears"]), 3, "{j:#}");
    assert_eq!(n(t, &["resurrected"]), 0);
    let kills: Vec<&str> = j["iterations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|it| {
            assert!(it["clear"]["returned"].is_boolean(), "{it:#}");
            assert_eq!(
                n(it, &["served_committed"]) + n(it, &["missing"]) + n(it, &["cleared"]),
                n(it, &["committed"]),
                "{it:#}"
            );
            it["clear"]["kill"].as_str().unwrap()
        })
        .collect();
    // Odd iterations aim at the CLEAR itself, even ones at the write-behind after it returned.
    assert_eq!(kills, ["during", "after", "during"], "{j:#}");
    assert!(j["iterations"][1]["clear"]["returned"] == true, "{j:#}");
}

#[test]
fn damaged_payloads_are_reported_corrupt_and_never_served() {
    let (out, diag, j) = killloop(
        "corrupt",
        &[
            "--iterations",
            "3",
            "--sabotage",
            "corrupt",
            "--sabotage-iteration",
            "2",
        ],
    );
    assert!(out.status.success(), "kill loop failed:\n{diag}");
    assert_eq!(n(&j, &["totals", "wrong"]), 0, "{j:#}");
    let it = &j["iterations"][1];
    assert!(n(it, &["sabotaged_slots"]) > 0, "{it:#}");
    // Every slot was damaged: every recovered object fails its checksum when loaded. The
    // restart follows a kill, so the node counts the failures as torn (the kill can explain
    // them), not as media corruption.
    assert!(n(it, &["recovered"]) > 0, "{it:#}");
    assert_eq!(n(it, &["served"]), 0, "{it:#}");
    assert_eq!(n(it, &["torn_counted"]), n(it, &["recovered"]), "{it:#}");
    assert_eq!(n(it, &["corrupt"]), 0, "{it:#}");
    // The loop goes on: the next iteration stores, is killed and serves again.
    assert!(n(&j["iterations"][2], &["served"]) > 0, "{j:#}");
}

#[test]
fn undetectable_damage_makes_the_loop_fail_with_wrong_bytes() {
    let (out, diag, j) = killloop(
        "forge",
        &[
            "--iterations",
            "2",
            "--sabotage",
            "forge",
            "--sabotage-iteration",
            "2",
        ],
    );
    assert!(
        !out.status.success(),
        "a forged payload must fail the loop:\n{diag}"
    );
    let line = summary(&out);
    assert!(line.ends_with(": FAIL"), "{line}");
    assert!(!line.contains(" 0 wrong, "), "{line}");
    assert_eq!(j["pass"], false);
    let it = &j["iterations"][1];
    assert!(n(it, &["wrong"]) > 0, "{it:#}");
    assert_eq!(n(it, &["wrong"]), n(it, &["served"]), "{it:#}");
}
