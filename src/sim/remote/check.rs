//! The remote data path's checks after every step: every pool range the fabric may touch is a
//! slot storage still holds for that op's transfer; a transfer in flight is out of its
//! instance's table and still holds its items; the node's pending transfers of each remote
//! worker are the worker's; and what ops in flight hold, for the lock and quota books.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use super::Taken;
use crate::modules::instances::Instance;
use crate::sim::{Check, Sim};
use crate::storage::index::ObjectState;
use crate::storage::StorageKey;

impl Sim {
    /// The remote checks (skip with `inflight`, `owners`).
    pub(in crate::sim) fn check_remote(&self) -> Check {
        if self.remote.actors.is_empty() {
            return Ok(());
        }
        if self.on("inflight") {
            self.check_inflight()?;
        }
        if self.on("owners") {
            self.check_remote_owners()?;
        }
        Ok(())
    }

    /// (1) Every pool range in flight lies in a slot storage still holds for that op's
    /// transfer: `WriteReserved` under the store's lease, or `Ready` and read-locked under the
    /// retrieve's lease; never freed or reused while the fabric may touch it.
    fn check_inflight(&self) -> Check {
        let snapshot: HashMap<StorageKey, crate::storage::index::Entry> =
            self.ctx.storage.snapshot().into_iter().collect();
        let inflight = self.remote.fabric.inflight_ranges();
        let counted = kvnode_hw::fabric::Fabric::stats(&*self.remote.fabric).inflight_ops;
        if counted != self.remote.ops.len() as u64 {
            return Err(format!(
                "the fabric counts {counted} ops in flight, the node {}",
                self.remote.ops.len()
            ));
        }
        for (op, _, r) in &inflight {
            let Some(o) = self.remote.ops.get(&op.0) else {
                return Err(format!(
                    "pool range {}+{} is in flight for op {}, which no transfer owns",
                    r.offset, r.len, op.0
                ));
            };
            let Some(s) = o
                .slots
                .iter()
                .find(|s| s.offset == r.offset && s.len == r.len)
            else {
                return Err(format!(
                    "op {} has pool range {}+{} in flight, which is none of its slots",
                    op.0, r.offset, r.len
                ));
            };
            let e = snapshot.get(&s.key);
            let same = |e: &crate::storage::index::Entry| {
                e.lease == s.lease && e.slot.offset == s.offset && e.slot.len == s.len
            };
            let (ok, what) = match o.taken {
                Taken::Write(_) => (
                    e.is_some_and(|e| same(e) && e.state == ObjectState::WriteReserved),
                    "store",
                ),
                Taken::Read(_) => (
                    e.is_some_and(|e| same(e) && e.state == ObjectState::Ready && e.readers > 0),
                    "retrieve",
                ),
                Taken::Settled => (false, "settled op"),
            };
            if !ok {
                return Err(format!(
                    "[inflight] op {} ({what} {} of remote instance {}, posted at {} ms) has pool \
                     range {}+{} in flight, but storage no longer holds that slot for it (lease \
                     {}): {:?}",
                    op.0,
                    o.tid,
                    o.inst.id,
                    o.posted_ms,
                    r.offset,
                    r.len,
                    s.lease,
                    e.map(|e| (e.state, e.lease, e.slot.offset, e.readers, e.doomed))
                ));
            }
        }
        for (k, o) in &self.remote.ops {
            let all_in_flight = o.slots.iter().all(|s| {
                inflight
                    .iter()
                    .any(|(op, _, r)| op.0 == *k && r.offset == s.offset)
            });
            let (items, listed) = {
                let p = o.inst.pending.lock();
                match &o.taken {
                    Taken::Write(t) => (t.reserved().0.len(), p.writes.contains_key(&o.tid)),
                    Taken::Read(t) => (t.locked().len(), p.reads.contains_key(&o.tid)),
                    Taken::Settled => (0, false),
                }
            };
            if !all_in_flight || items != o.slots.len() || listed {
                return Err(format!(
                    "op {k} (transfer {} of instance {}): all slots in flight {all_in_flight}, \
                     items held {items} of {}, also in the instance's table {listed}",
                    o.tid,
                    o.inst.id,
                    o.slots.len()
                ));
            }
        }
        Ok(())
    }

    /// The node's pending transfers of each remote worker are the worker's (none orphaned, none
    /// both pending and in flight), and every one it holds within its TTL is still the node's.
    fn check_remote_owners(&self) -> Check {
        for (i, a) in self.remote.actors.iter().enumerate() {
            let Some(reg) = &a.reg else { continue };
            let node: BTreeSet<u64> = {
                let p = reg.inst.pending.lock();
                p.writes.keys().chain(p.reads.keys()).copied().collect()
            };
            let held: BTreeMap<u64, u64> = a.held().collect();
            if let Some(t) = node.iter().find(|t| !held.contains_key(t)) {
                return Err(format!(
                    "the node holds transfer {t} of remote instance {} that the worker does not \
                     hold (in flight: {})",
                    a.id,
                    self.remote.in_flight(i, *t)
                ));
            }
            for (t, mid) in &held {
                if self.model.get(*mid).is_some() && !node.contains(t) {
                    return Err(format!(
                        "remote instance {} holds transfer {t} within its TTL, but the node no \
                         longer has it",
                        a.id
                    ));
                }
            }
        }
        Ok(())
    }

    /// The read locks retrieves in flight hold (out of their instances' tables).
    pub(crate) fn remote_taken_locks(&self) -> Vec<(StorageKey, u64)> {
        self.remote
            .ops
            .values()
            .filter_map(|o| match &o.taken {
                Taken::Read(t) => Some(t.locked().to_vec()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// The bytes stores in flight are charged, by instance (released ones included: their
    /// charge is refunded when the op settles).
    pub(crate) fn remote_taken_charges(&self) -> Vec<(Arc<Instance>, u64)> {
        self.remote
            .ops
            .values()
            .filter_map(|o| match &o.taken {
                Taken::Write(t) => Some((o.inst.clone(), t.reserved().1)),
                _ => None,
            })
            .collect()
    }
}
