//! User-facing safety of `kvnode serve` against the real binary: the node never removes or
//! changes a file it did not create at its socket path (only a stale socket is replaced), a
//! missing socket directory is an error, SIGTERM stops the node even when its socket path was
//! deleted or taken over, a pool larger than the machine is refused before any memory is
//! touched, and a busy socket is refused before the pool and the L2 tier are built.
//!
//! No test asserts elapsed time: "promptly" means within a generous 20 s deadline.

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;

use common::*;

/// `serve` on `socket` with a small pool plus `extra`, expected to exit by itself.
fn serve_at(dir: &TestDir, socket: &Path, extra: &[&str]) -> Finished {
    let mut args = vec!["serve", "--socket", socket.to_str().unwrap()];
    if !extra.contains(&"--pool-size") {
        args.extend(["--pool-size", "8MiB"]);
    }
    args.extend_from_slice(extra);
    kvnode_until_exit(dir, &args)
}

fn assert_refused(out: &Finished, must_name: &[&str]) {
    assert!(
        out.failed(),
        "the node must refuse to start (status {:?}); stderr:\n{}",
        out.status,
        out.stderr
    );
    for s in must_name {
        assert!(
            out.stderr.contains(s),
            "stderr must contain {s:?}:\n{}",
            out.stderr
        );
    }
    assert_no_kind_prefix(&out.stderr);
}

#[test]
fn regular_file_at_the_socket_path_is_refused_and_left_alone() {
    let dir = TestDir::new("sock-file");
    let file = dir.join("precious.txt");
    std::fs::write(&file, b"someone's data").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = serve_at(&dir, &file, &[]);
    assert_refused(&out, &[file.to_str().unwrap(), "regular file"]);
    assert_eq!(std::fs::read(&file).unwrap(), b"someone's data", "kept");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o644, "never chmodded");
}

#[test]
fn directory_symlinks_and_fifo_at_the_socket_path_are_refused_and_left_alone() {
    let dir = TestDir::new("sock-other");
    let sub = dir.join("a-directory");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("inside"), b"x").unwrap();
    let target = dir.join("target.txt");
    std::fs::write(&target, b"target").unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let dangling = dir.join("dangling");
    std::os::unix::fs::symlink(dir.join("nothing-here"), &dangling).unwrap();
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    for (path, what) in [
        (&sub, "directory"),
        (&link, "symbolic link"),
        (&dangling, "symbolic link"),
        (&fifo, "fifo"),
    ] {
        let before = std::fs::symlink_metadata(path).unwrap();
        let out = serve_at(&dir, path, &[]);
        assert_refused(&out, &[path.to_str().unwrap(), what]);
        let after = std::fs::symlink_metadata(path).expect("still there");
        assert_eq!(before.file_type(), after.file_type(), "{}", path.display());
        assert_eq!(
            before.permissions().mode(),
            after.permissions().mode(),
            "{}",
            path.display()
        );
    }
    assert!(sub.join("inside").exists());
    assert_eq!(std::fs::read(&target).unwrap(), b"target");
}

#[test]
fn a_stale_socket_is_replaced() {
    let dir = TestDir::new("sock-stale");
    let path = dir.join("stale.sock");
    drop(UnixListener::bind(&path).unwrap()); // the file stays, nobody accepts
    assert!(std::fs::symlink_metadata(&path)
        .unwrap()
        .file_type()
        .is_socket());
    let node = NodeProc::start_at("stale-node", &path, &[]);
    node.client().noop().unwrap();
}

#[test]
fn a_missing_socket_directory_is_an_error_naming_it() {
    let dir = TestDir::new("sock-nodir");
    let missing = dir.join("missing").join("sub");
    let socket = missing.join("kvnode.sock");
    let out = serve_at(&dir, &socket, &[]);
    assert_refused(&out, &[missing.to_str().unwrap(), "does not exist"]);
    assert!(!dir.join("missing").exists(), "no directory was created");
}

#[test]
fn sigterm_stops_a_node_whose_socket_file_was_deleted() {
    let mut node = NodeProc::start("sigterm-deleted", &[]);
    std::fs::remove_file(&node.socket).unwrap();
    let st = node.sigterm_and_wait();
    assert!(st.success(), "exit status {st}; log:\n{}", node.log());
}

#[test]
fn sigterm_stops_a_node_whose_socket_path_now_belongs_to_another_node() {
    let mut a = NodeProc::start("sigterm-a", &[]);
    std::fs::remove_file(&a.socket).unwrap();
    let b = NodeProc::start_at("sigterm-b", &a.socket, &[]);
    let st = a.sigterm_and_wait();
    assert!(st.success(), "exit status {st}; log:\n{}", a.log());
    assert!(
        std::fs::symlink_metadata(&b.socket).is_ok(),
        "the first node must not remove the second node's socket"
    );
    b.client().noop().expect("the second node keeps serving");
}

#[test]
fn shutdown_never_removes_a_file_put_at_the_socket_path() {
    let mut node = NodeProc::start("sigterm-file", &[]);
    std::fs::remove_file(&node.socket).unwrap();
    std::fs::write(&node.socket, b"not a socket").unwrap();
    let st = node.sigterm_and_wait();
    assert!(st.success(), "exit status {st}; log:\n{}", node.log());
    assert_eq!(std::fs::read(&node.socket).unwrap(), b"not a socket");
}

/// Holds an exclusive `flock` on `dir` through its own open file description, as
/// `flock DIR sleep inf` would, until dropped.
fn lock_dir(dir: &Path) -> std::fs::File {
    let f = std::fs::File::open(dir).unwrap();
    rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive).unwrap();
    f
}

/// Another process holding a lock on the socket's directory makes start-up fail naming the
/// directory (it used to wait for the lock forever) and touches nothing there.
#[test]
fn a_lock_held_on_the_socket_directory_fails_start_up_naming_it() {
    let dir = TestDir::new("dirlock-start");
    let socket = dir.join("kvnode.sock");
    let _held = lock_dir(dir.path());
    let out = serve_at(&dir, &socket, &[]);
    assert_refused(
        &out,
        &[&format!(
            "another process holds a lock on {}",
            dir.path().display()
        )],
    );
    assert!(std::fs::symlink_metadata(&socket).is_err(), "nothing bound");
}

/// SIGTERM stops a node while another process holds a lock on its socket's directory (it used
/// to wait for the lock forever): the socket file is left in place, with a warning.
#[test]
fn sigterm_stops_a_node_whose_socket_directory_is_locked() {
    let mut node = NodeProc::start("dirlock-stop", &[]);
    let _held = lock_dir(&node.dir);
    let st = node.sigterm_and_wait();
    assert!(st.success(), "exit status {st}; log:\n{}", node.log());
    assert!(
        node.log().contains("leaving the socket file in place"),
        "{}",
        node.log()
    );
    assert!(
        std::fs::symlink_metadata(&node.socket).is_ok(),
        "left alone"
    );
}

#[test]
fn sigterm_removes_the_nodes_own_socket() {
    let mut node = NodeProc::start("sigterm-own", &[]);
    let st = node.sigterm_and_wait();
    assert!(st.success(), "exit status {st}; log:\n{}", node.log());
    assert!(std::fs::symlink_metadata(&node.socket).is_err(), "removed");
}

#[test]
fn a_pool_larger_than_the_machine_is_refused_naming_the_available_memory() {
    let dir = TestDir::new("pool-huge");
    for pages in ["2m", "1g", "thp", "4k"] {
        let socket = dir.join(format!("kvnode-{pages}.sock"));
        let out = serve_at(&dir, &socket, &["--pool-size", "64TiB", "--pages", pages]);
        assert_refused(&out, &["available", "64 TiB"]);
        assert!(
            out.stderr.contains("GiB") || out.stderr.contains("MiB"),
            "the available memory is named with a size:\n{}",
            out.stderr
        );
        assert!(
            std::fs::symlink_metadata(&socket).is_err(),
            "the socket created before the check is removed again"
        );
    }
}

#[test]
fn a_second_node_on_a_busy_socket_is_refused_before_the_pool_and_l2_are_built() {
    let first = NodeProc::start("busy-first", &[]);
    let dir = TestDir::new("busy-second");
    let l2 = dir.join("l2");
    std::fs::create_dir(&l2).unwrap();
    // A pool far beyond the machine: only reaching the socket check first gives "in use".
    let out = serve_at(
        &dir,
        &first.socket,
        &[
            "--pool-size",
            "64TiB",
            "--l2-path",
            l2.to_str().unwrap(),
            "--l2-size",
            "64MiB",
        ],
    );
    assert_refused(&out, &[first.socket.to_str().unwrap(), "in use"]);
    assert!(
        !out.stderr.contains("available"),
        "no memory check ran:\n{}",
        out.stderr
    );
    assert!(
        !l2.join("kvnode-l2.dat").exists(),
        "the L2 tier was not opened"
    );
    first.client().noop().expect("the first node keeps serving");
}

#[test]
fn the_socket_is_removed_when_a_later_start_up_step_fails() {
    let dir = TestDir::new("late-fail");
    let socket = dir.join("kvnode.sock");
    let l2 = dir.join("foreign.dat");
    let mut bytes = vec![0u8; 64 << 20];
    bytes[..26].copy_from_slice(b"someone else's file system");
    std::fs::write(&l2, &bytes).unwrap();
    let out = serve_at(
        &dir,
        &socket,
        &["--l2-path", l2.to_str().unwrap(), "--l2-size", "64MiB"],
    );
    assert_refused(&out, &[l2.to_str().unwrap()]);
    assert!(
        std::fs::symlink_metadata(&socket).is_err(),
        "the socket this node created is removed"
    );
    assert_eq!(std::fs::read(&l2).unwrap()[..26], bytes[..26]);
}

/// SIGTERM during start-up (while a large pool is being pre-faulted) stops the node there: it
/// never finishes building the pool or starts serving, and removes the socket it created.
#[test]
fn sigterm_during_start_up_stops_the_pre_fault() {
    use std::time::{Duration, Instant};
    let dir = TestDir::new("sigterm-startup");
    let sock = dir.join("s.sock");
    let log = std::fs::File::create(dir.join("node.log")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args(["serve", "--socket", sock.to_str().unwrap()])
        .args([
            "--pool-size",
            "6GiB",
            "--pages",
            "4k",
            "--log",
            "kvnode=debug,info",
        ])
        .stderr(log)
        .spawn()
        .unwrap();
    // The socket is bound before the pool is built: once it exists, the pre-fault runs.
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::symlink_metadata(&sock).is_err() {
        assert!(child.try_wait().unwrap().is_none(), "exited early");
        assert!(Instant::now() < deadline, "no socket");
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the node did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(dir.join("node.log")).unwrap();
    assert!(!status.success(), "start-up was interrupted: {text}");
    assert!(text.contains("interrupted by a signal"), "{text}");
    assert!(!text.contains("kvnode serving"), "{text}");
    assert!(
        std::fs::symlink_metadata(&sock).is_err(),
        "its socket is removed"
    );
}

/// A node killed while a native client still holds the pool descriptor it received over
/// SCM_RIGHTS restarts on the same POSIX shm name (the segment used to carry the node's lock,
/// which lived on in the client, so the restart was refused as "in use by a running node").
#[test]
fn a_node_killed_while_a_client_holds_its_pool_restarts_on_the_same_shm_name() {
    let shm = format!("kvnode-it-restart-{}", std::process::id());
    let segment = format!("/dev/shm/{shm}");
    let toml = format!("shm_name = \"{shm}\"\n");
    let mut first = NodeProc::start_with_config("shm-restart-a", &toml, &[]);
    let mut client = first.client();
    client.register(&reg(1)).expect("register maps the pool");
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    assert!(
        Path::new(&segment).exists(),
        "a killed node leaves its segment"
    );
    let mut second = NodeProc::start_with_config("shm-restart-b", &toml, &[]);
    second.client().noop().expect("the restarted node serves");
    drop(client);
    let st = second.sigterm_and_wait();
    assert!(st.success(), "exit status {st}; log:\n{}", second.log());
    assert!(!Path::new(&segment).exists(), "removed on SIGTERM");
    // The killed node's lock file is not the second node's to remove.
    let _ = std::fs::remove_file(format!("{segment}.lock"));
}
