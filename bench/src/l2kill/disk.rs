//! The data file between a kill and the restart: the scan that judges it as recovery will
//! (torn slots), and the sabotage that tests the loop itself.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use kvnode::hashing::ChunkHash;
use kvnode::l2::format::{payload_checksum, SlotHeader, BLOCK, EXTENT_BASE, SLOT_MAGIC};

use super::Sabotage;

/// Damages every slot of the data file (see [`Sabotage`]); returns how many slots. Takes the
/// file's lock first, as a node does, so the killed node's last I/O has landed.
pub(super) fn sabotage(path: &Path, kind: Sabotage) -> Result<u64, String> {
    let err = |e: std::io::Error| format!("sabotage of {}: {e}", path.display());
    let file = File::options()
        .read(true)
        .write(true)
        .open(path)
        .map_err(err)?;
    kvnode_hw::lock_exclusive(&file, Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let bytes = std::fs::read(path).map_err(err)?;
    let mut n = 0;
    let mut off = EXTENT_BASE as usize;
    while off + BLOCK <= bytes.len() {
        let block = &bytes[off..off + BLOCK];
        if block[..8] != SLOT_MAGIC.to_le_bytes() {
            off += BLOCK;
            continue;
        }
        let Ok(mut h) = SlotHeader::decode(block) else {
            off += BLOCK;
            continue;
        };
        let start = off + BLOCK;
        let end = start + h.object_len as usize;
        if h.file_offset != off as u64 || end > bytes.len() {
            off += BLOCK;
            continue;
        }
        let mut payload = bytes[start..end].to_vec();
        let at = payload.len() / 2;
        payload[at] ^= 0x5a;
        file.write_all_at(&payload[at..at + 1], (start + at) as u64)
            .map_err(err)?;
        if kind == Sabotage::Forge {
            h.payload_checksum = payload_checksum(&payload);
            let mut hb = vec![0u8; BLOCK];
            h.encode(&mut hb).map_err(|e| e.to_string())?;
            file.write_all_at(&hb, off as u64).map_err(err)?;
        }
        n += 1;
        off = end.div_ceil(BLOCK) * BLOCK;
    }
    file.sync_data().map_err(err)?;
    Ok(n)
}

/// What the data file holds right after a kill, judged as recovery will (see [`scan`]).
#[derive(Default, Clone, Copy, Debug)]
pub(super) struct Scan {
    /// Slot headers recovery will index: current format, extent epoch and offset, newest copy
    /// of their key.
    pub(super) live: u64,
    /// ...whose payload fails the header's checksum (recovery indexes them; the first load
    /// counts them `corrupt`).
    pub(super) torn: u64,
    /// ...of them, the payload starts with another key (a slot reused: the evicted object's
    /// header still on disk over the new object's payload, written first).
    pub(super) torn_other_key: u64,
    /// ...the payload starts with the header's own key (the same object, partly written).
    pub(super) torn_same_key: u64,
}

/// Reads the data file as recovery does (superblock, extent headers, slot headers) and checks
/// every payload recovery would index against its header's checksum. Takes the file's lock
/// first, as a node does, so the killed node's last I/O has landed.
pub(super) fn scan(path: &Path) -> Result<Scan, String> {
    use kvnode::l2::format::{
        extent_count, extent_offset, slot_offset, slots_per_extent, ExtentHeader, Superblock,
        SUPERBLOCK_OFFSETS,
    };
    let file = File::open(path).map_err(|e| format!("scan of {}: {e}", path.display()))?;
    kvnode_hw::lock_exclusive(&file, Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let bytes = std::fs::read(path).map_err(|e| format!("scan of {}: {e}", path.display()))?;
    let block = |off: u64| bytes.get(off as usize..off as usize + BLOCK);
    let Some(sb) = SUPERBLOCK_OFFSETS
        .iter()
        .filter_map(|&o| block(o).and_then(|b| Superblock::decode(b).ok()))
        .max_by_key(|sb| sb.update)
    else {
        return Ok(Scan::default());
    };
    // Newest copy per key (hash, rank, group, model, salt).
    type SlotKey = (ChunkHash, u32, u32, String, String);
    let mut newest: std::collections::HashMap<SlotKey, SlotHeader> =
        std::collections::HashMap::new();
    for e in 0..extent_count(sb.file_bytes, sb.extent_bytes) {
        let Some(Ok(eh)) = block(extent_offset(sb.extent_bytes, e)).map(ExtentHeader::decode)
        else {
            continue;
        };
        if eh.format_id != sb.format_id || eh.extent_index != e {
            continue;
        }
        for j in 0..slots_per_extent(sb.extent_bytes, eh.stride) {
            let off = slot_offset(sb.extent_bytes, e, eh.stride, j);
            let Some(Ok(h)) = block(off).map(SlotHeader::decode) else {
                continue;
            };
            if h.format_id != sb.format_id || h.extent_epoch != eh.epoch || h.file_offset != off {
                continue;
            }
            let key = (
                h.chunk_hash,
                h.kv_rank,
                h.object_group,
                h.model.clone(),
                h.cache_salt.clone(),
            );
            if newest.get(&key).is_none_or(|old| old.seq < h.seq) {
                newest.insert(key, h);
            }
        }
    }
    let mut out = Scan::default();
    for h in newest.values() {
        out.live += 1;
        let start = (h.file_offset + BLOCK as u64) as usize;
        let payload = bytes
            .get(start..start + h.object_len as usize)
            .unwrap_or(&[]);
        if payload.len() as u64 == h.object_len && payload_checksum(payload) == h.payload_checksum {
            continue;
        }
        out.torn += 1;
        match payload.get(..32) {
            Some(k) if k == h.chunk_hash => out.torn_same_key += 1,
            Some(k) if k.iter().any(|&b| b != 0) => out.torn_other_key += 1,
            _ => {}
        }
    }
    Ok(out)
}
