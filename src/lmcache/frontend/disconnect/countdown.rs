//! The countdowns of instances whose owner's connection closed: starting one, cancelling it
//! when the owner comes back (same user over a new connection, or the same routing id
//! reopened), releasing the instance when it ends, and the `disconnect` status part.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Countdown, Notify};
use crate::lmcache::frontend::owners::Owner;
use crate::lmcache::frontend::{ClientId, LmFrontend};
use crate::modules::instances::Instance;

impl LmFrontend {
    /// Starts the countdown of `inst` whose owner `owner` is gone (kept if already running for
    /// the same owner, with the later close's stamp); whether one runs now. None starts when a
    /// connection of the same routing id opened after this close already used the instance.
    /// (`closed_ms`: when the close was seen, where the countdown starts).
    pub(in crate::lmcache::frontend) fn start_countdown(
        &self,
        inst: &Instance,
        owner: ClientId,
        closed_ms: u64,
        closed_stamp: u64,
    ) -> bool {
        let now = closed_ms;
        let wait = if inst.pinged.load(Ordering::Relaxed) {
            self.disconnect_grace_ms()
        } else {
            self.unproven_grace_ms()
        };
        let d = &self.state.disconnects;
        let mut cd = d.countdowns.lock();
        if cd
            .reclaimed
            .get(&inst.id)
            .is_some_and(|s| *s >= closed_stamp)
        {
            return false;
        }
        match cd.map.get_mut(&inst.id) {
            Some(c) if c.generation == inst.generation && c.owner == owner => {
                c.closed_stamp = c.closed_stamp.max(closed_stamp);
            }
            _ => {
                cd.map.insert(
                    inst.id,
                    Countdown {
                        generation: inst.generation,
                        owner,
                        closed_ms: now,
                        closed_stamp,
                        due_ms: now.saturating_add(wait),
                    },
                );
                d.counting.store(cd.map.len(), Ordering::Relaxed);
            }
        }
        true
    }

    /// `client`, which owns `inst`, asks for it. When `client`'s routing id closed and
    /// reopened (a peer that sets its routing id reconnected) and this request came over the
    /// reopened connection (stamped after the close), the close's countdown is cancelled (or,
    /// when the sweeper has not processed the close yet, never starts), under a new pairing
    /// epoch as for an adoption. Requests of the closed connection (stamped before its close)
    /// change nothing. Cheap when no countdown runs and no close waits.
    pub(in crate::lmcache::frontend) fn reclaim(&self, client: &ClientId, inst: &Instance) {
        let s = &self.state;
        let d = &s.disconnects;
        let stamp = client.stamp();
        if stamp == 0
            || (d.counting.load(Ordering::Relaxed) == 0
                && d.closes_waiting.load(Ordering::Relaxed) == 0)
        {
            return;
        }
        // Lock order: pending, owners, countdowns, conns.
        let mut pending = s.pending.lock();
        let owners = s.owners.lock();
        let mut cd = d.countdowns.lock();
        let owns = owners
            .get(&inst.id)
            .is_some_and(|o| o.client == *client && o.generation == inst.generation);
        if !owns || inst.is_released() {
            return;
        }
        let cancel = cd.map.get(&inst.id).is_some_and(|c| {
            c.generation == inst.generation && c.owner == *client && c.closed_stamp < stamp
        });
        let reopened = d
            .conns
            .read()
            .open
            .get(client.identity())
            .and_then(|o| o.reopened_from)
            .filter(|c| *c < stamp && cd.reclaimed.get(&inst.id) != Some(c));
        if !cancel && reopened.is_none() {
            return;
        }
        if cancel {
            cd.map.remove(&inst.id);
            d.counting.store(cd.map.len(), Ordering::Relaxed);
        }
        if let Some(c) = reopened {
            cd.reclaimed.insert(inst.id, c);
        }
        pending.new_epoch(inst.id, inst.generation);
        drop((pending, owners, cd));
        d.counters.reconnects.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            instance = inst.id,
            %client,
            "LMCache instance used over a connection that reopened with its owner's routing id \
             after the owner's connection closed: it is not released"
        );
    }

    /// `client` asks for `inst`, which another connection owns: when that owner's connection
    /// closed (its countdown runs, or the close is not processed yet), and `client` is of the
    /// same user (and open), `client` becomes the owner under a new pairing epoch and the
    /// countdown ends. Whether it did.
    pub(in crate::lmcache::frontend) fn adopt_orphan(
        &self,
        client: &ClientId,
        inst: &Instance,
    ) -> bool {
        let s = &self.state;
        let d = &s.disconnects;
        let orphaned = |o: &Owner| {
            o.generation == inst.generation
                && o.client != *client
                && o.client.same_user(client)
                && d.is_closed(o.client.identity())
        };
        let candidate = s.owners.lock().get(&inst.id).is_some_and(orphaned);
        if !candidate || d.is_closed(client.identity()) {
            return false;
        }
        // Lock order: pending, owners, countdowns (as REGISTER and the release hook).
        let mut pending = s.pending.lock();
        let mut owners = s.owners.lock();
        let mut cd = d.countdowns.lock();
        let previous = match owners.get(&inst.id) {
            Some(o) if orphaned(o) && !inst.is_released() => o.client.clone(),
            _ => return false,
        };
        cd.map.remove(&inst.id);
        d.counting.store(cd.map.len(), Ordering::Relaxed);
        pending.new_epoch(inst.id, inst.generation);
        owners.insert(
            inst.id,
            Owner {
                client: client.clone(),
                generation: inst.generation,
            },
        );
        drop((pending, owners, cd));
        d.counters.adoptions.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            instance = inst.id,
            %client,
            %previous,
            "LMCache instance used over a new connection of the same user after its owner's \
             connection closed: the countdown is cancelled and the new connection owns it"
        );
        true
    }

    /// Releases the instances whose countdown ended; returns how many.
    pub(in crate::lmcache::frontend) fn release_disconnected(&self) -> usize {
        let s = &self.state;
        let now = self.ctx.now_ms();
        let due: Vec<u64> = s
            .disconnects
            .countdowns
            .lock()
            .map
            .iter()
            .filter(|(_, c)| c.due_ms <= now)
            .map(|(id, _)| *id)
            .collect();
        let mut released = 0;
        for id in due {
            let inst = self.ctx.instances.get(id);
            // Marked released under the owners lock, so no adoption can slip in between the
            // check and the release.
            let marked = {
                let owners = s.owners.lock();
                let mut cd = s.disconnects.countdowns.lock();
                match cd.map.get(&id) {
                    Some(c) if c.due_ms <= now => {}
                    _ => continue,
                }
                let c = cd.map.remove(&id).expect("checked");
                s.disconnects
                    .counting
                    .store(cd.map.len(), Ordering::Relaxed);
                inst.filter(|i| {
                    i.generation == c.generation
                        && owners
                            .get(&id)
                            .is_some_and(|o| o.client == c.owner && o.generation == c.generation)
                        && i.mark_released()
                })
                .map(|i| (i, c))
            };
            let Some((inst, c)) = marked else {
                continue;
            };
            // Counted before the release completes, so a STATUS that no longer lists the
            // instance already counts its release.
            self.ctx
                .counters
                .disconnected
                .fetch_add(1, Ordering::SeqCst);
            s.disconnects
                .counters
                .releases
                .fetch_add(1, Ordering::SeqCst);
            let r = self.ctx.finish_release(&inst, "disconnected");
            released += 1;
            tracing::info!(
                instance = id,
                client = %c.owner,
                after_close_ms = self.ctx.now_ms().saturating_sub(c.closed_ms),
                freed_writes = r.writes,
                released_reads = r.reads,
                "LMCache instance released: its client's connection closed"
            );
        }
        released
    }

    /// The status report's `disconnect` part of `lmcache`.
    pub(in crate::lmcache::frontend) fn disconnect_status(
        state: &crate::lmcache::frontend::State,
        unproven_ms: u64,
    ) -> serde_json::Value {
        let d = &state.disconnects;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let notify = match &*d.notify.lock() {
            Notify::Detached => "off: no ZMQ endpoint".to_owned(),
            Notify::On => "on".to_owned(),
            Notify::Off(why) => format!("off: {why}"),
        };
        let c = &d.counters;
        serde_json::json!({
            "notifications": notify,
            "grace_seconds": state.limits.worker_disconnect_grace_ms as f64 / 1000.0,
            "unproven_grace_seconds": unproven_ms as f64 / 1000.0,
            "open_connections": d.conns.read().open.len(),
            "untracked_open": d.conns.read().untracked_len(),
            "opened": n(&c.opened),
            "closed": n(&c.closed),
            "untracked": n(&c.untracked),
            "untracked_closes": n(&c.untracked_closes),
            "untracked_unremembered": n(&c.untracked_unremembered),
            "expired": n(&c.expired),
            "closes_dropped": n(&c.closes_dropped),
            "counting_down": d.countdowns.lock().map.len(),
            "releases": n(&c.releases),
            "adoptions": n(&c.adoptions),
            "reconnects": n(&c.reconnects),
            "sessions_ended": n(&c.sessions_ended),
        })
    }
}
