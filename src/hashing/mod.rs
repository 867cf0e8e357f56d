//! LMCache-compatible rolling chunk hashes: BLAKE3 over 256-token chunks, chained from the
//! "none hash". Clients compute these; the node only ever sees the 32-byte digests.

/// A 32-byte chunk digest, used verbatim as `ObjectKey::chunk_hash`.
pub type ChunkHash = [u8; 32];

/// Default tokens per chunk (LMCache's `--chunk-size`).
pub const DEFAULT_CHUNK_TOKENS: u32 = 256;

/// `BLAKE3(0i64 as big-endian || 0u32 as big-endian)`: the seed of every hash chain.
pub fn none_hash() -> ChunkHash {
    let mut h = blake3::Hasher::new();
    h.update(&0i64.to_be_bytes());
    h.update(&0u32.to_be_bytes());
    *h.finalize().as_bytes()
}

/// The rolling hash of one chunk given its predecessor's digest: `BLAKE3(prev || tokens as BE u32)`.
pub fn chain_hash(prev: &ChunkHash, tokens: &[u32]) -> ChunkHash {
    let mut h = blake3::Hasher::new();
    h.update(prev);
    // Encode in small stack batches: no allocation per chunk.
    let mut buf = [0u8; 1024];
    for group in tokens.chunks(buf.len() / 4) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(group) {
            dst.copy_from_slice(&t.to_be_bytes());
        }
        h.update(&buf[..group.len() * 4]);
    }
    *h.finalize().as_bytes()
}

/// Hashes of every full chunk of `tokens` (a trailing partial chunk is ignored), in order.
/// Invariant: `result.len() == tokens.len() / chunk_tokens`, and `result[i]` depends on every
/// token before `(i + 1) * chunk_tokens`. A zero chunk size yields no hashes.
pub fn chunk_hashes(tokens: &[u32], chunk_tokens: u32) -> Vec<ChunkHash> {
    if chunk_tokens == 0 {
        return Vec::new();
    }
    let mut prev = none_hash();
    tokens
        .chunks_exact(chunk_tokens as usize)
        .map(|chunk| {
            prev = chain_hash(&prev, chunk);
            prev
        })
        .collect()
}

/// Lowercase hex of a digest (for logs and the status report).
pub fn to_hex(h: &ChunkHash) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_hash_matches_lmcache() {
        assert_eq!(
            to_hex(&none_hash()),
            "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
        );
    }

    #[test]
    fn rolling_vectors_match_lmcache() {
        let tokens: Vec<u32> = (1..=9).collect();
        let hs = chunk_hashes(&tokens, 4);
        assert_eq!(hs.len(), 2, "trailing partial chunk is ignored");
        assert_eq!(
            to_hex(&hs[0]),
            "6309ed506b8721905753f5c73c070bb21c3aafbd9b474b1e231f41368b71123c"
        );
        assert_eq!(
            to_hex(&hs[1]),
            "98efc76eafb06cfe774c31ff151f300b61a614c27982a211bb8cdbd83a8c0e19"
        );
        let zeros = vec![0u32; 256];
        assert_eq!(
            to_hex(&chunk_hashes(&zeros, 256)[0]),
            "03edbe7e49c9198da23fa92679fd592f12679bb4ccc65b5c91f31dda79bf1fa9"
        );
    }

    #[test]
    fn counts_follow_full_chunks() {
        assert_eq!(chunk_hashes(&[1; 8], 4).len(), 2);
        assert_eq!(chunk_hashes(&[1; 10], 4).len(), 2);
        assert_eq!(chunk_hashes(&[1; 3], 4).len(), 0);
        assert!(chunk_hashes(&[1; 3], 0).is_empty());
    }

    #[test]
    fn prefix_dependence() {
        let a = chunk_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = chunk_hashes(&[9, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_ne!(a[1], b[1], "a chunk's hash depends on every earlier token");
        let c = chunk_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4);
        assert_eq!(
            &c[..2],
            &a[..],
            "extending the sequence keeps the prefix hashes"
        );
    }

    #[test]
    fn long_chunks_encode_across_batches() {
        // 600 tokens spans more than one 256-token stack batch inside chain_hash.
        let tokens: Vec<u32> = (0..600).collect();
        let mut bytes = none_hash().to_vec();
        for t in &tokens {
            bytes.extend_from_slice(&t.to_be_bytes());
        }
        assert_eq!(
            chunk_hashes(&tokens, 600)[0],
            *blake3::hash(&bytes).as_bytes()
        );
    }
}
