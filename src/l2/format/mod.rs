//! On-disk format of the L2 disk tier.
//!
//! Layout of the L2 file (regular file opened `O_DIRECT`, or a block device):
//!
//! - bytes `0..BLOCK` and `BLOCK..2 * BLOCK`: the two copies of the [`Superblock`], written
//!   alternately (copy `update % 2`), each synced before it is relied on, so a torn superblock
//!   write always leaves the previous copy intact; the valid copy with the higher `update` wins;
//! - the rest of the first `EXTENT_BASE` bytes is reserved (zero);
//! - extent `i` covers `[EXTENT_BASE + i * extent_bytes, EXTENT_BASE + (i + 1) * extent_bytes)`;
//! - each extent starts with one [`ExtentHeader`] block, then its table
//!   ([`table_blocks`] blocks of [`TableBlock`]s, written at a clean shutdown), then slots of a
//!   fixed `stride`: slot `j` starts at `extent_start + BLOCK + table + j * stride` and is one
//!   [`SlotHeader`] block followed by `stride - BLOCK` payload bytes.
//!
//! Every block starts with the same 20-byte prefix, all little-endian:
//!
//! | bytes  | field                                                          |
//! |--------|----------------------------------------------------------------|
//! | 0..8   | magic (`u64`)                                                  |
//! | 8..16  | checksum: xxh3_64 of the whole block with these 8 bytes zeroed |
//! | 16..20 | version (`u32`, [`FORMAT_VERSION`])                            |
//!
//! The kind-specific body starts at byte [`BODY`]; the rest of the block is zero.

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

pub use super::table::{table_blocks, TableBlock, TableEntry, ENTRIES_PER_TABLE_BLOCK};

/// Size of every header block and the alignment unit of all on-disk offsets.
pub const BLOCK: usize = 4096;
const B: u64 = BLOCK as u64;
/// File offset of extent 0 (2 MiB); extents are multiples of this size, so stay aligned.
pub const EXTENT_BASE: u64 = 2 << 20;
/// Format version written into every block; any other value decodes as `BadVersion`.
pub const FORMAT_VERSION: u32 = 4;
/// Magic of the superblock (`b"KVL2SUPR"` little-endian); never 0.
pub const SUPERBLOCK_MAGIC: u64 = u64::from_le_bytes(*b"KVL2SUPR");
/// Magic of an extent header (`b"KVL2EXTH"` little-endian); never 0.
pub const EXTENT_MAGIC: u64 = u64::from_le_bytes(*b"KVL2EXTH");
/// Magic of a slot header (`b"KVL2SLOT"` little-endian); never 0.
pub const SLOT_MAGIC: u64 = u64::from_le_bytes(*b"KVL2SLOT");
/// File offsets of the two superblock copies; copy `i` is at `SUPERBLOCK_OFFSETS[i]`.
pub const SUPERBLOCK_OFFSETS: [u64; 2] = [0, B];
/// Maximum encoded length of [`SlotHeader::model`] in bytes.
pub const MAX_MODEL_BYTES: usize = 1024;
/// Maximum encoded length of [`SlotHeader::cache_salt`] in bytes.
pub const MAX_SALT_BYTES: usize = 1024;

const CKSUM: usize = 8;
const VERSION: usize = 16;
/// Byte offset where kind-specific fields start (after magic, checksum, version, padding).
pub(super) const BODY: usize = 24;
const MIB2: u64 = 2 << 20;

/// Why a block failed to decode or a header failed to encode.
/// Invariant: decode functions report every problem through this type, never by panicking.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum FormatError {
    /// The block is entirely zero: it was never written.
    #[error("block is all zero (never written)")]
    Empty,
    /// The magic number does not match the expected block kind (garbage or another kind).
    #[error("bad magic {found:#018x}")]
    BadMagic {
        /// Magic found at offset 0 (0 if the buffer was too short to hold one).
        found: u64,
    },
    /// The block was written by an unsupported format version.
    #[error("unsupported format version {found} (expected {FORMAT_VERSION})")]
    BadVersion {
        /// Version found in the block.
        found: u32,
    },
    /// The header checksum does not match the block contents.
    #[error("header checksum mismatch")]
    BadChecksum,
    /// A field is out of range or inconsistent, or the buffer is not `BLOCK` bytes.
    #[error("invalid header: {0}")]
    Invalid(String),
    /// A variable-length field exceeds its limit.
    #[error("field {field} is {len} bytes, max {max}")]
    FieldTooLong {
        /// Field name.
        field: &'static str,
        /// Actual length in bytes.
        len: usize,
        /// Maximum allowed length in bytes.
        max: usize,
    },
}

/// Checksum stored in [`SlotHeader::payload_checksum`]: xxh3_64 of the payload bytes.
pub fn payload_checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// A superblock copy. Invariant (checked by decode): `extent_bytes` is a non-zero multiple of
/// 2 MiB, `file_bytes >= EXTENT_BASE + extent_bytes`, `update >= 1`. `format_id` is random per
/// formatting; headers carrying another `format_id` are stale.
///
/// `seq_limit` and `epoch_limit` are leases: every slot sequence number and extent epoch ever
/// written under this file is below them. A node that opens the file first raises both limits
/// (and syncs the superblock) and then issues numbers from the old limits up, so numbers are
/// never reused across runs, whatever headers a run could or could not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Random id of this formatting of the file.
    pub format_id: u64,
    /// Usable size of the file in bytes.
    pub file_bytes: u64,
    /// Size of every extent in bytes.
    pub extent_bytes: u64,
    /// Number of superblock writes since the file was first formatted; the copy with the
    /// higher value is current. Written to copy `update % 2`.
    pub update: u64,
    /// Every slot sequence number written so far is below this.
    pub seq_limit: u64,
    /// Every extent epoch written so far is below this.
    pub epoch_limit: u64,
    /// Non-zero: the tier was stopped cleanly and the extent tables stamped with this number
    /// list every object it held (a restart reads them instead of every slot header). Zero
    /// after every open (written before the first slot write of a run) and every new format.
    pub checkpoint: u64,
    /// Objects whose sequence number is below this were written before an unclean stop (a
    /// checksum failure of theirs is what the stop left, counted as torn, not as corruption).
    /// Raised to `seq_limit` by every open that follows an unclean stop.
    pub torn_below: u64,
}

impl Superblock {
    /// Writes the block into `out`, zero-filling unused bytes.
    /// Panics if `out.len() != BLOCK` (a programming error).
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), BLOCK, "superblock buffer must be BLOCK bytes");
        out.fill(0);
        put_u64(out, BODY, self.format_id);
        put_u64(out, BODY + 8, self.file_bytes);
        put_u64(out, BODY + 16, self.extent_bytes);
        put_u64(out, BODY + 24, self.update);
        put_u64(out, BODY + 32, self.seq_limit);
        put_u64(out, BODY + 40, self.epoch_limit);
        put_u64(out, BODY + 48, self.checkpoint);
        put_u64(out, BODY + 56, self.torn_below);
        seal(out, SUPERBLOCK_MAGIC);
    }

    /// File offset of the copy this superblock is written to (`update % 2`).
    pub fn offset(&self) -> u64 {
        SUPERBLOCK_OFFSETS[(self.update % 2) as usize]
    }

    /// Decodes and validates a `BLOCK`-byte buffer; never panics.
    pub fn decode(buf: &[u8]) -> Result<Superblock, FormatError> {
        check(buf, SUPERBLOCK_MAGIC)?;
        let sb = Superblock {
            format_id: get_u64(buf, BODY),
            file_bytes: get_u64(buf, BODY + 8),
            extent_bytes: get_u64(buf, BODY + 16),
            update: get_u64(buf, BODY + 24),
            seq_limit: get_u64(buf, BODY + 32),
            epoch_limit: get_u64(buf, BODY + 40),
            checkpoint: get_u64(buf, BODY + 48),
            torn_below: get_u64(buf, BODY + 56),
        };
        if sb.update == 0 {
            return Err(invalid("superblock update count 0".to_owned()));
        }
        if sb.extent_bytes == 0 || !sb.extent_bytes.is_multiple_of(MIB2) {
            return Err(invalid(format!(
                "extent_bytes {} is not a non-zero multiple of 2 MiB",
                sb.extent_bytes
            )));
        }
        if EXTENT_BASE
            .checked_add(sb.extent_bytes)
            .is_none_or(|min| sb.file_bytes < min)
        {
            return Err(invalid(format!(
                "file_bytes {} too small for one extent of {}",
                sb.file_bytes, sb.extent_bytes
            )));
        }
        Ok(sb)
    }
}

/// First block of an extent. Invariant (checked by decode): `stride` is a multiple of
/// `BLOCK` and at least `2 * BLOCK`. `epoch` increases on every (re)assignment of the
/// extent, so slot headers from an older epoch are stale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentHeader {
    /// `format_id` of the superblock this header was written under.
    pub format_id: u64,
    /// Index of the extent this header belongs to.
    pub extent_index: u32,
    /// Assignment epoch of the extent.
    pub epoch: u64,
    /// Slot stride in bytes (slot header block + payload).
    pub stride: u64,
}

impl ExtentHeader {
    /// Writes the block into `out`, zero-filling unused bytes.
    /// Panics if `out.len() != BLOCK` (a programming error).
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), BLOCK, "extent header buffer must be BLOCK bytes");
        out.fill(0);
        put_u64(out, BODY, self.format_id);
        put_u64(out, BODY + 8, self.epoch);
        put_u64(out, BODY + 16, self.stride);
        put_u32(out, BODY + 24, self.extent_index);
        seal(out, EXTENT_MAGIC);
    }

    /// Decodes and validates a `BLOCK`-byte buffer; never panics.
    pub fn decode(buf: &[u8]) -> Result<ExtentHeader, FormatError> {
        check(buf, EXTENT_MAGIC)?;
        let h = ExtentHeader {
            format_id: get_u64(buf, BODY),
            epoch: get_u64(buf, BODY + 8),
            stride: get_u64(buf, BODY + 16),
            extent_index: get_u32(buf, BODY + 24),
        };
        if h.stride < 2 * B || !h.stride.is_multiple_of(B) {
            return Err(invalid(format!(
                "stride {} is not a multiple of {BLOCK} that is >= {}",
                h.stride,
                2 * B
            )));
        }
        Ok(h)
    }
}

/// Header block of one slot. Invariant (checked by encode and decode): `object_len > 0`,
/// `model.len() <= MAX_MODEL_BYTES`, `cache_salt.len() <= MAX_SALT_BYTES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotHeader {
    /// `format_id` of the superblock this header was written under.
    pub format_id: u64,
    /// Epoch of the extent at the time of writing.
    pub extent_epoch: u64,
    /// File offset of this header (slot start); detects misplaced or stale blocks.
    pub file_offset: u64,
    /// Global write sequence number; newer wins on recovery.
    pub seq: u64,
    /// Hash identifying the KV chunk.
    pub chunk_hash: [u8; 32],
    /// KV rank of the object.
    pub kv_rank: u32,
    /// Object group of the object.
    pub object_group: u32,
    /// Model name, at most `MAX_MODEL_BYTES` bytes.
    pub model: String,
    /// Cache salt, at most `MAX_SALT_BYTES` bytes.
    pub cache_salt: String,
    /// Payload length in bytes; > 0.
    pub object_len: u64,
    /// [`payload_checksum`] of the first `object_len` payload bytes.
    pub payload_checksum: u64,
    /// Fingerprint of the object's layout (shape and dtype) when it was written; 0 = unknown.
    pub layout: u64,
}

// Slot header body offsets.
const S_HASH: usize = BODY + 48;
const S_RANK: usize = S_HASH + 32;
const S_GROUP: usize = S_RANK + 4;
const S_LAYOUT: usize = S_GROUP + 4;
const S_MODEL_LEN: usize = S_LAYOUT + 8;
const S_SALT_LEN: usize = S_MODEL_LEN + 4;
const S_STRINGS: usize = S_SALT_LEN + 4;
const _: () = assert!(S_STRINGS + MAX_MODEL_BYTES + MAX_SALT_BYTES <= BLOCK);

impl SlotHeader {
    /// Writes the block into `out`, zero-filling unused bytes. Fails with `FieldTooLong`
    /// for oversized strings and `Invalid` for `object_len == 0`, leaving `out` unspecified.
    /// Panics if `out.len() != BLOCK` (a programming error).
    pub fn encode(&self, out: &mut [u8]) -> Result<(), FormatError> {
        assert_eq!(out.len(), BLOCK, "slot header buffer must be BLOCK bytes");
        check_len("model", self.model.len(), MAX_MODEL_BYTES)?;
        check_len("cache_salt", self.cache_salt.len(), MAX_SALT_BYTES)?;
        if self.object_len == 0 {
            return Err(invalid("object_len is 0".into()));
        }
        out.fill(0);
        put_u64(out, BODY, self.format_id);
        put_u64(out, BODY + 8, self.extent_epoch);
        put_u64(out, BODY + 16, self.file_offset);
        put_u64(out, BODY + 24, self.seq);
        put_u64(out, BODY + 32, self.object_len);
        put_u64(out, BODY + 40, self.payload_checksum);
        out[S_HASH..S_HASH + 32].copy_from_slice(&self.chunk_hash);
        put_u32(out, S_RANK, self.kv_rank);
        put_u32(out, S_GROUP, self.object_group);
        put_u64(out, S_LAYOUT, self.layout);
        let (m, s) = (self.model.as_bytes(), self.cache_salt.as_bytes());
        put_u32(out, S_MODEL_LEN, m.len() as u32);
        put_u32(out, S_SALT_LEN, s.len() as u32);
        out[S_STRINGS..S_STRINGS + m.len()].copy_from_slice(m);
        out[S_STRINGS + m.len()..S_STRINGS + m.len() + s.len()].copy_from_slice(s);
        seal(out, SLOT_MAGIC);
        Ok(())
    }

    /// Decodes and validates a `BLOCK`-byte buffer; never panics.
    pub fn decode(buf: &[u8]) -> Result<SlotHeader, FormatError> {
        check(buf, SLOT_MAGIC)?;
        let model_len = get_u32(buf, S_MODEL_LEN) as usize;
        let salt_len = get_u32(buf, S_SALT_LEN) as usize;
        check_len("model", model_len, MAX_MODEL_BYTES)?;
        check_len("cache_salt", salt_len, MAX_SALT_BYTES)?;
        // Both lengths are bounded, so this stays inside the block (see const assert).
        let model = get_str("model", &buf[S_STRINGS..S_STRINGS + model_len])?;
        let salt_at = S_STRINGS + model_len;
        let cache_salt = get_str("cache_salt", &buf[salt_at..salt_at + salt_len])?;
        let object_len = get_u64(buf, BODY + 32);
        if object_len == 0 {
            return Err(invalid("object_len is 0".into()));
        }
        let mut chunk_hash = [0u8; 32];
        chunk_hash.copy_from_slice(&buf[S_HASH..S_HASH + 32]);
        Ok(SlotHeader {
            format_id: get_u64(buf, BODY),
            extent_epoch: get_u64(buf, BODY + 8),
            file_offset: get_u64(buf, BODY + 16),
            seq: get_u64(buf, BODY + 24),
            chunk_hash,
            kv_rank: get_u32(buf, S_RANK),
            object_group: get_u32(buf, S_GROUP),
            model,
            cache_salt,
            object_len,
            payload_checksum: get_u64(buf, BODY + 40),
            layout: get_u64(buf, S_LAYOUT),
        })
    }
}

/// Slot stride for an object: one header block plus `object_len` rounded up to a
/// multiple of `BLOCK`. Always a multiple of `BLOCK` and `>= BLOCK` (saturates near `u64::MAX`).
pub fn stride_for(object_len: u64) -> u64 {
    object_len.div_ceil(B).saturating_mul(B).saturating_add(B)
}

/// Number of whole extents that fit after `EXTENT_BASE`; 0 if none or if
/// `extent_bytes == 0`, capped at `u32::MAX`.
pub fn extent_count(file_bytes: u64, extent_bytes: u64) -> u32 {
    let n = file_bytes
        .saturating_sub(EXTENT_BASE)
        .checked_div(extent_bytes)
        .unwrap_or(0);
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// File offset of extent `index` (its header block). Caller guarantees the result
/// fits in `u64` (true for any index below `extent_count`).
pub fn extent_offset(extent_bytes: u64, index: u32) -> u64 {
    EXTENT_BASE + u64::from(index) * extent_bytes
}

/// Number of slots of `stride` bytes that fit in an extent after its header block and its
/// table (one table block per [`ENTRIES_PER_TABLE_BLOCK`] slots); 0 if `stride == 0`, capped
/// at `u32::MAX`. Invariant: `BLOCK * (1 + table_blocks(n)) + n * stride <= extent_bytes`.
pub fn slots_per_extent(extent_bytes: u64, stride: u64) -> u32 {
    if stride == 0 {
        return 0;
    }
    let room = u128::from(extent_bytes.saturating_sub(B));
    let per = ENTRIES_PER_TABLE_BLOCK as u128;
    // Charging each slot its fractional share of a table block gives an upper bound; the
    // table's last block is whole, which costs at most one or two slots more.
    let mut n = room * per / (u128::from(stride) * per + u128::from(B));
    let fits =
        |n: u128| u128::from(B) * u128::from(table_blocks_u128(n)) + n * u128::from(stride) <= room;
    while n > 0 && !fits(n) {
        n -= 1;
    }
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn table_blocks_u128(slots: u128) -> u64 {
    u64::try_from(slots.div_ceil(ENTRIES_PER_TABLE_BLOCK as u128)).unwrap_or(u64::MAX)
}

/// File offset of the first table block of extent `extent` (right after its header).
pub fn table_offset(extent_bytes: u64, extent: u32) -> u64 {
    extent_offset(extent_bytes, extent) + B
}

/// Offset of slot 0 from the start of an extent of `stride`: the header block and the table.
pub fn slots_start(extent_bytes: u64, stride: u64) -> u64 {
    B + B * table_blocks(slots_per_extent(extent_bytes, stride))
}

/// File offset of slot `slot` of extent `extent` (its header block; payload is at
/// `+ BLOCK`). Aligned to `BLOCK` when `extent_bytes` and `stride` are. Caller
/// guarantees `slot < slots_per_extent` and `extent < extent_count`.
pub fn slot_offset(extent_bytes: u64, extent: u32, stride: u64, slot: u32) -> u64 {
    let slots = slots_per_extent(extent_bytes, stride);
    slot_offset_of(extent_bytes, extent, stride, slots, slot)
}

/// [`slot_offset`] for a caller that already knows the extent's `slots`
/// (`== slots_per_extent(extent_bytes, stride)`): no geometry is recomputed.
pub fn slot_offset_of(extent_bytes: u64, extent: u32, stride: u64, slots: u32, slot: u32) -> u64 {
    debug_assert_eq!(slots, slots_per_extent(extent_bytes, stride));
    extent_offset(extent_bytes, extent) + B + B * table_blocks(slots) + u64::from(slot) * stride
}

/// Default extent size for a file: 256 MiB, at most a quarter of the space after
/// `EXTENT_BASE` rounded down to a multiple of 2 MiB, at least 2 MiB. Returns 0 if
/// not even one 2 MiB extent fits. A non-zero result always passes `Superblock::decode`.
pub fn default_extent_bytes(file_bytes: u64) -> u64 {
    let avail = file_bytes.saturating_sub(EXTENT_BASE);
    if avail < MIB2 {
        return 0;
    }
    (avail / 4 / MIB2 * MIB2).clamp(MIB2, 256 << 20)
}

// ---- helpers ----

pub(super) fn invalid(msg: String) -> FormatError {
    FormatError::Invalid(msg)
}

fn check_len(field: &'static str, len: usize, max: usize) -> Result<(), FormatError> {
    if len > max {
        return Err(FormatError::FieldTooLong { field, len, max });
    }
    Ok(())
}

fn get_str(field: &str, bytes: &[u8]) -> Result<String, FormatError> {
    String::from_utf8(bytes.to_vec()).map_err(|e| invalid(format!("{field} is not UTF-8: {e}")))
}

pub(super) fn put_u64(out: &mut [u8], at: usize, v: u64) {
    out[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub(super) fn put_u32(out: &mut [u8], at: usize, v: u32) {
    out[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Callers only read fixed offsets inside a buffer already checked to be `BLOCK` bytes.
pub(super) fn get_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(b)
}

pub(super) fn get_u32(buf: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(b)
}

/// xxh3_64 of a `BLOCK`-byte buffer with the checksum field read as zero.
fn block_checksum(buf: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&buf[..CKSUM]);
    h.update(&[0u8; 8]);
    h.update(&buf[CKSUM + 8..]);
    h.digest()
}

/// Writes magic, version and (last) the checksum into an encoded block.
pub(super) fn seal(out: &mut [u8], magic: u64) {
    put_u64(out, 0, magic);
    put_u32(out, VERSION, FORMAT_VERSION);
    let sum = block_checksum(out);
    put_u64(out, CKSUM, sum);
}

/// Common decode checks, in order: length, all-zero, magic, version, checksum.
pub(super) fn check(buf: &[u8], magic: u64) -> Result<(), FormatError> {
    if buf.len() != BLOCK {
        return Err(invalid(format!(
            "block is {} bytes, expected {BLOCK}",
            buf.len()
        )));
    }
    if buf.iter().all(|&b| b == 0) {
        return Err(FormatError::Empty);
    }
    let found = get_u64(buf, 0);
    if found != magic {
        return Err(FormatError::BadMagic { found });
    }
    let found = get_u32(buf, VERSION);
    if found != FORMAT_VERSION {
        return Err(FormatError::BadVersion { found });
    }
    if get_u64(buf, CKSUM) != block_checksum(buf) {
        return Err(FormatError::BadChecksum);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
