//! The load path: L2 objects pinned, read into fresh L1 slots, checksummed, and published
//! (or dropped) within the node-wide prefetch budget.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kvnode_hw::{BlockIo, EngineKind};

use super::{round_block, L2Tier, BLOCK_U64};
use crate::l2::format::payload_checksum;
use crate::l2::gate::GateToken;
use crate::storage::{Grant, KeyError, Layout, StorageCore, StorageKey};

/// Whether an L2 object can be served under `layout`: same size, and the same layout if one
/// was recorded (objects written while the model had no registered layout carry 0).
fn layout_matches(layout: &Layout, l: &crate::l2::space::Located) -> bool {
    l.object_len == layout.object_bytes() && (l.layout == 0 || l.layout == layout.fingerprint())
}

/// How long a load waits, in all, for keys another request is loading or storing into L1.
#[cfg(not(test))]
const WAIT_CONTENDED: std::time::Duration = std::time::Duration::from_secs(2);

/// Unit tests share two cores with stress tests: a starved loader must not fail them.
#[cfg(test)]
const WAIT_CONTENDED: std::time::Duration = std::time::Duration::from_secs(20);

/// Waits until `deadline` for a key that another request is loading or storing into L1 to
/// become readable, then takes `1 + extra` read locks on it. `None` if it vanished or time ran
/// out.
fn wait_readable(
    storage: &StorageCore,
    key: &StorageKey,
    extra: u32,
    deadline: std::time::Instant,
) -> Option<u64> {
    let mut pause = std::time::Duration::from_micros(50);
    loop {
        match storage
            .reserve_read(std::slice::from_ref(key), extra)
            .pop()?
        {
            Ok(g) => return Some(g.lease),
            Err(KeyError::KeyNotReadable) if std::time::Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(5));
            }
            Err(_) => return None,
        }
    }
}

/// What a load holds while its I/O runs: the prefetch budget, the L2 pins, the L1 reservations
/// not yet published or aborted, and (until its reservations are made, never across I/O) its
/// place in the CLEAR gate. All of it is given back on
/// drop, on the normal path and if a bug panics mid-load, so nothing stays pinned or reserved
/// (the reservations never expire by themselves).
struct LoadGuard<'a> {
    tier: &'a L2Tier,
    storage: &'a StorageCore,
    keys: &'a [StorageKey],
    budget: usize,
    pinned: Vec<Option<crate::l2::space::Located>>,
    grants: Vec<Option<Grant>>,
    gate: Option<GateToken<'a>>,
}

impl Drop for LoadGuard<'_> {
    fn drop(&mut self) {
        for (k, g) in self.keys.iter().zip(&mut self.grants) {
            if let Some(g) = g.take() {
                self.storage.abort_write(&[(*k, g)]);
            }
        }
        {
            let mut index = self.tier.index.lock();
            for (k, l) in self.keys.iter().zip(&self.pinned) {
                if let Some(l) = l {
                    let _ = index.unpin(k, l.slot);
                }
            }
        }
        self.tier
            .prefetch_budget()
            .fetch_sub(self.budget, Ordering::AcqRel);
    }
}

impl L2Tier {
    /// Loads objects that are on L2 but not in L1 into fresh L1 slots and publishes them with
    /// `1 + extra` read locks. Returns, per key, the lease of the lock taken, or `None` when the
    /// key was not loaded (not on L2, L1 full, prefetch bound reached, device error, corrupt
    /// payload: the last two also drop it from L2). At most `max_prefetch_objects` objects are
    /// in flight node-wide; keys beyond the budget are not loaded (callers cut their prefix there).
    /// With `expected` (the layout the model is registered with now), objects of another size
    /// or another recorded layout are not loaded: they were stored under an earlier layout.
    pub fn load(
        &self,
        storage: &StorageCore,
        keys: &[StorageKey],
        extra: u32,
        expected: Option<&Layout>,
    ) -> Vec<Option<u64>> {
        let mut out = vec![None; keys.len()];
        if self.stuck() {
            self.count_stalled(keys.len() as u64);
            return out;
        }
        let gate = self.clear_gate.enter();
        let budget = self.acquire_prefetch(keys.len());
        if budget == 0 {
            return out;
        }
        let keys = &keys[..budget];
        // Copies that cannot be served under `expected` are not pinned (nor made recent).
        let pinned: Vec<Option<crate::l2::space::Located>> = {
            let mut index = self.index.lock();
            keys.iter()
                .map(|k| index.pin_if(k, |l| expected.is_none_or(|e| layout_matches(e, l))))
                .collect()
        };
        let mut held = LoadGuard {
            tier: self,
            storage,
            keys,
            budget,
            grants: vec![None; keys.len()],
            pinned,
            gate: Some(gate),
        };
        let contended = self.load_pinned(&mut held, extra, expected, &mut out);
        // Pins, budget, gate and every unpublished reservation go back before any waiting.
        drop(held);
        // Keys another request was loading or storing: wait for them, together at most
        // `WAIT_CONTENDED`, and only until the first one fails (callers cut their prefix there).
        let deadline = std::time::Instant::now() + WAIT_CONTENDED;
        for i in contended {
            out[i] = wait_readable(storage, &keys[i], extra, deadline);
            if out[i].is_none() {
                break;
            }
        }
        out
    }

    /// The I/O part of [`L2Tier::load`]: reserves L1 slots for the pinned keys, reads and
    /// verifies them, publishes the good ones with their locks (into `out`) and aborts the rest.
    /// Returns the keys that someone else holds in L1 right now (to wait for).
    fn load_pinned(
        &self,
        held: &mut LoadGuard<'_>,
        extra: u32,
        expected: Option<&Layout>,
        out: &mut [Option<u64>],
    ) -> Vec<usize> {
        let (storage, keys) = (held.storage, held.keys);
        let located: Vec<Option<crate::l2::space::Located>> = held
            .pinned
            .iter()
            .map(|l| l.filter(|l| expected.is_none_or(|e| layout_matches(e, l))))
            .collect();
        // Reserve L1 slots, grouped by object length (one allocator call per group).
        let mut contended: Vec<usize> = Vec::new();
        let mut lens: Vec<u64> = located.iter().flatten().map(|l| l.object_len).collect();
        lens.sort_unstable();
        lens.dedup();
        for len in lens {
            let idx: Vec<usize> = (0..keys.len())
                .filter(|&i| located[i].as_ref().is_some_and(|l| l.object_len == len))
                .collect();
            let group: Vec<StorageKey> = idx.iter().map(|&i| keys[i]).collect();
            for (&i, r) in idx.iter().zip(storage.reserve_write_untimed(&group, len)) {
                match r {
                    Ok(g) => held.grants[i] = Some(g),
                    Err(KeyError::OutOfMemory) => {
                        tracing::debug!("L1 full: L2 object not loaded")
                    }
                    // Present in L1 meanwhile, or being loaded/stored by someone else.
                    Err(_) => contended.push(i),
                }
            }
        }
        // Pinned in L2 and reserved in L1 under the gate: a CLEAR from now on dooms both (the
        // reservation is then never published). The I/O runs outside the gate, so a CLEAR never
        // waits for a device.
        drop(held.gate.take());
        let grants = held.grants.clone();
        let plan: Vec<usize> = (0..keys.len()).filter(|&i| grants[i].is_some()).collect();
        let ios: Vec<BlockIo> = plan
            .iter()
            .map(|&i| {
                let l = located[i].as_ref().expect("granted implies located");
                BlockIo {
                    pool_offset: grants[i].expect("planned").slot.offset,
                    file_offset: l.slot.file_offset + BLOCK_U64,
                    len: round_block(l.object_len),
                }
            })
            .collect();
        // Checksums are verified as each read completes, while the rest are still on the disk;
        // with the io_uring engine (callbacks on the ring's thread) every other object goes to a
        // helper thread, so a batch whose reads finish together is verified twice as fast.
        let checksum_ok: Vec<std::sync::atomic::AtomicBool> =
            plan.iter().map(|_| Default::default()).collect();
        let verify = |j: usize| {
            let i = plan[j];
            let l = located[i].as_ref().expect("planned");
            let g = grants[i].expect("planned");
            let sum = self
                .pool
                .region()
                .with_bytes(g.slot.offset, l.object_len, payload_checksum);
            checksum_ok[j].store(sum.ok() == Some(l.checksum), Ordering::Relaxed);
        };
        let _call = self.io.start(ios.iter().map(|io| io.len).sum());
        let results = if plan.len() < 4 || self.read_engine.kind() != EngineKind::Uring {
            self.read_engine.read_batch_then(&ios, &verify)
        } else {
            std::thread::scope(|scope| {
                let (tx, rx) = std::sync::mpsc::channel::<usize>();
                let helper = std::thread::Builder::new()
                    .name("kvnode-l2-verify".into())
                    .spawn_scoped(scope, || rx.into_iter().for_each(verify));
                match helper {
                    Ok(_) => self.read_engine.read_batch_then(&ios, &|j| {
                        if j % 2 == 1 {
                            if let Err(back) = tx.send(j) {
                                verify(back.0);
                            }
                        } else {
                            verify(j);
                        }
                    }),
                    Err(_) => self.read_engine.read_batch_then(&ios, &verify),
                }
                // The scope joins the helper (after the sender is dropped) before returning.
            })
        };
        drop(_call);
        let mut loaded = 0u64;
        for (j, (&i, r)) in plan.iter().zip(results).enumerate() {
            let l = located[i].as_ref().expect("planned");
            let Some(g) = held.grants[i].take() else {
                continue;
            };
            if self.verdict(r, checksum_ok[j].load(Ordering::Relaxed), l) {
                // An error here means the object was cleared meanwhile (and freed by publish).
                if let Some(Ok(lease)) = storage
                    .finish_write_locked(&[(keys[i], g)], extra, l.layout)
                    .pop()
                {
                    out[i] = Some(lease);
                    loaded += 1;
                    self.counters
                        .bytes_read
                        .fetch_add(l.object_len, Ordering::Relaxed);
                }
            } else {
                storage.abort_write(&[(keys[i], g)]);
                self.index.lock().remove(&keys[i]);
            }
        }
        self.counters.hits.fetch_add(loaded, Ordering::Relaxed);
        contended
    }

    /// Judges one loaded payload: the read succeeded and its checksum matched. Failures are
    /// counted and logged here; the caller drops the object.
    fn verdict(
        &self,
        read: kvnode_hw::HwResult<u64>,
        checksum_ok: bool,
        l: &crate::l2::space::Located,
    ) -> bool {
        if let Err(e) = read {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, file_offset = l.slot.file_offset, "L2 read failed: object dropped from L2");
            return false;
        }
        if !checksum_ok {
            if l.seq < self.identity.torn_below() {
                self.counters.torn.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    file_offset = l.slot.file_offset,
                    "L2 object written before an unclean stop failed its checksum (torn by \
                     the stop): dropped, not served"
                );
            } else {
                self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    file_offset = l.slot.file_offset,
                    "L2 object failed its checksum: dropped, not served"
                );
            }
            return false;
        }
        true
    }

    /// The prefetch budget counter (objects being loaded).
    pub(in crate::l2) fn prefetch_budget(&self) -> Arc<AtomicUsize> {
        self.prefetching.read().clone()
    }

    /// Uses `budget` (another device's) instead of this device's own counter, so a set of
    /// devices has one node-wide bound. Only at opening, before any load.
    pub(in crate::l2) fn share_prefetch_budget(&self, budget: &Arc<AtomicUsize>) {
        *self.prefetching.write() = budget.clone();
    }

    /// Takes up to `want` units of the node-wide prefetch budget.
    fn acquire_prefetch(&self, want: usize) -> usize {
        let counter = self.prefetch_budget();
        let mut cur = counter.load(Ordering::Acquire);
        loop {
            let n = want.min(self.max_prefetch.saturating_sub(cur));
            if n == 0 {
                return 0;
            }
            match counter.compare_exchange_weak(cur, cur + n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return n,
                Err(c) => cur = c,
            }
        }
    }
}
