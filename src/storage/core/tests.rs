//! The per-shard counters and the incremental memcheck: planted faults are found, and checks
//! running while other threads change the index never report a problem that is not there.

use std::sync::atomic::{AtomicBool, Ordering};

use super::*;
use crate::storage::key::NamespaceId;

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

fn put(c: &StorageCore, keys: &[StorageKey]) -> Vec<(StorageKey, Grant)> {
    let items: Vec<_> = keys
        .iter()
        .copied()
        .zip(c.reserve_write(keys, 4096, false))
        .map(|(k, r)| (k, r.unwrap()))
        .collect();
    assert!(c.finish_write(&items).iter().all(Result::is_ok));
    items
}

fn both_ok(c: &StorageCore) {
    let exact = c.memcheck();
    assert!(exact.ok, "exact: {:?}", exact.problems);
    let inc = c.run_memcheck(|| c.memcheck_incremental());
    assert!(inc.ok, "incremental: {:?}", inc.problems);
    assert_eq!(
        (inc.objects, inc.index_bytes, inc.allocated_bytes),
        (exact.objects, exact.index_bytes, exact.allocated_bytes)
    );
}

/// Counts read from the shards' counters follow every kind of transition.
#[test]
fn counters_follow_every_transition() {
    let c = StorageCore::new(64 * MIB, StorageConfig::default());
    let keys: Vec<_> = (0..200).map(key).collect();
    let reserved: Vec<_> = keys[..50]
        .iter()
        .copied()
        .zip(c.reserve_write(&keys[..50], 4096, false))
        .map(|(k, r)| (k, r.unwrap()))
        .collect();
    assert_eq!(c.counts().write_reserved, 50);
    put(&c, &keys[50..150]);
    assert!(c
        .finish_write_as(&reserved[..20], 0, true)
        .iter()
        .all(Result::is_ok));
    assert!(c.abort_write(&reserved[20..]).iter().all(Result::is_ok));
    let locks: Vec<_> = keys[50..60]
        .iter()
        .copied()
        .zip(c.reserve_read(&keys[50..60], 1))
        .map(|(k, r)| (k, r.unwrap().lease))
        .collect();
    let holds: Vec<_> = keys[60..65]
        .iter()
        .copied()
        .zip(c.hold_for_io(&keys[60..65]))
        .map(|(k, r)| (k, r.unwrap()))
        .collect();
    let n = c.counts();
    assert_eq!(
        (n.ready, n.read_locked, n.write_reserved, n.unwritten),
        (120 - 15, 15, 0, 20),
        "{n:?}"
    );
    c.clear_unwritten(&keys[..20]);
    let (deleted, deferred) = c.clear();
    assert_eq!((deleted, deferred), (105, 15));
    assert_eq!(c.counts().doomed, 15);
    both_ok(&c);
    c.finish_read(&locks, 1);
    c.release_io_holds(&holds);
    assert_eq!(c.counts(), ObjectCounts::default());
    both_ok(&c);
    let temp: Vec<_> = [key(900)]
        .iter()
        .copied()
        .zip(c.reserve_write(&[key(900)], 4096, true))
        .map(|(k, r)| (k, r.unwrap()))
        .collect();
    let leases = c.finish_write_locked(&temp, 0, 7);
    assert_eq!(c.counts().temporary, 1);
    c.finish_read(&[(key(900), leases[0].unwrap())], 0);
    assert_eq!(c.counts(), ObjectCounts::default());
    c.expire_locks(u64::MAX);
    both_ok(&c);
}

/// Faults planted behind the core's back are found by the incremental check.
#[test]
fn incremental_check_finds_planted_faults() {
    let c = StorageCore::new(64 * MIB, StorageConfig::default());
    put(&c, &(0..100).map(key).collect::<Vec<_>>());
    both_ok(&c);

    // A leaked slot: allocated, in no entry.
    let leaked = c.alloc.lock().allocate(4096).unwrap();
    let r = c.run_memcheck(|| c.memcheck_incremental());
    assert!(!r.ok);
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains("allocator holds 101 slots")),
        "{:?}",
        r.problems
    );
    c.alloc.lock().free(leaked).unwrap();
    both_ok(&c);

    // An entry whose slot was freed behind the index's back.
    let k = key(7);
    let si = StorageCore::shard_index(&k);
    let slot = c.shards[si].lock().map[&k].slot;
    c.alloc.lock().free(slot).unwrap();
    let r = c.run_memcheck(|| c.memcheck_incremental());
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains("is not live in the allocator")),
        "{:?}",
        r.problems
    );
    let again = c.alloc.lock().allocate(4096).unwrap();
    assert_eq!(again, slot, "the freed slot is handed out again");

    // A counter out of step with the entries.
    c.tallies[si].bump(0, 1);
    let r = c.run_memcheck(|| c.memcheck_incremental());
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains(&format!("shard {si}: counters say"))),
        "{:?}",
        r.problems
    );
    c.tallies[si].bump(0, u64::MAX);
    both_ok(&c);

    // STATUS's record shows the last outcome and the number of runs.
    let s = c.memcheck_status();
    assert!(!s.running && s.last_ok && s.runs >= 5, "{s:?}");
}

/// The reports of a badly broken index stay bounded.
#[test]
fn problems_are_capped() {
    let c = StorageCore::new(64 * MIB, StorageConfig::default());
    put(&c, &(0..500).map(key).collect::<Vec<_>>());
    for t in c.tallies.iter() {
        t.bump(0, 1);
    }
    // One problem per shard, and the totals on top: more than the cap.
    let leaked = c.alloc.lock().allocate(4096).unwrap();
    let r = c.run_memcheck(|| c.memcheck_incremental());
    assert_eq!(
        r.problems.len(),
        MEMCHECK_MAX_PROBLEMS + 1,
        "{:?}",
        r.problems
    );
    assert!(r.problems.last().unwrap().contains("more problems"));
    let exact = c.memcheck();
    assert_eq!(exact.problems.len(), MEMCHECK_MAX_PROBLEMS + 1);
    c.alloc.lock().free(leaked).unwrap();
    for t in c.tallies.iter() {
        t.bump(0, u64::MAX);
    }
    both_ok(&c);
}

/// Incremental checks running while other threads store, read, abort, evict and clear never
/// report a problem (objects come and go, and slots are reused, between two shards' checks).
#[test]
fn incremental_check_is_quiet_under_concurrent_changes() {
    // Small pool: allocations evict constantly, so slots move between keys (and shards).
    let c = StorageCore::new(8 * MIB, StorageConfig::default());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..3u32 {
            let (c, stop) = (&c, &stop);
            s.spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i = i.wrapping_add(1);
                    let keys: Vec<_> = (0..8)
                        .map(|j| key(t * 1_000_000 + (i * 8 + j) % 4000))
                        .collect();
                    let got: Vec<_> = keys
                        .iter()
                        .copied()
                        .zip(c.reserve_write(&keys, 4096 * (1 + u64::from(t % 2)), false))
                        .filter_map(|(k, r)| r.ok().map(|g| (k, g)))
                        .collect();
                    if i.is_multiple_of(5) {
                        c.abort_write(&got);
                    } else {
                        c.finish_write_as(&got, 0, i.is_multiple_of(3));
                    }
                    let locks: Vec<_> = keys
                        .iter()
                        .copied()
                        .zip(c.reserve_read(&keys, 0))
                        .filter_map(|(k, r)| r.ok().map(|g| (k, g.lease)))
                        .collect();
                    c.finish_read(&locks, 0);
                    c.clear_unwritten(&keys[..4]);
                    if i.is_multiple_of(97) {
                        c.evict_to_watermark();
                    }
                    if t == 0 && i.is_multiple_of(1000) {
                        c.clear();
                    }
                }
            });
        }
        for _ in 0..20 {
            let r = c.run_memcheck(|| c.memcheck_incremental());
            assert!(r.ok, "{:?}", r.problems);
        }
        stop.store(true, Ordering::Relaxed);
    });
    both_ok(&c);
}
