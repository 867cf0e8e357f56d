//! A real etcd for cluster tests: the `etcd` binary (Debian's etcd-server package, installed by
//! scripts/setup.sh) on free loopback ports, in its own directory, killed on drop. Tests that
//! need it skip, saying so, when the binary is missing.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::lm::free_port;
use super::TestDir;

/// A running etcd, killed on drop.
pub struct Etcd {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    port: u16,
    _dir: TestDir,
}

/// The etcd server binary: `$KVNODE_ETCD_BIN` (scripts/test.sh sets it to the copy
/// scripts/setup.sh unpacked), else `etcd` on the PATH.
pub fn etcd_bin() -> std::ffi::OsString {
    std::env::var_os("KVNODE_ETCD_BIN").unwrap_or_else(|| "etcd".into())
}

/// Whether the etcd server binary runs.
pub fn etcd_available() -> bool {
    Command::new(etcd_bin())
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Starts etcd, or prints why the test is skipped and returns `None` (no etcd binary).
pub fn start_or_skip(test: &str) -> Option<Etcd> {
    if !etcd_available() {
        eprintln!(
            "SKIPPED {test}: no `etcd` binary (Debian package etcd-server; scripts/setup.sh \
             installs it)"
        );
        return None;
    }
    Some(Etcd::start(test))
}

impl Etcd {
    /// Starts etcd on free loopback ports and waits until it answers.
    pub fn start(tag: &str) -> Etcd {
        Etcd::start_on(tag, "127.0.0.1")
    }

    /// Starts etcd serving clients at `ip` (free port; peers on loopback) and waits until it
    /// answers.
    pub fn start_on(tag: &str, ip: &str) -> Etcd {
        let dir = TestDir::new(&format!("etcd-{tag}"));
        let port = free_port();
        let peer = free_port();
        let url = format!("http://{ip}:{port}");
        let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
        let child = Command::new(etcd_bin())
            .arg("--name")
            .arg(format!("t{port}"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--listen-client-urls")
            .arg(&url)
            .arg("--advertise-client-urls")
            .arg(&url)
            .arg("--listen-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-advertise-peer-urls")
            .arg(format!("http://127.0.0.1:{peer}"))
            .arg("--initial-cluster")
            .arg(format!("t{port}=http://127.0.0.1:{peer}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        let etcd = Etcd {
            child,
            url,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect((ip, etcd.port)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        etcd
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
