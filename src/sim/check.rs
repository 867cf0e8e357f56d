//! The checks run after every step: the model's invariants, the reaper's deadlines, the
//! liveness wheel, transfer ownership, and namespace reclaiming.

use super::world::{self, TICK_MS};
use super::{Check, Sim};

impl Sim {
    /// Checks after every step: the model's invariants, the reaper's deadlines and the wheel.
    pub(super) fn check(&mut self) -> Check {
        let taken_locks = self.remote_taken_locks();
        self.model.check(&self.ctx, &self.opts.skip, &taken_locks)?;
        self.check_remote()?;
        let now = self.now();
        for r in self
            .natives
            .iter()
            .filter_map(|a| a.reg.as_ref())
            .chain(self.lms.iter().filter_map(|a| a.reg.as_ref()))
            .chain(self.remote.actors.iter().filter_map(|a| a.reg.as_ref()))
        {
            if self.on("reaper") && now >= r.deadline_ms() + 2 * TICK_MS {
                return Err(format!(
                    "instance {} silent since {} ms (pinged: {}) is still registered at {now} ms, \
                     past its deadline {} ms",
                    r.inst.id,
                    r.last_seen_ms,
                    r.pinged,
                    r.deadline_ms()
                ));
            }
        }
        if self.on("owners") {
            self.check_transfer_owners()?;
        }
        if self.on("disconnects") {
            self.check_disconnects()?;
        }
        if self.on("quotas") {
            self.check_reservation_quotas()?;
        }
        let live: Vec<u64> = self.ctx.instances.all().iter().map(|i| i.id).collect();
        let watched = self.reaper.watched();
        if self.on("wheel") && watched != live {
            return Err(format!(
                "the liveness wheel watches {watched:?} but the live instances are {live:?}"
            ));
        }
        if self.on("wheel") && self.ctx.liveness.tracked() != live.len() {
            return Err(format!(
                "status reports {} tracked instances for {} live ones",
                self.ctx.liveness.tracked(),
                live.len()
            ));
        }
        Ok(())
    }

    /// The store quotas balance: each live instance's `reserved_bytes` is exactly what its
    /// pending stores hold (each store charged exactly its slots), within the per-instance cap;
    /// each user's shared counter is the sum over that user's live instances, within the
    /// per-user cap. Stores whose bytes are moving (out of their instance's table) stay
    /// charged until they settle, also when their instance was released meanwhile. (A leak or a
    /// double refund anywhere shows up here.)
    fn check_reservation_quotas(&self) -> Check {
        let mut users: Vec<(std::sync::Arc<std::sync::atomic::AtomicU64>, u64)> = Vec::new();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Acquire);
        let taken = self.remote_taken_charges();
        let live = self.ctx.instances.all();
        for (inst, charged) in &taken {
            if live.iter().any(|l| std::sync::Arc::ptr_eq(l, inst)) {
                continue;
            }
            match users
                .iter_mut()
                .find(|(c, _)| std::sync::Arc::ptr_eq(c, &inst.user_reserved))
            {
                Some((_, sum)) => *sum += charged,
                None => users.push((inst.user_reserved.clone(), *charged)),
            }
        }
        for inst in live {
            let held: u64 = {
                let p = inst.pending.lock();
                let mut sum: u64 = taken
                    .iter()
                    .filter(|(i, _)| std::sync::Arc::ptr_eq(i, &inst))
                    .map(|(_, c)| c)
                    .sum();
                for (t, w) in &p.writes {
                    let slots: u64 = w.items.iter().map(|(_, g)| g.slot.len).sum();
                    if w.charged != slots {
                        return Err(format!(
                            "store {t} of instance {} charged {} bytes for {slots} of slots",
                            inst.id, w.charged
                        ));
                    }
                    sum += slots;
                }
                sum
            };
            let reserved = load(&inst.reserved_bytes);
            if reserved != held || reserved > self.ctx.reserved_cap_per_instance() {
                return Err(format!(
                    "instance {} counts {reserved} reserved bytes; its pending stores hold {held} \
                     (cap {})",
                    inst.id,
                    self.ctx.reserved_cap_per_instance()
                ));
            }
            match users
                .iter_mut()
                .find(|(c, _)| std::sync::Arc::ptr_eq(c, &inst.user_reserved))
            {
                Some((_, sum)) => *sum += reserved,
                None => users.push((inst.user_reserved.clone(), reserved)),
            }
        }
        for (counter, sum) in &users {
            let n = load(counter);
            if n != *sum || n > self.ctx.reserved_cap_per_user() {
                return Err(format!(
                    "a user's reserved-bytes counter is {n}; its live instances hold {sum} (cap {})",
                    self.ctx.reserved_cap_per_user()
                ));
            }
        }
        Ok(())
    }

    /// Every transfer the node holds for an instance is held by a client (or was left by a
    /// crashed process that a new one replaced, and waits for its TTL): nothing is orphaned;
    /// and every transfer a client holds within its TTL is still the node's.
    fn check_transfer_owners(&mut self) -> Check {
        for a in &self.natives {
            let Some(reg) = &a.reg else { continue };
            let node: std::collections::BTreeSet<u64> = {
                let p = reg.inst.pending.lock();
                p.writes.keys().chain(p.reads.keys()).copied().collect()
            };
            let held: std::collections::BTreeMap<u64, u64> = a.held().collect();
            if let Some(t) = node.iter().find(|t| !held.contains_key(t)) {
                return Err(format!(
                    "the node holds transfer {t} of native instance {} that no client holds",
                    a.id
                ));
            }
            for (t, mid) in &held {
                if self.model.get(*mid).is_some() && !node.contains(t) {
                    return Err(format!(
                        "native instance {} holds transfer {t} within its TTL, but the node \
                         no longer has it",
                        a.id
                    ));
                }
            }
        }
        for a in &mut self.lms {
            let Some(reg) = &a.reg else { continue };
            let node: std::collections::BTreeSet<u64> = {
                let p = reg.inst.pending.lock();
                p.writes.keys().chain(p.reads.keys()).copied().collect()
            };
            let queued = self.frontend.queued_transfer_ids(a.id);
            // A closed connection's requests still queued may have prepared a store nobody
            // will commit: it waits in the frontend's queue for the release.
            if reg.closed_ms.is_none() && queued.len() != a.queued() {
                return Err(format!(
                    "the frontend queues {} transfers for LMCache worker {}, which expects {}",
                    queued.len(),
                    a.id,
                    a.queued()
                ));
            }
            a.orphans.retain(|t| node.contains(t));
            if let Some(t) = node
                .iter()
                .find(|t| queued.binary_search(t).is_err() && !a.orphans.contains(t))
            {
                return Err(format!(
                    "the node holds transfer {t} of LMCache instance {} that the frontend does \
                     not queue for any COMMIT",
                    a.id
                ));
            }
        }
        Ok(())
    }

    /// After the maintenance pass, the node keeps only namespaces that something uses or that a
    /// request named recently.
    pub(super) fn check_namespaces_reclaimed(&mut self) -> Check {
        let now = self.now();
        let mut keep: std::collections::HashSet<crate::storage::NamespaceId> = self
            .ctx
            .storage
            .snapshot()
            .iter()
            .map(|(k, _)| k.namespace)
            .collect();
        keep.extend(self.ctx.instances.all().iter().map(|i| i.namespace));
        keep.extend(self.ctx.sessions.namespaces());
        if let Some(lost) = keep
            .iter()
            .find(|id| self.ctx.namespaces.name(**id).is_none())
        {
            if self.on("namespaces") {
                return Err(format!("namespace {lost:?} is in use but was reclaimed"));
            }
        }
        for ((m, s), t) in &self.named {
            if now.saturating_sub(*t) < world::NAMESPACE_IDLE_MS {
                keep.extend(self.ctx.namespaces.lookup(m, s));
            }
        }
        let interned = self.ctx.namespaces.len();
        if self.on("namespaces") && interned > keep.len() {
            return Err(format!(
                "the node keeps {interned} namespaces after maintenance, but only {} are in use \
                 or were named in the last {} ms",
                keep.len(),
                world::NAMESPACE_IDLE_MS
            ));
        }
        Ok(())
    }

    /// Runs `f` and fails if it grew the namespace table (lookups and retrieves never intern).
    pub(super) fn no_intern<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut Sim) -> T,
    ) -> Result<T, String> {
        let before = self.ctx.namespaces.len();
        let out = f(self);
        let after = self.ctx.namespaces.len();
        if self.on("namespaces") && after > before {
            return Err(format!(
                "{what} interned a namespace ({before} -> {after}); an unknown namespace is a miss"
            ));
        }
        Ok(out)
    }
}
