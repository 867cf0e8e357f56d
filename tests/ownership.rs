//! Ownership and access on the native protocol, with real processes: a client touches only the
//! instances, transfers and lookup sessions it created; node-wide operations are for admins.
//! The intruder is another process (this test binary run again as an ignored child role), so
//! the node sees a different pid, and for the cross-user cases a different uid too.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::*;
use kvnode::client::Client;
use kvnode::protocol::Request;
use kvnode::ErrorKind;

const VICTIM: u64 = 1001;

/// The outcome of one intruder request: `ok` or the error kind's name.
fn outcome(r: kvnode::Result<kvnode::protocol::Response>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(e) => format!("{:?}", e.kind),
    }
}

/// Child role (run by the tests below with `--ignored`): connects to `KVNODE_OWN_SOCKET` and
/// tries every request on instance 1001 and its transfers `KVNODE_OWN_STORE` /
/// `KVNODE_OWN_READ`, printing `op=outcome` lines, then `DONE`.
#[test]
#[ignore = "child role of the ownership tests"]
fn child_intruder() {
    let socket = std::env::var("KVNODE_OWN_SOCKET").expect("run by the ownership tests");
    let store: u64 = std::env::var("KVNODE_OWN_STORE").unwrap().parse().unwrap();
    let read: u64 = std::env::var("KVNODE_OWN_READ").unwrap().parse().unwrap();
    let mut c = Client::connect(&socket).unwrap();
    let mut other_layout = reg(VICTIM);
    other_layout.num_layers = 3;
    let mut tries: Vec<(&str, Request)> = vec![
        (
            "commit_store",
            Request::CommitStore {
                instance_id: VICTIM,
                transfer_id: store,
            },
        ),
        (
            "abort_store",
            Request::AbortStore {
                instance_id: VICTIM,
                transfer_id: store,
            },
        ),
        (
            "commit_retrieve",
            Request::CommitRetrieve {
                instance_id: VICTIM,
                transfer_id: read,
            },
        ),
        (
            "prepare_store",
            Request::PrepareStore {
                instance_id: VICTIM,
                range: range(&tokens(9, 1)),
            },
        ),
        (
            "ping",
            Request::Ping {
                instance_id: Some(VICTIM),
            },
        ),
        (
            "unregister",
            Request::Unregister {
                instance_id: VICTIM,
            },
        ),
        ("register_other_layout", Request::Register(other_layout)),
        ("register_same_layout", Request::Register(reg(VICTIM))),
    ];
    // Guessing: the transfer ids right after the victim's.
    for guess in 1..=8u64 {
        tries.push((
            "abort_guess",
            Request::AbortStore {
                instance_id: VICTIM,
                transfer_id: store.wrapping_add(guess),
            },
        ));
    }
    for (op, req) in tries {
        println!("{op}={}", outcome(c.call(&req)));
    }
    // Session requests name the victim's request id: another user's must not reach it.
    println!(
        "free_lookup_locks={}",
        outcome(c.call(&Request::FreeLookupLocks {
            request_id: "victim-req".into(),
            start_chunk: 0,
            end_chunk: 4,
        }))
    );
    println!(
        "end_session={}",
        outcome(c.call(&Request::EndSession {
            request_id: "victim-req".into(),
        }))
    );
    println!("clear={}", outcome(c.call(&Request::Clear)));
    println!("memcheck={}", outcome(c.call(&Request::Memcheck)));
    let status = c.status().unwrap();
    println!(
        "status_instances={}",
        status["instances"].as_array().map_or(0, Vec::len)
    );
    println!("DONE");
}

/// Runs the intruder child (as `uid`, when given) against `node` and returns its outcomes.
fn run_intruder(node: &NodeProc, store: u64, read: u64, uid: Option<u32>) -> Vec<(String, String)> {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match uid {
        Some(u) => {
            let mut c = Command::new("/usr/bin/setpriv");
            c.args([
                format!("--reuid={u}"),
                format!("--regid={u}"),
                "--clear-groups".into(),
            ])
            .arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    let out = cmd
        .args([
            "--exact",
            "child_intruder",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("KVNODE_OWN_SOCKET", &node.socket)
        .env("KVNODE_OWN_STORE", store.to_string())
        .env("KVNODE_OWN_READ", read.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the intruder")
        .wait_with_output()
        .unwrap();
    let lines: Vec<String> = BufReader::new(&out.stdout[..])
        .lines()
        .map_while(Result::ok)
        .collect();
    assert!(
        lines.iter().any(|l| l == "DONE"),
        "the intruder did not finish: {lines:?}"
    );
    lines
        .iter()
        .filter_map(|l| l.split_once('='))
        // The first line follows the harness's "test child_intruder ... " on the same line.
        .map(|(a, b)| (a.rsplit(' ').next().unwrap_or(a).to_owned(), b.to_owned()))
        .collect()
}

/// The victim: registers 1001, stores one chunk, then holds a prepared store, a prepared
/// retrieve of the stored chunk and a lookup session `victim-req` on it.
struct Victim {
    client: Client,
    store: u64,
    read: u64,
    stored: kvnode::protocol::ChunkRange,
    pending: kvnode::protocol::ChunkRange,
    len: usize,
}

fn victim(node: &NodeProc) -> Victim {
    let mut client = node.client();
    let len = client.register(&reg(VICTIM)).unwrap().object_bytes as usize;
    let stored = range(&tokens(1, 1));
    let data = payloads(&stored, len);
    client.store(VICTIM, &stored, &[&data[0]]).unwrap();
    let pending = range(&tokens(2, 2));
    let p = client.prepare_store(VICTIM, &pending).unwrap();
    assert_eq!(p.slots.len(), 2);
    let r = client.prepare_retrieve(VICTIM, &stored, None).unwrap();
    let read = r.expect("the stored chunk hits").transfer_id;
    let mut all = stored.clone();
    all.worker_id = None;
    assert_eq!(client.lookup("victim-req", &all, 1).unwrap(), 1);
    Victim {
        client,
        store: p.transfer_id,
        read,
        stored,
        pending,
        len,
    }
}

/// The victim's state survived: its store commits (exactly its two chunks), its retrieve
/// commits, its session still holds its lock, its instance keeps its layout and data.
fn assert_victim_intact(node: &NodeProc, v: &mut Victim) {
    let s = node.status();
    assert_eq!(num(&s, &["objects", "read_locked"]), 1, "{s:#}");
    assert_eq!(num(&s, &["sessions"]), 1);
    assert_eq!(v.client.commit_store(VICTIM, v.store).unwrap(), 2);
    v.client.commit_retrieve(VICTIM, v.read).unwrap();
    v.client.end_session("victim-req").unwrap();
    let back = v.client.retrieve(VICTIM, &v.stored).unwrap().expect("hit");
    assert_eq!(back, payloads(&v.stored, v.len));
    assert!(v.client.retrieve(VICTIM, &v.pending).unwrap().is_some());
    let s = node.status();
    let insts = s["instances"].as_array().unwrap();
    assert_eq!(insts.len(), 1);
    assert_eq!(insts[0]["id"], VICTIM);
    assert_eq!(insts[0]["shape"][0], 2, "still the victim's layout");
    assert_eq!(num(&s, &["objects", "ready"]), 3);
    assert_eq!(s["memcheck_ok"], true);
}

#[test]
fn another_process_cannot_touch_an_instance_it_did_not_register() {
    let node = NodeProc::start("own-proc", &[]);
    let mut v = victim(&node);
    let got = run_intruder(&node, v.store, v.read, None);
    for (op, res) in &got {
        match op.as_str() {
            // Same user: its session name space is the victim's (same trust domain), and it is
            // an admin (the node's own user).
            "free_lookup_locks" | "end_session" | "clear" | "memcheck" | "status_instances" => {}
            _ => assert_eq!(res, "PermissionDenied", "{op}: {got:?}"),
        }
    }
    assert!(got.iter().filter(|(op, _)| op == "abort_guess").count() == 8);
    // The intruder ran CLEAR as the node's own user (allowed) and may have ended the session:
    // only check what ownership protects.
    let s = node.status();
    assert_eq!(num(&s, &["pending_writes"]), 1, "{s:#}");
    assert_eq!(num(&s, &["pending_reads"]), 1);
    // Still the victim's to commit (CLEAR doomed the reserved chunks: none is published).
    v.client.commit_store(VICTIM, v.store).unwrap();
    v.client.commit_retrieve(VICTIM, v.read).unwrap();
    let s = node.status();
    assert_eq!(
        s["instances"][0]["shape"][0], 2,
        "still the victim's layout"
    );
}

#[test]
fn another_user_touches_nothing_of_ours_and_runs_no_admin_operation() {
    if !running_as_root_with_setpriv() {
        return;
    }
    let dir = TestDir::new("own-user-cfg");
    let cfg = dir.join("access.toml");
    std::fs::write(&cfg, "[access]\nallow_uids = [65534]\n").unwrap();
    let node = NodeProc::start(
        "own-user",
        &["--socket-mode", "0666", "--config", cfg.to_str().unwrap()],
    );
    open_dir_to_others(&node);
    let mut v = victim(&node);
    let got = run_intruder(&node, v.store, v.read, Some(65534));
    for (op, res) in &got {
        match op.as_str() {
            // Sessions of another user are not found: FREE and END are no-ops for it.
            "free_lookup_locks" | "end_session" => assert_eq!(res, "ok", "{op}"),
            "status_instances" => assert_eq!(res, "0", "another user's instances are hidden"),
            _ => assert_eq!(res, "PermissionDenied", "{op}: {got:?}"),
        }
    }
    assert_victim_intact(&node, &mut v);
}

#[test]
fn a_second_connection_of_the_same_process_joins_by_registering() {
    let node = NodeProc::start("own-join", &[]);
    let mut a = node.client();
    let len = a.register(&reg(7)).unwrap().object_bytes as usize;
    let mut b = node.client();
    let r = range(&tokens(3, 1));
    let e = b.prepare_store(7, &r).unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    assert!(e.context.contains("instance 7"), "{e}");
    b.register(&reg(7)).unwrap();
    let data = payloads(&r, len);
    assert_eq!(b.store(7, &r, &[&data[0]]).unwrap(), 1);
    assert_eq!(a.retrieve(7, &r).unwrap().unwrap(), data);
    // The instance lives while either connection is open.
    drop(a);
    let s = node.wait_status("the first connection's close", |s| {
        num(s, &["connections"]) == 2
    });
    assert_eq!(s["instances"].as_array().unwrap().len(), 1);
    assert_eq!(b.retrieve(7, &r).unwrap().unwrap(), data);
}

#[test]
fn transfer_ids_are_not_sequential() {
    let node = NodeProc::start("own-ids", &[]);
    let mut c = node.client();
    c.register(&reg(8)).unwrap();
    let ids: Vec<u64> = (0..16u32)
        .map(|i| {
            c.prepare_store(8, &range(&tokens(100 + i, 1)))
                .unwrap()
                .transfer_id
        })
        .collect();
    let close = ids
        .windows(2)
        .filter(|w| w[1].abs_diff(w[0]) < 1 << 20)
        .count();
    assert!(close <= 1, "transfer ids follow each other: {ids:?}");
}

fn running_as_root_with_setpriv() -> bool {
    let uid = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m));
    if uid.ok() != Some(0) || !std::path::Path::new("/usr/bin/setpriv").exists() {
        eprintln!("skipped: needs root and setpriv");
        return false;
    }
    true
}

fn open_dir_to_others(node: &NodeProc) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&node.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}
