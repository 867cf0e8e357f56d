//! State-machine tests of the storage core: every transition and error code, plus random
//! operation sequences checked by memcheck after every step.

use proptest::prelude::*;

use super::core::{Grant, KeyError, StorageConfig, StorageCore};
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

/// Reserves and commits `keys`, returning their grants.
fn put(c: &StorageCore, keys: &[StorageKey], bytes: u64) -> Vec<(StorageKey, Grant)> {
    let items: Vec<_> = keys
        .iter()
        .copied()
        .zip(c.reserve_write(keys, bytes, false))
        .map(|(k, r)| (k, r.unwrap()))
        .collect();
    assert!(ok_all(&c.finish_write(&items)));
    items
}

/// Read-locks `keys` (all must succeed), returning `(key, lease)` pairs for release.
fn lock(c: &StorageCore, keys: &[StorageKey], extra: u32) -> Vec<(StorageKey, u64)> {
    keys.iter()
        .copied()
        .zip(c.reserve_read(keys, extra))
        .map(|(k, r)| (k, r.unwrap().lease))
        .collect()
}

#[test]
fn write_then_read_life_cycle() {
    let c = core(64 * MIB);
    let keys = [key(1), key(2)];
    let grants: Vec<_> = c
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
    let items: Vec<_> = keys.iter().copied().zip(grants.iter().copied()).collect();
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
    let l = lock(&c, &keys[..1], 2);
    assert_eq!(c.counts().read_locked, 1);
    assert!(ok_all(&c.read_locked_slots(&keys[..1])));
    assert_eq!(
        c.read_locked_slots(&keys[1..])[0],
        Err(KeyError::KeyInWrongState)
    );
    assert!(ok_all(&c.finish_read(&l, 0)));
    assert!(ok_all(&c.finish_read(&l, 1)));
    assert_eq!(c.finish_read(&l, 0)[0], Err(KeyError::KeyNotReadable));
    assert_eq!(
        c.finish_read(&[(key(9), 0)], 0)[0],
        Err(KeyError::KeyNotExist)
    );
    assert_eq!(c.counts().ready, 2);
    check(&c);
}

#[test]
fn abort_frees_and_never_publishes() {
    let c = core(16 * MIB);
    let k = [key(1)];
    let g = c.reserve_write(&k, MIB, false)[0].unwrap();
    assert!(c.used_bytes() > 0);
    assert!(ok_all(&c.abort_write(&[(k[0], g)])));
    assert_eq!(c.used_bytes(), 0);
    assert!(!c.contains_ready(&k[0]));
    assert_eq!(c.reserve_read(&k, 0)[0], Err(KeyError::KeyNotExist));
    // Aborting a committed object is refused.
    let items = put(&c, &k, MIB);
    assert_eq!(c.abort_write(&items)[0], Err(KeyError::KeyInWrongState));
    check(&c);
}

#[test]
fn commit_must_match_reserved_grant() {
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
fn stale_commit_after_expiry_cannot_publish_a_newer_reservation() {
    let c = core(16 * MIB);
    let stale = c.reserve_write(&[key(1)], MIB, false)[0].unwrap();
    c.expire_locks(u64::MAX);
    // A new writer gets the same key, very likely the same slot.
    let fresh = c.reserve_write(&[key(1)], MIB, false)[0].unwrap();
    assert_eq!(
        fresh.slot, stale.slot,
        "LIFO slot reuse makes this the dangerous case"
    );
    assert_eq!(
        c.finish_write(&[(key(1), stale)])[0],
        Err(KeyError::KeyInWrongState)
    );
    assert_eq!(
        c.abort_write(&[(key(1), stale)])[0],
        Err(KeyError::KeyInWrongState)
    );
    assert_eq!(
        c.counts().write_reserved,
        1,
        "the new reservation is untouched"
    );
    assert!(ok_all(&c.finish_write(&[(key(1), fresh)])));
    check(&c);
}

#[test]
fn expired_read_locks_are_dropped_and_stale_unlocks_ignored() {
    let c = core(16 * MIB);
    put(&c, &[key(1)], MIB);
    let stale = lock(&c, &[key(1)], 0);
    assert_eq!(c.expire_locks(u64::MAX), (0, 1));
    assert_eq!(c.counts().read_locked, 0);
    assert!(c.contains_ready(&key(1)));
    // A new reader locks; the holder of the expired lock cannot release the new one.
    let fresh = lock(&c, &[key(1)], 0);
    assert_eq!(c.finish_read(&stale, 0)[0], Err(KeyError::KeyInWrongState));
    assert_eq!(c.counts().read_locked, 1);
    assert!(ok_all(&c.finish_read(&fresh, 0)));
    check(&c);
}

#[test]
fn clear_defers_in_flight_objects() {
    let c = core(32 * MIB);
    put(&c, &[key(1)], MIB);
    put(&c, &[key(2)], MIB);
    let l = lock(&c, &[key(2)], 0);
    let writing = c.reserve_write(&[key(3)], MIB, false)[0].unwrap();
    assert_eq!(c.clear(), (1, 2));
    // Memory of in-flight objects is still allocated: a client may be copying.
    assert!(c.used_bytes() >= 2 * MIB);
    assert!(!c.contains_ready(&key(2)), "doomed objects are invisible");
    assert_eq!(c.reserve_read(&[key(2)], 0)[0], Err(KeyError::KeyNotExist));
    check(&c);
    // The reader finishes: freed. The writer commits: freed, not published.
    assert!(ok_all(&c.finish_read(&l, 0)));
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
    let g = c.reserve_write(&[key(1)], MIB, true)[0].unwrap();
    c.finish_write(&[(key(1), g)]);
    let l = lock(&c, &[key(1)], 1);
    assert_eq!(c.counts().temporary, 1);
    c.finish_read(&l, 0);
    assert!(c.contains_ready(&key(1)));
    c.finish_read(&l, 0);
    assert!(!c.contains_ready(&key(1)));
    assert_eq!(c.used_bytes(), 0);
    check(&c);
}

#[test]
fn allocation_evicts_synchronously_later_chunks_first() {
    // 8 MiB pool, 2 MiB objects: 4 fit.
    let c = core(8 * MIB);
    let keys: Vec<_> = (0..4).map(key).collect();
    put(&c, &keys, 2 * MIB);
    // One more chunk forces one eviction: the *last* chunk of the earlier request goes first.
    let r = c.reserve_write(&[key(10)], 2 * MIB, false);
    assert!(r[0].is_ok());
    assert!(c.contains_ready(&key(0)) && c.contains_ready(&key(1)) && c.contains_ready(&key(2)));
    assert!(!c.contains_ready(&key(3)));
    assert_eq!(c.eviction_counters().sync_evictions, 1);
    check(&c);
}

#[test]
fn eviction_finds_unlocked_objects_behind_many_locked_ones() {
    // 8192 objects of 16 KiB fill a 128 MiB pool; the 7000 oldest are read-locked (about 110 per
    // index shard). Eviction must still find the unlocked ones behind them.
    let c = core(128 * MIB);
    let keys: Vec<_> = (0..8192).map(key).collect();
    for k in &keys {
        put(&c, &[*k], 16 * 1024);
    }
    assert_eq!(c.used_bytes(), c.capacity());
    let _locks = lock(&c, &keys[..7000], 0);
    let fresh: Vec<_> = (10_000..10_010).map(key).collect();
    let r = c.reserve_write(&fresh, 16 * 1024, false);
    assert!(ok_all(&r), "{r:?}");
    assert_eq!(c.eviction_counters().sync_evictions, 10);
    assert!(
        keys[..7000].iter().all(|k| c.contains_ready(k)),
        "locked objects survive"
    );
    check(&c);
}

#[test]
fn locked_objects_are_never_evicted_and_oom_is_reported() {
    let c = core(4 * MIB);
    let keys = [key(0), key(1)];
    put(&c, &keys, 2 * MIB);
    let l = lock(&c, &keys, 0);
    let r = c.reserve_write(&[key(5), key(6)], 2 * MIB, false);
    assert_eq!(
        r,
        vec![Err(KeyError::OutOfMemory), Err(KeyError::OutOfMemory)]
    );
    assert!(c.contains_ready(&key(0)) && c.contains_ready(&key(1)));
    // Unlock one: the prefix that fits is reserved, the rest is OOM.
    c.finish_read(&l[..1], 0);
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
        put(&c, &[key(i)], MIB);
    }
    let locked = c.lock_prefix((0..4).map(|i| vec![key(i)]), 0);
    assert_eq!(locked.len(), 2);
    assert_eq!(
        c.counts().read_locked,
        2,
        "chunk 3 is beyond the gap: not locked"
    );
    for chunk in &locked {
        assert!(ok_all(&c.finish_read(chunk, 0)));
    }
    assert_eq!(c.counts().read_locked, 0);
    check(&c);
}

#[test]
fn objects_waiting_for_write_behind_are_evicted_last() {
    // 8 MiB pool, 2 MiB objects: 4 fit. Keys 0 and 1 (the oldest) wait for their L2 write.
    let c = core(8 * MIB);
    let commit = |keys: &[StorageKey], unwritten: bool| {
        let items: Vec<_> = keys
            .iter()
            .copied()
            .zip(c.reserve_write(keys, 2 * MIB, false))
            .map(|(k, r)| (k, r.unwrap()))
            .collect();
        assert!(ok_all(&c.finish_write_as(&items, 0, unwritten)));
    };
    commit(&[key(0), key(1)], true);
    commit(&[key(2), key(3)], false);
    check(&c);
    // Two allocations take the newer, written objects although they are more recent.
    assert!(ok_all(&c.reserve_write(
        &[key(10), key(11)],
        2 * MIB,
        false
    )));
    assert!(c.contains_ready(&key(0)) && c.contains_ready(&key(1)));
    assert!(!c.contains_ready(&key(2)) && !c.contains_ready(&key(3)));
    assert_eq!(c.eviction_counters().unwritten_evictions, 0);
    check(&c);
    // The watermark pass leaves unwritten objects alone (the write-behind will catch up)...
    assert_eq!(c.evict_to_watermark(), 0);
    // ...once written they are ordinary LRU victims again: key 1 (older than 0) goes first.
    c.clear_unwritten(&[key(0), key(1)]);
    check(&c);
    assert!(ok_all(&c.reserve_write(&[key(12)], 2 * MIB, false)));
    assert!(c.contains_ready(&key(0)) && !c.contains_ready(&key(1)));
    // With nothing else evictable, an allocation still takes an unwritten object, counted.
    let c2 = core(4 * MIB);
    let items: Vec<_> = [key(0), key(1)]
        .iter()
        .copied()
        .zip(c2.reserve_write(&[key(0), key(1)], 2 * MIB, false))
        .map(|(k, r)| (k, r.unwrap()))
        .collect();
    assert!(ok_all(&c2.finish_write_as(&items, 0, true)));
    assert!(ok_all(&c2.reserve_write(&[key(5)], 2 * MIB, false)));
    let ev = c2.eviction_counters();
    assert_eq!((ev.sync_evictions, ev.unwritten_evictions), (1, 1));
    check(&c2);
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
    put(&c, &keys, 2 * MIB);
    assert_eq!(c.evict_to_watermark(), 4);
    assert!(c.used_bytes() <= 4 * MIB);
    assert!(c.contains_ready(&key(0)) && c.contains_ready(&key(1)));
    check(&c);
}

#[derive(Debug, Clone)]
enum Op {
    Reserve(Vec<u32>, u64),
    Commit(usize, bool),
    Written(Vec<u32>),
    Abort(usize),
    Read(Vec<u32>, u32),
    Unread(usize),
    Clear,
    Expire,
    Evict,
}

fn op() -> impl Strategy<Value = Op> {
    let keys = proptest::collection::vec(0u32..24, 1..5);
    prop_oneof![
        4 => (keys.clone(), prop_oneof![Just(64 * 1024u64), Just(MIB + 4096), Just(3 * MIB)])
            .prop_map(|(k, s)| Op::Reserve(k, s)),
        3 => (0usize..8, any::<bool>()).prop_map(|(i, u)| Op::Commit(i, u)),
        1 => proptest::collection::vec(0u32..24, 1..5).prop_map(Op::Written),
        1 => (0usize..8).prop_map(Op::Abort),
        2 => (keys, 0u32..3).prop_map(|(k, e)| Op::Read(k, e)),
        2 => (0usize..8).prop_map(Op::Unread),
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
        let mut writes: Vec<Vec<(StorageKey, Grant)>> = Vec::new();
        let mut reads: Vec<(Vec<(StorageKey, u64)>, u32)> = Vec::new();
        for op in ops {
            match op {
                Op::Reserve(ids, size) => {
                    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
                    let got: Vec<_> = keys.iter().copied().zip(c.reserve_write(&keys, size, false))
                        .filter_map(|(k, r)| r.ok().map(|g| (k, g))).collect();
                    if !got.is_empty() { writes.push(got); }
                }
                Op::Commit(i, unwritten) if i < writes.len() => {
                    let items = writes.remove(i);
                    for (k, r) in items.iter().zip(c.finish_write_as(&items, 0, unwritten)) {
                        // A successful commit makes the key readable. (A failed one was doomed or
                        // expired; the key may since belong to a newer reservation.)
                        if r.is_ok() { prop_assert!(c.contains_ready(&k.0)); }
                    }
                }
                Op::Abort(i) if i < writes.len() => {
                    let items = writes.remove(i);
                    for ((k, _), r) in items.iter().zip(c.abort_write(&items)) {
                        // A successful abort never leaves the key readable.
                        if r.is_ok() { prop_assert!(!c.contains_ready(k)); }
                    }
                }
                Op::Commit(..) | Op::Abort(_) => {}
                Op::Written(ids) => {
                    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
                    c.clear_unwritten(&keys);
                }
                Op::Read(ids, e) => {
                    let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
                    let got: Vec<_> = keys.iter().copied().zip(c.reserve_read(&keys, e))
                        .filter_map(|(k, r)| r.ok().map(|g| (k, g.lease))).collect();
                    reads.push((got, e));
                }
                Op::Unread(i) if i < reads.len() => {
                    let (items, e) = reads.remove(i);
                    c.finish_read(&items, e);
                }
                Op::Unread(_) => {}
                Op::Clear => { c.clear(); }
                Op::Expire => { c.expire_locks(u64::MAX); }
                Op::Evict => { c.evict_to_watermark(); }
            }
            let r = c.memcheck();
            prop_assert!(r.ok, "{:?}", r.problems);
        }
        // Everything released: memory returns to zero.
        for items in writes.drain(..) { c.abort_write(&items); }
        for (items, e) in reads.drain(..) { c.finish_read(&items, e); }
        c.clear();
        prop_assert_eq!(c.used_bytes(), 0, "{:?}", c.counts());
        let r = c.memcheck();
        prop_assert!(r.ok, "{:?}", r.problems);
    }
}

/// Fails to compile the test suite unless strict assertions are on (memcheck after every transfer).
#[cfg(not(feature = "strict-assertions"))]
compile_error!(
    "tests must be built with the strict-assertions feature (see the dev-dependency in Cargo.toml)"
);

/// Many threads hammer overlapping keys with every operation; afterwards everything is released
/// and the books must balance exactly (no leaked bytes, no stray locks, memcheck clean).
#[test]
fn concurrent_operations_keep_the_books_balanced() {
    use std::sync::Arc;
    let c = Arc::new(core(32 * MIB));
    let threads: Vec<_> = (0..6u32)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                let mut x = 0x9E37_79B9u64 ^ u64::from(t);
                let mut rnd = move |n: u32| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % u64::from(n)) as u32
                };
                for _ in 0..20_000 {
                    let keys: Vec<_> = (0..1 + rnd(4)).map(|_| key(rnd(64))).collect();
                    match rnd(10) {
                        0..=3 => {
                            let items: Vec<_> = keys
                                .iter()
                                .copied()
                                .zip(c.reserve_write(&keys, 256 * 1024, false))
                                .filter_map(|(k, r)| r.ok().map(|g| (k, g)))
                                .collect();
                            if rnd(4) == 0 {
                                c.abort_write(&items);
                            } else {
                                c.finish_write(&items);
                            }
                        }
                        4..=6 => {
                            let extra = rnd(3);
                            let locked: Vec<_> = keys
                                .iter()
                                .copied()
                                .zip(c.reserve_read(&keys, extra))
                                .filter_map(|(k, r)| r.ok().map(|g| (k, g.lease)))
                                .collect();
                            // Release exactly what was taken: 1 + extra per key.
                            for r in c.finish_read(&locked, extra) {
                                assert!(r.is_ok(), "own locks always release: {r:?}");
                            }
                        }
                        7 => {
                            c.touch(&keys);
                        }
                        8 => {
                            c.evict_to_watermark();
                        }
                        _ => {
                            if rnd(50) == 0 {
                                c.clear();
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let r = c.memcheck();
    assert!(r.ok, "{:?}", r.problems);
    let counts = c.counts();
    assert_eq!(
        counts.write_reserved, 0,
        "every reservation was committed or aborted"
    );
    assert_eq!(counts.read_locked, 0, "every lock was released: {counts:?}");
    assert_eq!(counts.doomed, 0);
    c.clear();
    assert_eq!(c.used_bytes(), 0);
    assert!(c.memcheck().ok);
}

#[test]
fn duplicate_keys_in_one_batch_reserve_once() {
    let c = core(16 * MIB);
    let r = c.reserve_write(&[key(1), key(2), key(1)], MIB, false);
    assert!(r[0].is_ok() && r[1].is_ok());
    assert_eq!(r[2], Err(KeyError::KeyNotWritable));
    assert_eq!(c.counts().write_reserved, 2);
    check(&c);
}
