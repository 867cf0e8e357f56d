//! The index's memory bound (issue 10, defect 5: about 442 bytes of index per object plus a
//! key per slot, used or not, with no cap; 8 TiB of 64 KiB objects needed about 57 GB).
//!
//! Every heap structure is charged at its worst case, allocator overhead included (glibc
//! malloc: a 16-byte header and rounding per block, and blocks of 128 KiB or more may be
//! mapped, rounded up to a 4 KiB page), so the charge bounds the heap the index holds:
//!
//! * hash tables (`entries`, `strides`): hashbrown has a power-of-two number of buckets, each
//!   `size_of::<(key, value)>()` plus a control byte. It fills at most 7/8 of them, but
//!   removals leave tombstones, and when those use up its room it doubles as soon as more
//!   than 7/16 of the buckets hold items (measured: 2147 entries in 8192 buckets), so it can
//!   reach `32/7` buckets per item (`B <= 32 n / 7` for every table of `n >= 1` items, the
//!   small ones included); it never shrinks, but its items never exceed their cap (`reserve`
//!   evicts before it inserts), so neither does it; plus 16 trailing control bytes and 16 of
//!   alignment;
//! * B-trees: every node but the root holds at least 5 of its 11 elements, so a tree of `n`
//!   elements has at most `n / 5 + 1` nodes, each charged as an internal node (header,
//!   11 keys, 11 values, 12 edges) plus allocator overhead: `node / 5` per element and one
//!   node per tree (per stride for the per-stride trees);
//! * vectors: exact (`Vec<Extent>`, the bitmaps), plus allocator overhead; `clear` and
//!   reclaiming an extent build a transient list of keys (at most one per entry).
//!
//! Per object, for the tier's 48-byte `StorageKey` (`Entry` is 88 bytes): the entry table
//! `ceil((48 + 88 + 1) * 32 / 7) = 627`, the LRU map `ceil((16 + 11 * (16 + 48) + 96 + 16) /
//! 5) = 167`, the slot map `ceil((16 + 11 * (8 + 48) + 96 + 16) / 5) = 149`, the transient
//! key 48: [`INDEX_BYTES_PER_OBJECT`]` = 991`. Per slot: [`INDEX_BITS_PER_SLOT`]` = 1` (the
//! occupancy bitmap; it was a 56-byte `Option<key>` and a 4-byte free-list entry). Per extent
//! (its bitmap at the smallest stride aside): the `Extent` itself, its places in the free,
//! partial and reclaimable sets, and the stride it may hold (its `strides` item, heads
//! element, LRU and partial roots): [`L2Index::BYTES_PER_EXTENT`], 1628 bytes. Typical use
//! is about half the charge (measured: about 470 bytes per object with the table 3/4 full).
//!
//! The rule: the geometry's cost, [`L2Index::fixed_bytes`] (every extent with its bitmap at
//! the smallest stride, the most slots it can have, plus the tables' minimum sizes), is
//! charged up front; what is left of the limit, divided by the per-object cost, is the entry
//! cap. A limit below the geometry's cost plus one object is refused.

use std::fmt;
use std::hash::Hash;
use std::mem::size_of;

use super::{slots_in, Entry, Extent, L2Index, Stamp, StrideSet, MIN_STRIDE};
use crate::storage::StorageKey;

/// Allocator overhead charged per heap block (glibc: 8-byte header, size rounded to 16).
const MALLOC_OVERHEAD: u64 = 16;
/// Blocks at least this large may be mapped (glibc's default mmap threshold)...
const MMAP_FROM: u64 = 128 << 10;
/// ...and then waste up to a page.
const PAGE: u64 = 4096;
/// Elements per B-tree node: at most 11, at least 5 in every node but the root.
const BTREE_CAPACITY: u64 = 11;
const BTREE_MIN_LEN: u64 = 5;

/// Index bits per slot of an extent (its occupancy bitmap); charged for every extent at the
/// smallest stride, where it has the most slots.
pub const INDEX_BITS_PER_SLOT: u64 = 1;

/// Index bytes charged per entry of the tier's index (keys are [`StorageKey`]): 991 (the
/// arithmetic is in this module's documentation).
pub const INDEX_BYTES_PER_OBJECT: u64 = L2Index::<StorageKey>::BYTES_PER_OBJECT;

const fn round8(n: u64) -> u64 {
    n.div_ceil(8) * 8
}

/// Heap bytes of a block of `n` bytes, allocator overhead included.
const fn block(n: u64) -> u64 {
    n + MALLOC_OVERHEAD + if n >= MMAP_FROM { PAGE } else { 0 }
}

/// An internal B-tree node with keys of `k` bytes and values of `v` bytes (a leaf is smaller):
/// parent pointer, index and length (16 with padding), 11 keys, 11 values, 12 edges.
const fn btree_node(k: usize, v: usize) -> u64 {
    block(round8(16 + BTREE_CAPACITY * k as u64) + round8(BTREE_CAPACITY * v as u64) + 12 * 8)
}

/// Worst-case bytes per element of a B-tree (its root aside).
const fn btree_per_element(k: usize, v: usize) -> u64 {
    btree_node(k, v).div_ceil(BTREE_MIN_LEN)
}

/// Worst-case bytes per item of a hashbrown table with `(key, value)` items of `item` bytes.
const fn table_per_item(item: usize) -> u64 {
    (item as u64 + 1).saturating_mul(32).div_ceil(7)
}

/// A table's bytes besides its buckets: trailing control bytes, alignment, allocator overhead.
const TABLE_FIXED: u64 = 16 + 16 + MALLOC_OVERHEAD + PAGE;

/// Why [`L2Index::with_limit`] refused a limit. Invariant: `limit_bytes < fixed_bytes +
/// bytes_per_object` (not even one object fits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexLimitError {
    /// The limit asked for.
    pub limit_bytes: u64,
    /// What the geometry costs ([`L2Index::fixed_bytes`]).
    pub fixed_bytes: u64,
    /// What each object costs on top.
    pub bytes_per_object: u64,
    /// What each extent costs, its bitmap aside ([`L2Index::BYTES_PER_EXTENT`]).
    pub bytes_per_extent: u64,
    /// Extents of the geometry.
    pub extent_count: u32,
    /// Their size.
    pub extent_bytes: u64,
}

impl fmt::Display for IndexLimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an L2 index limit of {} bytes holds no object: {} extents of {} bytes cost {} bytes \
             of index before any object (one bit per 8 KiB slot, and about {} bytes per extent), \
             and each object {} more; at least {} bytes are needed",
            self.limit_bytes,
            self.extent_count,
            self.extent_bytes,
            self.fixed_bytes,
            self.bytes_per_extent,
            self.bytes_per_object,
            self.fixed_bytes.saturating_add(self.bytes_per_object)
        )
    }
}

impl std::error::Error for IndexLimitError {}

impl<K: Copy + Eq + Hash + fmt::Debug> L2Index<K> {
    /// Index bytes charged per entry (module documentation): the entry table, the LRU map,
    /// the slot map and the transient key list of `clear` or a reclaim.
    pub const BYTES_PER_OBJECT: u64 = table_per_item(size_of::<(K, Entry)>())
        + btree_per_element(size_of::<Stamp>(), size_of::<K>())
        + btree_per_element(size_of::<(u32, u32)>(), size_of::<K>())
        + size_of::<K>() as u64;

    /// Index bytes charged per extent besides its bitmap: the `Extent`, its places in the
    /// free, partial and reclaimable sets, and one stride (there are at most as many strides
    /// with sets as assigned extents): its table item, its heads element, the roots of its LRU
    /// map and partial set.
    pub const BYTES_PER_EXTENT: u64 = size_of::<Extent>() as u64
        + btree_per_element(size_of::<u32>(), 0) // free_extents
        + btree_per_element(size_of::<u32>(), 0) // a partial set
        + btree_per_element(size_of::<super::ReclaimKey>(), 0) // reclaimable
        + table_per_item(size_of::<(u64, StrideSet<K>)>()) // strides
        + btree_per_element(size_of::<(Stamp, u64)>(), 0) // heads
        + btree_node(size_of::<Stamp>(), size_of::<K>()) // the stride's LRU root
        + btree_node(size_of::<u32>(), 0); // the stride's partial root

    /// What the geometry costs before any entry, at its worst: the index itself, the
    /// minimum tables and the global trees' roots, and per extent [`Self::BYTES_PER_EXTENT`]
    /// plus its bitmap at the smallest stride (the most slots an extent can have).
    pub fn fixed_bytes(extent_count: u32, extent_bytes: u64) -> u64 {
        let slots = u64::from(slots_in(extent_bytes, MIN_STRIDE));
        let bitmap = block((slots * INDEX_BITS_PER_SLOT).div_ceil(64) * 8);
        let per_extent = Self::BYTES_PER_EXTENT + bitmap;
        let global = size_of::<Self>() as u64
            + 2 * TABLE_FIXED // entries, strides
            + block(0) + PAGE // Vec<Extent>'s block (its bytes are in BYTES_PER_EXTENT)
            + btree_node(size_of::<(u32, u32)>(), size_of::<K>()) // by_slot root
            + btree_node(size_of::<u32>(), 0) // free_extents root
            + btree_node(size_of::<super::ReclaimKey>(), 0) // reclaimable root
            + btree_node(size_of::<(Stamp, u64)>(), 0); // heads root
        global.saturating_add(per_extent.saturating_mul(u64::from(extent_count)))
    }

    /// An index like [`L2Index::new`] whose memory is bounded by `limit_bytes`: it holds at
    /// most `(limit_bytes - fixed_bytes) / BYTES_PER_OBJECT` entries. Refused when not even
    /// one entry fits.
    pub fn with_limit(
        extent_count: u32,
        extent_bytes: u64,
        limit_bytes: u64,
    ) -> Result<Self, IndexLimitError> {
        let fixed_bytes = Self::fixed_bytes(extent_count, extent_bytes);
        let max_entries = limit_bytes.saturating_sub(fixed_bytes) / Self::BYTES_PER_OBJECT;
        if max_entries == 0 {
            return Err(IndexLimitError {
                limit_bytes,
                fixed_bytes,
                bytes_per_object: Self::BYTES_PER_OBJECT,
                bytes_per_extent: Self::BYTES_PER_EXTENT,
                extent_count,
                extent_bytes,
            });
        }
        let mut ix = Self::new(extent_count, extent_bytes);
        ix.max_entries = max_entries;
        ix.limit_bytes = limit_bytes;
        Ok(ix)
    }

    /// Most entries the index holds at once (`u64::MAX` for [`L2Index::new`]).
    pub fn max_entries(&self) -> u64 {
        self.max_entries
    }

    /// Index bytes charged now: the geometry's [`Self::fixed_bytes`] plus
    /// [`Self::BYTES_PER_OBJECT`] per entry. An upper bound of the heap the index holds,
    /// except that its hash table keeps the size of its largest number of entries so far (at
    /// most the cap, so it stays within the limit). `<= limit` whenever the cap holds.
    pub fn index_bytes(&self) -> u64 {
        Self::fixed_bytes(self.extents.len() as u32, self.extent_bytes)
            .saturating_add((self.entries.len() as u64).saturating_mul(Self::BYTES_PER_OBJECT))
    }
}
