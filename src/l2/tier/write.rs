//! The write-behind path: batches of committed L1 objects planned inside the CLEAR gate,
//! their payloads then their slot headers written straight from the pool, and committed.

use std::sync::atomic::Ordering;

use kvnode_hw::{BlockIo, HwError};

use super::sync::SYNC_ALLOWANCE_BYTES;
use super::{round_block, same_object, InFlight, L2Tier, BLOCK_U64};
use crate::l2::format::{extent_offset, payload_checksum, ExtentHeader, SlotHeader, BLOCK};
use crate::l2::gate::GateToken;
use crate::l2::space::ReserveError;
use crate::storage::{Grant, Namespaces, StorageCore, StorageKey};

/// Payload bytes per write batch at most (besides `l2.batch_objects`): batch k+1 is locked and
/// checksummed while batch k is on the disk, which only overlaps when one batch is a small part
/// of the work (64 objects of 32 MiB would be one 2 GiB batch, checksummed before any of it is
/// written).
pub const WRITE_BATCH_BYTES: u64 = 128 << 20;

/// Splits `keys` into consecutive parts of at most `max_objects` keys whose lengths (`len_of`)
/// reach at most [`WRITE_BATCH_BYTES`] (a part ends with the key that reaches it; every part
/// holds at least one key).
pub(crate) fn byte_bounded_parts<'k>(
    keys: &'k [StorageKey],
    max_objects: usize,
    len_of: &dyn Fn(&StorageKey) -> u64,
) -> Vec<&'k [StorageKey]> {
    let mut parts = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, k) in keys.iter().enumerate() {
        bytes += len_of(k);
        if i + 1 - start >= max_objects.max(1) || bytes >= WRITE_BATCH_BYTES {
            parts.push(&keys[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < keys.len() {
        parts.push(&keys[start..]);
    }
    parts
}

/// A planned write-behind batch: the L1 I/O holds it keeps on its objects, the objects, their I/Os (header
/// then payload, per object) and the staging blocks of the headers. Invariant: every lock and
/// block is released by `complete_write`, exactly once. The batch was planned inside the CLEAR
/// gate but holds no place in it during its I/O: a CLEAR meanwhile dooms its index entries
/// (never committed) and its headers carry the format id the CLEAR replaced.
pub(in crate::l2) struct WriteBatch<'a> {
    tier: &'a L2Tier,
    storage: &'a StorageCore,
    locked: Vec<(StorageKey, Grant)>,
    plans: Vec<PlannedWrite>,
    ios: Vec<BlockIo>,
    blocks: Vec<u64>,
    /// Counted in the tier's `writes_in_flight` until the batch is dropped (after its end).
    _in_flight: InFlight<'a>,
}

impl Drop for WriteBatch<'_> {
    /// Only does something when the batch was never completed (a bug panicked, or the thread
    /// meant to complete it is gone): its objects are not written, their L2 slots, staging
    /// blocks and L1 locks are released.
    fn drop(&mut self) {
        if !self.plans.is_empty() {
            let mut index = self.tier.index.lock();
            for p in &self.plans {
                let _ = index.abort(p.key, p.slot);
            }
            self.tier
                .counters
                .errors
                .fetch_add(self.plans.len() as u64, Ordering::Relaxed);
        }
        self.tier.staging.give(std::mem::take(&mut self.blocks));
        self.storage.release_io_holds(&self.locked);
    }
}

/// One planned object write of a batch.
struct PlannedWrite {
    key: StorageKey,
    slot: crate::l2::space::SlotRef,
    checksum: u64,
    layout: u64,
    len: u64,
    extent_ok: bool,
}

impl L2Tier {
    /// Writes committed L1 objects to L2 (those not already there): each is held in L1 (an I/O hold)
    /// for the duration of its write, so its slot is neither freed nor reused under the I/O.
    /// Batches are pipelined: while one batch is on the disk (an I/O thread), the next one is
    /// checksummed and staged. Returns the number written.
    pub fn persist(
        &self,
        storage: &StorageCore,
        namespaces: &Namespaces,
        keys: &[StorageKey],
    ) -> u64 {
        if self.stuck() {
            // The device has not answered for a while: nothing is locked for it meanwhile.
            return 0;
        }
        if self.sealed() {
            // The checkpoint's tables describe the tier: nothing may change it any more.
            self.counters
                .skipped
                .fetch_add(keys.len() as u64, Ordering::Relaxed);
            return 0;
        }
        let parts = byte_bounded_parts(keys, self.batch_objects, &|k| {
            storage.ready_object(k).map_or(0, |(len, _)| len)
        });
        if parts.len() <= 1 {
            return parts
                .into_iter()
                .filter_map(|part| self.prepare_write(storage, namespaces, part))
                .map(|batch| self.complete_write(storage, batch))
                .sum();
        }
        std::thread::scope(|scope| {
            // One batch on the disk, one staged: at most three hold staging blocks at once.
            let (tx, rx) = std::sync::mpsc::sync_channel::<WriteBatch>(1);
            let io = std::thread::Builder::new()
                .name("kvnode-l2-batch".into())
                .spawn_scoped(scope, move || {
                    rx.iter()
                        .map(|batch| self.complete_write(storage, batch))
                        .sum::<u64>()
                });
            let io = match io {
                Ok(h) => h,
                Err(e) => {
                    tracing::warn!(error = %e, "no L2 I/O thread: writing without pipelining");
                    return parts
                        .into_iter()
                        .filter_map(|part| self.prepare_write(storage, namespaces, part))
                        .map(|batch| self.complete_write(storage, batch))
                        .sum();
                }
            };
            for part in parts {
                if let Some(batch) = self.prepare_write(storage, namespaces, part) {
                    if let Err(back) = tx.send(batch) {
                        // The I/O thread is gone (a bug): finish here so nothing stays locked.
                        self.complete_write(storage, back.0);
                    }
                }
            }
            drop(tx);
            io.join().unwrap_or_else(|_| {
                tracing::error!("L2 I/O thread panicked (bug)");
                0
            })
        })
    }

    /// Locks `part` in L1 (the objects not already on L2), checksums each payload, reserves
    /// its L2 slot, writes the headers of newly assigned extents, and stages the slot headers.
    /// `None` when nothing is left to write.
    pub(in crate::l2) fn prepare_write<'a>(
        &'a self,
        storage: &'a StorageCore,
        namespaces: &Namespaces,
        part: &[StorageKey],
    ) -> Option<WriteBatch<'a>> {
        // Leases for this batch's numbers, extended (a superblock write) outside the gate.
        let next_epoch = self.index.lock().next_epoch();
        if let Err(e) = self
            .identity
            .prepare(part.len() as u64, next_epoch, &|o, b| {
                self.write_durable(o, b)
            })
        {
            tracing::warn!(error = %e, "L2 leases not extended: batch not written");
            self.counters
                .errors
                .fetch_add(part.len() as u64, Ordering::Relaxed);
            return None;
        }
        let gate = self.clear_gate.enter();
        if self.sealed() {
            // The checkpoint has begun (it set the flag alone in the gate): nothing more.
            self.counters
                .skipped
                .fetch_add(part.len() as u64, Ordering::Relaxed);
            return None;
        }
        let in_flight = InFlight::new(&self.writes_in_flight);
        // Already on L2 as this very object (same length and layout): nothing to write. A copy
        // stored under another layout is dropped and replaced (loads would never serve it).
        let todo: Vec<StorageKey> = {
            let mut index = self.index.lock();
            part.iter()
                .filter(|k| {
                    let Some(l) = index.get(k) else { return true };
                    match storage.ready_object(k) {
                        Some((len, layout)) if !same_object(&l, len, layout) => {
                            index.remove(k);
                            true
                        }
                        _ => false,
                    }
                })
                .copied()
                .collect()
        };
        if todo.is_empty() {
            return None;
        }
        // An I/O hold, not a timed read lock: the slot is neither freed nor reused until the
        // device has finished reading it, however slow the device is.
        let grants = storage.hold_for_io(&todo);
        let locked: Vec<(StorageKey, Grant)> = todo
            .iter()
            .zip(grants)
            .filter_map(|(k, g)| g.ok().map(|g| (*k, g)))
            .collect();
        // Evicted (or cleared) from L1 before its turn came: it cannot be written any more.
        self.counters
            .skipped
            .fetch_add((todo.len() - locked.len()) as u64, Ordering::Relaxed);
        Some(self.plan_write(storage, namespaces, locked, gate, in_flight))
    }

    /// Plans the writes of read-locked objects (at most `batch_objects`): extent headers of
    /// newly assigned extents are written first (synchronously, they are small), then each
    /// object's header is staged; the returned batch holds the header and payload I/Os.
    fn plan_write<'a>(
        &'a self,
        storage: &'a StorageCore,
        namespaces: &Namespaces,
        locked: Vec<(StorageKey, Grant)>,
        gate: GateToken<'a>,
        in_flight: InFlight<'a>,
    ) -> WriteBatch<'a> {
        let items = &locked;
        let format_id = self.identity.format_id();
        let mut extent_headers: Vec<(u32, u64, Vec<u8>)> = Vec::new();
        let mut plans: Vec<PlannedWrite> = Vec::new();
        let mut slot_headers: Vec<Vec<u8>> = Vec::new();
        for (key, grant) in items {
            let Some((model, cache_salt)) = namespaces.name(key.namespace) else {
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let len = grant.slot.len;
            let checksum =
                match self
                    .pool
                    .region()
                    .with_bytes(grant.slot.offset, len, payload_checksum)
                {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::error!(error = %e, "L1 slot outside the pool (bug)");
                        continue;
                    }
                };
            // Numbers come from leases prepared before the gate: no I/O in here. Should another
            // batch have used them up meanwhile, the object waits for the next round.
            let next_epoch = self.index.lock().next_epoch();
            let seq = match self.identity.try_next_seq() {
                Some(s) if self.identity.epochs_leased(next_epoch) => s,
                _ => {
                    self.defer(*key);
                    continue;
                }
            };
            let reserved = self.index.lock().reserve(*key, len, seq);
            let reservation = match reserved {
                Ok(r) => r,
                Err(ReserveError::Exists) => {
                    // An older entry of this key is still being loaded or written (doomed, or
                    // racing another writer): write this one once that is over.
                    if !self.index.lock().contains(key) {
                        self.defer(*key);
                    }
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "object not written to L2");
                    self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            self.counters
                .evictions
                .fetch_add(reservation.evicted.len() as u64, Ordering::Relaxed);
            if let Some((extent, epoch, stride)) = reservation.new_extent {
                let mut b = vec![0u8; BLOCK];
                ExtentHeader {
                    format_id,
                    extent_index: extent,
                    epoch,
                    stride,
                }
                .encode(&mut b);
                self.mark_headed(extent);
                extent_headers.push((extent, extent_offset(self.extent_bytes, extent), b));
            }
            let header = SlotHeader {
                format_id,
                extent_epoch: reservation.slot.epoch,
                file_offset: reservation.slot.file_offset,
                seq,
                chunk_hash: key.chunk_hash,
                kv_rank: key.kv_rank,
                object_group: key.object_group,
                model,
                cache_salt,
                object_len: len,
                payload_checksum: checksum,
                // Read under the batch's L1 I/O hold: the layout of exactly these bytes.
                layout: storage.ready_object(key).map_or(0, |(_, layout)| layout),
            };
            let mut b = vec![0u8; BLOCK];
            if let Err(e) = header.encode(&mut b) {
                tracing::debug!(error = %e, "object key does not fit an L2 header");
                let _ = self.index.lock().abort(*key, reservation.slot);
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            slot_headers.push(b);
            plans.push(PlannedWrite {
                key: *key,
                slot: reservation.slot,
                checksum,
                layout: header.layout,
                len,
                extent_ok: true,
            });
        }
        // Reserved and staged under the gate (in memory, but for a rare lease extension); the
        // extent headers' I/O runs outside it.
        drop(gate);
        // Extent headers first, so a slot is never written into an extent whose header says
        // otherwise (a crash in between leaves at worst an extent with no readable slots).
        if !extent_headers.is_empty() {
            let writes: Vec<(u64, Vec<u8>)> = extent_headers
                .iter()
                .map(|(_, off, b)| (*off, b.clone()))
                .collect();
            for ((extent, _, _), r) in extent_headers.iter().zip(self.write_blocks(&writes)) {
                if let Err(e) = r {
                    tracing::warn!(extent, error = %e, "L2 extent header write failed");
                    // The next reservation in this extent rewrites the header; until then
                    // nothing is written into it.
                    self.index.lock().header_lost(*extent);
                    for p in plans.iter_mut().filter(|p| p.slot.extent == *extent) {
                        p.extent_ok = false;
                    }
                }
            }
            // Durable before any slot of the extent is written: a crash must never leave slot
            // headers of a new assignment without the extent header that carries its epoch
            // (recovery would not know the epoch, could hand it out again, and the old slot
            // headers would then look current).
            let synced = {
                let _call = self.io.start(SYNC_ALLOWANCE_BYTES);
                self.write_engine.sync()
            };
            if let Err(e) = synced {
                tracing::warn!(error = %e, "L2 fdatasync after extent headers failed");
                // Nothing written since the last good sync is known durable any more (their
                // keys are written again only if the writer meets them again).
                self.drop_unsynced();
                for (extent, _, _) in &extent_headers {
                    self.index.lock().header_lost(*extent);
                }
                for p in plans.iter_mut() {
                    if extent_headers.iter().any(|(e, _, _)| *e == p.slot.extent) {
                        p.extent_ok = false;
                    }
                }
            }
        }
        // Objects of extents without a header are not written (they could not be recovered).
        let (plans, dropped): (Vec<_>, Vec<_>) = plans
            .into_iter()
            .zip(slot_headers)
            .partition(|(p, _)| p.extent_ok);
        for (p, _) in &dropped {
            let _ = self.index.lock().abort(p.key, p.slot);
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        let (plans, slot_headers): (Vec<PlannedWrite>, Vec<Vec<u8>>) = plans.into_iter().unzip();
        let grants: std::collections::HashMap<StorageKey, Grant> = items.iter().copied().collect();
        let blocks = self.staging.take(plans.len());
        let mut ios = Vec::with_capacity(plans.len() * 2);
        for ((p, hdr), &b) in plans.iter().zip(&slot_headers).zip(&blocks) {
            self.pool
                .region()
                .write_at(b, hdr)
                .expect("staging block in the pool");
            ios.push(BlockIo {
                pool_offset: b,
                file_offset: p.slot.file_offset,
                len: BLOCK_U64,
            });
            ios.push(BlockIo {
                pool_offset: grants[&p.key].slot.offset,
                file_offset: p.slot.file_offset + BLOCK_U64,
                len: round_block(p.len),
            });
        }
        if blocks.len() < plans.len() {
            ios.clear(); // staging exhausted (cannot happen): everything aborts in complete_write
        }
        WriteBatch {
            tier: self,
            storage,
            locked,
            plans,
            ios,
            blocks,
            _in_flight: in_flight,
        }
    }

    /// Runs a planned batch's I/O, commits what was written, aborts what was not, and releases
    /// the staging blocks and the L1 I/O holds. Returns the number written.
    pub(in crate::l2) fn complete_write(
        &self,
        storage: &StorageCore,
        mut batch: WriteBatch<'_>,
    ) -> u64 {
        debug_assert!(std::ptr::eq(batch.tier, self) && std::ptr::eq(batch.storage, storage));
        // Taken out of the batch: its Drop (the panic path) then has nothing left to release.
        let locked = std::mem::take(&mut batch.locked);
        let plans = std::mem::take(&mut batch.plans);
        let ios = std::mem::take(&mut batch.ios);
        let blocks = std::mem::take(&mut batch.blocks);
        // A failed fdatasync while this batch is on the device may lose its payloads even if its
        // headers land after it: then nothing of the batch is committed (written again later).
        let failed_syncs = self.unsynced.lock().failed_syncs;
        let results = self.write_payloads_then_headers(&ios);
        self.staging.give(blocks);
        let (mut written, mut bytes_written) = (0u64, 0u64);
        for (i, p) in plans.iter().enumerate() {
            let io_ok = match (results.get(2 * i), results.get(2 * i + 1)) {
                (Some(Ok(_)), Some(Ok(_))) => Ok(()),
                (Some(Err(e)), _) | (_, Some(Err(e))) => Err(e.to_string()),
                _ => Err("not submitted".to_owned()),
            };
            // Lock order: unsynced, then index (as in `drop_unsynced`).
            let mut unsynced = self.unsynced.lock();
            let io_ok = match io_ok {
                Ok(()) if unsynced.failed_syncs != failed_syncs => {
                    self.defer(p.key);
                    Err("an fdatasync failed while the batch was on the device".to_owned())
                }
                other => other,
            };
            let mut index = self.index.lock();
            match io_ok {
                Ok(()) => {
                    if index.commit(p.key, p.slot, p.checksum, p.layout).is_ok() {
                        written += 1;
                        bytes_written += p.len;
                        unsynced.objects.push((p.key, p.slot));
                    }
                }
                other => {
                    drop(unsynced);
                    let _ = index.abort(p.key, p.slot);
                    drop(index);
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        error = other.err().as_deref().unwrap_or_default(),
                        file_offset = p.slot.file_offset,
                        "L2 write failed: object kept in L1 only"
                    );
                }
            }
        }
        storage.release_io_holds(&locked);
        // Counted only now: STATUS never shows a write as done while L1 still holds its lock.
        self.counters.writes.fetch_add(written, Ordering::Relaxed);
        self.counters
            .bytes_written
            .fetch_add(bytes_written, Ordering::Relaxed);
        written
    }

    /// Runs a batch's I/Os (`[header, payload]` per object): every payload first, then the
    /// headers of the objects whose payload was written, so a header on the device always
    /// describes a payload that was completely written before it (a crash between the two
    /// leaves an object without a header, never a header without its payload). Results in the
    /// order of `ios`; a header not attempted reports its payload's error.
    fn write_payloads_then_headers(&self, ios: &[BlockIo]) -> Vec<kvnode_hw::HwResult<u64>> {
        if ios.is_empty() {
            return Vec::new();
        }
        let payloads: Vec<BlockIo> = ios.iter().skip(1).step_by(2).copied().collect();
        let written = {
            let _call = self.io.start(payloads.iter().map(|io| io.len).sum());
            self.write_engine.write_batch(&payloads)
        };
        let headers: Vec<BlockIo> = ios
            .iter()
            .step_by(2)
            .zip(&written)
            .filter(|(_, w)| w.is_ok())
            .map(|(h, _)| *h)
            .collect();
        let mut header_results = {
            let _call = self.io.start(headers.iter().map(|io| io.len).sum());
            self.write_engine.write_batch(&headers).into_iter()
        };
        let mut out = Vec::with_capacity(ios.len());
        for w in written {
            match w {
                Ok(n) => {
                    out.push(
                        header_results.next().unwrap_or_else(|| {
                            Err(HwError::Invalid("header write not run".into()))
                        }),
                    );
                    out.push(Ok(n));
                }
                Err(e) => {
                    out.push(Err(HwError::Invalid(format!(
                        "not written: payload failed ({e})"
                    ))));
                    out.push(Err(e));
                }
            }
        }
        out
    }
}
