//! Remote workers' control requests: PREPARE through the ordinary dispatch (checking every
//! slot against the model), COMMIT and ABORT over the control connection, buffer registration,
//! and requests the node must refuse.

use super::Taken;
use crate::error::ErrorKind;
use crate::protocol::{RemoteRegion, Request, Response};
use crate::remote::ops;
use crate::sim::model::{Grant, Transfer};
use crate::sim::native::short;
use crate::sim::world::{self, PROMPT_CHUNKS};
use crate::sim::{Check, Sim};

impl Sim {
    pub(super) fn remote_prepare_store(&mut self, i: usize) -> Check {
        let (id, model) = (self.remote.actors[i].id, self.remote.actors[i].model);
        let salt = if self.rng.chance(80) { "" } else { "t1" };
        let p = self.rng.index(self.prompts.len());
        let a = if self.rng.chance(70) {
            0
        } else {
            self.rng.index(PROMPT_CHUNKS)
        };
        let b = self.rng.range(a as u64 + 1, PROMPT_CHUNKS as u64) as usize;
        let range = self.remote_range(model, salt, p, a, b);
        self.named(model, salt);
        self.touched(id, false);
        let conn = self.remote_conn(i);
        let r = self.native_call(
            &conn,
            Request::PrepareStore {
                instance_id: id,
                range: range.clone(),
            },
        );
        self.log(format!(
            "remote {id} PREPARE_STORE p{p}[{a}..{b}) salt {salt:?} -> {}",
            short(&r)
        ));
        let Response::StorePrepared {
            transfer_id,
            slots,
            chunk_indices,
            ..
        } = r
        else {
            return Ok(());
        };
        if slots.is_empty() {
            return Ok(());
        }
        let mut grants = Vec::new();
        for (s, ci) in slots.iter().zip(&chunk_indices) {
            let key = self.key_of(model, salt, &range.chunk_hashes[*ci as usize]);
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
            label: format!("remote {id} store {transfer_id}"),
        };
        let mid = self.model.hand_out(t)?;
        self.remote.actors[i].writes.push((transfer_id, mid, false));
        if self.rng.chance(50) {
            // As the remote client's `store` does: the bytes follow the PREPARE at once.
            let k = self.remote.actors[i].writes.len() - 1;
            return self.remote_write_slots_at(i, k);
        }
        Ok(())
    }

    fn remote_range(
        &self,
        model: &str,
        salt: &str,
        p: usize,
        a: usize,
        b: usize,
    ) -> crate::protocol::ChunkRange {
        crate::protocol::ChunkRange {
            model: model.to_owned(),
            world_size: 1,
            worker_id: Some(0),
            cache_salt: salt.to_owned(),
            first_chunk: a as u32,
            chunk_hashes: self.prompts.hashes(p)[a..b].to_vec(),
        }
    }

    pub(super) fn remote_prepare_retrieve(&mut self, i: usize) -> Check {
        let (id, model) = (self.remote.actors[i].id, self.remote.actors[i].model);
        let salt = if self.rng.chance(80) { "" } else { "t1" };
        let p = self.rng.index(self.prompts.len());
        let b = self.rng.range(1, PROMPT_CHUNKS as u64) as usize;
        let range = self.remote_range(model, salt, p, 0, b);
        self.named(model, salt);
        self.touched(id, false);
        let conn = self.remote_conn(i);
        let req = Request::PrepareRetrieve {
            instance_id: id,
            range: range.clone(),
            lookup_session: None,
        };
        let r = self.no_intern("PREPARE_RETRIEVE", |s| s.native_call(&conn, req))?;
        self.log(format!(
            "remote {id} PREPARE_RETRIEVE p{p}[0..{b}) salt {salt:?} -> {}",
            short(&r)
        ));
        let Response::RetrievePrepared {
            hit: true,
            transfer_id,
            slots,
            ..
        } = r
        else {
            return Ok(());
        };
        let mut grants = Vec::new();
        for (s, h) in slots.iter().zip(&range.chunk_hashes) {
            let key = self.key_of(model, salt, h);
            let version = world::read_stamp(&self.ctx, s.offset, s.length, &key)
                .filter(|v| self.model.is_committed(&key, *v, s.offset))
                .ok_or_else(|| {
                    format!(
                        "remote retrieve {transfer_id} of instance {id} was handed slot {} \
                         whose bytes are no committed version of its key",
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
            label: format!("remote {id} retrieve {transfer_id}"),
        };
        let mid = self.model.hand_out(t)?;
        self.remote.actors[i].reads.push((transfer_id, mid));
        if self.rng.chance(50) {
            let k = self.remote.actors[i].reads.len() - 1;
            return self.remote_read_slots_at(i, k);
        }
        Ok(())
    }

    /// COMMIT_STORE over the control connection of a store whose bytes moved.
    pub(super) fn remote_commit_store(&mut self, i: usize) -> Check {
        let ready: Vec<usize> = (0..self.remote.actors[i].writes.len())
            .filter(|k| self.remote.actors[i].writes[*k].2)
            .collect();
        if ready.is_empty() {
            return Ok(());
        }
        let k = ready[self.rng.index(ready.len())];
        let (tid, mid, _) = self.remote.actors[i].writes.remove(k);
        let id = self.remote.actors[i].id;
        let conn = self.remote_conn(i);
        self.touched(id, false);
        let r = self.native_call(
            &conn,
            Request::CommitStore {
                instance_id: id,
                transfer_id: tid,
            },
        );
        self.log(format!("remote {id} COMMIT_STORE {tid} -> {}", short(&r)));
        match self.model.take(mid) {
            Some((t, true)) => match r {
                Response::StoreCommitted { published } => {
                    let expect = if t.clear_epoch == self.model.clear_epoch {
                        t.grants.len() as u32
                    } else {
                        0
                    };
                    if published != expect {
                        return Err(format!(
                            "COMMIT_STORE {tid} of remote {id} published {published}, expected \
                             {expect}"
                        ));
                    }
                    self.model.committed(&t);
                    self.stats.remote_stores_committed += 1;
                    Ok(())
                }
                other => Err(format!(
                    "COMMIT_STORE of held store {tid} (remote {id}) failed: {other:?}"
                )),
            },
            Some((t, false)) => {
                if matches!(r, Response::StoreCommitted { .. }) {
                    self.model.committed(&t);
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    pub(super) fn remote_abort_store(&mut self, i: usize) -> Check {
        if self.remote.actors[i].writes.is_empty() {
            return Ok(());
        }
        let k = self.rng.index(self.remote.actors[i].writes.len());
        let (tid, mid, _) = self.remote.actors[i].writes.remove(k);
        let id = self.remote.actors[i].id;
        let conn = self.remote_conn(i);
        self.touched(id, false);
        let r = self.native_call(
            &conn,
            Request::AbortStore {
                instance_id: id,
                transfer_id: tid,
            },
        );
        self.log(format!("remote {id} ABORT_STORE {tid} -> {}", short(&r)));
        if let Some(t) = self.model.finish(mid) {
            match r {
                Response::StoreAborted { freed } if freed as usize == t.grants.len() => {}
                other => {
                    return Err(format!(
                        "ABORT_STORE of held store {tid} (remote {id}): {other:?}"
                    ))
                }
            }
        }
        Ok(())
    }

    pub(super) fn remote_commit_retrieve(&mut self, i: usize) -> Check {
        if self.remote.actors[i].reads.is_empty() {
            return Ok(());
        }
        let k = self.rng.index(self.remote.actors[i].reads.len());
        let (tid, mid) = self.remote.actors[i].reads.remove(k);
        let id = self.remote.actors[i].id;
        let conn = self.remote_conn(i);
        self.touched(id, false);
        let r = self.native_call(
            &conn,
            Request::CommitRetrieve {
                instance_id: id,
                transfer_id: tid,
            },
        );
        self.log(format!(
            "remote {id} COMMIT_RETRIEVE {tid} -> {}",
            short(&r)
        ));
        if self.model.finish(mid).is_some() && !matches!(r, Response::Ok) {
            return Err(format!(
                "COMMIT_RETRIEVE of held retrieve {tid} (remote {id}) failed: {r:?}"
            ));
        }
        Ok(())
    }

    /// REGISTER_BUFFERS or UNREGISTER_BUFFERS (also of a region an op in flight uses: the node
    /// forgets the descriptor, the engine's memory stays), or a registration the node refuses.
    pub(super) fn remote_buffers(&mut self, i: usize) -> Check {
        let id = self.remote.actors[i].id;
        match self.rng.index(3) {
            0 => {
                self.remote_add_region(i);
                Ok(())
            }
            1 => {
                let rc = self.remote.actors[i].conn.as_mut().expect("connected");
                if rc.known.is_empty() {
                    return Ok(());
                }
                let k = self.rng.index(rc.known.len());
                let region = rc.known.remove(k);
                let r = rc.regions.unregister(&[region.id]);
                let left = rc.regions.len();
                self.log(format!(
                    "remote {id} UNREGISTER_BUFFERS region {} -> {r:?} ({left} left)",
                    region.id
                ));
                if r.is_err() {
                    return Err(format!("UNREGISTER_BUFFERS of a registered region: {r:?}"));
                }
                Ok(())
            }
            _ => {
                let rc = self.remote.actors[i].conn.as_mut().expect("connected");
                let before = rc.regions.len();
                let bad = match (rc.known.first(), self.rng.index(3)) {
                    (Some(r), 0) => vec![*r],
                    (_, 1) => vec![RemoteRegion {
                        id: 77_000,
                        addr: 0x1000,
                        len: 0,
                        rkey: 1,
                    }],
                    _ => vec![RemoteRegion {
                        id: 77_001,
                        addr: u64::MAX - 10,
                        len: 4096,
                        rkey: 1,
                    }],
                };
                let r = rc.regions.register(&bad);
                let after = rc.regions.len();
                self.log(format!("remote {id} REGISTER_BUFFERS (invalid) -> {r:?}"));
                if r.is_ok() || after != before {
                    return Err(format!(
                        "an invalid REGISTER_BUFFERS {bad:?} was accepted ({before} -> {after})"
                    ));
                }
                Ok(())
            }
        }
    }

    /// Requests the node must refuse: a data op over a local (UDS) connection, a second data op
    /// on a transfer whose bytes are moving, and another worker's transfer.
    pub(super) fn remote_refused(&mut self, i: usize) -> Check {
        let id = self.remote.actors[i].id;
        match self.rng.index(3) {
            0 => {
                let conn = self.schedulers[0].clone();
                let req = if self.rng.chance(50) {
                    Request::WriteSlots {
                        instance_id: id,
                        transfer_id: 1,
                        data: crate::protocol::DataPath::Inline,
                        commit: true,
                    }
                } else {
                    Request::RegisterBuffers { regions: vec![] }
                };
                let r = self.native_call(&conn, req);
                self.log(format!(
                    "local conn sends a remote data request -> {}",
                    short(&r)
                ));
                match r {
                    Response::Error { kind, .. } if kind == ErrorKind::Unsupported.code() => Ok(()),
                    other => Err(format!(
                        "a remote data request over a local connection was answered {other:?}"
                    )),
                }
            }
            1 => {
                let Some(op) = self.remote.ops.values().find(|o| o.actor == i) else {
                    return Ok(());
                };
                let (tid, write) = (op.tid, matches!(op.taken, Taken::Write(_)));
                let Some(rc) = self.remote.actors[i].conn.as_ref() else {
                    return Ok(());
                };
                let caller = rc.caller();
                self.touched(id, false);
                let r = if write {
                    ops::take_write(&self.ctx, &caller, id, tid).map(|t| t.put_back())
                } else {
                    ops::take_read(&self.ctx, &caller, id, tid).map(drop)
                };
                self.log(format!(
                    "remote {id} data op on transfer {tid} in flight -> {r:?}"
                ));
                match r {
                    Err(e)
                        if e.kind == ErrorKind::UnknownTransfer
                            || e.kind == ErrorKind::NotRegistered
                            || e.kind == ErrorKind::PermissionDenied =>
                    {
                        Ok(())
                    }
                    other => Err(format!(
                        "a second data op on transfer {tid} whose bytes are moving: {other:?}"
                    )),
                }
            }
            _ => {
                let j = self.rng.index(self.remote.actors.len());
                let other = &self.remote.actors[j];
                let (Some(&(tid, _, _)), Some(reg)) = (other.writes.first(), other.reg.as_ref())
                else {
                    return Ok(());
                };
                if j == i {
                    return Ok(());
                }
                let target = reg.inst.id;
                let caller = self.remote.actors[i]
                    .conn
                    .as_ref()
                    .expect("connected")
                    .caller();
                let r = ops::take_write(&self.ctx, &caller, target, tid).map(|t| t.put_back());
                self.log(format!(
                    "remote {id} WRITE_SLOTS of remote {target}'s store {tid} -> {r:?}"
                ));
                self.stats.intrusions += 1;
                match r {
                    Err(e)
                        if e.kind == ErrorKind::PermissionDenied
                            || e.kind == ErrorKind::NotRegistered =>
                    {
                        Ok(())
                    }
                    other => Err(format!(
                        "a data op on another connection's instance {target} was accepted: \
                         {other:?}"
                    )),
                }
            }
        }
    }
}
