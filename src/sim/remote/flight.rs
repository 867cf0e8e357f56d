//! Data ops in flight: the simulated node's deadlines and late teardowns, the fabric's clock,
//! and the settling of every completion (the mover's role, polled from the step loop), with the
//! checks that hold at that moment; and the drain at the end of a run.

use std::time::Duration;

use kvnode_hw::fabric::{Completion, Fabric, FabricError, OpId};

use super::{HeldSlot, RemoteOp, Taken, TRANSFER_TIMEOUT_MS};
use crate::error::ErrorKind;
use crate::protocol::Response;
use crate::sim::world;
use crate::sim::{Check, Sim};

/// Completions one poll takes at most (like the mover's).
const POLL_BATCH: usize = 64;

impl Sim {
    /// After every step: ops past their deadline are torn down (the node gives up on their
    /// connection), late teardowns come due, the fabric's clock follows the node's, and every
    /// completion is settled.
    pub(in crate::sim) fn remote_progress(&mut self) -> Check {
        if self.remote.actors.is_empty() {
            return Ok(());
        }
        let now = self.now();
        let late: Vec<u64> = self
            .remote
            .ops
            .iter()
            .filter(|(_, o)| !o.timed_out && now >= o.posted_ms + TRANSFER_TIMEOUT_MS)
            .map(|(k, _)| *k)
            .collect();
        for k in late {
            let o = self.remote.ops.get_mut(&k).expect("listed");
            o.timed_out = true;
            let (fconn, actor, conn, tid) = (o.fconn, o.actor, o.conn, o.tid);
            self.stats.remote_deadline_misses += 1;
            self.remote.teardown(fconn);
            let id = self.remote.actors[actor].id;
            self.log(format!(
                "op {k} (remote {id} transfer {tid}) missed its deadline: its fabric connection \
                 is torn down"
            ));
            if self.remote.actors[actor]
                .conn
                .as_ref()
                .is_some_and(|c| c.conn.id() == conn)
            {
                self.remote_close(actor, "a transfer missed its deadline")?;
            }
        }
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.remote.lingering)
            .into_iter()
            .partition(|(_, at)| *at <= now);
        self.remote.lingering = keep;
        for (f, _) in due {
            self.remote.teardown(f);
        }
        self.remote.fabric.advance_to(now);
        let mut out = Vec::with_capacity(POLL_BATCH);
        loop {
            out.clear();
            if self
                .remote
                .fabric
                .poll(&mut out, POLL_BATCH, Duration::ZERO)
                == 0
            {
                return Ok(());
            }
            for c in out.drain(..) {
                self.remote_complete(c)?;
            }
        }
    }

    /// Settles the op `c` completes, as the node does once the fabric returned it.
    fn remote_complete(&mut self, c: Completion) -> Check {
        if c.op == OpId::TEARDOWN_DONE {
            return Ok(());
        }
        let Some(mut op) = self.remote.ops.remove(&c.op.0) else {
            return Err(format!(
                "the fabric completed op {} that nobody posted",
                c.op.0
            ));
        };
        let id = self.remote.actors[op.actor].id;
        let released = op.inst.is_released();
        let result = c.result.clone();
        let what = match op.taken {
            Taken::Write(_) => "WRITE_SLOTS",
            _ => "READ_SLOTS",
        };
        let outcome = match &result {
            Ok(n) => format!("moved {n} bytes"),
            Err(e) => format!("failed: {e}"),
        };
        let total: u64 = op.slots.iter().map(|s| s.len).sum();
        if let Ok(n) = &result {
            if *n != total {
                return Err(format!(
                    "op {} moved {n} bytes of a transfer of {total}",
                    c.op.0
                ));
            }
        }
        match std::mem::replace(&mut op.taken, Taken::Settled) {
            Taken::Settled => return Err(format!("op {} settled twice", c.op.0)),
            Taken::Write(take) => {
                if result.is_ok() {
                    for s in &op.slots {
                        let v = world::read_stamp(&self.ctx, s.offset, s.len, &s.key);
                        if v != Some(s.version) {
                            return Err(format!(
                                "store op {} completed, but slot {} holds version {v:?}, not the \
                                 engine's {}",
                                c.op.0, s.offset, s.version
                            ));
                        }
                    }
                }
                let resp = take.settle(result.clone().map_err(|e| e.to_string()), op.commit);
                self.log(format!(
                    "op {} {what} {} of remote {id} {outcome} (instance released: {released}) \
                     -> {}",
                    c.op.0,
                    op.tid,
                    super::short(&resp)
                ));
                self.settled_write(&op, &result, released, resp)?;
            }
            Taken::Read(take) => {
                if result.is_ok() {
                    self.verify_delivered(&op, c.op.0)?;
                }
                let r = take.settle(result.is_ok(), op.commit);
                self.log(format!(
                    "op {} {what} {} of remote {id} {outcome} (instance released: {released}) \
                     -> commit {r:?}",
                    c.op.0, op.tid
                ));
                self.settled_read(&op, result.is_ok(), released, r)?;
            }
        }
        self.remote.teardown(op.fconn);
        if let Some(rc) = self.remote.actors[op.actor].conn.as_mut() {
            rc.fconns.retain(|f| *f != op.fconn);
        }
        self.remote.lingering.retain(|(f, _)| *f != op.fconn);
        let fatal = matches!(&result, Err(e) if *e != FabricError::Flushed);
        let same_conn = self.remote.actors[op.actor]
            .conn
            .as_ref()
            .is_some_and(|rc| rc.conn.id() == op.conn);
        if fatal && same_conn {
            self.remote_close(op.actor, "a data op failed")?;
        }
        Ok(())
    }

    /// A retrieve's bytes reached the engine: each buffer holds the version the model says the
    /// slot held at PREPARE (its read lock kept it there, whatever happened meanwhile).
    fn verify_delivered(&mut self, op: &RemoteOp, opid: u64) -> Check {
        for s in &op.slots {
            let region = self
                .remote
                .fabric
                .peer_region(op.fconn, s.peer.0)
                .or_else(|| {
                    op.delivered
                        .iter()
                        .find(|(k, _)| *k == s.peer.0)
                        .map(|(_, b)| b.clone())
                })
                .ok_or_else(|| format!("op {opid}: the engine's region {:#x} is gone", s.peer.0))?;
            let got = &region[s.peer.1..s.peer.1 + s.len as usize];
            let v = world::parse_stamp(got, &s.key);
            if v != Some(s.version) {
                return Err(format!(
                    "retrieve op {opid} (transfer {}) delivered {v:?} from slot {}, but the \
                     object read there is version {}",
                    op.tid, s.offset, s.version
                ));
            }
        }
        self.stats.remote_reads_verified += 1;
        Ok(())
    }

    /// No reservation or lock of `slots` (by its lease) is left: a failed or orphaned store
    /// was freed, never published.
    fn check_freed(&self, slots: &[HeldSlot], what: &str) -> Check {
        if !self.on("settle") {
            return Ok(());
        }
        let snapshot: std::collections::HashMap<_, _> =
            self.ctx.storage.snapshot().into_iter().collect();
        for s in slots {
            if let Some(e) = snapshot.get(&s.key).filter(|e| e.lease == s.lease) {
                return Err(format!(
                    "{what}: slot {} of {:?} is still held ({:?}, doomed {})",
                    s.offset,
                    &s.key.chunk_hash[..4],
                    e.state,
                    e.doomed
                ));
            }
        }
        Ok(())
    }

    fn settled_write(
        &mut self,
        op: &RemoteOp,
        result: &Result<u64, FabricError>,
        released: bool,
        resp: Response,
    ) -> Check {
        let i = op.actor;
        let tid = op.tid;
        if released {
            // The instance went away while the bytes moved: nothing is published, nothing is
            // put back into the released table, the slots are free.
            self.stats.remote_settled_released += 1;
            if !self.on("settle") {
                return Ok(());
            }
            if !matches!(resp, Response::Error { .. }) {
                return Err(format!(
                    "store {tid} of a released instance settled with {resp:?}"
                ));
            }
            if !op.inst.pending.lock().writes.is_empty() {
                return Err(format!(
                    "store {tid} was put back into its released instance's table"
                ));
            }
            return self.check_freed(&op.slots, &format!("store {tid} of a released instance"));
        }
        let Ok(n) = result else {
            self.stats.remote_ops_failed += 1;
            self.model.take(op.mid);
            if !self.on("settle") {
                return Ok(());
            }
            match &resp {
                Response::Error { kind, .. } if *kind == ErrorKind::Io.code() => {}
                other => {
                    return Err(format!(
                        "store {tid} whose bytes did not arrive settled with {other:?}"
                    ))
                }
            }
            return self.check_freed(&op.slots, &format!("failed store {tid}"));
        };
        match (op.commit, resp) {
            (
                false,
                Response::SlotsWritten {
                    bytes,
                    published: None,
                },
            ) if bytes == *n => {
                self.remote.actors[i].writes.push((tid, op.mid, true));
                Ok(())
            }
            (
                true,
                Response::SlotsWritten {
                    bytes,
                    published: Some(published),
                },
            ) if bytes == *n => {
                match self.model.take(op.mid) {
                    Some((t, true)) => {
                        let expect = if t.clear_epoch == self.model.clear_epoch {
                            t.grants.len() as u32
                        } else {
                            0
                        };
                        if published != expect {
                            return Err(format!(
                                "WRITE_SLOTS {tid} with commit published {published}, expected \
                                 {expect}"
                            ));
                        }
                        self.model.committed(&t);
                    }
                    Some((t, false)) => self.model.committed(&t),
                    None => {}
                }
                self.stats.remote_stores_committed += 1;
                Ok(())
            }
            (commit, other) => Err(format!(
                "store {tid} (commit {commit}) whose bytes moved settled with {other:?}"
            )),
        }
    }

    fn settled_read(
        &mut self,
        op: &RemoteOp,
        ok: bool,
        released: bool,
        commit_error: Option<Response>,
    ) -> Check {
        let tid = op.tid;
        if released {
            self.stats.remote_settled_released += 1;
            if self.on("settle") && !op.inst.pending.lock().reads.is_empty() {
                return Err(format!(
                    "retrieve {tid} was put back into its released instance's table"
                ));
            }
            return Ok(());
        }
        if let Some(r) = commit_error {
            return Err(format!(
                "the commit of retrieve {tid} after its bytes moved failed: {r:?}"
            ));
        }
        if !ok {
            self.stats.remote_ops_failed += 1;
        }
        if ok && op.commit {
            self.model.take(op.mid);
        } else {
            self.remote.actors[op.actor].reads.push((tid, op.mid));
        }
        Ok(())
    }

    /// The end of a run: every remote connection is torn down; every op must then complete and
    /// settle, nothing may stay in flight, and every remote instance's charges are refunded.
    pub(in crate::sim) fn remote_drain(&mut self) -> Check {
        for i in 0..self.remote.actors.len() {
            self.remote_close(i, "end of run")?;
        }
        for (f, _) in std::mem::take(&mut self.remote.lingering) {
            self.remote.teardown(f);
        }
        self.remote_progress()?;
        let stats = self.remote.fabric.stats();
        let ranges = self.remote.fabric.inflight_ranges();
        if !self.remote.ops.is_empty() || stats.inflight_ops != 0 || !ranges.is_empty() {
            return Err(format!(
                "after every remote connection was torn down, {} ops are unsettled, the fabric \
                 counts {} in flight and {} pool ranges",
                self.remote.ops.len(),
                stats.inflight_ops,
                ranges.len()
            ));
        }
        for inst in &self.remote.instances {
            let r = inst
                .reserved_bytes
                .load(std::sync::atomic::Ordering::Acquire);
            let u = inst
                .user_reserved
                .load(std::sync::atomic::Ordering::Acquire);
            if !inst.is_released() || r != 0 || u != 0 {
                return Err(format!(
                    "remote instance {} after the drain: released {}, {r} reserved bytes, its \
                     user {u}",
                    inst.id,
                    inst.is_released()
                ));
            }
        }
        self.log("drain: every remote op settled".into());
        self.reaper.step(&*self.ctx);
        self.observe_releases()?;
        self.check()
    }
}
