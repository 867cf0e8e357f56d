//! Native-protocol clients of the simulator: engine workers that register over one or two
//! connections, store, retrieve (with their own, someone else's, a stale or no lookup session),
//! commit, abort, repeat commits, disconnect or fall silent; and schedulers that look up,
//! free lookup locks and end sessions.
//!
//! This file holds the actors, the step dispatch, registration, unregistration, disconnects and
//! the schedulers; `transfer` holds the workers' store and retrieve transfers.

mod intrude;
mod transfer;

pub use intrude::{foreign_conn, worker_pid, FOREIGN_UID};

use std::sync::Arc;

use super::world::{self, CaptureSink, DTYPE, HIDDEN, HIDDEN_ALT, NUM_LAYERS, PROMPT_CHUNKS};
use super::{Check, Registration, Sim};
use crate::error::ErrorKind;
use crate::protocol::{ChunkRange, RegisterRequest, Request, Response};
use crate::server::dispatch;
use crate::storage::{pack_kv_rank, StorageKey};

/// One client connection: its reply sink and the dispatcher's list of instances registered
/// over it.
#[derive(Clone)]
pub struct Conn {
    sink: Arc<CaptureSink>,
    /// The dispatcher's record of instances registered over it.
    pub registered: Arc<parking_lot::Mutex<dispatch::Registered>>,
}

impl Conn {
    /// A new open connection with id `id` of a process of the node's own user.
    pub fn new(id: u64) -> Conn {
        Conn {
            sink: CaptureSink::new(id),
            registered: Arc::default(),
        }
    }

    /// A new open connection with id `id` whose peer is `peer`.
    pub fn with_peer(id: u64, peer: kvnode_hw::PeerCred) -> Conn {
        Conn {
            sink: CaptureSink::with_peer(id, peer),
            registered: Arc::default(),
        }
    }

    /// A new open remote connection with id `id` whose handshake proved the client token: its
    /// caller is [`crate::modules::Caller::remote`] with [`crate::access::Role::Client`].
    pub fn remote(id: u64) -> Conn {
        let conn = Conn {
            sink: CaptureSink::remote(id),
            registered: Arc::default(),
        };
        conn.registered
            .lock()
            .set_caller(crate::modules::Caller::remote(
                id,
                crate::access::Role::Client,
            ));
        conn
    }

    /// The connection id.
    pub fn id(&self) -> u64 {
        crate::transport::ReplySink::connection_id(&*self.sink)
    }
}

/// A native engine worker.
pub struct NativeActor {
    /// Its instance id.
    pub id: u64,
    model: &'static str,
    conns: Vec<Conn>,
    /// Registration, while the model believes the instance is registered.
    pub(crate) reg: Option<Registration>,
    /// (node transfer id, model transfer id) of prepared stores.
    writes: Vec<(u64, u64)>,
    /// (node transfer id, model transfer id) of prepared retrieves.
    reads: Vec<(u64, u64)>,
    /// Transfer ids already committed or aborted (repeated on purpose).
    retired: Vec<u64>,
    /// Silent forever (a hung process): only the reaper can release it.
    pub(crate) dead: bool,
}

impl NativeActor {
    /// A worker for instance `id` of `model`.
    pub fn new(id: u64, model: &'static str) -> NativeActor {
        NativeActor {
            id,
            model,
            conns: Vec::new(),
            reg: None,
            writes: Vec::new(),
            reads: Vec::new(),
            retired: Vec::new(),
            dead: false,
        }
    }

    /// Forgets the transfers of a released registration.
    pub fn forget(&mut self) {
        self.writes.clear();
        self.reads.clear();
    }

    /// A new process replaces this (dead) one: nothing of the old one is kept; returns the old
    /// connections, which the caller closes.
    pub fn revive(&mut self) -> Vec<Conn> {
        self.dead = false;
        self.forget();
        self.retired.clear();
        std::mem::take(&mut self.conns)
    }

    /// Node transfer ids this worker holds (prepared and not yet committed or aborted).
    pub fn held(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.writes.iter().chain(self.reads.iter()).copied()
    }
}

const SALTS: [&str; 6] = ["", "", "", "t1", "t2", "t3"];

impl Sim {
    /// Sends one native request over `conn` and returns the answer.
    pub(super) fn native_call(&mut self, conn: &Conn, req: Request) -> Response {
        self.stats.requests += 1;
        let rid = self.request_id();
        let sink: Arc<dyn crate::transport::ReplySink> = conn.sink.clone();
        let mut registered = conn.registered.lock();
        dispatch::dispatch(&self.ctx, &sink, rid, req, &mut registered);
        drop(registered);
        conn.sink.take().unwrap_or_else(|| Response::Error {
            kind: ErrorKind::Internal.code(),
            message: "no response".into(),
        })
    }

    fn salt(&mut self) -> &'static str {
        if self.rng.chance(12) {
            // Rare, many distinct salts: namespaces come and go.
            const MANY: [&str; 10] = ["x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8", "x9"];
            MANY[self.rng.index(MANY.len())]
        } else {
            SALTS[self.rng.index(SALTS.len())]
        }
    }

    /// A chunk range `[a, b)` of a random prompt.
    fn chunk_span(&mut self) -> (usize, usize, usize) {
        let p = self.rng.index(self.prompts.len());
        let a = if self.rng.chance(70) {
            0
        } else {
            self.rng.index(PROMPT_CHUNKS)
        };
        let b = self.rng.range(a as u64 + 1, PROMPT_CHUNKS as u64) as usize;
        (p, a, b)
    }

    fn range(&self, model: &str, salt: &str, p: usize, a: usize, b: usize) -> ChunkRange {
        ChunkRange {
            model: model.to_owned(),
            world_size: 1,
            worker_id: Some(0),
            cache_salt: salt.to_owned(),
            first_chunk: a as u32,
            chunk_hashes: self.prompts.hashes(p)[a..b].to_vec(),
        }
    }

    pub(super) fn key_of(
        &self,
        model: &str,
        salt: &str,
        hash: &crate::hashing::ChunkHash,
    ) -> StorageKey {
        StorageKey {
            chunk_hash: *hash,
            kv_rank: pack_kv_rank(1, 0),
            object_group: 0,
            namespace: self
                .ctx
                .namespaces
                .lookup(model, salt)
                .unwrap_or(crate::storage::NamespaceId(u64::MAX)),
        }
    }

    /// One random action of native worker `i`.
    pub(super) fn native_step(&mut self, i: usize) -> Check {
        if self.natives[i].dead {
            return Ok(());
        }
        if self.natives[i].conns.is_empty() {
            let c = self.worker_conn(i);
            self.natives[i].conns.push(c);
        }
        let registered = self.natives[i].reg.is_some();
        if !registered {
            return self.native_register(i, 0, HIDDEN);
        }
        let weights = [
            3,  // 0 register again (same layout), maybe over a second connection
            1,  // 1 re-register with another layout
            8,  // 2 ping
            25, // 3 prepare store
            20, // 4 commit store
            4,  // 5 abort store
            20, // 6 prepare retrieve
            18, // 7 commit retrieve
            3,  // 8 repeat a finished commit, or commit someone else's transfer
            2,  // 9 unregister
            2,  // 10 disconnect one connection
            1,  // 11 fall silent forever
            3,  // 12 send a request for another worker's instance
        ];
        match self.rng.weighted(&weights) {
            0 => {
                let second = self.natives[i].conns.len() < 2 && self.rng.chance(50);
                if second {
                    let c = self.worker_conn(i);
                    self.natives[i].conns.push(c);
                }
                let conn = self.natives[i].conns.len() - 1;
                let hidden = self.natives[i].reg.as_ref().map_or(HIDDEN, |r| r.hidden);
                self.native_register(i, conn, hidden)
            }
            1 => {
                let hidden = match self.natives[i].reg.as_ref().map(|r| r.hidden) {
                    Some(HIDDEN) => HIDDEN_ALT,
                    _ => HIDDEN,
                };
                self.native_register(i, 0, hidden)
            }
            2 => {
                let id = self.natives[i].id;
                let conn = self.natives[i].conns[0].clone();
                self.touched(id, true);
                let r = self.native_call(
                    &conn,
                    Request::Ping {
                        instance_id: Some(id),
                    },
                );
                self.log(format!("native {id} PING -> {r:?}"));
                Ok(())
            }
            3 => self.native_prepare_store(i),
            4 => self.native_commit_store(i),
            5 => self.native_abort_store(i),
            6 => self.native_prepare_retrieve(i),
            7 => self.native_commit_retrieve(i),
            8 => self.native_bogus_commit(i),
            9 => self.native_unregister(i),
            10 => self.native_disconnect(i),
            12 => self.native_intrude(i),
            _ => {
                self.natives[i].dead = true;
                let id = self.natives[i].id;
                self.log(format!("native {id} falls silent (connection left open)"));
                Ok(())
            }
        }
    }

    /// A new connection of native worker `i`'s process.
    fn worker_conn(&mut self, i: usize) -> Conn {
        self.next_conn += 1;
        Conn::with_peer(
            self.next_conn,
            kvnode_hw::PeerCred {
                pid: Some(worker_pid(i)),
                uid: kvnode_hw::effective_uid(),
                gid: kvnode_hw::effective_gid(),
            },
        )
    }

    fn native_register(&mut self, i: usize, conn: usize, hidden: u32) -> Check {
        let (id, model) = (self.natives[i].id, self.natives[i].model);
        let c = self.natives[i].conns[conn].clone();
        self.named(model, "");
        let replaces = self.natives[i]
            .reg
            .as_ref()
            .is_some_and(|r| r.hidden != hidden);
        let r = self.native_call(
            &c,
            Request::Register(RegisterRequest {
                instance_id: id,
                model: model.to_owned(),
                world_size: 1,
                block_size: 16,
                num_layers: NUM_LAYERS,
                hidden_dim: hidden,
                dtype: DTYPE.into(),
                use_mla: false,
                physical_slots: None,
            }),
        );
        self.log(format!(
            "native {id} REGISTER hidden={hidden} on conn {} -> {}",
            c.id(),
            short(&r)
        ));
        if !matches!(r, Response::Registered(_)) {
            return Err(format!("registration of instance {id} refused: {r:?}"));
        }
        if replaces {
            // The old context is released with everything it held.
            self.forget_instance(id, true)?;
        }
        let inst = self
            .ctx
            .instances
            .get(id)
            .ok_or_else(|| format!("instance {id} registered but not in the table"))?;
        if inst.is_released() {
            return Err(format!("registration of {id} returned a released instance"));
        }
        let now = self.now();
        let a = &mut self.natives[i];
        match &mut a.reg {
            Some(reg) if std::sync::Arc::ptr_eq(&reg.inst, &inst) => {
                reg.last_seen_ms = now;
                if !reg.conns.contains(&c.id()) {
                    reg.conns.push(c.id());
                }
            }
            _ => {
                a.reg = Some(Registration {
                    inst,
                    last_seen_ms: now,
                    pinged: false,
                    hidden,
                    conns: vec![c.id()],
                    closed_ms: None,
                });
            }
        }
        Ok(())
    }

    fn session_id(&mut self) -> String {
        if self.rng.chance(15) {
            // A session that may never have existed, or one of the LMCache workers'.
            format!("lm-p{}-", self.rng.index(self.prompts.len()))
        } else {
            format!("s{}", self.rng.index(8))
        }
    }

    fn native_unregister(&mut self, i: usize) -> Check {
        let id = self.natives[i].id;
        let conn = self.natives[i].conns[0].clone();
        self.touched(id, false);
        let r = self.native_call(&conn, Request::Unregister { instance_id: id });
        self.log(format!("native {id} UNREGISTER -> {}", short(&r)));
        if !matches!(r, Response::Unregistered { .. }) {
            return Err(format!("UNREGISTER of instance {id} failed: {r:?}"));
        }
        self.forget_instance(id, true)?;
        self.natives[i].retired.clear();
        Ok(())
    }

    fn native_disconnect(&mut self, i: usize) -> Check {
        let id = self.natives[i].id;
        let k = self.rng.index(self.natives[i].conns.len());
        let conn = self.natives[i].conns.remove(k);
        let registered = conn.registered.lock().ids();
        self.ctx.connection_closed(conn.id(), &registered, true);
        let Some(reg) = self.natives[i].reg.as_mut() else {
            self.log(format!(
                "native {id} closes conn {} (not registered)",
                conn.id()
            ));
            return Ok(());
        };
        let was_registering = reg.conns.contains(&conn.id());
        reg.conns.retain(|c| *c != conn.id());
        let last = reg.conns.is_empty();
        let live = self.is_live(&self.natives[i].reg.as_ref().expect("checked").inst);
        self.log(format!(
            "native {id} closes conn {} (registered over it: {was_registering}, last: {last})",
            conn.id()
        ));
        if was_registering && last {
            if live {
                return Err(format!(
                    "instance {id} survived the close of its last registering connection"
                ));
            }
            self.stats.disconnected += 1;
            self.forget_instance(id, true)?;
        } else if !live {
            return Err(format!(
                "instance {id} was released when connection {} closed, but another connection \
                 that registered it is open",
                conn.id()
            ));
        }
        Ok(())
    }

    /// A scheduler's action: LOOKUP, FREE_LOOKUP_LOCKS or END_SESSION (over either of two
    /// connections, which use the same session ids: a session is its creating connection's),
    /// or a scheduler that reconnects (its sessions end with the old connection).
    pub(super) fn scheduler_step(&mut self) -> Check {
        let which = self.rng.index(2);
        let conn = self.schedulers[which].clone();
        let mut session = self.session_id();
        let before = self.ctx.sessions.held_locks();
        let action = self.rng.weighted(&[60, 20, 20, 2]);
        if action == 0 && session.starts_with("lm-") {
            // Never create a session under an LMCache worker's id (the frontend's LOOKUP of it
            // would then be refused: it is another connection's).
            session = format!("s{}", self.rng.index(8));
        }
        // Whether this connection may act on the session: refused exactly when a live session
        // of that id was created over another connection.
        let mine = format!("{}:{session}", kvnode_hw::effective_uid());
        let exists = before.iter().any(|(s, ..)| *s == mine);
        let expect_denied = exists
            && match self.session_creators.get(&session) {
                Some(&c) => c != conn.id(),
                None => !session.starts_with('s'), // an LMCache worker's: the frontend's
            };
        let r = match action {
            0 => {
                let salt = self.salt();
                let model = world::MODELS[self.rng.index(2)];
                let p = self.rng.index(self.prompts.len());
                let mut range = self.range(model, salt, p, 0, PROMPT_CHUNKS);
                range.worker_id = None;
                let tp_size = if self.rng.chance(30) { 2 } else { 1 };
                // Declared readers (LMCache 0.5.6): none (the tp rule), a few, or too many.
                let readers = match self.rng.index(10) {
                    0..=4 => 0,
                    5..=8 => self.rng.range(1, 4) as u32,
                    _ => crate::modules::lookup::MAX_KV_READERS + 1,
                };
                self.named(model, salt);
                self.stats.lookups += 1;
                let req = Request::Lookup {
                    request_id: session.clone(),
                    range,
                    tp_size,
                    readers,
                };
                let r = self.no_intern("LOOKUP", |s| s.native_call(&conn, req))?;
                if let Response::LookupHits { chunks } = r {
                    self.remember_lookup(session.clone(), model, salt, p, chunks);
                    if chunks > 0 {
                        self.session_creators.insert(session.clone(), conn.id());
                    } else {
                        self.session_creators.remove(&session);
                    }
                }
                self.log(format!(
                    "LOOKUP {session} p{p} {model} salt {salt:?} tp {tp_size} readers {readers} -> {}",
                    short(&r)
                ));
                r
            }
            1 => {
                let a = self.rng.index(PROMPT_CHUNKS + 1) as u32;
                let b = self.rng.range(u64::from(a), PROMPT_CHUNKS as u64 + 1) as u32;
                let req = Request::FreeLookupLocks {
                    request_id: session.clone(),
                    start_chunk: a,
                    end_chunk: b,
                };
                let r = self.native_call(&conn, req);
                self.log(format!(
                    "FREE_LOOKUP_LOCKS {session} [{a}..{b}) -> {}",
                    short(&r)
                ));
                r
            }
            2 => {
                let req = Request::EndSession {
                    request_id: session.clone(),
                };
                let r = self.native_call(&conn, req);
                self.log(format!("END_SESSION {session} -> {}", short(&r)));
                if r == Response::Ok {
                    self.session_creators.remove(&session);
                }
                r
            }
            _ => {
                let registered = conn.registered.lock().ids();
                self.ctx.connection_closed(conn.id(), &registered, true);
                let left = self.ctx.sessions.remove_of_connection(conn.id());
                if !left.is_empty() {
                    return Err(format!(
                        "{} lookup sessions outlived their connection {}",
                        left.len(),
                        conn.id()
                    ));
                }
                self.session_creators.retain(|_, c| *c != conn.id());
                self.schedulers[which] = self.new_conn();
                self.log(format!("scheduler conn {} reconnects", conn.id()));
                return Ok(());
            }
        };
        let denied = matches!(&r, Response::Error { kind, .. } if *kind == ErrorKind::PermissionDenied.code());
        if denied != expect_denied {
            return Err(format!(
                "session {session} over conn {}: refused {denied}, expected {expect_denied} \
                 (created over {:?}): {r:?}",
                conn.id(),
                self.session_creators.get(&session)
            ));
        }
        if let Response::Error { kind, .. } = &r {
            if *kind == ErrorKind::PermissionDenied.code() {
                // Another connection's session: refused, and nothing changed.
                self.stats.intrusions += 1;
                if self.ctx.sessions.held_locks() != before {
                    return Err(format!(
                        "a refused request for session {session} changed session locks"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A one-line summary of a response for the trace.
pub(super) fn short(r: &Response) -> String {
    match r {
        Response::StorePrepared {
            transfer_id, slots, ..
        } => format!(
            "prepared {transfer_id} slots {:?}",
            slots.iter().map(|s| s.offset).collect::<Vec<_>>()
        ),
        Response::RetrievePrepared {
            hit,
            transfer_id,
            slots,
            ..
        } => format!(
            "hit {hit} transfer {transfer_id} slots {:?}",
            slots.iter().map(|s| s.offset).collect::<Vec<_>>()
        ),
        Response::Registered(_) => "registered".into(),
        other => format!("{other:?}"),
    }
}
