//! Where a chunk lives in the cluster: weighted rendezvous hashing (highest random weight) over
//! the live members.
//!
//! Every chunk is placed on its own, by its **placement key**: the hash of (model, cache salt,
//! chunk hash), so every rank of a chunk (tensor-parallel shards) lives on the same node and a
//! scheduler-side LOOKUP (all ranks) asks one node per chunk. Each member scores each key
//! `-weight / ln(u)` with `u` uniform in (0, 1) from the key and the member's id; the highest
//! score owns the key. A member's share of keys is its weight over the sum, and a join or a
//! leave moves only the keys whose owner changes: about `1/n` of them (the keys the newcomer now
//! wins, or the keys of the member that left), never a reshuffle of the rest.
//!
//! A prefix lookup groups its chunks by owner and asks each owner once, all owners in parallel:
//! one round per node concerned (at most `min(chunks, members)` nodes), never one per chunk.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::hashing::ChunkHash;

/// A member as placement sees it: its id's hash and its weight (capacity).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// [`node_hash`] of the member's id.
    pub hash: u64,
    /// Relative weight (> 0): the pool capacity in GiB, at least 1/1024.
    pub weight: f64,
}

/// The hash of a node id, as placement uses it.
pub fn node_hash(node_id: &str) -> u64 {
    xxh3_64_with_seed(node_id.as_bytes(), 0x6b76_6e6f_6465_0001)
}

/// The placement key of a chunk: every rank and layout of one (model, salt, chunk) shares it.
pub fn placement_key(model: &str, cache_salt: &str, chunk: &ChunkHash) -> u64 {
    let mut h = xxh3_64_with_seed(model.as_bytes(), 0x6b76_6e6f_6465_0002);
    h = xxh3_64_with_seed(cache_salt.as_bytes(), h);
    xxh3_64_with_seed(chunk, h)
}

/// The weight of a member with `capacity_bytes` of pool: its GiB, at least 1/1024.
pub fn weight_of(capacity_bytes: u64) -> f64 {
    (capacity_bytes as f64 / (1u64 << 30) as f64).max(1.0 / 1024.0)
}

/// SplitMix64's finaliser: a bijective mix, so distinct inputs give distinct outputs.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The score of `c` for `key` (higher wins).
pub fn score(key: u64, c: &Candidate) -> f64 {
    // 53 random bits, shifted into (0, 1): never 0 (ln would be -inf) nor 1 (ln 0).
    let bits = mix(key ^ mix(c.hash)) >> 11;
    let u = (bits as f64 + 0.5) / (1u64 << 53) as f64;
    -c.weight / u.ln()
}

/// The index in `members` of the owner of `key`; `None` when there are no members. Ties (equal
/// scores; practically never) go to the lower node hash, so every node picks the same owner.
pub fn owner(key: u64, members: &[Candidate]) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, c) in members.iter().enumerate() {
        let s = score(key, c);
        best = match best {
            None => Some((i, s)),
            Some((b, bs)) if s > bs || (s == bs && c.hash < members[b].hash) => Some((i, s)),
            keep => keep,
        };
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(ids: &[&str], weights: &[f64]) -> Vec<Candidate> {
        ids.iter()
            .zip(weights)
            .map(|(id, &weight)| Candidate {
                hash: node_hash(id),
                weight,
            })
            .collect()
    }

    fn key(i: u64) -> u64 {
        let mut c = [0u8; 32];
        c[..8].copy_from_slice(&i.to_le_bytes());
        placement_key("m", "", &c)
    }

    #[test]
    fn shares_follow_the_weights() {
        let m = members(&["a", "b", "c"], &[1.0, 1.0, 2.0]);
        let mut counts = [0usize; 3];
        let n = 40_000;
        for i in 0..n {
            counts[owner(key(i), &m).unwrap()] += 1;
        }
        let share = |c: usize| c as f64 / n as f64;
        assert!((share(counts[0]) - 0.25).abs() < 0.02, "{counts:?}");
        assert!((share(counts[1]) - 0.25).abs() < 0.02, "{counts:?}");
        assert!((share(counts[2]) - 0.5).abs() < 0.02, "{counts:?}");
    }

    #[test]
    fn a_join_moves_only_the_newcomers_keys_and_a_leave_only_the_leavers() {
        let three = members(&["a", "b", "c"], &[1.0, 1.0, 1.0]);
        let four = members(&["a", "b", "c", "d"], &[1.0, 1.0, 1.0, 1.0]);
        let n = 20_000;
        let mut moved = 0;
        for i in 0..n {
            let before = owner(key(i), &three).unwrap();
            let after = owner(key(i), &four).unwrap();
            if before != after {
                // Only to the newcomer, never between the others.
                assert_eq!(after, 3, "key {i} moved from {before} to {after}");
                moved += 1;
            }
        }
        let frac = moved as f64 / n as f64;
        assert!((frac - 0.25).abs() < 0.02, "moved {frac}");
        // A leave: only the leaver's keys move.
        let two = members(&["a", "c"], &[1.0, 1.0]);
        for i in 0..n {
            let before = owner(key(i), &three).unwrap();
            let after = owner(key(i), &two).unwrap();
            if before != 1 {
                let same = if before == 0 { 0 } else { 1 };
                assert_eq!(after, same, "key {i} of a surviving member moved");
            }
        }
    }

    #[test]
    fn the_owner_does_not_depend_on_member_order() {
        let a = members(&["x", "y", "z"], &[1.0, 3.0, 2.0]);
        let mut b = a.clone();
        b.reverse();
        for i in 0..2000 {
            let oa = a[owner(key(i), &a).unwrap()].hash;
            let ob = b[owner(key(i), &b).unwrap()].hash;
            assert_eq!(oa, ob);
        }
        assert_eq!(owner(1, &[]), None);
    }

    #[test]
    fn placement_keys_separate_models_and_salts() {
        let c = [7u8; 32];
        assert_ne!(placement_key("m", "", &c), placement_key("n", "", &c));
        assert_ne!(placement_key("m", "", &c), placement_key("m", "s", &c));
        assert_eq!(placement_key("m", "s", &c), placement_key("m", "s", &c));
    }
}
