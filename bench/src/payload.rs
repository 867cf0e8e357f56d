//! The bytes a chunk carries: a pure function of its key (the chunk hash), never of the instance
//! or run that wrote it. Whoever reads a chunk, including one the node already held when another
//! run "stored" it (deduplicated, PREPARE_STORE's "new" mode), can therefore verify it.
//!
//! Layout of a chunk of key `h` (32 bytes): bytes `0..32` are `h` itself; every later byte is a
//! fixed pseudo-random base pattern XORed with four 64-bit lane words derived from all of `h`
//! (byte `32 + 8k + b` uses lane `k % 4`, byte `b` of it). A slot holding another key's bytes
//! differs in the header and in every body word (unless two keys' lane words coincide: 2^-64
//! per lane); a torn or partial write leaves body words that do not match, wherever it stops;
//! a misplaced run of bytes meets a different base pattern.

use kvnode::hashing::ChunkHash;

/// Bytes at the start of every chunk that hold its key verbatim.
pub const HEADER_BYTES: usize = 32;

/// Seed of the base pattern: a constant, so every process of every run agrees on it.
const BASE_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: a bijective 64-bit mixer.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The four lane words of key `h`; each depends on all 32 bytes of `h`.
fn lanes(h: &ChunkHash) -> [u64; 4] {
    let w = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    };
    let all = splitmix64(w(0) ^ splitmix64(w(1) ^ splitmix64(w(2) ^ splitmix64(w(3)))));
    [0u64, 1, 2, 3].map(|k| splitmix64(all ^ w(k as usize) ^ (k << 56)))
}

/// Generates and checks chunk payloads of one size. Invariant: `base.len()` is that size.
pub struct Payload {
    base: Vec<u8>,
}

impl Payload {
    /// Payloads of `len` bytes (the node's object size).
    pub fn new(len: usize) -> Payload {
        let mut base = vec![0u8; len];
        let mut x = BASE_SEED;
        for w in base.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
        }
        Payload { base }
    }

    /// Writes the payload of key `h` into `out`. Panics unless `out.len() == self.len()`.
    pub fn fill(&self, h: &ChunkHash, out: &mut [u8]) {
        assert_eq!(out.len(), self.base.len(), "payload buffer size");
        let head = HEADER_BYTES.min(out.len());
        out[..head].copy_from_slice(&h[..head]);
        let lanes = lanes(h);
        let body = out[head..].chunks_mut(8).zip(self.base[head..].chunks(8));
        for (k, (o, b)) in body.enumerate() {
            let lane = lanes[k % 4].to_le_bytes();
            for ((o, b), l) in o.iter_mut().zip(b).zip(lane) {
                *o = b ^ l;
            }
        }
    }

    /// Whether `data` is exactly the payload of key `h` (same length, every byte).
    pub fn check(&self, h: &ChunkHash, data: &[u8]) -> bool {
        if data.len() != self.base.len() {
            return false;
        }
        let head = HEADER_BYTES.min(data.len());
        if data[..head] != h[..head] {
            return false;
        }
        let lanes = lanes(h);
        let body = data[head..].chunks(8).zip(self.base[head..].chunks(8));
        body.enumerate().all(|(k, (d, b))| {
            let lane = lanes[k % 4].to_le_bytes();
            d.iter().zip(b).zip(lane).all(|((d, b), l)| *d == b ^ l)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> ChunkHash {
        let mut h = [0u8; 32];
        h[0] = n;
        h[31] = n.wrapping_mul(7);
        h
    }

    #[test]
    fn a_payload_depends_on_the_key_only() {
        for len in [0, 5, 32, 33, 41, 4096, 16 * 1024 + 3] {
            let (p, q) = (Payload::new(len), Payload::new(len));
            let (mut a, mut b) = (vec![0u8; len], vec![0xFFu8; len]);
            p.fill(&key(1), &mut a);
            q.fill(&key(1), &mut b);
            assert_eq!(a, b, "len {len}");
            assert!(q.check(&key(1), &a), "len {len}");
            assert!(!p.check(&key(1), &a[..len.saturating_sub(1)]) || len == 0);
        }
    }

    #[test]
    fn another_keys_bytes_are_caught_everywhere() {
        let p = Payload::new(4096);
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        p.fill(&key(1), &mut a);
        p.fill(&key(2), &mut b);
        assert!(!p.check(&key(1), &b));
        // Every 8-byte word of the body differs between two keys.
        for (x, y) in a[HEADER_BYTES..].chunks(8).zip(b[HEADER_BYTES..].chunks(8)) {
            assert_ne!(x, y);
        }
        // Only the header of the right key: still caught.
        let mut c = b.clone();
        c[..HEADER_BYTES].copy_from_slice(&key(1));
        assert!(!p.check(&key(1), &c));
    }

    #[test]
    fn torn_and_damaged_writes_are_caught() {
        let p = Payload::new(4096);
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        p.fill(&key(1), &mut a);
        p.fill(&key(2), &mut b);
        for cut in [HEADER_BYTES, 40, 2048, 4095] {
            // Key 1 written up to `cut` over a slot that held key 2, or over zeros.
            let mut torn = b.clone();
            torn[..cut].copy_from_slice(&a[..cut]);
            assert!(!p.check(&key(1), &torn), "cut {cut}");
            let mut partial = vec![0u8; 4096];
            partial[..cut].copy_from_slice(&a[..cut]);
            assert!(!p.check(&key(1), &partial), "cut {cut}");
        }
        for i in [0, 31, 32, 1000, 4095] {
            let mut flipped = a.clone();
            flipped[i] ^= 1;
            assert!(!p.check(&key(1), &flipped), "byte {i}");
        }
        // Two halves swapped (misplaced bytes of the right key).
        let mut swapped = a.clone();
        swapped[HEADER_BYTES..].rotate_left(1024);
        assert!(!p.check(&key(1), &swapped));
    }
}
