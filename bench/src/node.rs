//! `--spawn`: a private `kvnode serve` on a temporary socket, stopped with SIGTERM on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A node this run started. Invariant: stopped (SIGTERM, then SIGKILL) and its directory removed on drop.
pub struct SpawnedNode {
    child: Child,
    dir: PathBuf,
    /// Its socket.
    pub socket: PathBuf,
}

/// The `kvnode` binary: `explicit`, else next to this binary, else on PATH.
pub fn find_node_bin(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    if let Ok(exe) = std::env::current_exe() {
        let sibling = exe.with_file_name("kvnode");
        if sibling.is_file() {
            return Ok(sibling);
        }
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("kvnode"))
                .find(|p| p.is_file())
        })
        .ok_or_else(|| {
            "no kvnode binary next to kvnode-bench or on PATH (build it, or pass --node-bin)".into()
        })
}

impl SpawnedNode {
    /// Starts the node and waits until it answers.
    pub fn start(
        bin: Option<&Path>,
        pool_size: &str,
        chunk_tokens: u32,
        extra: &[String],
    ) -> Result<SpawnedNode, String> {
        let bin = find_node_bin(bin)?;
        let dir = std::env::temp_dir().join(format!("kvnode-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let socket = dir.join("kvnode.sock");
        let log = std::fs::File::create(dir.join("node.log")).map_err(|e| e.to_string())?;
        let child = Command::new(&bin)
            .args(["serve", "--socket"])
            .arg(&socket)
            .args([
                "--pool-size",
                pool_size,
                "--chunk-size",
                &chunk_tokens.to_string(),
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", bin.display()))?;
        let mut node = SpawnedNode { child, dir, socket };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(mut c) = kvnode::client::Client::connect(&node.socket) {
                if c.noop().is_ok() {
                    return Ok(node);
                }
            }
            if let Ok(Some(st)) = node.child.try_wait() {
                let log = std::fs::read_to_string(node.dir.join("node.log")).unwrap_or_default();
                return Err(format!("kvnode exited ({st}) during start-up:\n{log}"));
            }
            if Instant::now() > deadline {
                return Err("kvnode did not answer within 120 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The node's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The node's log so far (its stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }

    /// Stops the node with SIGTERM and waits up to `timeout` for it to exit; returns how long
    /// that took. A non-zero exit or no exit within `timeout` is an error carrying the node's log
    /// (past the timeout the node is killed on drop).
    pub fn stop(mut self, timeout: Duration) -> Result<Duration, String> {
        let t = Instant::now();
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .map_err(|e| format!("kill -TERM: {e}"))?;
        let deadline = t + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(t.elapsed()),
                Ok(Some(st)) => {
                    return Err(format!(
                        "kvnode exited with {st} after SIGTERM:\n{}",
                        self.log()
                    ))
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Ok(None) => {
                    return Err(format!(
                        "kvnode did not exit within {timeout:?} of SIGTERM:\n{}",
                        self.log()
                    ))
                }
                Err(e) => return Err(format!("waiting for kvnode: {e}")),
            }
        }
    }
}

impl SpawnedNode {
    /// Kills the node with SIGKILL (a crash: no shutdown path runs) and reaps it.
    pub fn kill(mut self) -> Result<(), String> {
        self.child
            .kill()
            .map_err(|e| format!("killing kvnode: {e}"))?;
        self.child
            .wait()
            .map_err(|e| format!("waiting for kvnode: {e}"))?;
        Ok(())
    }
}

impl Drop for SpawnedNode {
    fn drop(&mut self) {
        // Never signal a pid that was already reaped (`stop`): it may belong to another process.
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            let _ = std::fs::remove_dir_all(&self.dir);
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
