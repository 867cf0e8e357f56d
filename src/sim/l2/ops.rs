//! The operations one step may run: the tier's API driven the way the node drives it, plus
//! restarts, crashes, power losses, fault changes and stuck I/O.

use super::disk::{FaultRates, Restart};
use super::engine::{Release, StallAt};
use super::payload::{payload, SIZES};
use super::worker::{self, Job, Outcome, Started};
use super::{Check, L2Sim};
use crate::storage::{Layout, StorageKey};

/// How the tier stops in a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Sync, then drop; nothing is lost.
    Clean,
    /// Drop without a sync (the process died); completed writes stay.
    Crash,
    /// Drop, then the device loses power: writes not durable may be undone or torn.
    PowerLoss,
}

/// A load to run: key numbers, their keys, extra locks, the layout asked for.
pub(super) struct LoadPlan {
    pub ids: Vec<u32>,
    pub keys: Vec<StorageKey>,
    pub extra: u32,
    pub expected: Option<Layout>,
}

impl L2Sim {
    /// The storage key of key number `id` in the current run.
    pub(super) fn key_of(&self, id: u32) -> StorageKey {
        self.node.key(id, &self.model.keys[id as usize].chunk_hash)
    }

    /// Whether L1 holds a readable copy of key `id`.
    pub(super) fn in_l1(&self, id: u32) -> bool {
        self.node.storage.contains_ready(&self.key_of(id))
    }

    fn stuck_on(&self, id: u32) -> bool {
        self.stuck.as_ref().is_some_and(|s| s.ids.contains(&id))
    }

    fn keys_count(&self) -> u32 {
        self.model.keys.len() as u32
    }

    /// Up to `n` distinct key numbers drawn from `from`, in random order.
    fn pick(&mut self, mut from: Vec<u32>, n: usize) -> Vec<u32> {
        let mut out = Vec::new();
        while out.len() < n && !from.is_empty() {
            out.push(from.swap_remove(self.rng.index(from.len())));
        }
        out
    }

    /// Stores a new version of a random key (its L1 copy evicted first, so a copy of an older
    /// version on L2 is replaced by the next write-behind).
    pub(super) fn store_new(&mut self) -> Check {
        let id = self.rng.below(u64::from(self.keys_count())) as u32;
        let class = self.rng.index(SIZES.len());
        self.store_version(id, class);
        Ok(())
    }

    /// Stores a new version of key `id` in size class `class`; returns whether L1 took it.
    pub(super) fn store_version(&mut self, id: u32, class: usize) -> bool {
        let key = self.key_of(id);
        if self.stuck_on(id) {
            self.log(format!("store key {id}: skipped (its I/O is stuck)"));
            return false;
        }
        if self.in_l1(id) {
            self.node.storage.evict_if_idle(&[key]);
        }
        let (ver, bytes) = self.model.new_version(id, class);
        match self.node.store(&key, &ver, &bytes) {
            Ok(()) => {
                self.model.keys[id as usize].latest = Some(ver.v);
                self.stats.stores += 1;
                self.log(format!(
                    "store key {id} version {} ({} bytes)",
                    ver.v,
                    ver.bytes()
                ));
                true
            }
            Err(e) => {
                self.log(format!("store key {id} version {}: refused ({e})", ver.v));
                false
            }
        }
    }

    /// Stores the newest version of a key again, if L1 lost it (same layout, same bytes).
    pub(super) fn store_again(&mut self) -> Check {
        let id = self.rng.below(u64::from(self.keys_count())) as u32;
        let Some(v) = self.model.keys[id as usize].latest else {
            return Ok(());
        };
        if self.in_l1(id) || self.stuck_on(id) {
            return Ok(());
        }
        let ver = self.model.version(id, v).clone();
        let bytes = payload(id, v, ver.bytes());
        let r = self.node.store(&self.key_of(id), &ver, &bytes);
        if r.is_ok() {
            self.stats.stores += 1;
        }
        self.log(format!("store key {id} version {v} again: {r:?}"));
        Ok(())
    }

    fn l1_ids(&self) -> Vec<u32> {
        (0..self.keys_count()).filter(|&i| self.in_l1(i)).collect()
    }

    /// Write-behind of a few L1 objects (at most one batch).
    pub(super) fn persist(&mut self) -> Check {
        let n = self.rng.range(1, self.node.cfg.batch_objects as u64) as usize;
        let ids = self.pick(self.l1_ids(), n);
        if !ids.is_empty() {
            self.persist_ids(&ids);
        }
        Ok(())
    }

    /// Write-behind of the L1 objects of keys `ids` (at most one batch); returns how many
    /// were written.
    pub(super) fn persist_ids(&mut self, ids: &[u32]) -> u64 {
        let keys: Vec<StorageKey> = ids.iter().map(|&i| self.key_of(i)).collect();
        let written = self
            .node
            .tier()
            .persist(&self.node.storage, &self.node.namespaces, &keys);
        self.node.storage.clear_unwritten(&keys);
        self.stats.persisted += written;
        self.log(format!("persist {ids:?}: {written} written"));
        written
    }

    /// `fdatasync`; on success every object the tier holds is acknowledged durable.
    pub(super) fn sync(&mut self) -> Check {
        // Steering around a known bug: no fdatasync failure while a batch is parked between
        // its payload and header writes.
        let in_flight = self
            .stuck
            .as_ref()
            .is_some_and(|s| s.at == StallAt::HeaderWrite);
        let steer = in_flight && self.opts.skip.iter().any(|s| s == "in-flight-sync");
        if steer {
            self.node.disk.set_rates(FaultRates {
                sync_eio: 0,
                ..self.rates
            });
        }
        let tier = self.node.tier();
        let r = super::engine::explicit_sync(|| tier.sync());
        if steer {
            self.node.disk.set_rates(self.rates);
        }
        match r {
            Ok(()) => {
                self.refresh_claims()?;
                self.model.mark_synced();
                self.stats.syncs += 1;
                self.log(format!(
                    "sync: ok, {} objects durable",
                    self.model.durable().len()
                ));
            }
            Err((e, dropped)) => {
                self.stats.failed_syncs += 1;
                self.log(format!("sync: {e}; {} objects dropped", dropped.len()));
            }
        }
        Ok(())
    }

    /// Evicts a few idle L1 copies.
    pub(super) fn evict_some(&mut self) {
        let n = self.rng.range(1, 6) as usize;
        let ids = self.pick(self.l1_ids(), n);
        let keys: Vec<StorageKey> = ids.iter().map(|&i| self.key_of(i)).collect();
        let evicted = self.node.storage.evict_if_idle(&keys);
        self.log(format!("evict {ids:?} from L1: {evicted}"));
    }

    /// Drops every L1 copy (held ones are doomed).
    pub(super) fn drop_l1(&mut self) {
        let r = self.node.storage.clear();
        self.log(format!("drop L1: {r:?}"));
    }

    /// Plans a load of keys L1 does not hold: under one key's newest layout (with the other
    /// keys that have a version of that layout), under an older one, or under none.
    pub(super) fn plan_load(&mut self) -> Option<LoadPlan> {
        let candidates: Vec<u32> = (0..self.keys_count())
            .filter(|&i| {
                self.model.keys[i as usize].latest.is_some() && !self.in_l1(i) && !self.stuck_on(i)
            })
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let n = self.node.cfg.max_prefetch_objects.min(8);
        let mode = self.rng.weighted(&[60, 15, 25]);
        let (ids, expected) = if mode < 2 {
            let first = candidates[self.rng.index(candidates.len())];
            let k = &self.model.keys[first as usize];
            let ver = if mode == 0 {
                self.model.version(first, k.latest.expect("candidate"))
            } else {
                &k.versions[self.rng.index(k.versions.len())]
            };
            let layout = ver.layout.clone();
            let others: Vec<u32> = candidates
                .iter()
                .copied()
                .filter(|&c| {
                    c != first
                        && self
                            .model
                            .by_layout(c, layout.object_bytes(), layout.fingerprint())
                            .is_some()
                })
                .collect();
            let mut ids = vec![first];
            ids.extend(self.pick(others, n - 1));
            (ids, Some(layout))
        } else {
            (self.pick(candidates, n), None)
        };
        Some(LoadPlan {
            keys: ids.iter().map(|&i| self.key_of(i)).collect(),
            ids,
            extra: self.rng.below(3) as u32,
            expected,
        })
    }

    /// Loads keys from L2 into L1 and checks what was published.
    pub(super) fn load(&mut self) -> Check {
        let Some(p) = self.plan_load() else {
            return Ok(());
        };
        let leases =
            self.node
                .tier()
                .load(&self.node.storage, &p.keys, p.extra, p.expected.as_ref());
        self.check_loaded(&p, &leases, "load")
    }

    /// Checks each object a load published, then releases its locks.
    pub(super) fn check_loaded(
        &mut self,
        p: &LoadPlan,
        leases: &[Option<u64>],
        what: &str,
    ) -> Check {
        let fp = p.expected.as_ref().map(Layout::fingerprint);
        let mut got = Vec::new();
        for ((&id, key), lease) in p.ids.iter().zip(&p.keys).zip(leases) {
            let Some(lease) = lease else { continue };
            let v = self
                .check_l1_object(id, fp)
                .map_err(|e| format!("{what}: {e}"))?;
            self.node.storage.finish_read(&[(*key, *lease)], p.extra);
            got.push((id, v));
        }
        self.stats.loaded += got.len() as u64;
        let asked = fp.map_or("any layout".to_string(), |f| format!("layout {f:#x}"));
        self.log(format!("{what} {:?} under {asked}: loaded {got:?}", p.ids));
        Ok(())
    }

    /// CLEAR of both tiers (after releasing a stuck I/O, which it would wait for).
    pub(super) fn clear(&mut self) -> Check {
        self.release_stuck()?;
        let storage = self.node.storage.clone();
        let r = self.node.tier().clear_with(|| storage.clear());
        self.stats.clears += 1;
        match r {
            Ok((l1, l2)) => {
                self.model.on_clear(true);
                self.log(format!("CLEAR: L1 {l1:?}, L2 {l2:?}"));
            }
            Err(e) => {
                self.model.on_clear(false);
                self.log(format!("CLEAR: {e}"));
            }
        }
        Ok(())
    }

    /// `requeue_deferred` (the keys go to the tier's queue, which nothing drains here).
    pub(super) fn requeue(&mut self) {
        let n = self.node.tier().requeue_deferred();
        self.stats.requeued += n as u64;
        self.log(format!("requeue deferred: {n}"));
    }

    /// Stops the tier as `stop` says, reopens it, and checks every durable object.
    pub(super) fn restart(&mut self, stop: Stop) -> Check {
        if self.stuck.is_some() {
            let how = if self.rng.chance(50) {
                Release::Complete
            } else {
                Release::Fail
            };
            self.release_with(how)?;
        }
        let mut checkpointed = false;
        if stop == Stop::Clean {
            self.sync()?;
            // The node's shutdown: the tables of a checkpoint (or, when it fails, none).
            let node = &self.node;
            let r = super::engine::explicit_sync(|| node.tier().checkpoint(&node.namespaces));
            match r {
                Ok(c) => {
                    checkpointed = true;
                    self.stats.checkpoints += 1;
                    self.log(format!(
                        "checkpoint: {} extents, {} objects",
                        c.extents, c.objects
                    ));
                }
                Err(e) => self.log(format!("checkpoint failed: {e}")),
            }
        }
        // What the tier still holds now (a released I/O may have dropped objects).
        self.refresh_claims()?;
        let durable = self.model.durable();
        let held_before: Vec<(u32, u64)> =
            self.model.claims.iter().map(|(&i, c)| (i, c.v)).collect();
        // A copy not durable at the stop is, if found again, the device's leftover.
        self.model.claims.retain(|_, c| c.synced);
        self.node.close();
        let how = match stop {
            Stop::PowerLoss => Restart::PowerLoss,
            Stop::Clean | Stop::Crash => Restart::Process,
        };
        let reverted = self
            .node
            .disk
            .restart(how)
            .map_err(|e| format!("restoring the data file: {e}"))?;
        if let Some(m) = self.node.disk.file_mismatch() {
            return Err(m);
        }
        match stop {
            Stop::Clean => self.stats.restarts += 1,
            Stop::Crash => self.stats.crashes += 1,
            Stop::PowerLoss => self.stats.power_losses += 1,
        }
        self.log(format!(
            "{stop:?}: {} durable objects, {reverted} blocks undone",
            durable.len()
        ));
        let faults_before = self.node.disk.stats();
        let tries = self.reopen()?;
        self.model.on_reopen();
        // Claims on copies durable before the stop carry over; the rest were found on disk.
        self.refresh_claims_as(true)?;
        // A failed try may have withdrawn the checkpoint (its open's first superblock write).
        if checkpointed && tries == 1 {
            self.check_checkpoint_start(&held_before, faults_before, reverted)?;
        }
        self.check_durable(&durable, &format!("{stop:?}"))
    }

    /// After a stop whose checkpoint succeeded: the start used it, and (unless a read failed
    /// or was damaged, when a table block's slots are read from their headers, or the restart
    /// undid writes left in limbo by a failed fdatasync) found exactly the objects held at the
    /// stop, none that was evicted, replaced or dropped before it.
    fn check_checkpoint_start(
        &self,
        held_before: &[(u32, u64)],
        faults_before: super::disk::DiskStats,
        reverted: u64,
    ) -> Check {
        if !self.node.tier().status().clean_start {
            return Err("a checkpoint was written, but the next start did not use it".into());
        }
        let now = self.node.disk.stats();
        // Writes in limbo (made before a failed fdatasync) may be undone at a restart, tables'
        // objects with them; a read fault sends a table block's slots to their headers.
        if reverted > 0
            || (now.read_eio, now.flips) != (faults_before.read_eio, faults_before.flips)
        {
            return Ok(());
        }
        let held: Vec<(u32, u64)> = self.model.claims.iter().map(|(&i, c)| (i, c.v)).collect();
        if held != held_before {
            return Err(format!(
                "after a checkpoint the tier holds (key, version) {held:?}, at the stop it held \
                 {held_before:?}"
            ));
        }
        Ok(())
    }

    /// Opens the tier again: up to three tries under the faults in force, then one without.
    /// Returns how many tries it took.
    fn reopen(&mut self) -> Result<u32, String> {
        for attempt in 0..4 {
            if attempt == 3 {
                self.node.disk.set_rates(FaultRates::default());
            }
            match self.node.open() {
                Ok(()) => {
                    self.node.disk.set_rates(self.rates);
                    let s = self.node.tier().status();
                    self.log(format!(
                        "reopened: {} recovered, {} errors",
                        s.recovered, s.errors
                    ));
                    return Ok(attempt + 1);
                }
                Err(e) => self.log(format!("reopen failed: {e}")),
            }
        }
        self.node.disk.set_rates(self.rates);
        Err("the tier cannot be opened again, even on a healthy device".into())
    }

    /// New fault rates: off, light or heavy.
    pub(super) fn change_faults(&mut self) {
        let profile = self.rng.weighted(&[35, 40, 25]);
        let mut r = |lo: u64, hi: u64| self.rng.range(lo, hi);
        let rates = match profile {
            0 => FaultRates::default(),
            1 => FaultRates {
                read_eio: r(0, 20),
                read_flip: r(0, 20),
                write_eio: r(0, 30),
                write_enospc: r(0, 15),
                sync_eio: r(0, 40),
            },
            _ => FaultRates {
                read_eio: r(20, 150),
                read_flip: r(20, 100),
                write_eio: r(30, 200),
                write_enospc: r(10, 100),
                sync_eio: r(40, 300),
            },
        };
        self.rates = rates;
        self.node.disk.set_rates(rates);
        self.log(format!("faults: {rates:?}"));
    }

    /// Starts a write-behind batch or a load whose I/O gets stuck.
    pub(super) fn start_stuck(&mut self) -> Check {
        let (ids, job, at) = if self.rng.chance(65) {
            let n = self.rng.range(1, self.node.cfg.batch_objects as u64) as usize;
            let ids = self.pick(self.l1_ids(), n);
            let keys = ids.iter().map(|&i| self.key_of(i)).collect();
            let at = if self.rng.chance(50) {
                StallAt::PayloadWrite
            } else {
                StallAt::HeaderWrite
            };
            (ids, Job::Persist(keys), at)
        } else {
            let Some(p) = self.plan_load() else {
                return Ok(());
            };
            let job = Job::Load {
                keys: p.keys,
                extra: p.extra,
                expected: p.expected,
            };
            (p.ids, job, StallAt::PayloadRead)
        };
        if ids.is_empty() {
            return Ok(());
        }
        match worker::start(&self.node, ids.clone(), job, at)? {
            Started::Parked(s) => {
                self.stats.stalls += 1;
                self.log(format!("stuck {at:?} of {ids:?}"));
                self.stuck = Some(s);
                Ok(())
            }
            Started::Finished(job, out) => self.job_done(ids, job, out, "unstuck"),
        }
    }

    /// Releases a stuck I/O (if any): mostly completed, sometimes failed.
    pub(super) fn release_stuck(&mut self) -> Check {
        let how = if self.rng.chance(75) {
            Release::Complete
        } else {
            Release::Fail
        };
        self.release_with(how)
    }

    /// Releases a stuck I/O (if any) as `how` says and checks what it did.
    pub(super) fn release_with(&mut self, how: Release) -> Check {
        let Some(s) = self.stuck.take() else {
            return Ok(());
        };
        let ids = s.ids.clone();
        let (job, out) = s.release(how)?;
        self.job_done(ids, job, out, &format!("released ({how:?})"))?;
        self.check_all_l1()
    }

    fn job_done(&mut self, ids: Vec<u32>, job: Job, out: Outcome, what: &str) -> Check {
        match (job, out) {
            (Job::Persist(keys), Outcome::Persisted(n)) => {
                self.node.storage.clear_unwritten(&keys);
                self.stats.persisted += n;
                self.log(format!("{what} persist {ids:?}: {n} written"));
                Ok(())
            }
            (
                Job::Load {
                    keys,
                    extra,
                    expected,
                },
                Outcome::Loaded(leases),
            ) => {
                let p = LoadPlan {
                    ids,
                    keys,
                    extra,
                    expected,
                };
                self.check_loaded(&p, &leases, &format!("{what} load"))
            }
            _ => Err("a worker's outcome does not match its job (simulator bug)".into()),
        }
    }

    /// Much later on the simulator's clock, the L1 TTL sweep runs: nothing the tier holds for
    /// its own I/O (write-behind holds, load reservations) may expire, and the simulator holds
    /// no other lock between steps.
    pub(super) fn expire(&mut self) -> Check {
        let ms = self.rng.range(60_000, 3_600_000);
        self.node.clock.advance(ms);
        let (w, r) = self.node.storage.expire_locks(self.node.clock.now_ms());
        self.log(format!(
            "{ms} ms later, TTL sweep: {w} reservations, {r} locks expired"
        ));
        if (w, r) != (0, 0) {
            return Err(format!(
                "the L1 TTL sweep expired {w} reservations and {r} read locks, but only the \
                 tier's own (untimed) I/O holds were held"
            ));
        }
        Ok(())
    }
}
