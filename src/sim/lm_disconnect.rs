//! LMCache connection closes in the simulator (issue 12 §1): a worker's connection closes (its
//! process crashed, or the network cut it), possibly with requests of the closed connection
//! still queued behind the close, and either the worker comes back over a new connection (a new
//! routing id) before the grace is up, keeping its instance, or it is gone and the frontend must
//! release the instance within its countdown; a scheduler's connection closes and its lookup
//! sessions (and their read locks) must go. The checks after every step hold the frontend to
//! the countdown's bounds (`check_disconnects`), and `observe_releases` to its lower bound.

use super::{Check, Sim};
use crate::lmcache::wire::LmRequest;

impl Sim {
    /// The earliest (node-clock ms) the frontend may release an instance whose connection
    /// closed at `closed_ms`, and the latest (its countdown: the grace once it pinged, the
    /// unproven countdown otherwise).
    pub(super) fn disconnect_window(&self, closed_ms: u64, pinged: bool) -> (u64, u64) {
        let grace = self.frontend.disconnect_grace_ms();
        let wait = if pinged {
            grace
        } else {
            self.frontend.unproven_grace_ms()
        };
        (closed_ms + grace, closed_ms + wait)
    }

    /// Worker `i`'s connection closes. Then, at random: requests of the closed connection that
    /// were still queued run (a PING and a PREPARE_STORE: neither may cancel the countdown, and
    /// the store is never published); the worker comes back over a new connection and PINGs
    /// (the instance is its own again, under a new pairing epoch), or it is gone.
    pub(super) fn lm_connection_closes(&mut self, i: usize) -> Check {
        let id = self.lms[i].id;
        let old = self.lms[i].client.clone();
        let now = self.now();
        let pinged = self.lms[i].reg.as_ref().is_some_and(|r| r.pinged);
        self.frontend.connection_closed(old.identity());
        self.stats.lm_disconnects += 1;
        self.maybe_sweep_now();
        // What the old connection prepared is now nobody's: no COMMIT of a new connection is
        // ever paired with it; the release (or the node's TTL) frees it.
        if let Some(inst) = self.ctx.instances.get(id) {
            let p = inst.pending.lock();
            let left: Vec<u64> = p.writes.keys().chain(p.reads.keys()).copied().collect();
            drop(p);
            self.lms[i].orphans.extend(left);
        }
        self.model.release_instance(id);
        self.lms[i].forget();
        if self.rng.chance(40) {
            self.touched(id, true);
            let r = self.lm_call(
                &old,
                LmRequest::Ping {
                    instance_id: Some(id),
                },
            );
            self.log(format!(
                "lm {id} PING queued from the closed connection -> {r:?}"
            ));
        }
        if self.rng.chance(40) {
            let (p, a, b, salt) = self.lm_span();
            let key = self.ipc_key(p, a, b, salt, Some(0));
            self.named(crate::sim::world::MODELS[0], salt);
            self.touched(id, false);
            let r = self.lm_call(
                &old,
                LmRequest::PrepareStore {
                    key,
                    instance_id: id,
                },
            );
            self.log(format!(
                "lm {id} PREPARE_STORE queued from the closed connection -> {r:?}"
            ));
            if let Some(inst) = self.ctx.instances.get(id) {
                let p = inst.pending.lock();
                let left: Vec<u64> = p.writes.keys().copied().collect();
                drop(p);
                self.lms[i].orphans.extend(left);
            }
        }
        let live = self.lms[i]
            .reg
            .as_ref()
            .is_some_and(|r| self.is_live(&r.inst));
        if live && self.rng.chance(50) {
            // Back before the grace is up, over a new connection: with a new routing id, or
            // (a DEALER that sets its routing id) the same one reopened. A request for its
            // instance over it keeps the instance; a request of the closed connection still
            // queued behind the reopen (stamped before the close) does not.
            let c = if self.rng.chance(50) {
                self.lms[i].reconnect();
                self.lms[i].client.clone()
            } else {
                self.frontend.connection_opened(old.identity());
                self.maybe_sweep_now();
                if self.rng.chance(50) {
                    let before = self.reconnects();
                    let r = self.lm_call(
                        &old,
                        LmRequest::Ping {
                            instance_id: Some(id),
                        },
                    );
                    self.log(format!(
                        "lm {id} PING of the closed connection run after its id reopened -> {r:?}"
                    ));
                    if self.reconnects() != before {
                        return Err(format!(
                            "a request of the closed connection of instance {id} (stamped \
                             before its close) counted as a reconnect"
                        ));
                    }
                }
                let c = old.clone().with_stamp(self.frontend.connection_stamp());
                self.lms[i].client = c.clone();
                c
            };
            self.touched(id, true);
            let r = self.lm_call(
                &c,
                LmRequest::Ping {
                    instance_id: Some(id),
                },
            );
            self.log(format!(
                "lm {id} connection closed; back over a new connection: PING -> {r:?}"
            ));
            if let Some(reg) = self.lms[i].reg.as_mut() {
                reg.closed_ms = None;
            }
            return Ok(());
        }
        self.lms[i].dead = true;
        if let Some(reg) = self.lms[i].reg.as_mut() {
            reg.closed_ms = Some((now, pinged));
        }
        self.log(format!("lm {id} connection closed; the worker is gone"));
        Ok(())
    }

    /// The scheduler's connection closes, after a LOOKUP that was still queued behind the close
    /// (sometimes): its sessions must end (checked after the step), and the engine's scheduler
    /// comes back over a new connection.
    pub(super) fn lm_scheduler_closes(&mut self) -> Check {
        let old = self.scheduler();
        self.frontend.connection_closed(old.identity());
        self.stats.lm_disconnects += 1;
        self.maybe_sweep_now();
        if self.rng.chance(50) {
            let (p, _, _, salt) = self.lm_span();
            let key = self.ipc_key(p, 0, crate::sim::world::PROMPT_CHUNKS, salt, None);
            let r = self.no_intern("LMCache LOOKUP", |s| {
                s.lm_call(&old, LmRequest::Lookup { key, tp_size: 1 })
            })?;
            self.log(format!(
                "lm LOOKUP queued from the closed scheduler -> {r:?}"
            ));
        }
        self.closed_schedulers.push(old.clone());
        if self.closed_schedulers.len() > 8 {
            self.closed_schedulers.remove(0);
        }
        self.lm_scheduler += 1;
        self.log(format!(
            "lm scheduler {old} connection closed; it reconnects as {}",
            self.scheduler()
        ));
        Ok(())
    }

    /// Sometimes the frontend's sweeper processes a close before the closed connection's queued
    /// requests run (they then find their connection closed when they finish).
    fn reconnects(&self) -> u64 {
        self.frontend
            .disconnect_counters()
            .reconnects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn maybe_sweep_now(&mut self) {
        if self.rng.chance(50) {
            let n = self.frontend.sweep_disconnects();
            self.log(format!("the sweeper sees the close first ({n} released)"));
        }
    }

    /// After every step: an instance whose connection closed is released by the end of its
    /// countdown, and no closed scheduler's session holds a lock.
    pub(super) fn check_disconnects(&self) -> Check {
        let now = self.now();
        for a in &self.lms {
            let Some(reg) = &a.reg else { continue };
            let Some((closed, pinged)) = reg.closed_ms else {
                continue;
            };
            // Requests of the closed connection (a PING) change nothing about its countdown.
            let (_, latest) = self.disconnect_window(closed, pinged);
            if now >= latest && self.is_live(&reg.inst) {
                return Err(format!(
                    "LMCache instance {} is still registered at {now} ms although its \
                     connection closed at {closed} ms and its countdown ended at {latest} ms",
                    a.id
                ));
            }
        }
        let locks = self.ctx.sessions.held_locks();
        for c in &self.closed_schedulers {
            let prefix = format!("lmcache:{}:", c.tag());
            if let Some((name, ..)) = locks.iter().find(|l| l.0.contains(&prefix)) {
                return Err(format!(
                    "session {name} of a closed scheduler connection still holds a lock"
                ));
            }
        }
        Ok(())
    }
}
