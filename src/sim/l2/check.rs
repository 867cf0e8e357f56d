//! The checks run after every step, and the durability check run after every reopen.

use super::disk::FaultRates;
use super::model::Claim;
use super::{Check, L2Sim};
use crate::l2::tier::STAGING_BYTES;

impl L2Sim {
    /// Every per-step invariant (see the module docs of [`super`], items (a) to (e)).
    pub fn check_step(&mut self) -> Check {
        self.trace_faults();
        let v = self.node.disk.take_violations();
        if !v.is_empty() {
            return Err(format!(
                "the tier broke the device's rules: {}",
                v.join("; ")
            ));
        }
        let tier = self.node.tier();
        tier.check().map_err(|e| format!("L2 index: {e}"))?;
        let m = self.node.storage.memcheck();
        if !m.ok {
            return Err(format!("L1 memcheck: {:?}", m.problems));
        }
        if self.stuck.is_none() {
            let free = tier.staging_free() as u64;
            if free != STAGING_BYTES / 4096 {
                return Err(format!(
                    "{} staging blocks are still taken with no I/O running",
                    STAGING_BYTES / 4096 - free
                ));
            }
            let c = self.node.storage.counts();
            if (c.write_reserved, c.read_locked, c.doomed) != (0, 0, 0) {
                return Err(format!(
                    "L1 holds {} reservations, {} locked and {} doomed objects with no \
                     operation running",
                    c.write_reserved, c.read_locked, c.doomed
                ));
            }
        }
        self.refresh_claims()?;
        let in_l1: Vec<u32> = (0..self.model.keys.len() as u32)
            .filter(|&i| self.in_l1(i))
            .collect();
        if !in_l1.is_empty() {
            let id = in_l1[self.rng.index(in_l1.len())];
            self.check_l1_object(id, None)
                .map_err(|e| format!("L1 copy: {e}"))?;
        }
        let s = self.node.tier().status();
        let line = format!(
            "{} {} {} {} {} {} {} {} {}",
            s.objects,
            s.used_bytes,
            s.writes,
            s.errors,
            s.corrupt,
            s.evictions,
            s.skipped,
            s.hits,
            s.queued
        );
        self.digest.update(line.as_bytes());
        Ok(())
    }

    /// Adds the faults the device injected during the step to the trace.
    fn trace_faults(&mut self) {
        let (now, was) = (self.node.disk.stats(), self.seen);
        self.seen = now;
        let faults = [
            ("read EIO", now.read_eio - was.read_eio),
            ("flipped read", now.flips - was.flips),
            ("write EIO", now.write_eio - was.write_eio),
            ("ENOSPC", now.enospc - was.enospc),
            ("fdatasync EIO", now.sync_eio - was.sync_eio),
        ];
        let said: Vec<String> = faults
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(what, n)| format!("{n} {what}"))
            .collect();
        if !said.is_empty() {
            self.log(format!("  device faults: {}", said.join(", ")));
        }
    }

    /// Refreshes the claims from the tier's index: which version of each key it holds, and
    /// from which slot header write. A claim on the same copy keeps its durability.
    pub fn refresh_claims(&mut self) -> Check {
        self.refresh_claims_as(false)
    }

    /// [`L2Sim::refresh_claims`]; new claims are `inherited` (found at start-up) or not.
    pub fn refresh_claims_as(&mut self, inherited: bool) -> Check {
        for id in 0..self.model.keys.len() as u32 {
            let key = self.key_of(id);
            let tier = self.node.tier();
            if !tier.contains(&key) {
                self.model.claims.remove(&id);
                continue;
            }
            let k = &self.model.keys[id as usize];
            let Some(ver) = k
                .versions
                .iter()
                .rev()
                .find(|v| tier.holds_as(&key, v.bytes(), v.fp()))
            else {
                return Err(format!(
                    "L2 holds key {id} under a layout or length none of its versions has \
                     (another key's object?)"
                ));
            };
            if ver.v < self.model.soft_cleared_below {
                return Err(format!(
                    "L2 holds key {id} version {}, stored before a CLEAR{}",
                    ver.v,
                    if ver.v < self.model.cleared_below {
                        " that was acknowledged"
                    } else {
                        " (not yet restarted since)"
                    }
                ));
            }
            let written = self.node.disk.latest_header(&k.chunk_hash, ver.fp());
            // Found at start-up in an extent table although its slot header write was undone
            // (left in limbo by a failed fdatasync before the checkpoint), or claimed so since:
            // the table's entry names its slot; the payload is checked when it is loaded.
            let claimed = self.model.claims.get(&id);
            let from_table = || {
                tier.located(&key)
                    .map(|l| (l.seq, l.slot.file_offset))
                    .filter(|&(seq, offset)| {
                        inherited
                            || claimed
                                .is_some_and(|c| (c.v, c.seq, c.offset) == (ver.v, seq, offset))
                    })
            };
            let Some((seq, offset)) = written.or_else(from_table) else {
                return Err(format!(
                    "L2 holds key {id} version {}, but no slot header was ever written for it",
                    ver.v
                ));
            };
            let v = ver.v;
            let claim = match self.model.claims.get(&id) {
                Some(c) if (c.v, c.seq, c.offset) == (v, seq, offset) => *c,
                _ => Claim {
                    v,
                    seq,
                    offset,
                    synced: false,
                    inherited,
                },
            };
            self.model.claims.insert(id, claim);
        }
        Ok(())
    }

    /// Reads the L1 object of key `id` and judges it against the model (`expected`: the
    /// layout a load asked for). Returns its version.
    pub fn check_l1_object(&self, id: u32, expected: Option<u64>) -> Result<u64, String> {
        let Some(o) = self.node.l1_object(&self.key_of(id)) else {
            return Err(format!("key {id} was published but cannot be read from L1"));
        };
        self.model.check_served(id, expected, &o)
    }

    /// Judges every readable L1 object (after a stuck I/O ends: the riskiest moment for a
    /// write into the wrong pool slot).
    pub fn check_all_l1(&self) -> Check {
        for id in 0..self.model.keys.len() as u32 {
            if self.in_l1(id) {
                self.check_l1_object(id, None)
                    .map_err(|e| format!("L1 copy after a stuck I/O ended: {e}"))?;
            }
        }
        Ok(())
    }

    /// After a reopen (`what` stopped the tier): every claim acknowledged durable before the
    /// stop is held again and loads, with faults off, byte-exact under its own layout; claims
    /// whose slot or extent header could not be read at start-up (an injected fault) are
    /// excused.
    pub fn check_durable(&mut self, durable: &[(u32, Claim)], what: &str) -> Check {
        let faulted = self.node.disk.faulted_reads();
        let mut verify = Vec::new();
        for &(id, c) in durable {
            let ext = self.node.disk.extent_header_of(c.offset);
            if faulted.contains(&c.offset) || faulted.contains(&ext) {
                self.stats.durable_forgiven += 1;
                continue;
            }
            let ver = self.model.version(id, c.v).clone();
            if !self
                .node
                .tier()
                .holds_as(&self.key_of(id), ver.bytes(), ver.fp())
            {
                return Err(format!(
                    "{what} lost a durable object: key {id} version {} (slot header at {:#x}, \
                     seq {}) was held when a sync succeeded, but the reopened tier does not \
                     hold it ({})",
                    c.v,
                    c.offset,
                    c.seq,
                    self.node.disk.describe_slot(c.offset)
                ));
            }
            verify.push((id, ver));
        }
        self.node.disk.set_rates(FaultRates::default());
        let r = (|| {
            for (id, ver) in &verify {
                let key = self.key_of(*id);
                let lease = self.node.tier().load(
                    &self.node.storage,
                    std::slice::from_ref(&key),
                    0,
                    Some(&ver.layout),
                )[0];
                let Some(lease) = lease else {
                    let off = self.model.claims.get(id).map_or(0, |c| c.offset);
                    return Err(format!(
                        "after {what}, durable key {id} version {} is held but does not load \
                         (with no fault injected; {})",
                        ver.v,
                        self.node.disk.describe_slot(off)
                    ));
                };
                let got = self.check_l1_object(*id, Some(ver.fp()));
                self.node.storage.finish_read(&[(key, lease)], 0);
                match got {
                    Ok(v) if v == ver.v => {}
                    Ok(v) => {
                        return Err(format!(
                            "after {what}, durable key {id} version {} loaded as version {v}",
                            ver.v
                        ))
                    }
                    Err(e) => return Err(format!("after {what}, durable object: {e}")),
                }
            }
            Ok(())
        })();
        self.node.disk.set_rates(self.rates);
        r?;
        self.stats.durable_verified += verify.len() as u64;
        Ok(())
    }
}
