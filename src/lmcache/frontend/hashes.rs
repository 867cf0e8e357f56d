//! The rolling-hash cache of the frontend: the chunk hashes computed for a (client, request id),
//! reused by later requests of the same client under the same id only when their tokens match.
//!
//! The match is checked with a 128-bit XXH3 digest of every chunk-aligned token prefix, keyed
//! with a secret drawn at start-up: clients never see a digest and cannot compute one, so they
//! cannot craft token lists that pass the check with other tokens (an unkeyed 64-bit digest
//! could be matched on purpose, e.g. by a user who chooses a prompt and a request id that vLLM
//! forwards). Entries are kept per client, so no client can seed or evict another's.

use std::hash::BuildHasher;
use std::sync::atomic::Ordering;

use xxhash_rust::xxh3::Xxh3;

use super::{ClientId, LmFrontend};
use crate::hashing::{chunk_hashes, ChunkHash};
use crate::lmcache::wire::IpcKey;

/// Bytes of an XXH3 secret.
const SECRET_BYTES: usize = 192;

/// The secret keying the prefix digests. Invariant: drawn from the OS's randomness (through
/// the standard library's randomly keyed SipHash) once per frontend; never leaves the process.
pub(super) struct DigestKey([u8; SECRET_BYTES]);

impl DigestKey {
    /// A fresh random key.
    pub(super) fn random() -> DigestKey {
        let state = std::collections::hash_map::RandomState::new();
        let mut secret = [0u8; SECRET_BYTES];
        for (i, word) in secret.chunks_exact_mut(8).enumerate() {
            word.copy_from_slice(&state.hash_one(i as u64).to_le_bytes());
        }
        DigestKey(secret)
    }

    fn hasher(&self) -> Xxh3 {
        Xxh3::with_secret(self.0)
    }

    /// The keyed digest of `tokens` as the digests of [`HashEntry`] are computed.
    fn digest(&self, tokens: &[u32]) -> u128 {
        let mut h = self.hasher();
        feed(&mut h, tokens);
        h.digest128()
    }
}

/// The rolling hashes of a request's tokens, with a keyed digest of every chunk-aligned token
/// prefix so a later request under the same id reuses them only for the same tokens.
pub(super) struct HashEntry {
    pub(super) hashes: Vec<ChunkHash>,
    /// `digests[i]` = keyed XXH3-128 of the tokens of chunks `0..=i`.
    digests: Vec<u128>,
}

impl HashEntry {
    pub(super) fn compute(key: &DigestKey, tokens: &[u32], chunk_tokens: u32) -> HashEntry {
        let hashes = chunk_hashes(tokens, chunk_tokens);
        let mut digests = Vec::with_capacity(hashes.len());
        let mut h = key.hasher();
        for chunk in tokens
            .chunks_exact(chunk_tokens as usize)
            .take(hashes.len())
        {
            feed(&mut h, chunk);
            digests.push(h.digest128());
        }
        HashEntry { hashes, digests }
    }

    pub(super) fn bytes(&self) -> usize {
        self.hashes.len() * (32 + 16)
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

impl LmFrontend {
    /// Rolling hashes of the chunks `[start/C, end/C)` of `key`, reusing the hashes `client`
    /// cached for the request id only when they were computed from the same tokens; `Err` if
    /// the range is not chunk-aligned or runs past the tokens. Callers check first that the
    /// client may act on the request's instance, so only registered owners fill the cache.
    pub(super) fn range_hashes(
        &self,
        client: &ClientId,
        key: &IpcKey,
    ) -> Result<(u32, Vec<ChunkHash>), String> {
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
        let now = self.ctx.now_ms();
        let cached = {
            let cache = self.state.hashes.lock();
            cache
                .get(client, &key.request_id, now)
                .filter(|e| e.hashes.len() >= last)
                .map(|e| (e.digests[last - 1], e.hashes[first..last].to_vec()))
        };
        // The digest is computed outside the lock (it reads every token of the prefix).
        let key_digest = &self.state.digest_key;
        if let Some((digest, hashes)) = cached {
            if digest == key_digest.digest(&key.token_ids[..last * c as usize]) {
                return Ok((first as u32, hashes));
            }
            self.state
                .counters
                .hash_mismatches
                .fetch_add(1, Ordering::Relaxed);
        }
        let entry = HashEntry::compute(key_digest, &key.token_ids, self.ctx.config.chunk_tokens);
        let out = entry.hashes[first..last.min(entry.hashes.len())].to_vec();
        if !key.request_id.is_empty() {
            let bytes = entry.bytes();
            self.state
                .hashes
                .lock()
                .insert(client, &key.request_id, entry, bytes, now);
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
        let key = DigestKey::random();
        let a: Vec<u32> = (0..16).collect();
        let e = HashEntry::compute(&key, &a, c);
        assert_eq!(e.hashes.len(), 4);
        assert_eq!(e.digests[1], key.digest(&a[..8]));
        let mut b = a.clone();
        b[5] = 999;
        assert_ne!(
            e.digests[1],
            key.digest(&b[..8]),
            "other tokens, other digest"
        );
        assert_eq!(
            e.digests[0],
            key.digest(&b[..4]),
            "the common prefix still matches"
        );
    }

    #[test]
    fn digests_depend_on_a_secret_key() {
        let a: Vec<u32> = (0..64).collect();
        let (k1, k2) = (DigestKey::random(), DigestKey::random());
        assert_ne!(k1.0, k2.0);
        assert_ne!(
            k1.digest(&a),
            k2.digest(&a),
            "no digest is predictable across keys"
        );
        assert_eq!(k1.digest(&a), k1.digest(&a));
    }
}
