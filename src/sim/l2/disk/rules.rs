//! The rules every tier write must follow, checked as it is issued: inside `[0, l2.bytes)`;
//! below the first extent only the two superblock copies; at an extent's start only its
//! header (or zeros: a checkpoint freeing it); then only its table blocks (of that format and epoch); elsewhere only the header or
//! the payload of a slot of the stride, epoch and format the extent's last header gave it. Also the maps from the headers written to where each
//! object's newest copy is, and a description of a slot for failure messages.

use kvnode_hw::BlockIo;

use super::{SimDisk, State, BLOCK};
use crate::l2::format::{
    extent_offset, slot_offset, slots_per_extent, slots_start, ExtentHeader, FormatError,
    SlotHeader, Superblock, TableBlock, ENTRIES_PER_TABLE_BLOCK, EXTENT_BASE,
};

impl SimDisk {
    /// `(seq, offset)` of the newest slot header written for `chunk` under `layout`.
    pub fn latest_header(&self, chunk: &[u8; 32], layout: u64) -> Option<(u64, u64)> {
        self.state.lock().headers.get(&(*chunk, layout)).copied()
    }

    /// File offset of the header of the extent holding `offset`.
    pub fn extent_header_of(&self, offset: u64) -> u64 {
        let e = (offset.saturating_sub(EXTENT_BASE) / self.extent_bytes) as u32;
        extent_offset(self.extent_bytes, e)
    }

    /// Checks one I/O against the device's rules (violations are recorded, the I/O still
    /// runs); for a write, notes the extent header it carries.
    pub fn check_io(&self, io: &BlockIo, write: bool) {
        let mut st = self.state.lock();
        let end = io.file_offset.saturating_add(io.len);
        let what = if write { "write" } else { "read" };
        if end > self.bytes {
            st.violations.push(format!(
                "{what} of {} bytes at {:#x} reaches past l2.bytes ({:#x})",
                io.len, io.file_offset, self.bytes
            ));
            return;
        }
        if write {
            let block = self.pool_block(io);
            self.check_write(&mut st, io, block.as_deref());
        }
    }

    /// The pool bytes of a one-block I/O (headers), `None` for longer ones.
    pub(super) fn pool_block(&self, io: &BlockIo) -> Option<Vec<u8>> {
        (io.len == BLOCK).then(|| {
            let mut b = vec![0u8; BLOCK as usize];
            self.pool
                .region()
                .read_at(io.pool_offset, &mut b)
                .expect("a validated I/O lies in the pool");
            b
        })
    }

    fn check_write(&self, st: &mut State, io: &BlockIo, block: Option<&[u8]>) {
        let off = io.file_offset;
        let bad = |st: &mut State, why: String| {
            st.violations
                .push(format!("write of {} bytes at {off:#x}: {why}", io.len))
        };
        if off < EXTENT_BASE {
            let ok = (off == 0 || off == BLOCK)
                && block.is_some_and(|b| {
                    Superblock::decode(b).is_ok_and(|s| s.file_bytes == self.bytes)
                });
            if !ok {
                bad(st, "not a superblock copy of this device".into());
            }
            return;
        }
        let e = ((off - EXTENT_BASE) / self.extent_bytes) as u32;
        if e as usize >= st.extents.len() {
            return bad(st, "past the last extent".into());
        }
        let start = extent_offset(self.extent_bytes, e);
        if off + io.len > start + self.extent_bytes {
            return bad(st, format!("crosses the end of extent {e}"));
        }
        if off == start {
            match block.map(ExtentHeader::decode) {
                Some(Ok(h)) if h.extent_index == e => st.extents[e as usize] = Some(h),
                // A checkpoint frees an extent on disk that is free in memory.
                Some(Err(FormatError::Empty)) => st.extents[e as usize] = None,
                other => bad(
                    st,
                    format!("extent {e}'s header block is not its header: {other:?}"),
                ),
            }
            return;
        }
        let Some(h) = st.extents[e as usize].clone() else {
            return bad(
                st,
                format!("into extent {e}, which was never given a header"),
            );
        };
        let table_end = start + slots_start(self.extent_bytes, h.stride);
        if off < table_end {
            match block.map(TableBlock::decode) {
                Some(Ok(t))
                    if t.format_id == h.format_id
                        && t.epoch == h.epoch
                        && t.extent_index == e
                        && u64::from(t.first_slot)
                            == (off - start - BLOCK) / BLOCK * ENTRIES_PER_TABLE_BLOCK as u64 => {}
                other => bad(
                    st,
                    format!(
                        "table block of extent {e} that does not match it (format {:#x}, \
                         epoch {}): {other:?}",
                        h.format_id, h.epoch
                    ),
                ),
            }
            return;
        }
        let rel = off - table_end;
        if rel / h.stride >= u64::from(slots_per_extent(self.extent_bytes, h.stride)) {
            return bad(st, format!("past the last slot of extent {e}"));
        }
        match rel % h.stride {
            0 => match block.map(SlotHeader::decode) {
                Some(Ok(s))
                    if s.format_id == h.format_id
                        && s.extent_epoch == h.epoch
                        && s.file_offset == off
                        && s.object_len <= h.stride - BLOCK => {}
                other => bad(
                    st,
                    format!(
                        "slot header that does not match extent {e} (format {:#x}, epoch {}, \
                         stride {}): {other:?}",
                        h.format_id, h.epoch, h.stride
                    ),
                ),
            },
            BLOCK if io.len <= h.stride - BLOCK => {}
            within => bad(
                st,
                format!(
                    "payload at byte {within} of a slot of stride {} in extent {e} (it must \
                     start at byte {BLOCK} and stay inside the slot)",
                    h.stride
                ),
            ),
        }
    }

    /// What the device holds at slot header `offset` (for failure messages): the slot
    /// header, whether its payload matches its checksum, the extent header, the superblock.
    pub fn describe_slot(&self, offset: u64) -> String {
        let st = self.state.lock();
        let block = |at: u64| &st.image[at as usize..(at + BLOCK) as usize];
        let sb = [0, BLOCK]
            .iter()
            .filter_map(|&o| Superblock::decode(block(o)).ok())
            .max_by_key(|s| s.update)
            .map(|s| format!("superblock format {:#x} update {}", s.format_id, s.update));
        let ext = self.extent_header_of(offset);
        let eh = ExtentHeader::decode(block(ext)).map(|h| {
            format!(
                "format {:#x} epoch {} stride {}",
                h.format_id, h.epoch, h.stride
            )
        });
        let slot = SlotHeader::decode(block(offset)).map(|h| {
            let start = (offset + BLOCK) as usize;
            let payload = &st.image[start..start + h.object_len as usize];
            format!(
                "format {:#x} epoch {} seq {} layout {:#x} len {}, payload {}",
                h.format_id,
                h.extent_epoch,
                h.seq,
                h.layout,
                h.object_len,
                if crate::l2::format::payload_checksum(payload) == h.payload_checksum {
                    "intact"
                } else {
                    "damaged"
                }
            )
        });
        format!("device: {sb:?}; extent header {eh:?}; slot header {slot:?}")
    }

    /// Rebuilds the extent and slot header maps from the image (after blocks changed under
    /// the tier's feet).
    pub(super) fn rebuild_maps(&self, st: &mut State) {
        st.headers.clear();
        for e in 0..st.extents.len() as u32 {
            let at = extent_offset(self.extent_bytes, e) as usize;
            let h = ExtentHeader::decode(&st.image[at..at + BLOCK as usize])
                .ok()
                .filter(|h| h.extent_index == e);
            st.extents[e as usize] = h.clone();
            let Some(h) = h else { continue };
            for j in 0..slots_per_extent(self.extent_bytes, h.stride) {
                let off = slot_offset(self.extent_bytes, e, h.stride, j);
                let block = st.image[off as usize..(off + BLOCK) as usize].to_vec();
                note_header(st, off, &block);
            }
        }
    }
}

/// Notes a slot header written at `off` in the `(key, layout) -> newest` map.
pub(super) fn note_header(st: &mut State, off: u64, block: &[u8]) {
    if let Ok(h) = SlotHeader::decode(block) {
        if h.file_offset != off {
            return;
        }
        let e = st
            .headers
            .entry((h.chunk_hash, h.layout))
            .or_insert((0, off));
        if h.seq >= e.0 {
            *e = (h.seq, off);
        }
    }
}
