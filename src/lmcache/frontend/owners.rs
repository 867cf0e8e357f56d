//! Instance ownership on the LMCache frontend (see the parent module's docs): REGISTER,
//! UNREGISTER and PING, the ownership check every transfer request makes first, and the rate
//! limit of the refusal log lines.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::Mutex;

use super::{ClientId, LmFrontend, LmReply, REFUSAL_LOGS_PER_SEC};
use crate::lmcache::wire::{Op, RegisterPayload};
use crate::modules::instances::Instance;
use crate::protocol::{RegisterRequest, Request, Response};

/// Who registered an instance (see the module docs).
#[derive(Debug, Clone)]
pub(super) struct Owner {
    pub(super) client: ClientId,
    pub(super) generation: u64,
}

/// Rate limit for a kind of refusal log line. Invariant: at most [`REFUSAL_LOGS_PER_SEC`]
/// lines are allowed per second of the caller's clock; the others are counted.
#[derive(Default)]
pub struct LogLimit {
    /// (second of the window, lines logged in it, lines suppressed since the last one).
    state: Mutex<(u64, u64, u64)>,
}

impl LogLimit {
    /// Whether to log now, with the number of lines suppressed before this one.
    pub fn allow(&self, now_ms: u64) -> Option<u64> {
        let mut s = self.state.lock();
        let sec = now_ms / 1000;
        if s.0 != sec {
            *s = (sec, 0, s.2);
        }
        if s.1 < REFUSAL_LOGS_PER_SEC {
            s.1 += 1;
            Some(std::mem::take(&mut s.2))
        } else {
            s.2 += 1;
            None
        }
    }
}

impl LmFrontend {
    /// Logs a refused request (rate-limited: see [`REFUSAL_LOGS_PER_SEC`]).
    pub(super) fn refused(&self, client: &ClientId, op: &str, why: std::fmt::Arguments<'_>) {
        if let Some(suppressed) = self.state.refusal_log.allow(self.ctx.now_ms()) {
            tracing::warn!(%client, op, suppressed, "LMCache request refused: {why}");
        }
    }

    /// The current registration of `instance_id` when `client` registered it; otherwise logs
    /// why `op` is refused and returns `None`.
    pub(super) fn owned(
        &self,
        client: &ClientId,
        instance_id: u64,
        op: &str,
    ) -> Option<Arc<Instance>> {
        let Some(inst) = self.ctx.instances.get(instance_id) else {
            self.state
                .counters
                .unregistered
                .fetch_add(1, Ordering::Relaxed);
            self.refused(
                client,
                op,
                format_args!(
                    "instance {instance_id} is not registered (released by the node, or never \
                     registered): the worker must register again (LMCache workers do so after \
                     their heartbeat's next failed PING)"
                ),
            );
            return None;
        };
        // Compared under the lock: no copy of the owner per request.
        let owns = self
            .state
            .owners
            .lock()
            .get(&instance_id)
            .is_some_and(|o| o.generation == inst.generation && o.client == *client);
        match owns {
            true => {
                // Over a connection that reopened with the owner's routing id: not released.
                self.reclaim(client, &inst);
                Some(inst)
            }
            // The owner's connection closed and this one of the same user took over.
            _ if self.adopt_orphan(client, &inst) => Some(inst),
            _ => {
                self.state
                    .counters
                    .not_owner
                    .fetch_add(1, Ordering::Relaxed);
                self.refused(
                    client,
                    op,
                    format_args!(
                        "instance {instance_id} was registered by another connection (only the \
                         connection that registers an instance may use it)"
                    ),
                );
                None
            }
        }
    }

    /// PING: only the owner keeps its instance alive; a ping of another connection's instance
    /// is answered `true` (as LMCache always does) and ignored, unless that owner's connection
    /// closed and this is the same user's (see `disconnect`: it adopts the instance). The
    /// answer is `false` once for an instance the node released while its user's worker owned
    /// it (`lost`): that worker's heartbeat then registers it again.
    pub(super) fn ping(&self, client: &ClientId, instance_id: Option<u64>) -> bool {
        let Some(id) = instance_id else {
            self.call(Request::Ping { instance_id });
            return true;
        };
        let owner = {
            let o = self.state.owners.lock();
            o.get(&id).is_some_and(|w| w.client == *client)
        };
        if owner {
            if let Some(inst) = self.ctx.instances.get(id) {
                self.reclaim(client, &inst);
            }
        }
        let mine = owner
            || self
                .ctx
                .instances
                .get(id)
                .is_some_and(|inst| self.adopt_orphan(client, &inst));
        if mine {
            self.call(Request::Ping { instance_id });
            return true;
        }
        let registered = self.ctx.instances.get(id).is_some();
        if !registered && self.state.lost.lock().take_for(id, client) {
            self.state
                .counters
                .recovery_pings
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                instance = id,
                %client,
                "PING for an instance the node released (reaped or disconnected) while its \
                 worker still runs: answering false once, so the worker registers it again"
            );
            return false;
        }
        self.state
            .counters
            .not_owner
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// UNREGISTER: only the owner's is executed (the release hook then drops what the frontend
    /// kept for the instance).
    pub(super) fn unregister(&self, client: &ClientId, instance_id: u64) {
        let _serial = self.state.registering.lock();
        if self.owned(client, instance_id, "UNREGISTER").is_some() {
            self.call(Request::Unregister { instance_id });
            // Released at its worker's request: nobody needs telling.
            self.state.lost.lock().remove(instance_id);
        }
    }

    /// REGISTER: refused when another user's connection owns the live instance; from another
    /// connection of the same user, a takeover (see the parent module's docs).
    pub(super) fn register(&self, client: &ClientId, p: RegisterPayload) -> LmReply {
        let _serial = self.state.registering.lock();
        let id = p.instance_id;
        let current = self.ctx.instances.get(id).filter(|i| !i.is_released());
        let owner = self.state.owners.lock().get(&id).cloned();
        if let (Some(inst), Some(o)) = (&current, &owner) {
            if o.generation == inst.generation && o.client != *client {
                if !o.client.same_user(client) {
                    self.state
                        .counters
                        .register_refused
                        .fetch_add(1, Ordering::Relaxed);
                    self.refused(
                        client,
                        "REGISTER",
                        format_args!("instance {id} is registered by another user's connection"),
                    );
                    return self.stateless(Op::RegisterEngineDriven);
                }
                self.state
                    .counters
                    .takeovers
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    instance = id,
                    %client,
                    previous = %o.client,
                    "LMCache instance registered again by another connection of the same user \
                     (a restarted engine): it now owns the instance; the previous connection's \
                     transfers are never paired with the new one's commits"
                );
            }
        }
        let resp = self.call(Request::Register(RegisterRequest {
            instance_id: id,
            model: p.model_name,
            world_size: p.world_size,
            block_size: p.block_size,
            num_layers: p.num_layers,
            hidden_dim: p.hidden_dim_size,
            dtype: p.dtype_str,
            use_mla: p.use_mla,
            physical_slots: p.num_physical_slots,
        }));
        match resp {
            Response::Registered(r) => {
                // A REGISTER is idempotent for the node (LMCache's rule: it refreshes liveness
                // and keeps the registration), but ZMQ hides which process is asking: it may be
                // a restarted worker reusing its id. So COMMITs are never paired with transfers
                // prepared before it: those stay reserved (a live process may still be copying)
                // until the node's write TTL or the instance's release, and are never published.
                let current = self.ctx.instances.get(id);
                let mut pending = self.state.pending.lock();
                // Checked under the lock (as in `queue`): a release after this point runs the
                // hook, which waits for the lock and then drops this epoch. An instance released
                // already needs none (its hook drops what was kept for it).
                if let Some(inst) = current.filter(|i| !i.is_released()) {
                    pending.new_epoch(id, inst.generation);
                    // Under the same lock, so the release hook (which takes `pending` first)
                    // cannot run between the check and the insertion.
                    self.state.owners.lock().insert(
                        id,
                        Owner {
                            client: client.clone(),
                            generation: inst.generation,
                        },
                    );
                }
                drop(pending);
                self.state.pickle_instances.lock().remove(&id);
                // Registered again: no recovery PING is owed any more.
                self.state.lost.lock().remove(id);
                LmReply::Register {
                    shm_name: r.shm_name,
                    pool_bytes: r.pool_bytes,
                }
            }
            other => {
                tracing::warn!(instance = id, response = ?other, "LMCache registration refused");
                self.stateless(Op::RegisterEngineDriven)
            }
        }
    }
}
