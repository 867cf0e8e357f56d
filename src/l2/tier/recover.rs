//! Start-up: rebuilding the index from the extent headers, then, extent by extent, from its
//! table (after a clean stop: one block read per [`ENTRIES_PER_TABLE_BLOCK`] slots) or from its
//! slot headers (after a crash, or for the slots of a table block that is not current).
//! Payloads are verified when they are loaded.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{L2Tier, READ_RINGS, RECOVERY_READS, STAGING_BYTES};
use crate::error::Result;
use crate::l2::format::table_offset;
use crate::l2::format::{
    extent_count, extent_offset, slot_offset_of, slots_per_extent, table_blocks, ExtentHeader,
    FormatError, SlotHeader, TableBlock, TableEntry, BLOCK, ENTRIES_PER_TABLE_BLOCK,
};
use crate::l2::space::{RecoverOutcome, Recovered};
use crate::storage::{Namespaces, StorageKey};

/// What recovery found in one slot.
enum SlotScan {
    /// The header could not be read (an I/O error).
    Unreadable,
    /// Never written, torn, not a slot header, or free in a current table.
    Free,
    /// A decoded header (or a table entry standing for it) and the slot's offset.
    Header(Box<SlotHeader>, u64),
}

/// The slots of one assigned extent, read at start-up.
struct ExtentScan {
    extent: u32,
    epoch: u64,
    slots: Vec<SlotScan>,
}

/// The model and salt of each namespace digest met in an extent's tables (read from one slot
/// header each).
type Names = HashMap<u128, (String, String)>;

/// What the start-up read, for STATUS and the log.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct RecoveryReads {
    /// Blocks read (extent headers, table blocks, slot headers).
    pub blocks: u64,
    /// Table blocks that were current (their slots needed no header read but one per namespace).
    pub tables_used: u64,
    /// Table blocks read but not current (their slots were read header by header).
    pub tables_stale: u64,
}

impl L2Tier {
    /// Rebuilds the index from what is on disk.
    pub(super) fn recover(&mut self, namespaces: &Namespaces) -> Result<()> {
        let format_id = self.identity.format_id();
        let checkpoint = self.identity.opened_checkpoint();
        // Epochs of this run start above every epoch leased before, read or not.
        self.index
            .get_mut()
            .note_epoch(self.identity.first_epoch().saturating_sub(1));
        let extents = extent_count(self.file_bytes, self.extent_bytes);
        let blocks_read = AtomicU64::new(u64::from(extents));
        let (tables_used, tables_stale) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut assigned = Vec::new();
        let mut unreadable = 0u64;
        // Extent headers in batches (a device of small extents has millions of them).
        let mut found = Vec::with_capacity(RECOVERY_READS);
        for first in (0..extents).step_by(RECOVERY_READS) {
            let batch: Vec<u32> = (first..extents).take(RECOVERY_READS).collect();
            let offsets: Vec<u64> = batch
                .iter()
                .map(|&e| extent_offset(self.extent_bytes, e))
                .collect();
            found.clear();
            found.extend(
                batch
                    .into_iter()
                    .zip(self.read_blocks(&offsets, RECOVERY_READS)),
            );
            for (e, block) in found.drain(..) {
                self.recover_extent_header(e, block, format_id, &mut assigned, &mut unreadable);
            }
        }
        let (mut inserted, mut rejected, mut max_seq) = (0u64, 0u64, 0u64);
        // Extents are read by one thread per read ring (each with its share of the staging
        // area); this thread decodes nothing and only rebuilds the index, so the disk sees
        // several batches of reads at once.
        let this = &*self;
        let readers = READ_RINGS.min(assigned.len()).max(1);
        let per_call = (STAGING_BYTES as usize / BLOCK / readers).min(RECOVERY_READS);
        let next = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<ExtentScan>(2 * readers);
            for _ in 0..readers {
                let (tx, next, assigned) = (tx.clone(), &next, &assigned);
                let counts = (&blocks_read, &tables_used, &tables_stale);
                scope.spawn(move || {
                    while let Some((e, h)) = assigned.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let scan = this.scan_extent(*e, h, checkpoint, per_call);
                        counts.0.fetch_add(scan.1.blocks, Ordering::Relaxed);
                        counts.1.fetch_add(scan.1.tables_used, Ordering::Relaxed);
                        counts.2.fetch_add(scan.1.tables_stale, Ordering::Relaxed);
                        if tx.send(scan.0).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(tx);
            for scan in rx {
                let mut index = this.index.lock();
                for (j, slot) in scan.slots.into_iter().enumerate() {
                    let (s, expected_offset) = match slot {
                        SlotScan::Unreadable => {
                            unreadable += 1; // the slot is treated as free
                            continue;
                        }
                        SlotScan::Free => continue,
                        SlotScan::Header(s, off) => (s, off),
                    };
                    index.note_epoch(s.extent_epoch);
                    if s.format_id != format_id
                        || s.extent_epoch != scan.epoch
                        || s.file_offset != expected_offset
                    {
                        continue; // left over from an earlier format or assignment
                    }
                    let Ok(namespace) = namespaces.intern_recovered(&s.model, &s.cache_salt) else {
                        rejected += 1;
                        continue;
                    };
                    let key = StorageKey {
                        chunk_hash: s.chunk_hash,
                        kv_rank: s.kv_rank,
                        object_group: s.object_group,
                        namespace,
                    };
                    let outcome = index.recover_entry(
                        key,
                        j as u32,
                        scan.extent,
                        Recovered {
                            object_len: s.object_len,
                            checksum: s.payload_checksum,
                            seq: s.seq,
                            layout: s.layout,
                        },
                    );
                    match outcome {
                        RecoverOutcome::Inserted => inserted += 1,
                        // OverCap: counted by the index (`unindexed`).
                        RecoverOutcome::ReplacedOlder
                        | RecoverOutcome::KeptNewer
                        | RecoverOutcome::OverCap => {}
                        RecoverOutcome::Rejected(_) => rejected += 1,
                    }
                    max_seq = max_seq.max(s.seq);
                }
            }
        });
        self.startup = RecoveryReads {
            blocks: blocks_read.into_inner(),
            tables_used: tables_used.into_inner(),
            tables_stale: tables_stale.into_inner(),
        };
        let index = self.index.get_mut();
        index.finish_recovery();
        let stats = index.stats();
        self.recovered = stats.objects;
        if stats.unindexed > 0 {
            tracing::warn!(
                unindexed = stats.unindexed,
                indexed = stats.entries,
                max_objects = stats.max_entries,
                max_index_bytes = stats.index_limit_bytes,
                "L2 objects found at start-up exceed the index cap (l2.max_index_bytes): the \
                 least recently written are not indexed and their slots will be reused"
            );
        }
        // Never above the lease in a tier this code wrote; kept as a guard all the same.
        self.identity.seq_at_least(max_seq.saturating_add(1));
        if unreadable > 0 {
            self.counters
                .errors
                .fetch_add(unreadable, Ordering::Relaxed);
            tracing::warn!(
                unreadable,
                "L2 headers could not be read at start-up: their extents or slots are treated as free"
            );
        }
        if rejected > 0 {
            tracing::warn!(rejected, "L2 recovery rejected some slot headers");
        }
        if checkpoint != 0 && self.startup.tables_stale > 0 {
            tracing::warn!(
                stale = self.startup.tables_stale,
                current = self.startup.tables_used,
                "L2 extent table blocks unreadable or not current after a clean stop: their \
                 slots were recovered from their headers"
            );
        }
        tracing::info!(
            inserted,
            objects = self.recovered,
            clean_stop = checkpoint != 0,
            blocks_read = self.startup.blocks,
            tables_used = self.startup.tables_used,
            "L2 index rebuilt"
        );
        Ok(())
    }

    /// Judges one extent header read at start-up: a current one assigns the extent in the
    /// index (and joins `assigned`), an unreadable one counts in `unreadable` (the extent is
    /// free); any epoch seen is never used again. Every extent but a zero one or one of an
    /// earlier format is marked `headed`: a checkpoint must zero it if it ends up free.
    fn recover_extent_header(
        &mut self,
        e: u32,
        block: Result<Vec<u8>>,
        format_id: u64,
        assigned: &mut Vec<(u32, ExtentHeader)>,
        unreadable: &mut u64,
    ) {
        let Ok(block) = block else {
            *unreadable += 1; // the extent is treated as free
                              // It may hold a valid header all the same (a transient error): a checkpoint
                              // zeroes it, or the next start would find it with no table and read its slots.
            self.mark_headed(e);
            return;
        };
        match ExtentHeader::decode(&block) {
            Ok(h) => {
                // Any epoch seen on disk stays unused from now on (stale slot headers that
                // carry it can never match a new assignment).
                self.index.get_mut().note_epoch(h.epoch);
                if h.format_id != format_id {
                    return; // an earlier format's: stale
                }
                // Valid under this format: a checkpoint zeroes it if the extent ends up free.
                self.mark_headed(e);
                if h.extent_index != e {
                    return;
                }
                match self.index.get_mut().recover_extent(e, h.epoch, h.stride) {
                    Ok(()) => assigned.push((e, h)),
                    Err(err) => {
                        tracing::warn!(extent = e, error = %err, "L2 extent header rejected")
                    }
                }
            }
            Err(FormatError::Empty) => {}
            Err(err) => {
                // Damaged, or damaged in the reading only (a flipped bit on the way): as for
                // an unreadable one, a checkpoint zeroes it.
                self.mark_headed(e);
                tracing::warn!(extent = e, error = %err, "L2 extent header damaged: extent treated as free")
            }
        }
    }

    /// Reads one assigned extent: its current table blocks, then the headers of every slot no
    /// current table block describes. `checkpoint == 0`: no table is current.
    fn scan_extent(
        &self,
        e: u32,
        h: &ExtentHeader,
        checkpoint: u64,
        per_call: usize,
    ) -> (ExtentScan, RecoveryReads) {
        // Per extent, not per reader thread: which blocks a start reads must not depend on
        // how the extents fell to the threads (the simulator replays a seed's reads exactly).
        let mut names = Names::new();
        let n = slots_per_extent(self.extent_bytes, h.stride);
        let mut reads = RecoveryReads::default();
        let mut slots: Vec<Option<SlotScan>> = (0..n).map(|_| None).collect();
        if checkpoint != 0 {
            let first = table_offset(self.extent_bytes, e);
            let offsets: Vec<u64> = (0..table_blocks(n))
                .map(|t| first + t * BLOCK as u64)
                .collect();
            reads.blocks += offsets.len() as u64;
            for (t, block) in self.read_blocks(&offsets, per_call).into_iter().enumerate() {
                let first_slot = t * ENTRIES_PER_TABLE_BLOCK;
                let count = ENTRIES_PER_TABLE_BLOCK.min(n as usize - first_slot);
                let current = block
                    .ok()
                    .and_then(|b| TableBlock::decode(&b).ok())
                    .filter(|tb| {
                        tb.format_id == self.identity.format_id()
                            && tb.extent_index == e
                            && tb.epoch == h.epoch
                            && tb.checkpoint == checkpoint
                            && tb.first_slot as usize == first_slot
                            && tb.entries.len() == count
                    });
                match current.and_then(|tb| self.table_slots(e, h, &tb, &mut names, &mut reads)) {
                    Some(found) => {
                        reads.tables_used += 1;
                        for (i, s) in found.into_iter().enumerate() {
                            slots[first_slot + i] = Some(s);
                        }
                    }
                    None => reads.tables_stale += 1,
                }
            }
        }
        let missing: Vec<u32> = (0..n).filter(|&j| slots[j as usize].is_none()).collect();
        let offsets: Vec<u64> = missing
            .iter()
            .map(|&j| slot_offset_of(self.extent_bytes, e, h.stride, n, j))
            .collect();
        reads.blocks += offsets.len() as u64;
        for ((block, &off), &j) in self
            .read_blocks(&offsets, per_call)
            .into_iter()
            .zip(&offsets)
            .zip(&missing)
        {
            slots[j as usize] = Some(match block {
                Err(_) => SlotScan::Unreadable,
                Ok(b) => match SlotHeader::decode(&b) {
                    Ok(s) => SlotScan::Header(Box::new(s), off),
                    Err(_) => SlotScan::Free, // never written or torn
                },
            });
        }
        let scan = ExtentScan {
            extent: e,
            epoch: h.epoch,
            slots: slots
                .into_iter()
                .map(|s| s.unwrap_or(SlotScan::Free))
                .collect(),
        };
        (scan, reads)
    }

    /// The slots a current table block describes, or `None` when it does not hold up: the
    /// header read for a namespace met for the first time does not match its entry.
    fn table_slots(
        &self,
        e: u32,
        h: &ExtentHeader,
        tb: &TableBlock,
        names: &mut Names,
        reads: &mut RecoveryReads,
    ) -> Option<Vec<SlotScan>> {
        let format_id = self.identity.format_id();
        let n = slots_per_extent(self.extent_bytes, h.stride);
        let mut out = Vec::with_capacity(tb.entries.len());
        for (i, entry) in tb.entries.iter().enumerate() {
            let Some(entry) = entry else {
                out.push(SlotScan::Free);
                continue;
            };
            let off = slot_offset_of(self.extent_bytes, e, h.stride, n, tb.first_slot + i as u32);
            let (model, salt) = match names.entry(entry.namespace) {
                Entry::Occupied(known) => known.into_mut(),
                Entry::Vacant(unknown) => {
                    // The namespace's strings are in the slot headers: this one's, checked
                    // against its entry, gives them.
                    reads.blocks += 1;
                    let block = self.read_blocks(&[off], 1).pop()?.ok()?;
                    let hdr = SlotHeader::decode(&block).ok()?;
                    let matches = TableEntry::of(&hdr) == *entry
                        && hdr.format_id == format_id
                        && hdr.extent_epoch == h.epoch
                        && hdr.file_offset == off;
                    if !matches {
                        return None;
                    }
                    unknown.insert((hdr.model, hdr.cache_salt))
                }
            };
            out.push(SlotScan::Header(
                Box::new(entry.header(format_id, h.epoch, off, (model, salt))),
                off,
            ));
        }
        Some(out)
    }
}
