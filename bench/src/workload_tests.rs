//! Unit tests of the workload keys.

use super::*;

#[test]
fn conversation_keys_differ_by_nonce_index_domain_and_number() {
    let hashes = |nonce, index, domain, conv| {
        chunk_hashes(
            &conversation_tokens(conversation_seed(nonce, index, domain, conv), 32),
            16,
        )
    };
    let a = hashes(1, 0, Domain::Chunk, 0);
    assert_eq!(a, hashes(1, 0, Domain::Chunk, 0), "a pure function");
    let mut firsts = std::collections::HashSet::new();
    for nonce in [1, 2, u64::MAX] {
        for index in 0..4 {
            for domain in [Domain::Chunk, Domain::Multiturn] {
                for conv in 0..64 {
                    let h = hashes(nonce, index, domain, conv);
                    assert!(firsts.insert(h[0]), "{nonce} {index} {domain:?} {conv}");
                }
            }
        }
    }
    // Within one instance a conversation's seed is a bijection of its number.
    let seeds: std::collections::HashSet<u64> = (0..10_000)
        .map(|c| conversation_seed(7, 3, Domain::Chunk, c))
        .collect();
    assert_eq!(seeds.len(), 10_000);
}

#[test]
fn a_longer_conversation_extends_a_shorter_one() {
    let seed = conversation_seed(9, 1, Domain::Multiturn, 5);
    let short = conversation_tokens(seed, 32);
    let long = conversation_tokens(seed, 128);
    assert_eq!(short[..], long[..32]);
    assert_eq!(chunk_hashes(&short, 16)[..], chunk_hashes(&long, 16)[..2]);
    assert_eq!(short[0], seed as u32);
    assert_eq!(short[1], (seed >> 32) as u32);
}
