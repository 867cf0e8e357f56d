//! What the simulated engine stores: objects of a few sizes (so strides mix in the extents),
//! each version of a key under a layout of its own, and payload bytes that name their key and
//! version (so a load that serves the wrong object is told apart from one that serves garbage).

use xxhash_rust::xxh3::xxh3_64;

use crate::storage::{Dtype, Layout};

/// Object sizes in bytes: four strides (16, 24, 40 and 76 KiB with the slot header) that share
/// the few extents of the simulated device, so extents fill, drain and are reclaimed quickly.
pub const SIZES: [u64; 4] = [12 << 10, 20 << 10, 36 << 10, 72 << 10];

/// Magic at the start of every simulated payload (`b"KVSIMOBJ"` little-endian).
const MAGIC: u64 = u64::from_le_bytes(*b"KVSIMOBJ");

/// Bytes of the self-describing payload header: magic, key, version, length.
const HEADER: usize = 32;

/// The dtypes layouts are drawn from (element sizes 1, 2, 4 and 8).
const DTYPES: [Dtype; 4] = [Dtype::Uint8, Dtype::Int16, Dtype::Float32, Dtype::Float64];

/// The `n`-th layout of `SIZES[class]`: `[a, b, c, d]` of one of four dtypes with
/// `a * b * c * d * item == SIZES[class]`, in a fixed enumeration order. Invariant: distinct
/// `n` (below several thousand, far more than any key gets versions) give distinct shapes or
/// dtypes, hence distinct fingerprints; the same `(class, n)` always gives the same layout.
pub fn nth_layout(class: usize, n: u64) -> Layout {
    let bytes = SIZES[class];
    let mut left = n;
    loop {
        for dtype in DTYPES {
            let elems = bytes / dtype.item_bytes();
            let ds = divisors(elems);
            for &a in &ds {
                for &b in ds.iter().filter(|&&b| (elems / a).is_multiple_of(b)) {
                    for &c in ds.iter().filter(|&&c| (elems / a / b).is_multiple_of(c)) {
                        if left == 0 {
                            return Layout::new(vec![a, b, c, elems / a / b / c], dtype)
                                .expect("a valid simulated layout");
                        }
                        left -= 1;
                    }
                }
            }
        }
        // Past the end of the enumeration (never reached in practice): wrap around.
    }
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|&d| n.is_multiple_of(d)).collect()
}

/// The payload of `version` of key `key`, `len` bytes: a header naming both, then a stream
/// derived from them. Invariant: a pure function of its arguments; two different
/// `(key, version)` pairs never give equal payloads.
pub fn payload(key: u32, version: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    let head = [MAGIC, u64::from(key), version, len];
    for (i, w) in head.iter().enumerate() {
        out[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    let mut x = (u64::from(key) << 40) ^ version.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for chunk in out[HEADER..].chunks_mut(8) {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
    out
}

/// The checksum the model keeps of each version's payload (xxh3 of the bytes).
pub fn checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// What a payload says it is: `(key, version, len)` when it starts with a simulated header,
/// for failure messages ("bytes of key 7 version 31").
pub fn describe(bytes: &[u8]) -> Option<(u64, u64, u64)> {
    if bytes.len() < HEADER {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    (word(0) == MAGIC).then(|| (word(1), word(2), word(3)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_distinct_and_sized() {
        for (class, &size) in SIZES.iter().enumerate() {
            let fps: std::collections::BTreeSet<u64> = (0..200)
                .map(|n| {
                    let l = nth_layout(class, n);
                    assert_eq!(l.object_bytes(), size);
                    l.fingerprint()
                })
                .collect();
            assert_eq!(fps.len(), 200, "class {class}");
        }
        assert_eq!(nth_layout(2, 17), nth_layout(2, 17));
    }

    #[test]
    fn payloads_name_their_object() {
        let p = payload(7, 31, SIZES[1]);
        assert_eq!(p.len() as u64, SIZES[1]);
        assert_eq!(describe(&p), Some((7, 31, SIZES[1])));
        assert_ne!(checksum(&p), checksum(&payload(7, 32, SIZES[1])));
        assert_ne!(checksum(&p), checksum(&payload(8, 31, SIZES[1])));
        assert_eq!(p, payload(7, 31, SIZES[1]));
    }
}
