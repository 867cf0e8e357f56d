//! The node under test: a `kvnode serve` child process with the loop's pool and disk tier,
//! started (and waited for), SIGKILLed, or stopped with SIGTERM; killed and reaped on drop.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{connect, KillLoopArgs, CHUNK_TOKENS, START_TIMEOUT};

/// The node under test. Invariant: killed and reaped on drop if still running.
pub(super) struct Node {
    child: Child,
    pub(super) socket: PathBuf,
}

impl Node {
    pub(super) fn start(a: &KillLoopArgs, bin: &Path, dir: &Path, n: u32) -> Result<Node, String> {
        let socket = dir.join("kvnode.sock");
        let mut log = File::options()
            .create(true)
            .append(true)
            .open(dir.join("node.log"))
            .map_err(|e| format!("node log: {e}"))?;
        let _ = writeln!(log, "=== kvnode-bench l2-killloop: node start {n} ===");
        let child = Command::new(bin)
            .args(["serve", "--socket"])
            .arg(&socket)
            .args(["--pool-size", &a.pool_size])
            .args(["--chunk-size", &CHUNK_TOKENS.to_string()])
            .arg("--l2-path")
            .arg(dir)
            .args(["--l2-size", &a.l2_size, "--l2-engine", a.engine.as_str()])
            .args(["--l2-write-policy", "always"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        let mut node = Node { child, socket };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if connect(&node.socket)
                .and_then(|mut c| c.noop().map_err(|e| e.to_string()))
                .is_ok()
            {
                return Ok(node);
            }
            if let Ok(Some(st)) = node.child.try_wait() {
                return Err(format!("kvnode exited ({st}) during start-up {n}"));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "kvnode start-up {n}: no answer within {START_TIMEOUT:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL and reap.
    pub(super) fn kill(&mut self) -> Result<(), String> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Err(format!("the node had died before the kill ({st})"));
        }
        self.child.kill().map_err(|e| format!("kill: {e}"))?;
        self.child.wait().map_err(|e| format!("wait: {e}"))?;
        Ok(())
    }

    /// SIGTERM; the node must exit 0 within a minute.
    pub(super) fn stop(mut self) -> Result<(), String> {
        crate::soak_node::sigterm(self.child.id())?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(()),
                Ok(Some(st)) => return Err(format!("the node exited with {st} after SIGTERM")),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => return Err("the node did not exit within 60 s of SIGTERM".into()),
                Err(e) => return Err(format!("waiting for the node: {e}")),
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Never signal a pid already reaped: it may belong to another process by now.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
