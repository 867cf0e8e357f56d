//! Transfer ids that are not guessable: the n-th id is a keyed permutation of n (a 4-round
//! Feistel network over 64 bits whose round function is keyed BLAKE3), so ids never repeat while
//! the counter does not wrap, and knowing some ids tells nothing useful about the others. The key
//! is random per node run (from the kernel); the simulator fixes it for reproducibility.
//! Ids are scoped to their instance anyway (only its own connections reach them): this is
//! defence in depth, so a transfer id never serves as a guessable capability.

use std::sync::atomic::{AtomicU64, Ordering};

/// Rounds of the Feistel network (4 rounds of a pseudo-random function give a pseudo-random
/// permutation).
const ROUNDS: u8 = 4;

/// The node's transfer-id generator. Invariant: `next` never returns 0 and never returns the
/// same id twice (a bijection of a strictly increasing counter).
pub struct TransferIds {
    counter: AtomicU64,
    key: [u8; 32],
}

impl TransferIds {
    /// A generator with a random key from the kernel (`/dev/urandom`); if that cannot be read,
    /// a key from the standard library's randomly seeded hasher and the clock.
    pub fn random() -> TransferIds {
        TransferIds::with_key(random_key())
    }

    /// A generator with a fixed key (the simulator: reproducible runs).
    pub fn with_key(key: [u8; 32]) -> TransferIds {
        TransferIds {
            counter: AtomicU64::new(1),
            key,
        }
    }

    /// The next id (never 0, never repeated).
    pub fn next(&self) -> u64 {
        loop {
            let n = self.counter.fetch_add(1, Ordering::Relaxed);
            let id = self.permute(n);
            if id != 0 {
                return id;
            }
        }
    }

    fn permute(&self, n: u64) -> u64 {
        let (mut l, mut r) = ((n >> 32) as u32, n as u32);
        for round in 0..ROUNDS {
            let mut h = blake3::Hasher::new_keyed(&self.key);
            h.update(&[round]);
            h.update(&r.to_le_bytes());
            let f = u32::from_le_bytes(h.finalize().as_bytes()[..4].try_into().expect("4 bytes"));
            (l, r) = (r, l ^ f);
        }
        (u64::from(l) << 32) | u64::from(r)
    }
}

fn random_key() -> [u8; 32] {
    let mut key = [0u8; 32];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        if std::io::Read::read_exact(&mut f, &mut key).is_ok() {
            return key;
        }
    }
    use std::hash::{BuildHasher, Hasher};
    for (i, chunk) in key.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_nonzero_and_not_sequential() {
        let g = TransferIds::with_key([7; 32]);
        let ids: Vec<u64> = (0..10_000).map(|_| g.next()).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ids.len());
        assert!(!ids.contains(&0));
        let sequential = ids.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(sequential < 10, "{sequential} consecutive pairs");
    }

    #[test]
    fn the_key_decides_the_ids() {
        let a = TransferIds::with_key([1; 32]);
        let b = TransferIds::with_key([1; 32]);
        let c = TransferIds::with_key([2; 32]);
        let (x, y, z) = (a.next(), b.next(), c.next());
        assert_eq!(x, y, "same key, same sequence (the simulator relies on it)");
        assert_ne!(x, z);
        assert_ne!(random_key(), random_key());
    }
}
