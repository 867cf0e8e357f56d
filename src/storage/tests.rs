//! State-machine tests of the storage core: every transition and error code, plus random
//! operation sequences checked by memcheck after every step.

use proptest::prelude::*;

use super::core::{KeyError, StorageConfig, StorageCore};
use super::key::{NamespaceId, StorageKey};

const MIB: u64 = 1 << 20;

fn key(i: u32) -> StorageKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_le_bytes());
    h[8..12].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_le_bytes());
    StorageKey {
        chunk_hash: h,
        kv_rank: 0x0100_0100,
        object_group: 0,
        namespace: NamespaceId(0),
    }
}

fn core(pool: u64) -> StorageCore {
    StorageCore::new(pool, StorageConfig::default())
}

fn ok_all<T: std::fmt::Debug>(r: &[Result<T, KeyError>]) -> bool {
    r.iter().all(Result::is_ok)
}

fn check(c: &StorageCore) {
    let r = c.memcheck();
    assert!(r.ok, "{:?}", r.problems);
}

#[test]
fn write_then_read_life_cycle() {
    let c = core(64 * MIB);
    let keys = [key(1), key(2)];
    let slots: Vec<_> = c
        .reserve_write(&keys, MIB, false)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(c.counts().write_reserved, 2);
    // Not readable before commit.
    assert_eq!(
        c.reserve_read(&keys[..1], 0)[0],
        Err(KeyError::KeyNotReadable)
    );
    // Second "new" reservation of the same key is skipped as locked.
    assert_eq!(
        c.reserve_write(&keys[..1], MIB, false)[0],
        Err(KeyError::KeyIsLocked)
    );
    let items: Vec<_> = keys.iter().copied().zip(slots.iter().copied()).collect();
    assert!(ok_all(&c.finish_write(&items)));
    assert_eq!(c.counts().ready, 2);
    // Finishing twice is a wrong-state error.
    assert_eq!(
        c.finish_write(&items[..1])[0],
        Err(KeyError::KeyInWrongState)
    );
    // Existing ready key: not writable in "new" mode.
    assert_eq!(
        c.reserve_write(&keys[..1], MIB, false)[0],
        Err(KeyError::KeyNotWritable)
    );
    // Multi-reader locks (MLA): 1 + extra.
    assert!(ok_all(&c.reserve_read(&keys[..1], 2)));
    assert_eq!(c.counts().read_locked, 1);
    assert!(ok_all(&c.read_locked_slots(&keys[..1])));
    assert_eq!(
        c.read_locked_slots(&keys[1..])[0],
        Err(KeyError::KeyInWrongState)
    );
    assert!(ok_all(&c.finish_read(&keys[..1], 0)));
    assert!(ok_all(&c.finish_read(&keys[..1], 1)));
    assert_eq!(
        c.finish_read(&keys[..1], 0)[0],
        Err(KeyError::KeyNotReadable)
    );
    assert_eq!(c.finish_read(&[key(9)], 0)[0], Err(KeyError::KeyNotExist));
    assert_eq!(c.counts().ready, 2);
    check(&c);
}

#[test]
fn abort_frees_and_never_publishes() {
    let c = core(16 * MIB);
    let k = [key(1)];
    let s = c.reserve_write(&k, MIB, false)[0].unwrap();
    assert!(c.used_bytes() > 0);
    assert!(ok_all(&c.abort_write(&[(k[0], s)])));
    assert_eq!(c.used_bytes(), 0);
    assert!(!c.contains_ready(&k[0]));
    assert_eq!(c.reserve_read(&k, 0)[0], Err(KeyError::KeyNotExist));
    // Aborting a committed object is refused.
    let s = c.reserve_write(&k, MIB, false)[0].unwrap();
    c.finish_write(&[(k[0], s)]);
    assert_eq!(
        c.abort_write(&[(k[0], s)])[0],
        Err(KeyError::KeyInWrongState)
    );
    check(&c);
}

#[test]
fn commit_must_match_reserved_slot() {
    let c = core(16 * MIB);
    let a = c.reserve_write(&[key(1)], MIB, false)[0].unwrap();
    let b = c.reserve_write(&[key(2)], MIB, false)[0].unwrap();
    assert_eq!(
        c.finish_write(&[(key(1), b)])[0],
        Err(KeyError::KeyInWrongState)
    );
    assert!(ok_all(&c.finish_write(&[(key(1), a)])));
    check(&c);
}

#[test]
fn expired_write_reservation_is_freed_not_published() {
    let c = core(16 * MIB);
    let _ = c.reserve_write(&[key(1)], MIB, false)[0].unwrap();
    let (w, _) = c.expire_locks(u64::MAX);
    assert_eq!(w, 1);
    assert_eq!(c.used_bytes(), 0);
    assert!(!c.contains_ready(&key(1)));
    check(&c);
}

#[test]
fn expired_read_locks_are_dropped() {
    let c = core(16 * MIB);
    let s = c.reserve_write(&[key(1)], MIB, false)[0].unwrap();
    c.finish_write(&[(key(1), s)]);
    c.reserve_read(&[key(1)], 0);
    assert_eq!(c.expire_locks(u64::MAX), (0, 1));
    assert_eq!(c.counts().read_locked, 0);
    assert!(c.contains_ready(&key(1)));
}

#[test]
fn clear_defers_in_flight_objects() {
    let c = core(32 * MIB);
    let ready = c.reserve_write(&[key(1)], MIB, false)[0].unwrap();
    c.finish_write(&[(key(1), ready)]);
    let locked = c.reserve_write(&[key(2)], MIB, false)[0].unwrap();
    c.finish_write(&[(key(2), locked)]);
    c.reserve_read(&[key(2)], 0);
    let writing = c.reserve_write(&[key(3)], MIB, false)[0].unwrap();
    assert_eq!(c.clear(), (1, 2));
    // Memory of in-flight objects is still allocated: a client may be copying.
    assert!(c.used_bytes() >= 2 * MIB);
    assert!(!c.contains_ready(&key(2)), "doomed objects are invisible");
    assert_eq!(c.reserve_read(&[key(2)], 0)[0], Err(KeyError::KeyNotExist));
    // The reader finishes: freed. The writer commits: freed, not published.
    assert!(ok_all(&c.finish_read(&[key(2)], 0)));
    assert_eq!(
        c.finish_write(&[(key(3), writing)])[0],
        Err(KeyError::KeyNotExist)
    );
    assert_eq!(c.used_bytes(), 0);
    check(&c);
}

#[test]
fn temporary_objects_die_with_last_reader() {
    let c = core(16 * MIB);
    let s = c.reserve_write(&[key(1)], MIB, true)[0].unwrap();
    c.finish_write(&[(key(1), s)]);
    c.reserve_read(&[key(1)], 1);
    assert_eq!(c.counts().temporary, 1);
    c.finish_read(&[key(1)], 0);
    assert!(c.contains_ready(&key(1)));
    c.finish_read(&[key(1)], 0);
    assert!(!c.contains_ready(&key(1)));
    assert_eq!(c.used_bytes(), 0);
    check(&c);
}

#[test]
fn allocation_evicts_synchronously_later_chunks_first() {
    // 8 MiB pool, 2 MiB objects: 4 fit.
    let c = core(8 * MIB);
    let keys: Vec<_> = (0..4).map(key).collect();
    let slots: Vec<_> = c
        .reserve_write(&keys, 2 * MIB, false)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let items: Vec<_> = keys.iter().copied().zip(slots).collect();
    c.finish_write(&items);
    // One more chunk forces one eviction: the *last* chunk of the earlier request goes first.
    let r = c.reserve_write(&[key(10)], 2 * MIB, false);
    assert!(r[0].is_ok());
    assert!(c.contains_ready(&key(0)) && c.contains_ready(&key(1)) && c.contains_ready(&key(2)));
    assert!(!c.contains_ready(&key(3)));
    assert_eq!(c.eviction_counters().sync_evictions, 1);
    check(&c);
}

#[test]
fn locked_objects_are_never_evicted_and_oom_is_reported() {
    let c = core(4 * MIB);
    let keys = [key(0), key(1)];
    let slots: Vec<_> = c
        .reserve_write(&keys, 2 * MIB, false)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let items: Vec<_> = keys.iter().copied().zip(slots).collect();
    c.finish_write(&items);
    c.reserve_read(&keys, 0);
    let r = c.reserve_write(&[key(5), key(6)], 2 * MIB, false);
    assert_eq!(
        r,
        vec![Err(KeyError::OutOfMemory), Err(KeyError::OutOfMemory)]
    );
    assert!(c.contains_ready(&key(0)) && c.contains_ready(&key(1)));
    // Unlock one: the prefix that fits is reserved, the rest is OOM.
    c.finish_read(&keys[..1], 0);
    let r = c.reserve_write(&[key(5), key(6)], 2 * MIB, false);
    assert!(r[0].is_ok());
    assert_eq!(r[1], Err(KeyError::OutOfMemory));
    assert_eq!(c.eviction_counters().oom_keys, 3);
    check(&c);
}

#[test]
fn lock_prefix_stops_at_first_gap() {
    let c = core(32 * MIB);
    for i in [0, 1, 3] {
        let s = c.reserve_write(&[key(i)], MIB, false)[0].unwrap();
        c.finish_write(&[(key(i), s)]);
    }
    let chunks: Vec<Vec<_>> = (0..4).map(|i| vec![key(i)]).collect();
    let refs: Vec<&[_]> = chunks.iter().map(Vec::as_slice).collect();
    assert_eq!(c.lock_prefix(&refs, 0), 2);
    let counts = c.counts();
    assert_eq!(
        counts.read_locked, 2,
        "chunk 3 is beyond the gap: not locked"
    );
    check(&c);
}

#[test]
fn watermark_pass_evicts_down_to_low_mark() {
    let cfg = StorageConfig {
        high_watermark: 0.5,
        low_watermark: 0.25,
        ..StorageConfig::default()
    };
    let c = StorageCore::new(16 * MIB, cfg);
    let keys: Vec<_> = (0..6).map(key).collect();
    let slots: Vec<_> = c
        .reserve_write(&keys, 2 * MIB, false)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    c.finish_write(&keys.iter().copied().zip(slots).collect::<Vec<_>>());
    assert_eq!(c.evict_to_watermark(), 4);
    assert!(c.used_bytes() <= 4 * MIB);
    assert!(c.contains_ready(&key(0)) && c.contains_ready(&key(1)));
    check(&c);
}

#[derive(Debug, Clone)]
enum Op {
    Reserve(Vec<u32>, u64),
    Commit(usize),
    Abort(usize),
    Read(Vec<u32>, u32),
    Unread(Vec<u32>, u32),
    Clear,
    Expire,
    Evict,
}

fn op() -> impl Strategy<Value = Op> {
    let keys = proptest::collection::vec(0u32..24, 1..5);
    prop_oneof![
        4 => (keys.clone(), prop_oneof![Just(64 * 1024u64), Just(MIB + 4096), Just(3 * MIB)])
            .prop_map(|(k, s)| Op::Reserve(k, s)),
        3 => (0usize..8).prop_map(Op::Commit),
        1 => (0usize..8).prop_map(Op::Abort),
        2 => (keys.clone(), 0u32..3).prop_map(|(k, e)| Op::Read(k, e)),
        2 => (keys, 0u32..3).prop_map(|(k, e)| Op::Unread(k, e)),
        1 => Just(Op::Clear),
        1 => Just(Op::Expire),
        1 => Just(Op::Evict),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_sequences_keep_invariants(ops in proptest::collection::vec(op(), 1..60)) {
        let c = core(24 * MIB);
        let mut pending: Vec<Vec<(StorageKey, super::Slot)>> = Vec::new();
        for op in ops {
            match op {
                Op::Reserve(ids, size) => {
                    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
                    let got: Vec<_> = keys.iter().copied().zip(c.reserve_write(&keys, size, false))
                        .filter_map(|(k, r)| r.ok().map(|s| (k, s))).collect();
                    if !got.is_empty() { pending.push(got); }
                }
                Op::Commit(i) if i < pending.len() => {
                    let items = pending.remove(i);
                    for (k, r) in items.iter().zip(c.finish_write(&items)) {
                        // Only a doomed (cleared) reservation may fail, and then it is gone.
                        if r.is_err() { prop_assert!(!c.contains_ready(&k.0)); }
                        else { prop_assert!(c.contains_ready(&k.0)); }
                    }
                }
                Op::Abort(i) if i < pending.len() => {
                    let items = pending.remove(i);
                    c.abort_write(&items);
                    for (k, _) in &items { prop_assert!(!c.contains_ready(k)); }
                }
                Op::Commit(_) | Op::Abort(_) => {}
                Op::Read(ids, e) => { let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect(); c.reserve_read(&keys, e); }
                Op::Unread(ids, e) => { let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect(); c.finish_read(&keys, e); }
                Op::Clear => { c.clear(); }
                Op::Expire => {
                    c.expire_locks(u64::MAX);
                    pending.clear(); // every reservation expired
                }
                Op::Evict => { c.evict_to_watermark(); }
            }
            let r = c.memcheck();
            prop_assert!(r.ok, "{:?}", r.problems);
        }
        // Everything released: memory returns to zero.
        for items in pending.drain(..) { c.abort_write(&items); }
        c.expire_locks(u64::MAX);
        c.clear();
        prop_assert_eq!(c.used_bytes(), 0);
    }
}
