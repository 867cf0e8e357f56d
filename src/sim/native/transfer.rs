//! Store and retrieve transfers of the native workers: prepare (checking every slot the node
//! hands out against the model), commit, abort, and commits the node must refuse.

use super::short;
use crate::error::ErrorKind;
use crate::protocol::{Request, Response};
use crate::sim::model::{Grant, Transfer};
use crate::sim::world;
use crate::sim::{Check, Sim};
use crate::storage::StorageKey;

impl Sim {
    pub(super) fn native_prepare_store(&mut self, i: usize) -> Check {
        let (id, model) = (self.natives[i].id, self.natives[i].model);
        let salt = self.salt();
        let (p, a, b) = self.chunk_span();
        let range = self.range(model, salt, p, a, b);
        self.named(model, salt);
        self.touched(id, false);
        let conn = self.natives[i].conns[0].clone();
        let cached: Vec<StorageKey> = range
            .chunk_hashes
            .iter()
            .map(|h| self.key_of(model, salt, h))
            .filter(|k| self.ctx.storage.contains_ready(k))
            .collect();
        let r = self.native_call(
            &conn,
            Request::PrepareStore {
                instance_id: id,
                range: range.clone(),
            },
        );
        self.log(format!(
            "native {id} PREPARE_STORE p{p}[{a}..{b}) salt {salt:?} -> {}",
            short(&r)
        ));
        if let Some(k) = cached.iter().find(|k| !self.ctx.storage.contains_ready(k)) {
            return Err(format!(
                "PREPARE_STORE of instance {id} evicted {:?}, a cached chunk of its own range",
                &k.chunk_hash[..4]
            ));
        }
        let Response::StorePrepared {
            transfer_id,
            slots,
            chunk_indices,
            ..
        } = r
        else {
            return Ok(());
        };
        if slots.len() != chunk_indices.len() || (transfer_id == 0) != slots.is_empty() {
            return Err(format!(
                "PREPARE_STORE answer is inconsistent: transfer {transfer_id}, {} slots, {} indices",
                slots.len(),
                chunk_indices.len()
            ));
        }
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
            label: format!("native {id} store {transfer_id}"),
        };
        let mid = self.model.hand_out(t)?;
        // The client copies its bytes into the slots.
        for g in &self.model.get(mid).expect("just added").grants {
            world::write_stamp(&self.ctx, g.offset, g.len, &g.key, g.version);
        }
        self.natives[i].writes.push((transfer_id, mid));
        Ok(())
    }

    pub(super) fn native_commit_store(&mut self, i: usize) -> Check {
        if self.natives[i].writes.is_empty() {
            return Ok(());
        }
        let k = self.rng.index(self.natives[i].writes.len());
        let (tid, mid) = self.natives[i].writes.remove(k);
        let id = self.natives[i].id;
        let conn = self.natives[i].conns[0].clone();
        // The client's copy may run until the commit: it writes its bytes once more.
        if let Some(t) = self.model.get(mid) {
            for g in &t.grants {
                world::write_stamp(&self.ctx, g.offset, g.len, &g.key, g.version);
            }
        }
        self.touched(id, false);
        let r = self.native_call(
            &conn,
            Request::CommitStore {
                instance_id: id,
                transfer_id: tid,
            },
        );
        self.log(format!("native {id} COMMIT_STORE {tid} -> {}", short(&r)));
        self.natives[i].retired.push(tid);
        let t = match self.model.take(mid) {
            Some((t, true)) => t,
            Some((t, false)) => {
                // Its TTL passed: the node may have released it, or still accepted the commit.
                if matches!(r, Response::StoreCommitted { .. }) {
                    self.model.committed(&t);
                }
                return Ok(());
            }
            None => return Ok(()),
        };
        match r {
            Response::StoreCommitted { published } => {
                let expect = if t.clear_epoch == self.model.clear_epoch {
                    t.grants.len() as u32
                } else {
                    0
                };
                if published != expect {
                    return Err(format!(
                        "COMMIT_STORE {tid} of instance {id} published {published} objects, \
                         expected {expect}"
                    ));
                }
                self.model.committed(&t);
                self.stats.stores_committed += 1;
                Ok(())
            }
            other => Err(format!(
                "COMMIT_STORE of held transfer {tid} (instance {id}) failed: {other:?}"
            )),
        }
    }

    pub(super) fn native_abort_store(&mut self, i: usize) -> Check {
        if self.natives[i].writes.is_empty() {
            return Ok(());
        }
        let k = self.rng.index(self.natives[i].writes.len());
        let (tid, mid) = self.natives[i].writes.remove(k);
        let id = self.natives[i].id;
        let conn = self.natives[i].conns[0].clone();
        self.touched(id, false);
        let r = self.native_call(
            &conn,
            Request::AbortStore {
                instance_id: id,
                transfer_id: tid,
            },
        );
        self.log(format!("native {id} ABORT_STORE {tid} -> {}", short(&r)));
        self.natives[i].retired.push(tid);
        if let Some(t) = self.model.finish(mid) {
            match r {
                Response::StoreAborted { freed } if freed as usize == t.grants.len() => {}
                other => {
                    return Err(format!(
                        "ABORT_STORE of held transfer {tid} (instance {id}, {} slots): {other:?}",
                        t.grants.len()
                    ))
                }
            }
        }
        Ok(())
    }

    pub(super) fn native_prepare_retrieve(&mut self, i: usize) -> Check {
        let (id, model) = (self.natives[i].id, self.natives[i].model);
        // Mostly the hit prefix of a recent lookup of this model, as engines do; otherwise any
        // range with any (or no) session.
        let recent: Vec<_> = self
            .lookups
            .iter()
            .filter(|l| l.1 == model && l.4 > 0)
            .cloned()
            .collect();
        let (salt, p, a, b, session) = if !recent.is_empty() && self.rng.chance(60) {
            let (session, _, salt, p, hits) = recent[self.rng.index(recent.len())].clone();
            let a = if self.rng.chance(70) {
                0
            } else {
                self.rng.index(hits as usize)
            };
            let b = self.rng.range(a as u64 + 1, u64::from(hits)) as usize;
            (salt, p, a, b, Some(session))
        } else {
            let salt = self.salt();
            let (p, a, b) = self.chunk_span();
            let session = if self.rng.chance(60) {
                Some(self.session_id())
            } else {
                None
            };
            (salt, p, a, b, session)
        };
        let range = self.range(model, salt, p, a, b);
        self.named(model, salt);
        self.touched(id, false);
        let conn = self.natives[i].conns[0].clone();
        let req = Request::PrepareRetrieve {
            instance_id: id,
            range: range.clone(),
            lookup_session: session.clone(),
        };
        let r = self.no_intern("PREPARE_RETRIEVE", |s| s.native_call(&conn, req))?;
        self.log(format!(
            "native {id} PREPARE_RETRIEVE p{p}[{a}..{b}) salt {salt:?} session {session:?} -> {}",
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
        if slots.len() != b - a {
            return Err(format!(
                "a retrieve hit of {} chunks came with {} slots",
                b - a,
                slots.len()
            ));
        }
        let mut grants = Vec::new();
        for (s, h) in slots.iter().zip(&range.chunk_hashes) {
            let key = self.key_of(model, salt, h);
            let Some(version) = world::read_stamp(&self.ctx, s.offset, s.length, &key) else {
                return Err(format!(
                    "retrieve {transfer_id} of instance {id} was handed slot {} whose bytes are \
                     not an object of its key",
                    s.offset
                ));
            };
            if !self.model.is_committed(&key, version, s.offset) {
                return Err(format!(
                    "retrieve {transfer_id} of instance {id} was handed version {version} at {}, \
                     which no client committed there",
                    s.offset
                ));
            }
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
            label: format!("native {id} retrieve {transfer_id}"),
        };
        let mid = self.model.hand_out(t)?;
        self.stats.retrieves_hit += 1;
        self.natives[i].reads.push((transfer_id, mid));
        Ok(())
    }

    pub(super) fn native_commit_retrieve(&mut self, i: usize) -> Check {
        if self.natives[i].reads.is_empty() {
            return Ok(());
        }
        let k = self.rng.index(self.natives[i].reads.len());
        let (tid, mid) = self.natives[i].reads.remove(k);
        let id = self.natives[i].id;
        let conn = self.natives[i].conns[0].clone();
        self.touched(id, false);
        let r = self.native_call(
            &conn,
            Request::CommitRetrieve {
                instance_id: id,
                transfer_id: tid,
            },
        );
        self.log(format!(
            "native {id} COMMIT_RETRIEVE {tid} -> {}",
            short(&r)
        ));
        self.natives[i].retired.push(tid);
        if self.model.finish(mid).is_some() && !matches!(r, Response::Ok) {
            return Err(format!(
                "COMMIT_RETRIEVE of held transfer {tid} (instance {id}) failed: {r:?}"
            ));
        }
        Ok(())
    }

    /// A commit the node must refuse: a transfer already finished, or another instance's.
    pub(super) fn native_bogus_commit(&mut self, i: usize) -> Check {
        let id = self.natives[i].id;
        let conn = self.natives[i].conns[0].clone();
        let (target, tid) = if self.rng.chance(50) && !self.natives[i].retired.is_empty() {
            let k = self.rng.index(self.natives[i].retired.len());
            (id, self.natives[i].retired[k])
        } else {
            let j = self.rng.index(self.natives.len());
            let other = &self.natives[j];
            match other.writes.first().or(other.reads.first()) {
                Some(&(tid, _)) if j != i => (id, tid),
                _ => return Ok(()),
            }
        };
        self.touched(target, false);
        let req = if self.rng.chance(50) {
            Request::CommitStore {
                instance_id: target,
                transfer_id: tid,
            }
        } else {
            Request::CommitRetrieve {
                instance_id: target,
                transfer_id: tid,
            }
        };
        let r = self.native_call(&conn, req);
        self.log(format!(
            "native {id} commits foreign/finished transfer {tid} -> {}",
            short(&r)
        ));
        match r {
            Response::Error { kind, .. }
                if kind == ErrorKind::UnknownTransfer.code()
                    || kind == ErrorKind::NotRegistered.code() =>
            {
                Ok(())
            }
            other => Err(format!(
                "a commit of transfer {tid} that instance {target} does not hold was accepted: \
                 {other:?}"
            )),
        }
    }
}
