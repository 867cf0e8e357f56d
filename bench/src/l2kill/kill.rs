//! The first phase of an iteration: a storer thread stores objects while the main thread waits
//! for the write-behind to be busy and SIGKILLs the node (in the `--clear` variant around a
//! CLEAR).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvnode::error::ErrorKind;
use serde_json::json;

use super::node::Node;
use super::report::{ClearOutcome, Iter};
use super::{connect, l2, object_bytes, range, register, Key, Keys, Loop, START_TIMEOUT};
use crate::payload::Payload;

/// What the storer thread did in one iteration.
#[derive(Default)]
pub(super) struct Stored {
    /// Keys whose COMMIT_STORE the node acknowledged.
    pub(super) committed: Vec<Key>,
    /// PREPAREs that found the key present already (nothing to write).
    pub(super) present: u64,
    /// PREPAREs and COMMITs the node refused while alive (no memory, key busy...).
    pub(super) refused: u64,
    /// Why the storer stopped before it was told to (the node died under it), if it did.
    pub(super) lost: Option<String>,
}

/// State the storer shares with the main thread.
pub(super) struct Shared {
    pub(super) keys: Mutex<Keys>,
    pub(super) stop: AtomicBool,
    pub(super) done: AtomicBool,
}

/// Stores up to `max` objects (one per STORE) until told to stop. Each key is taken and
/// PREPAREd under the keys lock, so once the main thread has advanced the epoch under that lock
/// every PREPARE of an older epoch has been answered (its COMMIT may still be on the way).
fn storer(
    socket: PathBuf,
    first_id: u64,
    max: u64,
    (nonce, hidden): (u64, u32),
    shared: Arc<Shared>,
) -> Stored {
    let mut out = Stored::default();
    let run = |out: &mut Stored| -> Result<(), String> {
        let mut c = connect(&socket)?;
        let ids = register(&mut c, first_id, hidden)?;
        let len = |m| object_bytes(hidden, m);
        let payloads = [Payload::new(len(0)), Payload::new(len(1))];
        let mut bufs = [vec![0u8; len(0)], vec![0u8; len(1)]];
        // Backpressure: at most half of L1 waits for the write-behind (in objects of the larger
        // size's two thirds, a little more than the mean), counted both as unwritten objects and as entries of the
        // write queue (which still holds objects evicted before their turn), so the writer stays
        // busy without L1 evicting most objects before their turn.
        let capacity = c.status().map_err(|e| format!("status: {e}"))?["capacity_bytes"]
            .as_u64()
            .unwrap_or(0);
        let bound = (capacity / 2 / (len(1) as u64 * 2 / 3)).max(4);
        let mut stored = 0;
        while !shared.stop.load(Ordering::Relaxed) && stored < max {
            if stored % 8 == 0 {
                loop {
                    let s = c.status().map_err(|e| format!("status: {e}"))?;
                    let unwritten = s["objects"]["unwritten"].as_u64().unwrap_or(0);
                    let waiting = unwritten.max(l2(&s, "queued"));
                    if waiting <= bound || shared.stop.load(Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let (key, p) = {
                let mut keys = shared.keys.lock().unwrap();
                let key = keys.next();
                let m = key.model();
                (key, c.prepare_store(ids[m], &range(key.hash(nonce), m)))
            };
            stored += 1;
            let m = key.model();
            let p = match p {
                Ok(p) => p,
                Err(e) if e.kind == ErrorKind::Io => return Err(format!("prepare_store: {e}")),
                Err(_) => {
                    out.refused += 1;
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
            };
            if p.slots.is_empty() {
                out.present += 1;
                continue;
            }
            payloads[m].fill(&key.hash(nonce), &mut bufs[m]);
            let pool = c.pool().ok_or("no pool mapped")?;
            pool.write_at(p.slots[0].offset, &bufs[m])
                .map_err(|e| format!("copy into the pool: {e}"))?;
            match c.commit_store(ids[m], p.transfer_id) {
                Ok(_) => out.committed.push(key),
                Err(e) if e.kind == ErrorKind::Io => return Err(format!("commit_store: {e}")),
                Err(_) => out.refused += 1,
            }
        }
        Ok(())
    };
    if let Err(e) = run(&mut out) {
        // An error after the main thread decided to kill is the kill.
        if !shared.stop.load(Ordering::Relaxed) {
            out.lost = Some(e);
        }
    }
    shared.done.store(true, Ordering::Relaxed);
    out
}

impl Loop<'_> {
    /// Stores until the kill; kills; returns what was stored and the kill's figures.
    pub(super) fn store_and_kill(
        &mut self,
        node: &mut Node,
        n: u32,
        it: &mut Iter,
    ) -> Result<Stored, String> {
        let shared = Arc::clone(&self.keys);
        shared.stop.store(false, Ordering::Relaxed);
        shared.done.store(false, Ordering::Relaxed);
        let (socket, max, nonce) = (node.socket.clone(), self.a.max_objects, self.nonce);
        let first_id = u64::from(n) * 8 + 1;
        let hidden = self.a.hidden;
        let storer =
            std::thread::spawn(move || storer(socket, first_id, max, (nonce, hidden), shared));
        let target = 1 + self.rng.below((self.a.max_objects / 2).max(1));
        let killed = match self.wait_busy(node, target, it) {
            Ok(()) if self.a.clear => self.clear_and_kill(node, n, it),
            Ok(()) => {
                it.kill_delay_us = self.rng.below(2000);
                std::thread::sleep(Duration::from_micros(it.kill_delay_us));
                self.keys.stop.store(true, Ordering::Relaxed);
                node.kill()
            }
            Err(e) => Err(e),
        };
        self.keys.stop.store(true, Ordering::Relaxed);
        let stored = storer.join().map_err(|_| "the storer thread panicked")?;
        killed.map(|()| stored)
    }

    /// Polls STATUS until the node has written at least `target` objects to L2 in this run and
    /// more are waiting for (or in) the write-behind; or until the storer is done and nothing
    /// waits (an idle kill).
    fn wait_busy(&mut self, node: &Node, target: u64, it: &mut Iter) -> Result<(), String> {
        it.kill_target_writes = target;
        let mut c = connect(&node.socket)?;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let s = c
                .status()
                .map_err(|e| format!("STATUS while storing: {e}"))?;
            it.writes_at_kill = l2(&s, "writes");
            it.queued_at_kill = l2(&s, "queued");
            it.unwritten_at_kill = s["objects"]["unwritten"].as_u64().unwrap_or(0);
            it.status_at_kill = json!({
                "l2": s["l2"],
                "objects": s["objects"],
                "eviction_counters": s["eviction_counters"],
            });
            let pending = it.queued_at_kill + it.unwritten_at_kill;
            it.busy = pending > 0;
            if it.writes_at_kill >= target && pending > 0 {
                return Ok(());
            }
            if self.keys.done.load(Ordering::Relaxed) && pending == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the write-behind did not reach {target} writes within {START_TIMEOUT:?}: {}",
                    s["l2"]
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends a CLEAR (the storer moves to a new epoch first) and SIGKILLs the node: in odd
    /// iterations during the CLEAR, at a random moment from 0 to twice the last CLEAR's latency
    /// after sending it; in even ones after it returned, once the write-behind is busy again
    /// with 1 to 64 more objects written.
    fn clear_and_kill(&mut self, node: &mut Node, n: u32, it: &mut Iter) -> Result<(), String> {
        let old_epoch = self.keys.keys.lock().unwrap().advance();
        let mut c = connect(&node.socket)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let clearer = std::thread::spawn(move || {
            let _ = rx.recv();
            let t = Instant::now();
            let r = c.clear();
            (r, t.elapsed())
        });
        let during = n % 2 == 1;
        let _ = tx.send(());
        let (r, took) = if during {
            it.kill_delay_us = self.rng.below(2 * self.clear_latency_us + 1);
            std::thread::sleep(Duration::from_micros(it.kill_delay_us));
            self.keys.stop.store(true, Ordering::Relaxed);
            node.kill()?;
            clearer.join().map_err(|_| "the CLEAR thread panicked")?
        } else {
            let r = clearer.join().map_err(|_| "the CLEAR thread panicked")?;
            let written = l2(
                &connect(&node.socket)?.status().map_err(|e| e.to_string())?,
                "writes",
            );
            let target = written + 1 + self.rng.below(64);
            self.wait_busy(node, target, it)?;
            it.kill_delay_us = self.rng.below(2000);
            std::thread::sleep(Duration::from_micros(it.kill_delay_us));
            self.keys.stop.store(true, Ordering::Relaxed);
            node.kill()?;
            r
        };
        let mut out = ClearOutcome {
            during,
            returned: r.is_ok(),
            error: None,
            latency_us: None,
            forbidden_below: self.forbidden_below,
        };
        match r {
            Ok(_) => {
                out.latency_us = Some(took.as_micros() as u64);
                self.clear_latency_us = (took.as_micros() as u64).max(100);
                self.forbidden_below = self.forbidden_below.max(old_epoch + 1);
                out.forbidden_below = self.forbidden_below;
            }
            // Killed before it answered: nothing is promised.
            Err(e) if e.kind == ErrorKind::Io => {}
            Err(e) => out.error = Some(e.to_string()),
        }
        it.clear = Some(out);
        Ok(())
    }
}
