//! The two ways a retrieve's bytes reach the engine: copied out of the mapped pool (local), or
//! received from the node over TCP (remote, READ_SLOTS). Both verify what they got.

use std::time::Instant;

use kvnode::client::RetrievePrepared;
use kvnode::hashing::ChunkHash;

use super::Instance;
use crate::conn::{ensure_buffers, Conn};
use crate::stats::Op;

impl Instance {
    /// Copies the slots of a prepared retrieve out of the pool, verifies them, commits.
    /// Returns (corrupt, checked) chunks.
    pub(super) fn read_local(
        &mut self,
        id: u64,
        p: &RetrievePrepared,
        hashes: &[ChunkHash],
    ) -> Result<(u64, u64), String> {
        let Conn::Local(c) = &self.client else {
            return Err("read_local on a remote connection".into());
        };
        let pool = c.pool().ok_or("no pool mapped")?;
        let (mut bad, mut checked) = (0, 0);
        for (slot, h) in p.slots.iter().zip(hashes) {
            pool.read_at(slot.offset, &mut self.dest)
                .map_err(|e| e.to_string())?;
            if self.spec.verify {
                // Verification is the harness's work, not the engine's: it is kept out of the
                // measured time (the retrieve latency and the goodput).
                let v = Instant::now();
                checked += 1;
                if !self.payload.check(h, &self.dest) {
                    bad += 1;
                }
                self.verify_time += v.elapsed();
            }
        }
        let t1 = Instant::now();
        self.client
            .commit_retrieve(id, p.transfer_id)
            .map_err(|e| format!("commit_retrieve: {e}"))?;
        self.record(Op::CommitRetrieve, t1);
        Ok((bad, checked))
    }

    /// READ_SLOTS of a prepared retrieve (the node sends every slot and releases its locks),
    /// then verifies. Returns (corrupt, checked) chunks.
    pub(super) fn read_remote(
        &mut self,
        id: u64,
        p: &RetrievePrepared,
        hashes: &[ChunkHash],
    ) -> Result<(u64, u64), String> {
        let n = p.slots.len();
        ensure_buffers(&mut self.dests, n, self.chunk_bytes);
        let Conn::Remote(c) = &mut self.client else {
            return Err("read_remote on a local connection".into());
        };
        let t1 = Instant::now();
        let mut out: Vec<&mut [u8]> = self.dests[..n].iter_mut().map(Vec::as_mut_slice).collect();
        let bytes = c
            .read_slots(id, p.transfer_id, &mut out, true)
            .map_err(|e| format!("read_slots: {e}"))?;
        self.result.moved_bytes += bytes;
        self.record(Op::ReadSlots, t1);
        let (mut bad, mut checked) = (0, 0);
        if self.spec.verify {
            let v = Instant::now();
            for (d, h) in self.dests[..n].iter().zip(hashes) {
                checked += 1;
                if !self.payload.check(h, d) {
                    bad += 1;
                }
            }
            self.verify_time += v.elapsed();
        }
        Ok((bad, checked))
    }
}
