//! The node under test of the kill soak: one `kvnode lmcache-server` serving LMCache's ZMQ
//! protocol on a free port and the native protocol on a socket in the soak's directory, with a
//! small pool and the short TTLs and reap timeout that release a killed client's state quickly.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvnode::client::Client;

use crate::soak::SoakArgs;

/// Longest wait for the node's answer to STATUS or MEMCHECK.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// The node under test. Invariant: stopped (SIGTERM, then SIGKILL) on drop; its segment removed.
pub struct LmNode {
    child: Child,
    /// The native socket.
    pub socket: PathBuf,
    /// The LMCache ZMQ port on 127.0.0.1.
    pub port: u16,
    shm: String,
    log: PathBuf,
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

/// Sends SIGTERM to `pid` through kill(1) (no unsafe code here).
pub fn sigterm(pid: u32) -> Result<(), String> {
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .map_err(|e| format!("kill -TERM: {e}"))
        .map(drop)
}

impl LmNode {
    /// Starts the node (configuration file in `dir`) and waits until it answers.
    pub fn start(a: &SoakArgs, dir: &Path) -> Result<LmNode, String> {
        let bin = crate::node::find_node_bin(a.node_bin.as_deref())?;
        let cfg = dir.join("node.toml");
        std::fs::write(
            &cfg,
            format!(
                "session_ttl_secs = {}\nread_ttl_secs = {}\nwrite_ttl_secs = {}\n",
                a.session_ttl_secs, a.read_ttl_secs, a.write_ttl_secs
            ),
        )
        .map_err(|e| format!("writing {}: {e}", cfg.display()))?;
        let port = free_port()?;
        let name = format!("soak{}", std::process::id());
        let socket = dir.join("native.sock");
        let log = dir.join("node.log");
        let reap = a.reap_secs.to_string();
        let child = Command::new(&bin)
            .args(["lmcache-server", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--chunk-size", "16", "--l1-size-gb"])
            .arg(a.pool_gb.to_string())
            .args([
                "--shm-name",
                &name,
                "--supported-transfer-mode",
                "engine_driven",
            ])
            .args(["--eviction-policy", "LRU", "--no-l1-use-lazy"])
            .args(["--worker-reap-timeout-seconds", &reap])
            .args(["--worker-registration-grace-seconds", &reap])
            .arg("--socket")
            .arg(&socket)
            .arg("--config")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(File::create(&log).map_err(|e| e.to_string())?)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        let mut node = LmNode {
            child,
            socket,
            port,
            shm: format!("lmcache_l1_pool_{name}"),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if Client::connect(&node.socket)
                .and_then(|mut c| c.noop())
                .is_ok()
            {
                return Ok(node);
            }
            if let Ok(Some(st)) = node.child.try_wait() {
                return Err(format!(
                    "kvnode lmcache-server exited ({st}) during start-up:\n{}",
                    node.log_tail(40)
                ));
            }
            if Instant::now() > deadline {
                return Err("kvnode lmcache-server did not answer within 120 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `f` on a fresh native connection, on its own thread, waiting at most
    /// [`ANSWER_TIMEOUT`]: a hung node fails the soak instead of hanging it (the stuck thread
    /// is left behind).
    fn ask<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut Client) -> kvnode::Result<T> + Send + 'static,
    ) -> Result<T, String> {
        let socket = self.socket.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = Client::connect(&socket).and_then(|mut c| f(&mut c));
            let _ = tx.send(r.map_err(|e| format!("{what}: {e}")));
        });
        rx.recv_timeout(ANSWER_TIMEOUT).unwrap_or_else(|_| {
            Err(format!(
                "{what}: no answer within {} s (node hung?)",
                ANSWER_TIMEOUT.as_secs()
            ))
        })
    }

    /// The node's STATUS.
    pub fn status(&self) -> Result<serde_json::Value, String> {
        self.ask("STATUS", |c| c.status())
    }

    /// The node's MEMCHECK: (ok, problems).
    pub fn memcheck(&self) -> Result<(bool, Vec<String>), String> {
        self.ask("MEMCHECK", |c| c.memcheck())
    }

    /// The last `lines` lines of the node's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The node's POSIX shm segment.
    pub fn segment(&self) -> PathBuf {
        Path::new("/dev/shm").join(&self.shm)
    }

    /// The node's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the node has exited (its status if so).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGTERM, then waits up to `timeout` for the exit; `None` if it is still running.
    pub fn terminate(&mut self, timeout: Duration) -> Result<Option<ExitStatus>, String> {
        sigterm(self.pid())?;
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(st) = self.exited() {
                return Ok(Some(st));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(None)
    }
}

impl Drop for LmNode {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = sigterm(self.child.id());
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // The segment name carries this process's pid: it is ours to remove.
        let _ = std::fs::remove_file(self.segment());
    }
}
