//! The command-line contract: `kvnode status [--json]`, `kvnode ping`, the socket's permissions
//! (`--socket-mode`), the defaults shown by `--help`, and clear errors for bad flags: every
//! start-up failure names the path or value involved, without internal kind prefixes.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
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
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no kvnode is running at /nonexistent/kvnode.sock"),
        "{err}"
    );
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

/// `status` and `ping` say that no node is running at the path, and why.
#[test]
fn status_and_ping_without_a_node_say_so() {
    let dir = TestDir::new("cli-nonode");
    let missing = dir.join("none.sock");
    let stale = dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let file = dir.join("file.sock");
    std::fs::write(&file, b"x").unwrap();
    for cmd in ["status", "ping"] {
        for (path, why) in [
            (&missing, "no such socket file"),
            (&stale, "connection refused"),
            (&file, "not a socket"),
        ] {
            let out = kvnode(&[cmd, "--socket", path.to_str().unwrap()]);
            assert!(!out.status.success());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains(&format!("no kvnode is running at {}", path.display())),
                "{cmd}: {err}"
            );
            assert!(err.contains(why), "{cmd} {}: {err}", path.display());
            assert_no_kind_prefix(&err);
        }
    }
    let out = kvnode(&["status", "--socket", stale.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("stale"));
}

/// Start-up failures name the path or value involved and read as sentences.
#[test]
fn start_up_errors_name_the_path_or_value() {
    let dir = TestDir::new("cli-errors");
    let sock = dir.join("kvnode.sock");
    let sock_s = sock.to_str().unwrap();
    let check = |args: &[&str], must: &[&str]| {
        let out = kvnode_until_exit(&dir, args);
        assert!(
            out.failed(),
            "{args:?} must fail: {:?}\n{}",
            out.status,
            out.stderr
        );
        for m in must {
            assert!(
                out.stderr.contains(m),
                "{args:?}: {m:?} missing in\n{}",
                out.stderr
            );
        }
        assert_no_kind_prefix(&out.stderr);
        // The error comes after any log lines, as `kvnode: <sentence>` (or clap's own error).
        let clap = out.stderr.contains("error: invalid value");
        let ours = out.stderr.lines().any(|l| l.starts_with("kvnode: "));
        assert!(clap || ours, "{args:?}: {}", out.stderr);
    };
    // A config file that does not exist, cannot be read (a directory) or does not parse.
    let missing = dir.join("missing.toml");
    check(
        &[
            "serve",
            "--config",
            missing.to_str().unwrap(),
            "--socket",
            sock_s,
        ],
        &[missing.to_str().unwrap()],
    );
    let as_dir = dir.join("a-dir.toml");
    std::fs::create_dir(&as_dir).unwrap();
    check(
        &[
            "serve",
            "--config",
            as_dir.to_str().unwrap(),
            "--socket",
            sock_s,
        ],
        &[as_dir.to_str().unwrap()],
    );
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "pool_bytes = \"many\"\n").unwrap();
    check(
        &[
            "serve",
            "--config",
            bad.to_str().unwrap(),
            "--socket",
            sock_s,
        ],
        &[bad.to_str().unwrap(), "pool_bytes"],
    );
    // Bad values on the command line.
    check(
        &["serve", "--pool-size", "lots", "--socket", sock_s],
        &["lots"],
    );
    check(&["serve", "--pool-size", "0", "--socket", sock_s], &["'0'"]);
    // A busy socket, for both frontends.
    let node = NodeProc::start("cli-busy", &[]);
    let busy = node.socket.to_str().unwrap();
    check(
        &["serve", "--pool-size", "8MiB", "--socket", busy],
        &[busy, "in use"],
    );
    check(
        &[
            "lmcache-server",
            "--port",
            "0",
            "--l1-size-gb",
            "0.01",
            "--socket",
            busy,
        ],
        &[busy, "in use"],
    );
    // A bad L2 path: below a regular file.
    std::fs::write(dir.join("plain-file"), b"x").unwrap();
    let l2 = dir.join("plain-file").join("l2");
    check(
        &[
            "serve",
            "--pool-size",
            "16MiB",
            "--socket",
            sock_s,
            "--l2-path",
            l2.to_str().unwrap(),
            "--l2-size",
            "64MiB",
        ],
        &[l2.to_str().unwrap()],
    );
    // A busy TCP port for the LMCache frontend names the address.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    check(
        &[
            "lmcache-server",
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--l1-size-gb",
            "0.01",
            "--shm-name",
            &format!("cli{}", std::process::id()),
        ],
        &[&format!("127.0.0.1:{port}")],
    );
    node.client().noop().unwrap();
}

/// `--socket-mode` sets the socket file's permission bits; bad values are refused by name.
#[test]
fn socket_mode_flag() {
    let node = NodeProc::start("cli-mode", &["--socket-mode", "0660"]);
    let mode = std::fs::metadata(&node.socket)
        .unwrap()
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(mode, 0o660);
    drop(node);
    let node = NodeProc::start_with_config("cli-mode-cfg", "socket_mode = 0o640\n", &[]);
    let mode = std::fs::metadata(&node.socket)
        .unwrap()
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(
        mode, 0o640,
        "the config file's socket_mode applies without the flag"
    );
    drop(node);
    let dir = TestDir::new("cli-mode-bad");
    let sock = dir.join("kvnode.sock");
    for bad in ["0999", "rw", "01777", "7777", ""] {
        let out = kvnode_until_exit(
            &dir,
            &[
                "serve",
                "--socket",
                sock.to_str().unwrap(),
                "--socket-mode",
                bad,
            ],
        );
        assert!(out.failed(), "--socket-mode {bad:?} must be refused");
        assert!(
            out.stderr.contains(&format!("'{bad}'")) || out.stderr.contains(&format!("{bad:?}")),
            "names {bad:?}: {}",
            out.stderr
        );
        assert!(std::fs::symlink_metadata(&sock).is_err());
    }
}

/// A root node with `--socket-mode 0666` serves another user that `--allow-uid` lets in; with
/// the default 0600 that user is told the permission was denied (the socket's mode stops it
/// before the node's access list is consulted). Runs only as root (it needs setpriv to drop
/// privileges).
#[test]
fn another_user_connects_only_when_the_mode_allows() {
    let uid = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m));
    if uid.ok() != Some(0) || !Path::new("/usr/bin/setpriv").exists() {
        eprintln!("skipped: needs root and setpriv");
        return;
    }
    let as_nobody = |socket: &Path| {
        Command::new("/usr/bin/setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_kvnode"))
            .args(["ping", "--socket", socket.to_str().unwrap()])
            .output()
            .unwrap()
    };
    for (mode, ok) in [("0666", true), ("0600", false)] {
        let node = NodeProc::start(
            &format!("cli-perm-{mode}"),
            &["--socket-mode", mode, "--allow-uid", "65534"],
        );
        // The test directory itself must let the other user reach the socket.
        std::fs::set_permissions(&node.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = as_nobody(&node.socket);
        if !out.status.success() && ok {
            // The binary may not be reachable for that user (a private target directory).
            let err = String::from_utf8_lossy(&out.stderr);
            if err.contains("setpriv") {
                eprintln!("skipped: {err}");
                return;
            }
        }
        assert_eq!(
            out.status.success(),
            ok,
            "mode {mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if !ok {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("permission denied") && err.contains(node.socket.to_str().unwrap()),
                "{err}"
            );
            assert_no_kind_prefix(&err);
        }
    }
}

/// Every `serve` and `lmcache-server` flag that has a default shows it in `--help`.
#[test]
fn help_shows_the_defaults() {
    fn option_blocks(help: &str) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for line in help.lines() {
            let t = line.trim_start();
            if t.starts_with("--") || (t.starts_with('-') && t.contains(", --")) {
                let name = t
                    .split(|c: char| c.is_whitespace() || c == ',' || c == '=')
                    .find(|w| w.starts_with("--"))
                    .unwrap()
                    .to_string();
                out.push((name, line.to_string()));
            } else if let Some(last) = out.last_mut() {
                last.1.push('\n');
                last.1.push_str(line);
            }
        }
        out
    }
    let cases: [(&str, &[(&str, &str)]); 2] = [
        (
            "serve",
            &[
                ("--socket", "kvnode.sock"),
                ("--socket-mode", "0600"),
                ("--pool-size", "1GiB"),
                ("--chunk-size", "256"),
                ("--reap-timeout", "120"),
                ("--registration-grace", "3600"),
                ("--pages", "2m"),
                ("--workers", "one per core"),
                ("--log", "info"),
                ("--l2-size", "8GiB"),
                ("--l2-engine", "auto"),
                ("--l2-write-policy", "always"),
            ],
        ),
        (
            "lmcache-server",
            &[
                ("--host", "localhost"),
                ("--port", "5555"),
                ("--chunk-size", "256"),
                ("--l1-size-gb", "1"),
                ("--shm-name", "kvnode_<port>"),
                ("--supported-transfer-mode", "auto"),
                ("--worker-reap-timeout-seconds", "120"),
                ("--worker-registration-grace-seconds", "3600"),
                ("--eviction-policy", "LRU"),
                ("--max-workers", "one per core"),
                ("--hash-algorithm", "blake3"),
                ("--socket-mode", "0600"),
                ("--pages", "2m"),
                ("--log", "info"),
                ("--l2-size", "8GiB"),
                ("--l2-engine", "auto"),
                ("--l2-write-policy", "always"),
            ],
        ),
    ];
    for (cmd, flags) in cases {
        let out = kvnode(&[cmd, "--help"]);
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout).to_string();
        let blocks = option_blocks(&help);
        for (flag, value) in flags {
            let (_, text) = blocks
                .iter()
                .find(|(n, _)| n == flag)
                .unwrap_or_else(|| panic!("{cmd} --help lacks {flag}:\n{help}"));
            assert!(
                text.to_lowercase().contains("default") && text.contains(value),
                "{cmd} --help: {flag} must show its default {value:?}:\n{text}"
            );
        }
    }
}

/// `kvnode lmcache-server` with its default `--host localhost` comes up (libzmq binds
/// addresses, not names), and a second server on the same port is refused before it builds a
/// pool, leaving the first server's shm segment alone (it used to unlink it).
#[test]
fn lmcache_server_default_host_and_a_second_server_on_its_port() {
    use std::time::{Duration, Instant};
    let dir = TestDir::new("cli-lmhost");
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let port_s = port.to_string();
    let shm = format!("clihost{}", std::process::id());
    let sock = dir.join("s.sock");
    let log = std::fs::File::create(dir.join("node.log")).unwrap();
    let mut first = Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args(["lmcache-server", "--port", &port_s, "--l1-size-gb", "0.01"])
        .args(["--shm-name", &shm, "--socket", sock.to_str().unwrap()])
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            first.try_wait().unwrap().is_none(),
            "lmcache-server exited: {}",
            std::fs::read_to_string(dir.join("node.log")).unwrap_or_default()
        );
        assert!(Instant::now() < deadline, "the LMCache port never opened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let segment = format!("/dev/shm/lmcache_l1_pool_{shm}");
    let before = std::fs::metadata(&segment).unwrap();
    let out = kvnode(&[
        "lmcache-server",
        "--port",
        &port_s,
        "--l1-size-gb",
        "0.01",
        "--shm-name",
        &shm,
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("localhost:{port}")), "{err}");
    let after = std::fs::metadata(&segment).expect("the first server's segment is kept");
    use std::os::unix::fs::MetadataExt;
    assert_eq!((before.dev(), before.ino()), (after.dev(), after.ino()));
    assert!(
        first.try_wait().unwrap().is_none(),
        "the first server still runs"
    );
    let _ = Command::new("kill").arg(first.id().to_string()).status();
    assert!(first.wait().unwrap().success());
    assert!(!Path::new(&segment).exists(), "removed on SIGTERM");
}

/// `kvnode status` against something that accepts but never answers (a node starting up or
/// hung) gives up with a clear message instead of blocking forever.
#[test]
fn status_gives_up_on_a_node_that_never_answers() {
    use std::time::{Duration, Instant};
    let dir = TestDir::new("cli-mute");
    let sock = dir.join("mute.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let held = std::thread::spawn(move || listener.accept().map(|c| c.0));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args([
            "status",
            "--socket",
            sock.to_str().unwrap(),
            "--timeout",
            "2",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "kvnode status is still waiting");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not answer"), "{err}");
    drop(held.join());
}

/// `kvnode ping` and `status` against a listener whose accept queue is full (a hung node) give
/// up naming the socket, instead of blocking in `connect` forever.
#[test]
fn ping_and_status_give_up_on_a_node_whose_accept_queue_is_full() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let dir = TestDir::new("cli-backlog");
    let sock = dir.join("hung.sock");
    let addr = SocketAddrUnix::new(&sock).unwrap();
    let unix = || {
        rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    };
    let listener = unix();
    rustix::net::bind(&listener, &addr).unwrap();
    rustix::net::listen(&listener, 0).unwrap();
    // Fill the accept queue: connect without blocking until the kernel says it is full.
    let mut queued = Vec::new();
    loop {
        let c = unix();
        match rustix::net::connect(&c, &addr) {
            Ok(()) => queued.push(c),
            Err(rustix::io::Errno::AGAIN) => break,
            Err(e) => panic!("filling the accept queue: {e}"),
        }
        assert!(queued.len() < 10_000, "the accept queue never filled");
    }
    for cmd in ["ping", "status"] {
        let out = kvnode_until_exit(
            &dir,
            &[cmd, "--socket", sock.to_str().unwrap(), "--timeout", "1"],
        );
        assert!(
            out.status.is_some(),
            "kvnode {cmd} was still waiting after 20 s"
        );
        assert!(out.failed(), "{cmd}: {}", out.stderr);
        assert!(
            out.stderr.contains(sock.to_str().unwrap())
                && out
                    .stderr
                    .contains("did not accept the connection within 1 s"),
            "{cmd}: {}",
            out.stderr
        );
    }
    drop(queued);
}

#[test]
fn timeouts_must_be_positive() {
    for bad in ["0", "-1", "x", "100000"] {
        let out = kvnode(&["ping", &format!("--timeout={bad}")]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("timeout"), "{bad}: {err}");
    }
}

/// `lmcache-server --host lo` serves on the interface's address (kvnode used to refuse the
/// name as a host name that does not resolve, and the libzmq it links binds no interface names).
#[test]
fn lmcache_server_binds_an_interface_name() {
    use std::time::{Duration, Instant};
    let dir = TestDir::new("cli-iface");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let shm = format!("cliiface{}", std::process::id());
    let log = std::fs::File::create(dir.join("node.log")).unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_kvnode"))
        .args([
            "lmcache-server",
            "--host",
            "lo",
            "--port",
            &port.to_string(),
        ])
        .args(["--l1-size-gb", "0.01", "--shm-name", &shm])
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            server.try_wait().unwrap().is_none(),
            "lmcache-server exited: {}",
            std::fs::read_to_string(dir.join("node.log")).unwrap_or_default()
        );
        assert!(Instant::now() < deadline, "the LMCache port never opened");
        std::thread::sleep(Duration::from_millis(20));
    }
    sigterm(&server);
    let st = wait_exit(&mut server, Duration::from_secs(20)).expect("stops on SIGTERM");
    assert!(st.success());
}
