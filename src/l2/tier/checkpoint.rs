//! The clean stop: every assigned extent's table is written from the index, synced, and only
//! then does the superblock name the checkpoint (see [`crate::l2::table`]). A restart after it
//! reads the tables instead of every slot header, and finds exactly what the index held:
//! evicted, replaced or dropped objects do not come back, and a checksum failure found later
//! is corruption, not the work of a crash.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::{L2Tier, RECOVERY_READS};
use crate::error::{Error, ErrorKind, Result};
use crate::l2::format::{
    extent_count, extent_offset, slots_per_extent, table_blocks, table_offset, TableBlock,
    TableEntry, BLOCK, ENTRIES_PER_TABLE_BLOCK,
};
use crate::l2::table::namespace_digest;
use crate::storage::{NamespaceId, Namespaces};

/// What a checkpoint wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointStats {
    /// Extents whose table was written.
    pub extents: u64,
    /// Table blocks written.
    pub blocks: u64,
    /// Objects the tables list.
    pub objects: u64,
}

fn refused(why: &str) -> Error {
    Error::new(ErrorKind::Io, format!("no L2 checkpoint: {why}"))
}

impl L2Tier {
    /// Ends the tier's writes and records a clean stop: waits (at most `l2.io_timeout_ms`) for
    /// the write-behind batches in flight, syncs, writes every assigned extent's table from the
    /// index and zeroes the header of every other extent that may hold a valid one, syncs
    /// again, then marks the superblock. From the first step on the
    /// tier writes no object (`persist` counts them as skipped), so the tables stay true.
    /// Any failure leaves the superblock without a checkpoint: the next start reads every slot
    /// header, as after a crash. Call once, at shutdown, after the write-behind drained.
    pub fn checkpoint(&self, namespaces: &Namespaces) -> Result<CheckpointStats> {
        // Alone in the CLEAR gate: a batch that starts after this sees the flag and writes
        // nothing; one that started before is counted in `writes_in_flight`.
        self.clear_gate
            .exclusive(|| self.sealed.store(true, Ordering::SeqCst));
        let deadline = std::time::Instant::now() + self.io_timeout;
        while self.writes_in_flight.load(Ordering::Acquire) > 0 {
            if std::time::Instant::now() >= deadline {
                return Err(refused("write-behind batches still running"));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if self.stuck() {
            return Err(refused("the device is not answering"));
        }
        self.sync()
            .map_err(|(e, _)| e.context("no L2 checkpoint: the sync before it failed"))?;
        let format_id = self.identity.format_id();
        if self.identity.format_pending() {
            return Err(refused("a CLEAR's format is not durable yet"));
        }
        let checkpoint = self.identity.new_checkpoint();
        let extents = self.index.lock().assigned_extents();
        // Every other extent is free in memory, but its header on disk may still be valid (an
        // extent emptied at start-up, one whose new header failed to land): with no table to
        // say so, the next start would read its slot headers and bring their objects back.
        // Its header is zeroed: the extent is free on disk too.
        let mut pending: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut tabled = extents.iter().map(|x| x.0).peekable();
        for e in 0..extent_count(self.file_bytes, self.extent_bytes) {
            if tabled.peek() == Some(&e) {
                tabled.next();
                continue;
            }
            if !self.is_headed(e) {
                continue; // never held a header of this format: nothing to free
            }
            pending.push((extent_offset(self.extent_bytes, e), vec![0u8; BLOCK]));
            if pending.len() >= RECOVERY_READS {
                self.write_tables(&mut pending)?;
            }
        }
        let mut names: HashMap<NamespaceId, Option<u128>> = HashMap::new();
        let mut stats = CheckpointStats::default();
        let mut unnamed = 0u64;
        for (e, epoch, stride, slots) in extents {
            debug_assert_eq!(slots, slots_per_extent(self.extent_bytes, stride));
            let visible = self.index.lock().visible_in_extent(e);
            let mut entries: Vec<Option<TableEntry>> = vec![None; slots as usize];
            for (j, key, l) in visible {
                let digest = *names.entry(key.namespace).or_insert_with(|| {
                    namespaces
                        .name(key.namespace)
                        .map(|(model, salt)| namespace_digest(&model, &salt))
                });
                // A namespace with no name left cannot be recovered: the object is not listed
                // (none should exist: the namespace reclaimer keeps those L2 objects use).
                let Some(namespace) = digest else {
                    unnamed += 1;
                    continue;
                };
                entries[j as usize] = Some(TableEntry {
                    seq: l.seq,
                    chunk_hash: key.chunk_hash,
                    kv_rank: key.kv_rank,
                    object_group: key.object_group,
                    object_len: l.object_len,
                    payload_checksum: l.checksum,
                    layout: l.layout,
                    namespace,
                });
                stats.objects += 1;
            }
            let first = table_offset(self.extent_bytes, e);
            for (t, chunk) in entries.chunks(ENTRIES_PER_TABLE_BLOCK).enumerate() {
                let mut block = vec![0u8; BLOCK];
                TableBlock {
                    format_id,
                    extent_index: e,
                    epoch,
                    checkpoint,
                    first_slot: (t * ENTRIES_PER_TABLE_BLOCK) as u32,
                    entries: chunk.to_vec(),
                }
                .encode(&mut block)
                .map_err(|err| refused(&format!("extent {e}: {err}")))?;
                pending.push((first + t as u64 * BLOCK as u64, block));
            }
            stats.extents += 1;
            stats.blocks += table_blocks(slots);
            if pending.len() >= RECOVERY_READS {
                self.write_tables(&mut pending)?;
            }
        }
        self.write_tables(&mut pending)?;
        if unnamed > 0 {
            self.counters.errors.fetch_add(unnamed, Ordering::Relaxed);
            tracing::error!(
                unnamed,
                "L2 objects whose namespace has no name left were not listed in the checkpoint: \
                 they are gone after the restart"
            );
        }
        self.sync()
            .map_err(|(e, _)| e.context("no L2 checkpoint: syncing its tables failed"))?;
        self.identity
            .mark_clean(checkpoint, format_id, &|o, b| self.write_durable(o, b))?;
        tracing::info!(
            path = %self.path.display(),
            extents = stats.extents,
            table_blocks = stats.blocks,
            objects = stats.objects,
            "L2 checkpoint written: the next start reads the extent tables"
        );
        Ok(stats)
    }

    /// Bytes a checkpoint would write now (tables of the assigned extents, zeroed headers of
    /// the others that may hold one): an upper bound for its time allowance at shutdown.
    pub fn checkpoint_bytes(&self) -> u64 {
        let assigned = self.index.lock().assigned_extents();
        let tables: u64 = assigned.iter().map(|x| table_blocks(x.3)).sum();
        let headed: u64 = self
            .headed
            .lock()
            .iter()
            .map(|w| u64::from(w.count_ones()))
            .sum();
        (tables + headed) * BLOCK as u64
    }

    fn write_tables(&self, pending: &mut Vec<(u64, Vec<u8>)>) -> Result<()> {
        for r in self.write_blocks(pending) {
            r.map_err(|e| e.context("no L2 checkpoint: writing an extent table failed"))?;
        }
        pending.clear();
        Ok(())
    }

    /// Whether [`L2Tier::checkpoint`] has begun: the tier writes nothing more.
    pub fn sealed(&self) -> bool {
        self.sealed.load(Ordering::SeqCst)
    }
}
