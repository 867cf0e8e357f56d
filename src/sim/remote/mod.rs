//! Remote engine workers of the simulator: the data path of issue 13 (WRITE_SLOTS, READ_SLOTS,
//! REGISTER_BUFFERS, UNREGISTER_BUFFERS) over a [`FakeFabric`] on the simulator's virtual clock.
//!
//! A remote worker holds a connection whose caller is [`Caller::remote`] (what the TCP
//! handshake establishes), registers its buffers in the connection's [`RegionTable`], prepares
//! stores and retrieves through the ordinary dispatch, and starts data ops the way the node's
//! remote connection does: [`ops::take_write`] / [`ops::take_read`] take the transfer out of its
//! instance's table, [`RegionTable::work_items`] turns its descriptors into work items, and the
//! batch is posted to the fake fabric over the node's pool. Unlike the node's blocking mover,
//! the simulator does not wait: the op stays in flight while every other actor keeps acting
//! (CLEAR, the reaper and TTL sweeps, UNREGISTER, disconnects of the op's own connection,
//! re-registration, other workers), and is settled when the step loop polls its completion
//! ([`flight`]). Each data op runs over its own fabric connection whose peer memory holds the
//! worker's bytes (the fake's peer memory is fixed at connect); closing a worker's connection
//! tears all of them down, so every op of the connection completes `Flushed`, as on a real one.
//!
//! The checks ([`check`]) hold the slot-safety argument of [`ops`] to account after every step:
//! nothing the fabric may still touch is free or reused, nothing a failed or orphaned op moved
//! is ever published, and the model's view of reservations and locks matches storage's.

mod check;
mod control;
mod data;
mod flight;
#[cfg(test)]
mod repro;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;

use kvnode_hw::fabric::{ConnId, FakeFabric, FakeOptions};

use super::native::{short, Conn};
use super::world::{DTYPE, HIDDEN, HIDDEN_ALT, NUM_LAYERS};
use super::{Check, Registration, Sim};
use crate::modules::instances::Instance;
use crate::modules::Caller;
use crate::protocol::{RegisterRequest, RemoteRegion, Request, Response};
use crate::remote::descriptors::RegionTable;
use crate::remote::ops::{ReadTake, WriteTake};
use crate::storage::StorageKey;

/// Instance id of the first remote worker.
pub const FIRST_REMOTE_ID: u64 = 3001;
/// Virtual time an op may stay in flight before the simulated node tears its connection down
/// (the node's `remote.transfer_timeout_ms`; the mover then waits for the fabric's `Flushed`).
pub const TRANSFER_TIMEOUT_MS: u64 = 5_000;
/// Bytes of one registered engine buffer (room for a whole prompt of the larger layout).
pub const REGION_BYTES: u64 = 256 << 10;
/// Regions one remote connection may register (its `remote.max_registered_regions`).
pub const MAX_REGIONS: usize = 4;
/// Engine address of region 0; region `n` starts `n * REGION_STRIDE` above it.
const REGION_BASE: u64 = 0x7f00_0000_0000;
const REGION_STRIDE: u64 = 1 << 24;

/// A remote worker's open connection.
pub struct RConn {
    /// The control connection (a remote caller).
    pub conn: Conn,
    /// The node's table of the connection's registered buffers.
    pub regions: RegionTable,
    /// The same regions as the worker knows them.
    pub known: Vec<RemoteRegion>,
    /// Fabric connections of its data ops not yet torn down.
    pub fconns: Vec<ConnId>,
}

impl RConn {
    fn caller(&self) -> Caller {
        Caller::remote(self.conn.id(), crate::access::Role::Client)
    }
}

/// A remote engine worker.
pub struct RemoteActor {
    /// Its instance id.
    pub id: u64,
    model: &'static str,
    /// Its connection, while open.
    pub conn: Option<RConn>,
    /// Registration, while the model believes the instance is registered.
    pub(crate) reg: Option<Registration>,
    /// (node transfer id, model transfer id, bytes moved) of prepared stores not in flight.
    pub writes: Vec<(u64, u64, bool)>,
    /// (node transfer id, model transfer id) of prepared retrieves not in flight.
    pub reads: Vec<(u64, u64)>,
    /// Silent forever (a hung process with ops in flight): only the reaper releases it.
    pub dead: bool,
    next_region: u32,
}

impl RemoteActor {
    fn new(id: u64, model: &'static str) -> RemoteActor {
        RemoteActor {
            id,
            model,
            conn: None,
            reg: None,
            writes: Vec::new(),
            reads: Vec::new(),
            dead: false,
            next_region: 0,
        }
    }

    /// Node transfer ids this worker holds and that are not in flight.
    pub fn held(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.writes
            .iter()
            .map(|w| (w.0, w.1))
            .chain(self.reads.iter().copied())
    }
}

/// One slot of a data op in flight.
#[derive(Debug, Clone)]
pub struct HeldSlot {
    /// The object.
    pub key: StorageKey,
    /// The lease of its reservation (store) or read lock (retrieve).
    pub lease: u64,
    /// Pool offset.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// Version the worker wrote (store) or must read (retrieve).
    pub version: u64,
    /// Peer region key and offset in that region of the engine's buffer.
    pub peer: (u32, usize),
}

/// The transfer a data op took out of its instance's table.
pub enum Taken {
    /// A store's bytes move into the slots.
    Write(WriteTake),
    /// A retrieve's bytes move out of the slots.
    Read(ReadTake),
    /// Settled (only while its completion is being handled, never in the table of ops).
    Settled,
}

/// A data op posted to the fabric whose completion was not polled yet.
pub struct RemoteOp {
    /// Index of the worker.
    pub actor: usize,
    /// The control connection it was sent over.
    pub conn: u64,
    /// Its fabric connection.
    pub fconn: ConnId,
    /// Node and model transfer ids.
    pub tid: u64,
    /// Model transfer id.
    pub mid: u64,
    /// Whether the request asked for the commit.
    pub commit: bool,
    /// When it was posted.
    pub posted_ms: u64,
    /// Whether the simulated node gave up on it (torn down at its deadline).
    pub timed_out: bool,
    /// The instance it was taken from.
    pub inst: Arc<Instance>,
    /// Its slots.
    pub slots: Vec<HeldSlot>,
    /// The taken transfer.
    pub taken: Taken,
    /// The engine's regions (by key) as they were when the op's fabric connection was torn
    /// down before its completion was polled.
    pub delivered: Vec<(u32, Vec<u8>)>,
}

/// The remote side of the simulated world.
pub struct RemoteWorld {
    /// The workers.
    pub actors: Vec<RemoteActor>,
    /// The fabric over the node's pool.
    pub fabric: Arc<FakeFabric>,
    /// Ops in flight by op id.
    pub ops: BTreeMap<u64, RemoteOp>,
    next_op: u64,
    /// Fabric connections of closed control connections whose teardown comes later (a node
    /// that noticed the death late: ops may still complete, successfully, after the release).
    pub lingering: Vec<(ConnId, u64)>,
    /// The fault mix of this seed (for the trace).
    pub faults: String,
    /// Every instance a remote worker registered (all must be released and refunded at the end).
    pub instances: Vec<Arc<Instance>>,
}

impl RemoteWorld {
    /// `n` workers and a fake fabric over `ctx`'s pool with a fault mix drawn from `seed`.
    pub fn new(n: usize, seed: u64, ctx: &crate::modules::NodeContext) -> RemoteWorld {
        let mut r = super::rng::Rng::new(seed ^ 0xFAB_5EED);
        let pick = |r: &mut super::rng::Rng, v: &[u64]| v[r.index(v.len())];
        let opts = FakeOptions {
            seed: r.next_u64(),
            delay_ms: (0, pick(&mut r, &[5, 50, 400, 3_000])),
            drop_pct: pick(&mut r, &[0, 2, 6]) as u8,
            reorder: r.chance(75),
            error_pct: pick(&mut r, &[0, 3, 10]) as u8,
            peer_death_pct: pick(&mut r, &[0, 2, 6]) as u8,
            partial_garbage: true,
            ..FakeOptions::default()
        };
        let faults = format!(
            "delay {:?} ms, drop {}%, error {}%, peer death {}%, reorder {}",
            opts.delay_ms, opts.drop_pct, opts.error_pct, opts.peer_death_pct, opts.reorder
        );
        let fabric = FakeFabric::new(opts, ctx.pool.clone()).expect("valid fake options");
        kvnode_hw::fabric::Fabric::register(&fabric, &ctx.pool).expect("the fake registers");
        RemoteWorld {
            actors: (0..n)
                .map(|i| RemoteActor::new(FIRST_REMOTE_ID + i as u64, super::world::MODELS[i % 2]))
                .collect(),
            fabric: Arc::new(fabric),
            ops: BTreeMap::new(),
            next_op: 1,
            lingering: Vec::new(),
            faults,
            instances: Vec::new(),
        }
    }

    /// Tears fabric connection `f` down. The engine's memory goes with it: what retrieves of it
    /// may already have delivered is kept with them for verification (the fake keeps a peer's
    /// memory only until its teardown).
    pub fn teardown(&mut self, f: ConnId) {
        for o in self.ops.values_mut().filter(|o| o.fconn == f) {
            if matches!(o.taken, Taken::Read(_)) {
                for s in &o.slots {
                    if !o.delivered.iter().any(|(k, _)| *k == s.peer.0) {
                        if let Some(bytes) = self.fabric.peer_region(f, s.peer.0) {
                            o.delivered.push((s.peer.0, bytes));
                        }
                    }
                }
            }
        }
        kvnode_hw::fabric::Fabric::teardown(&*self.fabric, f);
    }

    /// Whether worker `i` has a data op in flight on transfer `tid`.
    pub fn in_flight(&self, i: usize, tid: u64) -> bool {
        self.ops.values().any(|o| o.actor == i && o.tid == tid)
    }
}

impl Sim {
    /// One random action of remote worker `i`.
    pub(super) fn remote_step(&mut self, i: usize) -> Check {
        if self.remote.actors[i].dead {
            if self.remote.actors[i].conn.is_some() {
                return Ok(());
            }
            // The node closed the hung engine's connection: a new process replaces it.
            self.remote.actors[i].dead = false;
            self.stats.revived += 1;
        }
        if self.remote.actors[i].conn.is_none() {
            self.remote_connect(i);
            return Ok(());
        }
        if self.remote.actors[i].reg.is_none() {
            return self.remote_register(i, HIDDEN);
        }
        let weights = [
            2,  // 0 register again (same layout)
            1,  // 1 re-register with another layout (the old instance is released)
            6,  // 2 ping
            20, // 3 prepare store
            24, // 4 WRITE_SLOTS
            6,  // 5 commit a store whose bytes moved
            3,  // 6 abort a store
            18, // 7 prepare retrieve
            22, // 8 READ_SLOTS
            5,  // 9 commit retrieve
            4,  // 10 register or unregister buffers
            2,  // 11 unregister
            2,  // 12 disconnect
            1,  // 13 fall silent (ops in flight stay there)
            3,  // 14 requests the node must refuse
        ];
        match self.rng.weighted(&weights) {
            0 => {
                let hidden = self.remote.actors[i]
                    .reg
                    .as_ref()
                    .map_or(HIDDEN, |r| r.hidden);
                self.remote_register(i, hidden)
            }
            1 => {
                let hidden = match self.remote.actors[i].reg.as_ref().map(|r| r.hidden) {
                    Some(HIDDEN) => HIDDEN_ALT,
                    _ => HIDDEN,
                };
                self.remote_register(i, hidden)
            }
            2 => {
                let id = self.remote.actors[i].id;
                let conn = self.remote_conn(i);
                self.touched(id, true);
                let r = self.native_call(
                    &conn,
                    Request::Ping {
                        instance_id: Some(id),
                    },
                );
                self.log(format!("remote {id} PING -> {r:?}"));
                Ok(())
            }
            3 => self.remote_prepare_store(i),
            4 => self.remote_write_slots(i),
            5 => self.remote_commit_store(i),
            6 => self.remote_abort_store(i),
            7 => self.remote_prepare_retrieve(i),
            8 => self.remote_read_slots(i),
            9 => self.remote_commit_retrieve(i),
            10 => self.remote_buffers(i),
            11 => self.remote_unregister(i),
            12 => self.remote_close(i, "the engine closes its connection"),
            13 => {
                self.remote.actors[i].dead = true;
                let id = self.remote.actors[i].id;
                self.log(format!(
                    "remote {id} falls silent (connection and ops left open)"
                ));
                Ok(())
            }
            _ => self.remote_refused(i),
        }
    }

    /// The control connection of worker `i` (open).
    pub(super) fn remote_conn(&self, i: usize) -> Conn {
        self.remote.actors[i]
            .conn
            .as_ref()
            .expect("connected")
            .conn
            .clone()
    }

    /// A new connection (handshake done: a remote caller) with one or two buffers registered.
    fn remote_connect(&mut self, i: usize) {
        self.next_conn += 1;
        let conn = Conn::remote(self.next_conn);
        let id = self.remote.actors[i].id;
        self.log(format!("remote {id} connects as conn {}", conn.id()));
        self.remote.actors[i].conn = Some(RConn {
            conn,
            regions: RegionTable::new(MAX_REGIONS),
            known: Vec::new(),
            fconns: Vec::new(),
        });
        let n = self.rng.range(1, 2);
        for _ in 0..n {
            self.remote_add_region(i);
        }
    }

    /// REGISTER_BUFFERS of one new region (expected to succeed below the limit).
    fn remote_add_region(&mut self, i: usize) {
        let a = &mut self.remote.actors[i];
        a.next_region += 1;
        let n = a.next_region;
        let region = RemoteRegion {
            id: n,
            addr: REGION_BASE + u64::from(n) * REGION_STRIDE,
            len: REGION_BYTES,
            rkey: 0x1000 + n,
        };
        let id = a.id;
        let rc = a.conn.as_mut().expect("connected");
        let full = rc.known.len() >= MAX_REGIONS;
        let r = rc.regions.register(&[region]);
        let ok = r.is_ok();
        if ok {
            rc.known.push(region);
        }
        self.log(format!(
            "remote {id} REGISTER_BUFFERS region {n} -> {}",
            if ok { "ok" } else { "refused" }
        ));
        debug_assert_eq!(ok, !full, "region table limit");
    }

    fn remote_register(&mut self, i: usize, hidden: u32) -> Check {
        let (id, model) = (self.remote.actors[i].id, self.remote.actors[i].model);
        let c = self.remote_conn(i);
        self.named(model, "");
        let replaces = self.remote.actors[i]
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
            "remote {id} REGISTER hidden={hidden} on conn {} -> {}",
            c.id(),
            short(&r)
        ));
        if !matches!(r, Response::Registered(_)) {
            return Err(format!(
                "registration of remote instance {id} refused: {r:?}"
            ));
        }
        if replaces {
            self.remote_forget(i)?;
        }
        let inst = self
            .ctx
            .instances
            .get(id)
            .ok_or_else(|| format!("instance {id} registered but not in the table"))?;
        let now = self.now();
        let same = self.remote.actors[i]
            .reg
            .as_ref()
            .is_some_and(|r| Arc::ptr_eq(&r.inst, &inst));
        if same {
            if let Some(reg) = self.remote.actors[i].reg.as_mut() {
                reg.last_seen_ms = now;
            }
        } else {
            self.remote.instances.push(inst.clone());
            self.remote.actors[i].reg = Some(Registration {
                inst,
                last_seen_ms: now,
                pinged: false,
                hidden,
                conns: vec![c.id()],
                closed_ms: None,
            });
        }
        Ok(())
    }

    fn remote_unregister(&mut self, i: usize) -> Check {
        let id = self.remote.actors[i].id;
        let conn = self.remote_conn(i);
        self.touched(id, false);
        let r = self.native_call(&conn, Request::Unregister { instance_id: id });
        self.log(format!("remote {id} UNREGISTER -> {}", short(&r)));
        if !matches!(r, Response::Unregistered { .. }) {
            return Err(format!("UNREGISTER of remote instance {id} failed: {r:?}"));
        }
        self.remote_forget(i)
    }

    /// The model's side of a release of worker `i`'s instance: it is released and lists
    /// nothing (its data ops in flight are out of its table and settle on their own).
    pub(super) fn remote_forget(&mut self, i: usize) -> Check {
        let a = &mut self.remote.actors[i];
        a.writes.clear();
        a.reads.clear();
        let id = a.id;
        let reg = a.reg.take();
        self.model.release_instance(id);
        let Some(reg) = reg else { return Ok(()) };
        if !reg.inst.is_released() {
            return Err(format!(
                "remote instance {id} left the table but is not marked released"
            ));
        }
        let p = reg.inst.pending.lock();
        if !p.writes.is_empty() || !p.reads.is_empty() {
            return Err(format!(
                "released remote instance {id} still lists {} pending stores and {} retrieves",
                p.writes.len(),
                p.reads.len()
            ));
        }
        Ok(())
    }

    /// Closes worker `i`'s connection (the engine closed it, its peer died, or the node gave up
    /// on a transfer): the instance registered over it is released at once; the fabric
    /// connections of its ops are torn down before, after, or (a node that notices late) a
    /// while after the release.
    pub(super) fn remote_close(&mut self, i: usize, why: &str) -> Check {
        let Some(rc) = self.remote.actors[i].conn.take() else {
            return Ok(());
        };
        let id = self.remote.actors[i].id;
        let order = self.rng.weighted(&[40, 30, 30]);
        if order == 0 {
            for f in &rc.fconns {
                self.remote.teardown(*f);
            }
        }
        let registered = rc.conn.registered.lock().ids();
        self.ctx.connection_closed(rc.conn.id(), &registered, true);
        match order {
            1 => {
                for f in &rc.fconns {
                    self.remote.teardown(*f);
                }
            }
            2 => {
                for f in &rc.fconns {
                    let due = self.now() + self.rng.range(0, 3_000);
                    self.remote.lingering.push((*f, due));
                }
            }
            _ => {}
        }
        let in_flight = self
            .remote
            .ops
            .values()
            .filter(|o| o.conn == rc.conn.id())
            .count();
        self.log(format!(
            "remote {id} conn {} closes ({why}; {in_flight} ops in flight, fabric teardown {})",
            rc.conn.id(),
            ["before the release", "after the release", "later"][order]
        ));
        let registered_here = self.remote.actors[i]
            .reg
            .as_ref()
            .is_some_and(|r| r.conns.contains(&rc.conn.id()));
        if registered_here {
            let live = self.is_live(&self.remote.actors[i].reg.as_ref().expect("checked").inst);
            if live {
                return Err(format!(
                    "remote instance {id} survived the close of its only connection"
                ));
            }
            self.stats.disconnected += 1;
            self.remote_forget(i)?;
        }
        Ok(())
    }
}
