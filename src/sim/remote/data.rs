//! Remote workers' data ops: WRITE_SLOTS / READ_SLOTS the way the node's remote connection
//! runs them (take the transfer, check the descriptors against the connection's registered
//! buffers, post to the fabric), with the engine's memory built from the model's stamps.

use std::time::{Duration, Instant};

use kvnode_hw::fabric::{
    ConnSetup, Dir, Fabric, FakePeer, FakeRegion, OpId, PostBatch, RemoteSeg, WorkItem,
};

use super::{HeldSlot, RemoteOp, Taken, REGION_BYTES, TRANSFER_TIMEOUT_MS};
use crate::protocol::{RemoteBuf, RemoteRegion};
use crate::remote::ops;
use crate::sim::world;
use crate::sim::{Check, Sim};

/// Byte the engine's buffers hold where no stamp was put (a retrieve must overwrite it).
const NOISE: u8 = 0xEE;

/// The deadline given to the fake fabric: far beyond any run (the simulator enforces its own,
/// virtual, transfer deadline; a real-time one would make runs depend on the host's speed).
fn far_deadline() -> Instant {
    Instant::now() + Duration::from_secs(30 * 24 * 3600)
}

/// How a data op's descriptors are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Descr {
    /// Valid, inside a registered region.
    Good,
    /// Invalid (the node must refuse them and put the transfer back untouched).
    Bad,
    /// Valid for the node, but the engine's memory is not where it said (the NIC answers
    /// `REM_ACCESS_ERR`).
    WrongKey,
}

impl Sim {
    /// Descriptors for `slots` in worker `i`'s registered regions: consecutive buffers from a
    /// random start in one region; `Bad` ones break one rule of [`RegionTable::work_items`].
    fn remote_bufs(&mut self, i: usize, slots: &[(u64, u64)], how: Descr) -> Vec<RemoteBuf> {
        let known = self.remote.actors[i]
            .conn
            .as_ref()
            .expect("connected")
            .known
            .clone();
        let total: u64 = slots.iter().map(|s| s.1).sum();
        let region = if known.is_empty() {
            1_000 // nothing registered: any region is unknown
        } else {
            known[self.rng.index(known.len())].id
        };
        let slack = REGION_BYTES.saturating_sub(total) / 64;
        let mut at = self.rng.range(0, slack) * 64;
        let mut bufs: Vec<RemoteBuf> = slots
            .iter()
            .map(|&(_, len)| {
                let b = RemoteBuf {
                    region,
                    offset: at,
                    len,
                };
                at += len;
                b
            })
            .collect();
        if how == Descr::Bad {
            let k = self.rng.index(bufs.len());
            match self.rng.index(5) {
                0 => bufs[k].len -= 1,
                1 => bufs[k].region = 999,
                2 => bufs[k].offset = REGION_BYTES - bufs[k].len / 2,
                3 if bufs.len() > 1 => bufs[k].offset = bufs[(k + 1) % bufs.len()].offset + 8,
                3 => bufs[k].offset = u64::MAX - 16,
                _ => {
                    bufs.pop();
                }
            }
        }
        bufs
    }

    /// The engine's memory for a data op: each region its descriptors name, with `fill`'s
    /// bytes at each buffer (stores) or noise (retrieves).
    fn remote_peer(
        &self,
        known: &[RemoteRegion],
        bufs: &[RemoteBuf],
        fill: impl Fn(usize) -> Option<Vec<u8>>,
        wrong_key: bool,
    ) -> FakePeer {
        let mut regions: Vec<FakeRegion> = Vec::new();
        for (n, b) in bufs.iter().enumerate() {
            let r = known.iter().find(|r| r.id == b.region).expect("validated");
            let rkey = if wrong_key { r.rkey ^ 0xDEAD } else { r.rkey };
            let idx = match regions.iter().position(|x| x.addr == r.addr) {
                Some(idx) => idx,
                None => {
                    regions.push(FakeRegion {
                        addr: r.addr,
                        rkey,
                        bytes: vec![NOISE; r.len as usize],
                    });
                    regions.len() - 1
                }
            };
            if let Some(bytes) = fill(n) {
                let at = b.offset as usize;
                regions[idx].bytes[at..at + bytes.len()].copy_from_slice(&bytes);
            }
        }
        FakePeer { regions }
    }

    /// Refuses to post what would overlap a range in flight: a retrieve reading the very slot
    /// another retrieve is reading waits (`Ok(false)`: the fake fabric allows no two ops on one
    /// range; real fabrics let two reads share it); anything else would mean a slot is in two
    /// transfers at once, a broken invariant.
    fn remote_can_post(&self, items: &[WorkItem], dir: Dir, what: &str) -> Result<bool, String> {
        let inflight = self.remote.fabric.inflight_ranges();
        let mut wait = false;
        for it in items {
            for (op, _, r) in inflight.iter().filter(|(_, _, r)| r.overlaps(&it.local)) {
                let other_reads = self
                    .remote
                    .ops
                    .get(&op.0)
                    .is_some_and(|o| matches!(o.taken, Taken::Read(_)));
                if dir == Dir::Push && other_reads && *r == it.local {
                    wait = true;
                } else {
                    return Err(format!(
                        "{what} would move slot {}+{} while op {} still has {}+{} in flight",
                        it.local.offset, it.local.len, op.0, r.offset, r.len
                    ));
                }
            }
        }
        Ok(!wait)
    }

    /// Whether a punctual worker gives model transfer `mid` up rather than start a data op on
    /// it: the op could still be in flight (up to the node's transfer deadline) when the
    /// transfer's `ttl_ms` passes (`--remote-late` sends such late ops too: the pins keep their
    /// slots; punctual workers keep the default runs' model of TTLs simple).
    fn too_late(&self, mid: u64, ttl_ms: u64) -> bool {
        if self.opts.remote_late {
            return false;
        }
        self.model
            .get_any(mid)
            .is_none_or(|t| self.now() + TRANSFER_TIMEOUT_MS + 1 >= t.created_ms + ttl_ms)
    }

    /// WRITE_SLOTS of a random prepared store of worker `i`.
    pub(super) fn remote_write_slots(&mut self, i: usize) -> Check {
        if self.remote.actors[i].writes.is_empty() {
            return Ok(());
        }
        let k = self.rng.index(self.remote.actors[i].writes.len());
        self.remote_write_slots_at(i, k)
    }

    /// WRITE_SLOTS of worker `i`'s prepared store `k`: its bytes come from the engine's memory.
    pub(super) fn remote_write_slots_at(&mut self, i: usize, k: usize) -> Check {
        let (tid, mid, moved) = self.remote.actors[i].writes.remove(k);
        let id = self.remote.actors[i].id;
        let commit = self.rng.chance(65);
        if self.too_late(mid, world::WRITE_TTL_MS) {
            self.log(format!(
                "remote {id} gives store {tid} up: too close to its TTL"
            ));
            self.remote.actors[i].writes.push((tid, mid, moved));
            return Ok(());
        }
        let rc = self.remote.actors[i].conn.as_ref().expect("connected");
        let (caller, conn_id) = (rc.caller(), rc.conn.id());
        self.touched(id, false);
        let take = match ops::take_write(&self.ctx, &caller, id, tid) {
            Ok(t) => t,
            Err(e) => {
                self.log(format!("remote {id} WRITE_SLOTS {tid} -> {e}"));
                if self.model.get(mid).is_some() {
                    return Err(format!(
                        "WRITE_SLOTS of held store {tid} (remote instance {id}) refused: {e}"
                    ));
                }
                self.model.take(mid);
                return Ok(());
            }
        };
        let how = match self.rng.weighted(&[90, 6, 4]) {
            0 => Descr::Good,
            1 => Descr::Bad,
            _ => Descr::WrongKey,
        };
        let slots = take.slots();
        let bufs = self.remote_bufs(i, &slots, how);
        let rc = self.remote.actors[i].conn.as_ref().expect("connected");
        let items = match rc.regions.work_items(&bufs, &slots) {
            Ok(items) if how != Descr::Bad => items,
            Ok(_) => {
                return Err(format!(
                    "WRITE_SLOTS {tid} of remote {id} with bad descriptors {bufs:?} was accepted"
                ))
            }
            Err(e) => {
                take.put_back();
                let none_known = rc.known.is_empty();
                self.log(format!("remote {id} WRITE_SLOTS {tid} -> refused: {e}"));
                if how != Descr::Bad && !none_known {
                    return Err(format!("valid descriptors of store {tid} refused: {e}"));
                }
                self.stats.remote_refused += 1;
                self.remote.actors[i].writes.push((tid, mid, moved));
                return Ok(());
            }
        };
        let Some(t) = self.model.get_any(mid).cloned() else {
            return Err(format!("remote store {tid} has no model transfer"));
        };
        let (reserved, _) = take.reserved();
        let mut held = Vec::new();
        for ((key, grant), b) in reserved.iter().zip(&bufs) {
            let Some(g) = t.grants.iter().find(|g| g.offset == grant.slot.offset) else {
                return Err(format!(
                    "store {tid} of remote {id} reserves slot {} the PREPARE did not hand out",
                    grant.slot.offset
                ));
            };
            let rkey = rc
                .known
                .iter()
                .find(|r| r.id == b.region)
                .map_or(0, |r| r.rkey);
            held.push(HeldSlot {
                key: *key,
                lease: grant.lease,
                offset: grant.slot.offset,
                len: grant.slot.len,
                version: g.version,
                peer: (rkey, b.offset as usize),
            });
        }
        let peer = self.remote_peer(
            &rc.known,
            &bufs,
            |n| {
                Some(world::stamp_bytes(
                    held[n].len,
                    &held[n].key,
                    held[n].version,
                ))
            },
            how == Descr::WrongKey,
        );
        if !self.remote_can_post(&items, Dir::Pull, &format!("store {tid}"))? {
            unreachable!("a store never waits");
        }
        self.post(
            i,
            conn_id,
            tid,
            mid,
            commit,
            held,
            Taken::Write(take),
            peer,
            &items,
        )
    }

    /// READ_SLOTS of a random prepared retrieve of worker `i`.
    pub(super) fn remote_read_slots(&mut self, i: usize) -> Check {
        if self.remote.actors[i].reads.is_empty() {
            return Ok(());
        }
        let k = self.rng.index(self.remote.actors[i].reads.len());
        self.remote_read_slots_at(i, k)
    }

    /// READ_SLOTS of worker `i`'s prepared retrieve `k`: its bytes go to the engine's memory.
    pub(super) fn remote_read_slots_at(&mut self, i: usize, k: usize) -> Check {
        let (tid, mid) = self.remote.actors[i].reads.remove(k);
        let id = self.remote.actors[i].id;
        let commit = self.rng.chance(65);
        if self.too_late(mid, world::READ_TTL_MS) {
            self.log(format!(
                "remote {id} gives retrieve {tid} up: too close to its TTL"
            ));
            self.remote.actors[i].reads.push((tid, mid));
            return Ok(());
        }
        let rc = self.remote.actors[i].conn.as_ref().expect("connected");
        let (caller, conn_id) = (rc.caller(), rc.conn.id());
        self.touched(id, false);
        let take = match ops::take_read(&self.ctx, &caller, id, tid) {
            Ok(t) => t,
            Err(e) => {
                self.log(format!("remote {id} READ_SLOTS {tid} -> {e}"));
                if self.model.get(mid).is_some() {
                    return Err(format!(
                        "READ_SLOTS of held retrieve {tid} (remote instance {id}) refused: {e}"
                    ));
                }
                self.model.take(mid);
                return Ok(());
            }
        };
        let how = match self.rng.weighted(&[92, 5, 3]) {
            0 => Descr::Good,
            1 => Descr::Bad,
            _ => Descr::WrongKey,
        };
        let slots = take.slots().to_vec();
        let bufs = self.remote_bufs(i, &slots, how);
        let rc = self.remote.actors[i].conn.as_ref().expect("connected");
        let items = match rc.regions.work_items(&bufs, &slots) {
            Ok(items) if how != Descr::Bad => items,
            Ok(_) => {
                return Err(format!(
                    "READ_SLOTS {tid} of remote {id} with bad descriptors {bufs:?} was accepted"
                ))
            }
            Err(e) => {
                drop(take);
                let none_known = rc.known.is_empty();
                self.log(format!("remote {id} READ_SLOTS {tid} -> refused: {e}"));
                if how != Descr::Bad && !none_known {
                    return Err(format!("valid descriptors of retrieve {tid} refused: {e}"));
                }
                self.stats.remote_refused += 1;
                self.remote.actors[i].reads.push((tid, mid));
                return Ok(());
            }
        };
        let Some(t) = self.model.get_any(mid).cloned() else {
            return Err(format!("remote retrieve {tid} has no model transfer"));
        };
        let mut held = Vec::new();
        for (((key, lease), &(offset, len)), b) in take.locked().iter().zip(&slots).zip(&bufs) {
            let Some(g) = t
                .grants
                .iter()
                .find(|g| g.offset == offset && g.key == *key)
            else {
                return Err(format!(
                    "retrieve {tid} of remote {id} locks slot {offset} the PREPARE did not hand out"
                ));
            };
            let rkey = rc
                .known
                .iter()
                .find(|r| r.id == b.region)
                .map_or(0, |r| r.rkey);
            held.push(HeldSlot {
                key: *key,
                lease: *lease,
                offset,
                len,
                version: g.version,
                peer: (rkey, b.offset as usize),
            });
        }
        let peer = self.remote_peer(&rc.known, &bufs, |_| None, how == Descr::WrongKey);
        if !self.remote_can_post(&items, Dir::Push, &format!("retrieve {tid}"))? {
            drop(take);
            self.log(format!(
                "remote {id} READ_SLOTS {tid} waits: another retrieve reads its slot"
            ));
            self.remote.actors[i].reads.push((tid, mid));
            return Ok(());
        }
        self.post(
            i,
            conn_id,
            tid,
            mid,
            commit,
            held,
            Taken::Read(take),
            peer,
            &items,
        )
    }

    /// Connects the op's fabric connection and posts it (a refused post settles at once, as
    /// the node does: nothing moved).
    #[allow(clippy::too_many_arguments)]
    fn post(
        &mut self,
        i: usize,
        conn: u64,
        tid: u64,
        mid: u64,
        commit: bool,
        slots: Vec<HeldSlot>,
        taken: Taken,
        peer: FakePeer,
        items: &[WorkItem],
    ) -> Check {
        let id = self.remote.actors[i].id;
        let fabric = self.remote.fabric.clone();
        let fconn = fabric
            .connect(ConnSetup::Fake(peer))
            .map_err(|e| format!("fake connect: {e}"))?;
        let op = OpId(self.remote.next_op);
        self.remote.next_op += 1;
        let (dir, what) = match taken {
            Taken::Write(_) => (Dir::Pull, "WRITE_SLOTS"),
            _ => (Dir::Push, "READ_SLOTS"),
        };
        debug_assert!(items
            .iter()
            .all(|w| matches!(w.remote, RemoteSeg::Rdma { .. })));
        let posted = fabric.post(PostBatch {
            op,
            conn: fconn,
            dir,
            items,
            deadline: far_deadline(),
        });
        if let Err(e) = posted {
            fabric.teardown(fconn);
            self.log(format!("remote {id} {what} {tid} not posted: {e}"));
            return Err(format!(
                "a fresh fabric connection refused op {}: {e}",
                op.0
            ));
        }
        let inst = self.remote.actors[i]
            .reg
            .as_ref()
            .expect("taken from a registered instance")
            .inst
            .clone();
        self.log(format!(
            "remote {id} {what} {tid} commit={commit} -> op {} posted ({} slots {:?})",
            op.0,
            slots.len(),
            slots.iter().map(|s| s.offset).collect::<Vec<_>>()
        ));
        self.remote.actors[i]
            .conn
            .as_mut()
            .expect("connected")
            .fconns
            .push(fconn);
        self.remote.ops.insert(
            op.0,
            RemoteOp {
                actor: i,
                conn,
                fconn,
                tid,
                mid,
                commit,
                posted_ms: self.now(),
                timed_out: false,
                inst,
                slots,
                taken,
                delivered: Vec::new(),
            },
        );
        self.stats.remote_ops += 1;
        Ok(())
    }
}
