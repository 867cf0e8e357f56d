//! LMCache clients of the simulator: engine workers speaking LMCache's requests through the real
//! frontend (`LmFrontend`, without ZMQ): register, ping, prepare and commit stores and retrieves
//! (repeated prepares of one key included), lookups with prefetch queries, lock frees, session
//! ends, unregister, silent death. A worker pairs each COMMIT with its oldest PREPARE of the same
//! key, as LMCache workers do.

use std::collections::{BTreeMap, VecDeque};

use super::model::{Grant, Transfer};
use super::native::short;
use super::world::{self, CHUNK_TOKENS, DTYPE, HIDDEN, NUM_LAYERS, PROMPT_CHUNKS};
use super::{Check, Registration, Sim};
use crate::lmcache::frontend::{ClientId, LmReply};
use crate::lmcache::wire::{IpcKey, LmRequest, RegisterPayload};

/// The model the LMCache workers serve.
const LM_MODEL: &str = world::MODELS[0];

/// (prompt, first chunk, end chunk, salt): what LMCache compares to pair a COMMIT with its
/// PREPARE, the prompt made canonical (prompts sharing the first chunks give the same key).
type LmKey = (usize, usize, usize, &'static str);

/// An LMCache engine worker.
pub struct LmActor {
    /// Its instance id.
    pub id: u64,
    /// Registration, while the model believes the instance is registered.
    pub(crate) reg: Option<Registration>,
    /// Prepared stores per key, oldest first (model transfer ids; gone ones stay queued, since
    /// the frontend still pairs the next COMMIT with them).
    stores: BTreeMap<LmKey, VecDeque<u64>>,
    /// Prepared retrieves per key, oldest first.
    retrieves: BTreeMap<LmKey, VecDeque<u64>>,
    pub(crate) dead: bool,
    /// Node transfer ids a previous process of this worker left behind when it crashed and the
    /// new one registered the same id: nobody commits them; the node's TTL releases them.
    pub orphans: std::collections::BTreeSet<u64>,
    /// The connection of its current process (a new process connects anew).
    pub client: ClientId,
    pub(super) incarnation: u32,
}

impl LmActor {
    /// A worker for instance `id`.
    pub fn new(id: u64) -> LmActor {
        LmActor {
            id,
            reg: None,
            stores: BTreeMap::new(),
            retrieves: BTreeMap::new(),
            dead: false,
            orphans: std::collections::BTreeSet::new(),
            client: Self::connection(id, 0),
            incarnation: 0,
        }
    }

    fn connection(id: u64, incarnation: u32) -> ClientId {
        ClientId::new(
            format!("lm-worker-{id}-{incarnation}").as_bytes(),
            Some(kvnode_hw::effective_uid()),
        )
    }

    /// A new process of this worker (or the same one after a network cut): a new connection.
    pub(super) fn reconnect(&mut self) {
        self.incarnation += 1;
        self.client = Self::connection(self.id, self.incarnation);
    }

    /// Forgets the transfers of a released registration.
    pub fn forget(&mut self) {
        self.stores.clear();
        self.retrieves.clear();
    }

    /// A new process replaces this (dead) one.
    pub fn revive(&mut self) {
        self.dead = false;
        self.forget();
        self.orphans.clear();
        self.reconnect();
    }

    /// Prepared transfers this worker still expects to commit.
    pub fn queued(&self) -> usize {
        self.stores
            .values()
            .chain(self.retrieves.values())
            .map(VecDeque::len)
            .sum()
    }
}

const LM_SALTS: [&str; 4] = ["", "", "", "t1"];

impl Sim {
    /// The connection of the engine's scheduler: LOOKUPs, prefetch queries, lock frees and
    /// session ends come from it (as in vLLM), while the workers' retrieves take its sessions'
    /// locks over. A closed one is replaced by a new connection (a new routing id).
    pub(super) fn scheduler(&self) -> ClientId {
        ClientId::new(
            format!("lm-scheduler-{}", self.lm_scheduler).as_bytes(),
            Some(kvnode_hw::effective_uid()),
        )
    }

    /// One request of `client` (a worker's connection, or [`scheduler`]'s).
    pub(super) fn lm_call(&mut self, client: &ClientId, req: LmRequest) -> LmReply {
        self.stats.requests += 1;
        self.frontend.handle_typed(client, req)
    }

    pub(super) fn ipc_key(
        &self,
        p: usize,
        a: usize,
        b: usize,
        salt: &str,
        worker: Option<u32>,
    ) -> IpcKey {
        IpcKey {
            model_name: LM_MODEL.into(),
            world_size: 1,
            worker_id: worker,
            token_ids: self.prompts.tokens(p).to_vec(),
            start: (a as u64) * u64::from(CHUNK_TOKENS),
            end: (b as u64) * u64::from(CHUNK_TOKENS),
            request_id: format!("lm-p{p}-{salt}"),
            cache_salt: salt.into(),
            num_kv_readers: 1,
        }
    }

    pub(super) fn lm_span(&mut self) -> LmKey {
        let p = self.rng.index(self.prompts.len());
        let a = if self.rng.chance(70) {
            0
        } else {
            self.rng.index(PROMPT_CHUNKS)
        };
        let b = self.rng.range(a as u64 + 1, PROMPT_CHUNKS as u64) as usize;
        let salt = LM_SALTS[self.rng.index(LM_SALTS.len())];
        (self.prompts.canonical(p, b), a, b, salt)
    }

    /// A key this worker has prepared (so commits mostly pair with something), else a new one.
    fn lm_known_span(&mut self, i: usize, stores: bool) -> LmKey {
        let map = if stores {
            &self.lms[i].stores
        } else {
            &self.lms[i].retrieves
        };
        let keys: Vec<LmKey> = map.keys().copied().collect();
        if keys.is_empty() || self.rng.chance(10) {
            self.lm_span()
        } else {
            keys[self.rng.index(keys.len())]
        }
    }

    /// One random action of LMCache worker `i`.
    pub(super) fn lm_step(&mut self, i: usize) -> Check {
        if self.lms[i].dead {
            return Ok(());
        }
        if self.lms[i].reg.is_none() {
            return self.lm_register(i);
        }
        let weights = [
            2,  // 0 crash and restart under the same id (before any reaping)
            8,  // 1 ping
            22, // 2 prepare store
            20, // 3 commit store
            18, // 4 prepare retrieve
            16, // 5 commit retrieve
            10, // 6 lookup + prefetch query
            4,  // 7 free lookup locks
            4,  // 8 end session
            2,  // 9 unregister
            1,  // 10 fall silent
            2,  // 11 its connection closes (a crash, a network cut): see lm_disconnect
            1,  // 12 the scheduler's connection closes
        ];
        match self.rng.weighted(&weights) {
            0 => self.lm_restart(i),
            1 => {
                let id = self.lms[i].id;
                self.touched(id, true);
                let c = self.lms[i].client.clone();
                let r = self.lm_call(
                    &c,
                    LmRequest::Ping {
                        instance_id: Some(id),
                    },
                );
                self.log(format!("lm {id} PING -> {r:?}"));
                Ok(())
            }
            2 => self.lm_prepare_store(i),
            3 => self.lm_commit_store(i),
            4 => self.lm_prepare_retrieve(i),
            5 => self.lm_commit_retrieve(i),
            6 => self.lm_lookup(),
            7 => {
                let (p, a, b, salt) = self.lm_span();
                let key = self.ipc_key(p, a, b, salt, None);
                let sched = self.scheduler();
                let r = self.no_intern("FREE_LOOKUP_LOCKS", |s| {
                    s.lm_call(&sched, LmRequest::FreeLookupLocks { key, tp_size: 1 })
                })?;
                self.log(format!(
                    "lm FREE_LOOKUP_LOCKS p{p}[{a}..{b}) {salt:?} -> {r:?}"
                ));
                Ok(())
            }
            8 => {
                let (p, _, _, salt) = self.lm_span();
                let request_id = format!("lm-p{p}-{salt}");
                let sched = self.scheduler();
                let r = self.lm_call(
                    &sched,
                    LmRequest::EndSession {
                        request_id: request_id.clone(),
                    },
                );
                self.log(format!("lm END_SESSION {request_id} -> {r:?}"));
                Ok(())
            }
            9 => {
                let id = self.lms[i].id;
                let c = self.lms[i].client.clone();
                let r = self.lm_call(&c, LmRequest::UnregisterEngineDriven { instance_id: id });
                self.log(format!("lm {id} UNREGISTER -> {r:?}"));
                let live = self.lms[i]
                    .reg
                    .as_ref()
                    .is_some_and(|r| self.is_live(&r.inst));
                if live {
                    return Err(format!("LMCache UNREGISTER left instance {id} registered"));
                }
                self.forget_instance(id, false)
            }
            10 => {
                self.lms[i].dead = true;
                let id = self.lms[i].id;
                self.log(format!("lm {id} falls silent"));
                Ok(())
            }
            11 => self.lm_connection_closes(i),
            _ => self.lm_scheduler_closes(),
        }
    }

    /// The worker's process dies and a new one registers the same id at once: the node keeps
    /// the registration (REGISTER is idempotent), the old process's transfers are orphans the
    /// new one never commits, and no COMMIT of the new one may be paired with them.
    fn lm_restart(&mut self, i: usize) -> Check {
        let id = self.lms[i].id;
        if let Some(inst) = self.ctx.instances.get(id) {
            let p = inst.pending.lock();
            let left: Vec<u64> = p.writes.keys().chain(p.reads.keys()).copied().collect();
            drop(p);
            self.lms[i].orphans.extend(left);
        }
        self.model.release_instance(id);
        self.lms[i].forget();
        self.lms[i].reconnect();
        self.stats.lm_restarts += 1;
        self.log(format!("lm {id} crashes and restarts under the same id"));
        self.lm_register(i)
    }

    fn lm_register(&mut self, i: usize) -> Check {
        let id = self.lms[i].id;
        self.named(LM_MODEL, "");
        let c = self.lms[i].client.clone();
        let r = self.lm_call(
            &c,
            LmRequest::RegisterEngineDriven(RegisterPayload {
                instance_id: id,
                model_name: LM_MODEL.into(),
                world_size: 1,
                block_size: 16,
                num_layers: NUM_LAYERS,
                hidden_dim_size: HIDDEN,
                dtype_str: DTYPE.into(),
                use_mla: false,
                num_physical_slots: None,
            }),
        );
        self.log(format!("lm {id} REGISTER -> {r:?}"));
        match r {
            LmReply::Register { pool_bytes, .. } if pool_bytes > 0 => {}
            other => return Err(format!("LMCache registration of {id} refused: {other:?}")),
        }
        let inst = self
            .ctx
            .instances
            .get(id)
            .ok_or_else(|| format!("LMCache instance {id} registered but not in the table"))?;
        let now = self.now();
        let a = &mut self.lms[i];
        match &mut a.reg {
            Some(reg) if std::sync::Arc::ptr_eq(&reg.inst, &inst) => reg.last_seen_ms = now,
            _ => {
                a.reg = Some(Registration {
                    inst,
                    last_seen_ms: now,
                    pinged: false,
                    hidden: HIDDEN,
                    conns: Vec::new(),
                    closed_ms: None,
                })
            }
        }
        Ok(())
    }

    fn lm_prepare_store(&mut self, i: usize) -> Check {
        let id = self.lms[i].id;
        let span = if self.rng.chance(30) {
            self.lm_known_span(i, true) // a repeated prepare of a key still in flight
        } else {
            self.lm_span()
        };
        let (p, a, b, salt) = span;
        let key = self.ipc_key(p, a, b, salt, Some(0));
        self.named(LM_MODEL, salt);
        self.touched(id, false);
        let c = self.lms[i].client.clone();
        let r = self.lm_call(
            &c,
            LmRequest::PrepareStore {
                key,
                instance_id: id,
            },
        );
        self.log(format!(
            "lm {id} PREPARE_STORE p{p}[{a}..{b}) {salt:?} -> {r:?}"
        ));
        let LmReply::PrepareStore(Some((slots, indices))) = r else {
            return Err(format!("LMCache PREPARE_STORE answered {r:?}"));
        };
        if slots.len() != indices.len() {
            return Err(format!(
                "LMCache PREPARE_STORE: {} slots for {} chunk indices",
                slots.len(),
                indices.len()
            ));
        }
        if slots.is_empty() {
            return Ok(());
        }
        let hashes = self.prompts.hashes(p)[a..b].to_vec();
        let mut grants = Vec::new();
        for (s, ci) in slots.iter().zip(&indices) {
            let key = self.key_of(LM_MODEL, salt, &hashes[*ci as usize]);
            let version = self.model.next_version();
            grants.push(Grant {
                key,
                offset: s.offset,
                len: s.length,
                version,
            });
        }
        let t = Transfer {
            instance: id,
            write: true,
            grants,
            created_ms: self.now(),
            clear_epoch: self.model.clear_epoch,
            label: format!("lm {id} store p{p}[{a}..{b})"),
        };
        let mid = self.model.hand_out(t)?;
        for g in &self.model.get(mid).expect("just added").grants {
            world::write_stamp(&self.ctx, g.offset, g.len, &g.key, g.version);
        }
        self.lms[i].stores.entry(span).or_default().push_back(mid);
        Ok(())
    }

    fn lm_commit_store(&mut self, i: usize) -> Check {
        let id = self.lms[i].id;
        let span = self.lm_known_span(i, true);
        let (p, a, b, salt) = span;
        let mid = self.lms[i]
            .stores
            .get_mut(&span)
            .and_then(|q| q.pop_front());
        if self.lms[i].stores.get(&span).is_some_and(|q| q.is_empty()) {
            self.lms[i].stores.remove(&span);
        }
        if let Some(t) = mid.and_then(|m| self.model.get(m)) {
            for g in &t.grants {
                world::write_stamp(&self.ctx, g.offset, g.len, &g.key, g.version);
            }
        }
        if mid.is_some() {
            self.touched(id, false);
        }
        let key = self.ipc_key(p, a, b, salt, Some(0));
        let c = self.lms[i].client.clone();
        let r = self.lm_call(
            &c,
            LmRequest::CommitStore {
                key,
                instance_id: id,
                cpu_data: Vec::new(),
            },
        );
        self.log(format!(
            "lm {id} COMMIT_STORE p{p}[{a}..{b}) {salt:?} -> {r:?}"
        ));
        let t = match mid.and_then(|m| self.model.take(m)) {
            Some((t, true)) => t,
            Some((t, false)) => {
                // Its TTL passed: a commit the node still accepted counts.
                if r == LmReply::Bool(true) {
                    self.model.committed(&t);
                }
                return Ok(());
            }
            None => return Ok(()),
        };
        if r != LmReply::Bool(true) {
            return Err(format!(
                "LMCache COMMIT_STORE of a store instance {id} holds answered {r:?}"
            ));
        }
        self.model.committed(&t);
        self.stats.stores_committed += 1;
        Ok(())
    }

    fn lm_prepare_retrieve(&mut self, i: usize) -> Check {
        let id = self.lms[i].id;
        let recent: Vec<_> = self
            .lookups
            .iter()
            .filter(|l| l.1 == LM_MODEL && l.4 > 0 && l.0.starts_with("lm-"))
            .cloned()
            .collect();
        let span = if self.rng.chance(30) {
            self.lm_known_span(i, false)
        } else if !recent.is_empty() && self.rng.chance(60) {
            let (_, _, salt, p, hits) = recent[self.rng.index(recent.len())].clone();
            let a = if self.rng.chance(70) {
                0
            } else {
                self.rng.index(hits as usize)
            };
            let b = self.rng.range(a as u64 + 1, u64::from(hits)) as usize;
            (self.prompts.canonical(p, b), a, b, salt)
        } else {
            self.lm_span()
        };
        let (p, a, b, salt) = span;
        let key = self.ipc_key(p, a, b, salt, Some(0));
        self.named(LM_MODEL, salt);
        self.touched(id, false);
        let c = self.lms[i].client.clone();
        let r = self.no_intern("LMCache PREPARE_RETRIEVE", |s| {
            s.lm_call(
                &c,
                LmRequest::PrepareRetrieve {
                    key,
                    instance_id: id,
                },
            )
        })?;
        self.log(format!(
            "lm {id} PREPARE_RETRIEVE p{p}[{a}..{b}) {salt:?} -> {}",
            match &r {
                LmReply::PrepareRetrieve(Some(s)) =>
                    format!("hit {:?}", s.iter().map(|d| d.offset).collect::<Vec<_>>()),
                other => format!("{other:?}"),
            }
        ));
        let LmReply::PrepareRetrieve(Some(slots)) = r else {
            return Ok(());
        };
        if slots.len() != b - a {
            return Err(format!(
                "an LMCache retrieve hit of {} chunks came with {} slots",
                b - a,
                slots.len()
            ));
        }
        let hashes = self.prompts.hashes(p)[a..b].to_vec();
        let mut grants = Vec::new();
        for (s, h) in slots.iter().zip(&hashes) {
            let key = self.key_of(LM_MODEL, salt, h);
            let version = world::read_stamp(&self.ctx, s.offset, s.length, &key)
                .filter(|v| self.model.is_committed(&key, *v, s.offset))
                .ok_or_else(|| {
                    format!(
                        "LMCache retrieve of instance {id} was handed slot {} that holds no \
                         committed version of its key",
                        s.offset
                    )
                })?;
            grants.push(Grant {
                key,
                offset: s.offset,
                len: s.length,
                version,
            });
        }
        let t = Transfer {
            instance: id,
            write: false,
            grants,
            created_ms: self.now(),
            clear_epoch: self.model.clear_epoch,
            label: format!("lm {id} retrieve p{p}[{a}..{b})"),
        };
        let mid = self.model.hand_out(t)?;
        self.stats.retrieves_hit += 1;
        self.lms[i]
            .retrieves
            .entry(span)
            .or_default()
            .push_back(mid);
        Ok(())
    }

    fn lm_commit_retrieve(&mut self, i: usize) -> Check {
        let id = self.lms[i].id;
        let span = self.lm_known_span(i, false);
        let (p, a, b, salt) = span;
        let mid = self.lms[i]
            .retrieves
            .get_mut(&span)
            .and_then(|q| q.pop_front());
        if self.lms[i]
            .retrieves
            .get(&span)
            .is_some_and(|q| q.is_empty())
        {
            self.lms[i].retrieves.remove(&span);
        }
        if mid.is_some() {
            self.touched(id, false);
        }
        let key = self.ipc_key(p, a, b, salt, Some(0));
        let c = self.lms[i].client.clone();
        let r = self.lm_call(
            &c,
            LmRequest::CommitRetrieve {
                key,
                instance_id: id,
            },
        );
        self.log(format!(
            "lm {id} COMMIT_RETRIEVE p{p}[{a}..{b}) {salt:?} -> {r:?}"
        ));
        if let Some(m) = mid {
            self.model.finish(m);
        }
        Ok(())
    }

    fn lm_lookup(&mut self) -> Check {
        let (p, _, _, salt) = self.lm_span();
        let mut key = self.ipc_key(p, 0, PROMPT_CHUNKS, salt, None);
        // 0.5.6 clients declare their readers (MLA ranks sharing a worker id: several); 0.5.4
        // clients send none (0: the tp rule).
        key.num_kv_readers = match self.rng.index(4) {
            0 => 0,
            _ => self.rng.range(1, 4) as u32,
        };
        let readers = key.num_kv_readers;
        let request_id = key.request_id.clone();
        self.named(LM_MODEL, salt);
        self.stats.lookups += 1;
        let tp_size = if self.rng.chance(25) { 2 } else { 1 };
        let sched = self.scheduler();
        let r = self.no_intern("LMCache LOOKUP", |s| {
            s.lm_call(&sched, LmRequest::Lookup { key, tp_size })
        })?;
        let hits = self.lm_call(
            &sched,
            LmRequest::QueryPrefetchStatus {
                request_id: request_id.clone(),
            },
        );
        if let LmReply::Uint(n) = hits {
            self.remember_lookup(request_id.clone(), LM_MODEL, salt, p, n as u32);
        }
        self.log(format!(
            "lm LOOKUP {request_id} tp {tp_size} readers {readers} -> {r:?}, prefetch status {hits:?}"
        ));
        let _ = short;
        Ok(())
    }
}
