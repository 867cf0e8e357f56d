//! Extent tables: what a clean shutdown records about every slot of an extent, so the next
//! start reads one table block per [`ENTRIES_PER_TABLE_BLOCK`] slots instead of one header per
//! slot (issue 10: recovery read about 6 % of a disk of 64 KiB objects).
//!
//! A table block is valid only for the checkpoint number the superblock names
//! ([`super::format::Superblock::checkpoint`]), which every open resets to zero before its
//! first write: a table is never trusted after a run that could have changed the extent. A
//! block that does not decode or does not match (another checkpoint, format or epoch) costs
//! only its own slots, which are then recovered from their headers as after a crash.
//!
//! Block body, little-endian, after the common 24-byte prefix:
//!
//! | bytes  | field                                                |
//! |--------|------------------------------------------------------|
//! | 24..32 | format id                                            |
//! | 32..40 | extent epoch                                         |
//! | 40..48 | checkpoint number                                    |
//! | 48..52 | extent index                                         |
//! | 52..56 | first slot described by this block                   |
//! | 56..60 | number of entries (`<= ENTRIES_PER_TABLE_BLOCK`)     |
//! | 64..   | entries of [`TABLE_ENTRY_BYTES`] (sequence 0: empty) |

use xxhash_rust::xxh3::Xxh3;

use super::format::{
    check, get_u32, get_u64, invalid, put_u32, put_u64, seal, FormatError, SlotHeader, BLOCK, BODY,
};

/// Magic of a table block (`b"KVL2TABL"` little-endian); never 0.
pub const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"KVL2TABL");
/// Bytes of one entry.
pub const TABLE_ENTRY_BYTES: usize = 88;
const T_ENTRIES: usize = 64;
/// Entries (slots) described by one table block.
pub const ENTRIES_PER_TABLE_BLOCK: usize = (BLOCK - T_ENTRIES) / TABLE_ENTRY_BYTES;
const _: () = assert!(ENTRIES_PER_TABLE_BLOCK >= 32);

/// Table blocks an extent of `slots` slots carries.
pub fn table_blocks(slots: u32) -> u64 {
    u64::from(slots).div_ceil(ENTRIES_PER_TABLE_BLOCK as u64)
}

/// Fingerprint of a namespace (model, cache salt) as stored in table entries: xxh3_128 of the
/// model's length, the model and the salt. The strings themselves stay in the slot headers.
pub fn namespace_digest(model: &str, cache_salt: &str) -> u128 {
    let mut h = Xxh3::new();
    h.update(&(model.len() as u32).to_le_bytes());
    h.update(model.as_bytes());
    h.update(cache_salt.as_bytes());
    h.digest128()
}

/// What a table records about one occupied slot: its slot header without the strings (the
/// namespace by digest). Invariant: `seq != 0` and `object_len != 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableEntry {
    /// Sequence number of the slot header.
    pub seq: u64,
    /// Hash identifying the KV chunk.
    pub chunk_hash: [u8; 32],
    /// KV rank of the object.
    pub kv_rank: u32,
    /// Object group of the object.
    pub object_group: u32,
    /// Payload length in bytes.
    pub object_len: u64,
    /// Payload checksum.
    pub payload_checksum: u64,
    /// Layout fingerprint (0 = unknown).
    pub layout: u64,
    /// [`namespace_digest`] of the slot header's model and salt.
    pub namespace: u128,
}

impl TableEntry {
    /// The entry describing `h`.
    pub fn of(h: &SlotHeader) -> TableEntry {
        TableEntry {
            seq: h.seq,
            chunk_hash: h.chunk_hash,
            kv_rank: h.kv_rank,
            object_group: h.object_group,
            object_len: h.object_len,
            payload_checksum: h.payload_checksum,
            layout: h.layout,
            namespace: namespace_digest(&h.model, &h.cache_salt),
        }
    }

    /// The slot header this entry stands for, given where it lies and its namespace's
    /// strings (which must have the entry's digest; the caller checked).
    pub fn header(
        &self,
        format_id: u64,
        extent_epoch: u64,
        file_offset: u64,
        names: (&str, &str),
    ) -> SlotHeader {
        SlotHeader {
            format_id,
            extent_epoch,
            file_offset,
            seq: self.seq,
            chunk_hash: self.chunk_hash,
            kv_rank: self.kv_rank,
            object_group: self.object_group,
            model: names.0.to_owned(),
            cache_salt: names.1.to_owned(),
            object_len: self.object_len,
            payload_checksum: self.payload_checksum,
            layout: self.layout,
        }
    }

    fn encode(&self, out: &mut [u8]) {
        put_u64(out, 0, self.seq);
        out[8..40].copy_from_slice(&self.chunk_hash);
        put_u32(out, 40, self.kv_rank);
        put_u32(out, 44, self.object_group);
        put_u64(out, 48, self.object_len);
        put_u64(out, 56, self.payload_checksum);
        put_u64(out, 64, self.layout);
        out[72..88].copy_from_slice(&self.namespace.to_le_bytes());
    }

    fn decode(buf: &[u8]) -> Result<Option<TableEntry>, FormatError> {
        let seq = get_u64(buf, 0);
        if seq == 0 {
            return if buf.iter().all(|&b| b == 0) {
                Ok(None)
            } else {
                Err(invalid("table entry with sequence 0 is not empty".into()))
            };
        }
        let mut chunk_hash = [0u8; 32];
        chunk_hash.copy_from_slice(&buf[8..40]);
        let mut ns = [0u8; 16];
        ns.copy_from_slice(&buf[72..88]);
        let e = TableEntry {
            seq,
            chunk_hash,
            kv_rank: get_u32(buf, 40),
            object_group: get_u32(buf, 44),
            object_len: get_u64(buf, 48),
            payload_checksum: get_u64(buf, 56),
            layout: get_u64(buf, 64),
            namespace: u128::from_le_bytes(ns),
        };
        if e.object_len == 0 {
            return Err(invalid(format!("table entry seq {seq}: object_len 0")));
        }
        Ok(Some(e))
    }
}

/// One table block: the entries of slots `first_slot..first_slot + entries.len()` of an extent
/// assignment, as of checkpoint `checkpoint`. Invariant (checked by encode and decode):
/// `entries.len() <= ENTRIES_PER_TABLE_BLOCK`; `None` is a free slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableBlock {
    /// Format id the extent was written under.
    pub format_id: u64,
    /// Extent index.
    pub extent_index: u32,
    /// Epoch of the extent's assignment.
    pub epoch: u64,
    /// Checkpoint number (the superblock's, when the block is current).
    pub checkpoint: u64,
    /// First slot described.
    pub first_slot: u32,
    /// One entry per slot.
    pub entries: Vec<Option<TableEntry>>,
}

impl TableBlock {
    /// Writes the block into `out`. Fails (leaving `out` unspecified) with too many entries or
    /// an entry that breaks [`TableEntry`]'s invariant. Panics if `out.len() != BLOCK`.
    pub fn encode(&self, out: &mut [u8]) -> Result<(), FormatError> {
        assert_eq!(out.len(), BLOCK, "table block buffer must be BLOCK bytes");
        if self.entries.len() > ENTRIES_PER_TABLE_BLOCK {
            return Err(invalid(format!(
                "{} table entries in one block (max {ENTRIES_PER_TABLE_BLOCK})",
                self.entries.len()
            )));
        }
        out.fill(0);
        put_u64(out, BODY, self.format_id);
        put_u64(out, BODY + 8, self.epoch);
        put_u64(out, BODY + 16, self.checkpoint);
        put_u32(out, BODY + 24, self.extent_index);
        put_u32(out, BODY + 28, self.first_slot);
        put_u32(out, BODY + 32, self.entries.len() as u32);
        for (i, e) in self.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            if e.seq == 0 || e.object_len == 0 {
                return Err(invalid(format!(
                    "table entry {i}: seq {} / object_len {} must be non-zero",
                    e.seq, e.object_len
                )));
            }
            let at = T_ENTRIES + i * TABLE_ENTRY_BYTES;
            e.encode(&mut out[at..at + TABLE_ENTRY_BYTES]);
        }
        seal(out, TABLE_MAGIC);
        Ok(())
    }

    /// Decodes and validates a `BLOCK`-byte buffer; never panics.
    pub fn decode(buf: &[u8]) -> Result<TableBlock, FormatError> {
        check(buf, TABLE_MAGIC)?;
        let count = get_u32(buf, BODY + 32) as usize;
        if count > ENTRIES_PER_TABLE_BLOCK {
            return Err(invalid(format!(
                "{count} table entries in one block (max {ENTRIES_PER_TABLE_BLOCK})"
            )));
        }
        let entries = (0..count)
            .map(|i| {
                let at = T_ENTRIES + i * TABLE_ENTRY_BYTES;
                TableEntry::decode(&buf[at..at + TABLE_ENTRY_BYTES])
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(TableBlock {
            format_id: get_u64(buf, BODY),
            epoch: get_u64(buf, BODY + 8),
            checkpoint: get_u64(buf, BODY + 16),
            extent_index: get_u32(buf, BODY + 24),
            first_slot: get_u32(buf, BODY + 28),
            entries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::l2::format::{slot_offset, slots_per_extent, slots_start, stride_for};
    use proptest::prelude::*;

    fn entry(seq: u64) -> TableEntry {
        TableEntry {
            seq,
            chunk_hash: [seq as u8; 32],
            kv_rank: 3,
            object_group: 4,
            object_len: 65_536,
            payload_checksum: 0xfeed,
            layout: 9,
            namespace: namespace_digest("m", "s"),
        }
    }

    #[test]
    fn a_block_round_trips_and_any_flipped_byte_is_refused() {
        let mut entries = vec![None; ENTRIES_PER_TABLE_BLOCK];
        entries[0] = Some(entry(1));
        entries[ENTRIES_PER_TABLE_BLOCK - 1] = Some(entry(u64::MAX));
        let t = TableBlock {
            format_id: 7,
            extent_index: 2,
            epoch: 5,
            checkpoint: 11,
            first_slot: 45,
            entries,
        };
        let mut b = vec![0u8; BLOCK];
        t.encode(&mut b).unwrap();
        assert_eq!(TableBlock::decode(&b).unwrap(), t);
        for at in [0, 9, 20, 30, 100, 4000] {
            let mut c = b.clone();
            c[at] ^= 1;
            assert!(TableBlock::decode(&c).is_err(), "byte {at}");
        }
        assert_eq!(TableBlock::decode(&vec![0; BLOCK]), Err(FormatError::Empty));
    }

    #[test]
    fn bad_entries_and_counts_are_refused_on_both_sides() {
        let mut t = TableBlock {
            format_id: 1,
            extent_index: 0,
            epoch: 1,
            checkpoint: 1,
            first_slot: 0,
            entries: vec![Some(TableEntry {
                object_len: 0,
                ..entry(1)
            })],
        };
        let mut b = vec![0u8; BLOCK];
        assert!(t.encode(&mut b).is_err());
        t.entries = vec![None; ENTRIES_PER_TABLE_BLOCK + 1];
        assert!(t.encode(&mut b).is_err());
    }

    #[test]
    fn namespace_digests_separate_model_from_salt() {
        assert_ne!(namespace_digest("ab", "c"), namespace_digest("a", "bc"));
        assert_eq!(namespace_digest("ab", "c"), namespace_digest("ab", "c"));
    }

    proptest! {
        #[test]
        fn slots_and_their_table_always_fit_the_extent(
            mib2 in 1u64..512,
            len in 1u64..(64 << 20),
        ) {
            let extent = mib2 * (2 << 20);
            let stride = stride_for(len);
            let n = slots_per_extent(extent, stride);
            let used = slots_start(extent, stride) + u64::from(n) * stride;
            prop_assert!(used <= extent, "{n} slots of {stride} overflow {extent}");
            // And one more would not fit.
            let more = BLOCK as u64 * (1 + table_blocks(n + 1)) + u64::from(n + 1) * stride;
            prop_assert!(more > extent);
            if n > 0 {
                let last = slot_offset(extent, 0, stride, n - 1) + stride;
                prop_assert!(last <= crate::l2::format::EXTENT_BASE + extent);
            }
        }
    }
}
