//! Who gets in, on the native socket, with real processes and real users (root runs the tests;
//! `nobody` is the other user, through setpriv): the default socket directory is private and
//! never a squatted one, and clients never trust a socket another user serves.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const NOBODY: u32 = 65_534;

fn root_with_setpriv() -> bool {
    let uid = std::fs::metadata("/proc/self").map(|m| m.uid());
    if uid.ok() != Some(0) || !Path::new("/usr/bin/setpriv").exists() {
        eprintln!("skipped: needs root and setpriv");
        return false;
    }
    true
}

/// `kvnode args...` as user nobody, with an environment that names no runtime directory.
fn kvnode_as_nobody(args: &[&str]) -> Command {
    let mut c = Command::new("/usr/bin/setpriv");
    c.args([
        format!("--reuid={NOBODY}"),
        format!("--regid={NOBODY}"),
        "--clear-groups".into(),
    ])
    .arg(env!("CARGO_BIN_EXE_kvnode"))
    .args(args)
    .env_remove("XDG_RUNTIME_DIR")
    .env("RUST_LOG", "info")
    .stdin(Stdio::null());
    c
}

/// Waits (generously) until `path` is a socket.
fn wait_for_socket(path: &Path, child: &mut std::process::Child) {
    let t = Instant::now();
    while !std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("the node exited ({st}) before binding {}", path.display());
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no socket at {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

use std::os::unix::fs::FileTypeExt;

/// A node of another user serving at a path root would use: root's `ping` and clients refuse to
/// talk to it (before: `pong`, and a registration would have trusted its pool fd).
#[test]
fn clients_never_trust_a_socket_another_user_serves() {
    if !root_with_setpriv() {
        return;
    }
    let dir = TestDir::new("access-squat");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = dir.join("kvnode.sock");
    let mut impostor = kvnode_as_nobody(&[
        "serve",
        "--socket",
        sock.to_str().unwrap(),
        "--socket-mode",
        "0666",
        "--pool-size",
        "16MiB",
        "--pages",
        "4k",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_socket(&sock, &mut impostor);
    let out = kvnode_until_exit(&dir, &["ping", "--socket", sock.to_str().unwrap()]);
    let _ = impostor.kill();
    let _ = impostor.wait();
    assert!(
        out.failed(),
        "root's ping trusted nobody's socket: {}",
        out.stdout
    );
    assert!(
        out.stderr.contains("served by user 65534") && out.stderr.contains(sock.to_str().unwrap()),
        "{}",
        out.stderr
    );
    assert_no_kind_prefix(&out.stderr);
}

/// A user's default socket directory (`/tmp/kvnode-<uid>` without a runtime directory) is created
/// private by the node; one that another user created first is refused, naming it, and left
/// alone.
#[test]
fn the_default_socket_directory_is_private_and_never_a_squatted_one() {
    if !root_with_setpriv() {
        return;
    }
    let dir = Path::new("/tmp/kvnode-65534");
    if dir.exists() {
        eprintln!(
            "skipped: {} exists already (not ours to touch)",
            dir.display()
        );
        return;
    }
    // Squatted: root (another user, for nobody) created it first, writable by all.
    std::fs::create_dir(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let log = TestDir::new("access-squat-dir");
    let err_path = log.join("serve.err");
    let mut child = kvnode_as_nobody(&["serve", "--pool-size", "16MiB", "--pages", "4k"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    // A node that starts anyway is stopped and reported (never left running).
    let status = wait_exit(&mut child, Duration::from_secs(30));
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    let squatted_left = std::fs::metadata(dir).map(|m| (m.uid(), m.mode() & 0o777));
    let _ = std::fs::remove_file(dir.join("kvnode.sock"));
    let _ = std::fs::remove_file("/tmp/kvnode.sock");
    std::fs::remove_dir(dir).unwrap();
    assert!(
        status.is_some_and(|st| !st.success()),
        "started in a squatted directory ({status:?}): {err}"
    );
    assert!(
        err.contains("/tmp/kvnode-65534") && err.contains("belongs to user 0"),
        "{err}"
    );
    assert_eq!(
        squatted_left.unwrap(),
        (0, 0o777),
        "the squatted directory is left alone"
    );
    // Not squatted: the node creates it 0700 for itself and serves there; nobody's own ping
    // (same default) reaches it.
    let mut node = kvnode_as_nobody(&["serve", "--pool-size", "16MiB", "--pages", "4k"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let sock = dir.join("kvnode.sock");
    wait_for_socket(&sock, &mut node);
    let m = std::fs::metadata(dir).unwrap();
    let ping = kvnode_as_nobody(&["ping"]).output().unwrap();
    let _ = node.kill();
    let _ = node.wait();
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_dir(dir);
    assert_eq!((m.uid(), m.mode() & 0o777), (NOBODY, 0o700));
    assert!(
        ping.status.success(),
        "{}",
        String::from_utf8_lossy(&ping.stderr)
    );
}

/// `scripts/run-tenants.sh` starts one node per tenant, each admitting only its own users:
/// nobody reaches tenant a's node (allowed there) and is refused by tenant b's; the pools are
/// separate processes. SIGTERM stops them all.
#[test]
fn one_node_per_tenant_admits_only_that_tenants_users() {
    if !root_with_setpriv() {
        return;
    }
    let dir = TestDir::new("access-tenants");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let list = dir.join("tenants");
    std::fs::write(
        &list,
        "# name uids pool\na 65534 16MiB\nb 4242,4243 16MiB\n",
    )
    .unwrap();
    let base = dir.join("run");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/run-tenants.sh");
    let mut tenants = Command::new("bash")
        .arg(&script)
        .arg(&list)
        .arg(&base)
        .env("KVNODE_BIN", env!("CARGO_BIN_EXE_kvnode"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (a, b) = (base.join("a/kvnode.sock"), base.join("b/kvnode.sock"));
    wait_for_socket(&a, &mut tenants);
    wait_for_socket(&b, &mut tenants);
    let ping = |sock: &Path| {
        kvnode_as_nobody(&["ping", "--socket", sock.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let (pa, pb) = (ping(&a), ping(&b));
    sigterm(&tenants);
    let stopped = wait_exit(&mut tenants, Duration::from_secs(30));
    assert!(
        pa.status.success(),
        "tenant a: {}",
        String::from_utf8_lossy(&pa.stderr)
    );
    assert!(!pb.status.success());
    assert!(
        String::from_utf8_lossy(&pb.stderr).contains("user 65534 may not use this node"),
        "{}",
        String::from_utf8_lossy(&pb.stderr)
    );
    assert!(
        stopped.is_some(),
        "the tenants' nodes did not stop on SIGTERM"
    );
    assert!(!a.exists() && !b.exists(), "each node removed its socket");
}

/// A client user (not an admin) holds at most `max_connections_per_client_user` connections:
/// with two held open by one of its processes, its next one is refused naming the limit, and
/// once they close it gets in again (before: one allowed user could take every connection).
#[test]
fn a_client_user_holds_at_most_its_share_of_connections() {
    if !root_with_setpriv() || !Path::new("/usr/bin/python3").exists() {
        return;
    }
    let dir = TestDir::new("access-conn-share");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = dir.join("node.toml");
    std::fs::write(
        &cfg,
        "[access]\nallow_uids = [65534]\n[limits]\nmax_connections_per_client_user = 2\n",
    )
    .unwrap();
    let node = NodeProc::start(
        "access-conn-share-node",
        &["--socket-mode", "0666", "--config", cfg.to_str().unwrap()],
    );
    std::fs::set_permissions(&node.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = node.socket.to_str().unwrap().to_owned();
    // nobody's process holding two connections until its stdin closes.
    let mut holder = Command::new("/usr/bin/setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
        ])
        .arg(
            "import socket,sys\n\
             s=[socket.socket(socket.AF_UNIX) for _ in range(2)]\n\
             [x.connect(sys.argv[1]) for x in s]\n\
             print('HELD',flush=True)\n\
             sys.stdin.read()\n",
        )
        .arg(&sock)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(holder.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "HELD");
    node.wait_status("nobody's two connections", |s| {
        num(s, &["connections"]) >= 2
    });
    let ping = || {
        kvnode_as_nobody(&["ping", "--socket", &sock])
            .output()
            .unwrap()
    };
    let refused = ping();
    drop(holder.stdin.take());
    let _ = holder.wait();
    assert!(
        !refused.status.success(),
        "a third connection of nobody was served"
    );
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("max_connections_per_client_user"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // Root (an admin) is not limited by it meanwhile, and nobody gets in again once its
    // connections closed.
    let t = Instant::now();
    loop {
        let again = ping();
        if again.status.success() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "nobody never got in again: {}",
            String::from_utf8_lossy(&again.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
