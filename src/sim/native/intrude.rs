//! Intruders: requests that name what another client created. A native worker (its own
//! process) sends requests for another worker's instance and transfers; a scheduler of another
//! user frees and ends sessions by the same request ids and tries admin operations. Every such
//! request must be refused with `PermissionDenied` (or find nothing, for another user's session
//! names) and change nothing: the model is not told about them, so any effect on the node shows
//! up in the invariant checks after the step.

use super::{short, Conn};
use crate::error::ErrorKind;
use crate::protocol::{RegisterRequest, Request, Response};
use crate::sim::world::{DTYPE, HIDDEN_ALT, NUM_LAYERS, PROMPT_CHUNKS};
use crate::sim::{Check, Sim};

/// The uid of the simulator's foreign user (an allowed client, not an admin).
pub const FOREIGN_UID: u32 = 65_534;

/// The pid the simulator gives the connections of native worker `i` (each worker is its own
/// process; its connections share the pid).
pub fn worker_pid(i: usize) -> i32 {
    1_000 + i as i32
}

impl Sim {
    /// Native worker `i` sends a request for another worker's instance over its own connection.
    pub(in crate::sim) fn native_intrude(&mut self, i: usize) -> Check {
        let j = self.rng.index(self.natives.len());
        if j == i || self.natives[j].reg.is_none() {
            return Ok(());
        }
        let me = self.natives[i].id;
        let victim = self.natives[j].id;
        let conn = self.natives[i].conns[0].clone();
        let held: Vec<u64> = self.natives[j].held().map(|(t, _)| t).collect();
        let tid = if held.is_empty() {
            1
        } else {
            held[self.rng.index(held.len())]
        };
        let model = self.natives[j].model;
        let (p, a, b) = self.chunk_span();
        let req = match self.rng.index(8) {
            0 => Request::CommitStore {
                instance_id: victim,
                transfer_id: tid,
            },
            1 => Request::AbortStore {
                instance_id: victim,
                transfer_id: tid,
            },
            2 => Request::CommitRetrieve {
                instance_id: victim,
                transfer_id: tid,
            },
            3 => Request::Unregister {
                instance_id: victim,
            },
            4 => Request::Ping {
                instance_id: Some(victim),
            },
            5 => Request::PrepareStore {
                instance_id: victim,
                range: self.range(model, "", p, a, b),
            },
            6 => Request::PrepareRetrieve {
                instance_id: victim,
                range: self.range(model, "", p, a, b),
                lookup_session: None,
            },
            _ => Request::Register(RegisterRequest {
                instance_id: victim,
                model: model.to_owned(),
                world_size: 1,
                block_size: 16,
                num_layers: NUM_LAYERS,
                hidden_dim: HIDDEN_ALT,
                dtype: DTYPE.into(),
                use_mla: false,
                physical_slots: None,
            }),
        };
        let op = req.opcode();
        let r = self.native_call(&conn, req);
        self.log(format!(
            "native {me} intrudes on instance {victim} (opcode {op}, transfer {tid}) -> {}",
            short(&r)
        ));
        self.stats.intrusions += 1;
        expect_denied(
            &r,
            &format!("opcode {op} of native {me} on instance {victim}"),
        )
    }

    /// A scheduler of another user: FREE_LOOKUP_LOCKS and END_SESSION by the request ids the
    /// node's own schedulers use (another user's name space: nothing found), a LOOKUP under its
    /// own name space with those ids, and the admin operations (refused).
    pub(in crate::sim) fn foreign_step(&mut self) -> Check {
        let conn = self.foreign.clone();
        let session = format!("s{}", self.rng.index(8));
        let (label, req) = match self.rng.index(5) {
            4 => {
                let model = crate::sim::world::MODELS[self.rng.index(2)];
                let p = self.rng.index(self.prompts.len());
                let mut range = self.range(model, "", p, 0, PROMPT_CHUNKS);
                range.worker_id = None;
                self.named(model, "");
                (
                    "LOOKUP",
                    Request::Lookup {
                        request_id: session.clone(),
                        range,
                        tp_size: 1,
                        readers: 0,
                    },
                )
            }
            0 => (
                "FREE_LOOKUP_LOCKS",
                Request::FreeLookupLocks {
                    request_id: session.clone(),
                    start_chunk: 0,
                    end_chunk: PROMPT_CHUNKS as u32,
                },
            ),
            1 => (
                "END_SESSION",
                Request::EndSession {
                    request_id: session.clone(),
                },
            ),
            2 => ("CLEAR", Request::Clear),
            _ => ("MEMCHECK", Request::Memcheck),
        };
        let admin = matches!(req, Request::Clear | Request::Memcheck);
        let lookup = matches!(req, Request::Lookup { .. });
        let ours_before = self.sessions_not_of(FOREIGN_UID);
        let evicted_before = self.ctx.sessions.evicted();
        let r = if lookup {
            self.no_intern("LOOKUP", |s| s.native_call(&conn, req))?
        } else {
            self.native_call(&conn, req)
        };
        self.log(format!("foreign user {label} {session} -> {}", short(&r)));
        self.stats.intrusions += 1;
        // A LOOKUP may evict sessions to stay within the session budgets (the largest owner's
        // first): that is the budget's doing, not a name-space leak.
        let evicted = self.ctx.sessions.evicted() != evicted_before;
        if !evicted && self.sessions_not_of(FOREIGN_UID) != ours_before {
            return Err(format!(
                "another user's {label} {session} changed the locks of our sessions"
            ));
        }
        if admin {
            return expect_denied(&r, label);
        }
        match r {
            Response::Ok | Response::LookupHits { .. } => Ok(()),
            other => Err(format!(
                "{label} of another user's session name answered {other:?}"
            )),
        }
    }

    /// The session locks held by every user but `uid`: `(session, key, lease, remaining)`.
    fn sessions_not_of(&self, uid: u32) -> Vec<(String, crate::storage::StorageKey, u64, u32)> {
        let mine = format!("{uid}:");
        self.ctx
            .sessions
            .held_locks()
            .into_iter()
            .filter(|(s, ..)| !s.starts_with(&mine))
            .collect()
    }
}

fn expect_denied(r: &Response, what: &str) -> Check {
    match r {
        Response::Error { kind, .. } if *kind == ErrorKind::PermissionDenied.code() => Ok(()),
        other => Err(format!("{what} was not refused: {other:?}")),
    }
}

/// A connection of the foreign user's process.
pub fn foreign_conn(id: u64) -> Conn {
    Conn::with_peer(
        id,
        kvnode_hw::PeerCred {
            pid: Some(3),
            uid: FOREIGN_UID,
            gid: FOREIGN_UID,
        },
    )
}
