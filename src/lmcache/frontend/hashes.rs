//! The rolling-hash cache of the frontend: the chunk hashes computed for a request id, reused
//! by later requests under the same id only when their tokens match (checked by prefix digest).

use std::sync::atomic::Ordering;

use xxhash_rust::xxh3::Xxh3;

use super::LmFrontend;
use crate::hashing::{chunk_hashes, ChunkHash};
use crate::lmcache::wire::IpcKey;

/// The rolling hashes of a request's tokens, with a digest of every chunk-aligned token prefix
/// so a later request under the same id reuses them only for the same tokens.
pub(super) struct HashEntry {
    pub(super) hashes: Vec<ChunkHash>,
    /// `digests[i]` = xxh3 of the tokens of chunks `0..=i`.
    digests: Vec<u64>,
}

impl HashEntry {
    pub(super) fn compute(tokens: &[u32], chunk_tokens: u32) -> HashEntry {
        let hashes = chunk_hashes(tokens, chunk_tokens);
        let mut digests = Vec::with_capacity(hashes.len());
        let mut h = Xxh3::new();
        for chunk in tokens
            .chunks_exact(chunk_tokens as usize)
            .take(hashes.len())
        {
            feed(&mut h, chunk);
            digests.push(h.digest());
        }
        HashEntry { hashes, digests }
    }

    pub(super) fn bytes(&self) -> usize {
        self.hashes.len() * (32 + 8)
    }
}

fn feed(h: &mut Xxh3, tokens: &[u32]) {
    let mut buf = [0u8; 1024];
    for part in tokens.chunks(buf.len() / 4) {
        for (b, t) in buf.chunks_exact_mut(4).zip(part) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..part.len() * 4]);
    }
}

/// xxh3 of `tokens` as the digests of [`HashEntry`] are computed.
fn prefix_digest(tokens: &[u32]) -> u64 {
    let mut h = Xxh3::new();
    feed(&mut h, tokens);
    h.digest()
}

impl LmFrontend {
    /// Rolling hashes of the chunks `[start/C, end/C)` of `key`, reusing the request's cached
    /// hashes only when they were computed from the same tokens; `Err` if the range is not
    /// chunk-aligned or runs past the tokens.
    pub(super) fn range_hashes(&self, key: &IpcKey) -> Result<(u32, Vec<ChunkHash>), String> {
        let c = self.chunk();
        if !key.start.is_multiple_of(c) || !key.end.is_multiple_of(c) || key.start > key.end {
            return Err(format!(
                "range [{}, {}) is not aligned to {c}-token chunks",
                key.start, key.end
            ));
        }
        let (first, last) = ((key.start / c) as usize, (key.end / c) as usize);
        if (key.token_ids.len() as u64) < key.end {
            return Err(format!(
                "range end {} beyond {} tokens",
                key.end,
                key.token_ids.len()
            ));
        }
        if last == 0 {
            return Ok((first as u32, Vec::new()));
        }
        {
            let cache = self.state.hashes.lock();
            if let Some(e) = cache.get(&key.request_id) {
                if e.hashes.len() >= last {
                    if e.digests[last - 1] == prefix_digest(&key.token_ids[..last * c as usize]) {
                        return Ok((first as u32, e.hashes[first..last].to_vec()));
                    }
                    self.state
                        .counters
                        .hash_mismatches
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let entry = HashEntry::compute(&key.token_ids, self.ctx.config.chunk_tokens);
        let out = entry.hashes[first..last.min(entry.hashes.len())].to_vec();
        if !key.request_id.is_empty() {
            let bytes = entry.bytes();
            self.state
                .hashes
                .lock()
                .insert(key.request_id.clone(), entry, bytes);
        }
        Ok((first as u32, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_hashes_are_reused_only_for_the_same_tokens() {
        let c = 4u32;
        let a: Vec<u32> = (0..16).collect();
        let e = HashEntry::compute(&a, c);
        assert_eq!(e.hashes.len(), 4);
        assert_eq!(e.digests[1], prefix_digest(&a[..8]));
        let mut b = a.clone();
        b[5] = 999;
        assert_ne!(
            e.digests[1],
            prefix_digest(&b[..8]),
            "other tokens, other digest"
        );
        assert_eq!(
            e.digests[0],
            prefix_digest(&b[..4]),
            "the common prefix still matches"
        );
    }
}
