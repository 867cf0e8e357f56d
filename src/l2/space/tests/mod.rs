//! Unit and model tests of the index and space manager.

use super::*;
use proptest::prelude::*;
use std::collections::HashSet;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const EB: u64 = 2 * MIB;
/// Stride 256 KiB, 7 slots per 2 MiB extent.
const SMALL: u64 = 256 * KIB - BLOCK;
/// Stride 512 KiB, 3 slots.
const MID: u64 = 512 * KIB - BLOCK;
/// Stride 1 MiB, 1 slot.
const BIG: u64 = MIB - BLOCK;

fn ok(ix: &L2Index<u32>) {
    if let Err(e) = ix.check() {
        panic!("check failed: {e}");
    }
}

fn ready(ix: &mut L2Index<u32>, k: u32, len: u64) -> Reservation<u32> {
    let r = ix.reserve(k, len, u64::from(k)).unwrap();
    ix.commit(k, r.slot, 0xc0ffee, 0).unwrap();
    ok(ix);
    r
}

#[test]
fn geometry_offsets_and_limits() {
    let mut ix = L2Index::<u32>::new(4, EB);
    assert_eq!(ix.max_object_len(), EB - 3 * BLOCK);
    assert_eq!(
        ix.reserve(1, 0, 0),
        Err(ReserveError::TooLarge {
            object_len: 0,
            max: EB - 3 * BLOCK
        })
    );
    assert!(matches!(
        ix.reserve(1, EB - 3 * BLOCK + 1, 0),
        Err(ReserveError::TooLarge { .. })
    ));
    assert!(matches!(
        ix.reserve(1, u64::MAX, 0),
        Err(ReserveError::TooLarge { .. })
    ));
    let r = ix.reserve(1, 1, 0).unwrap();
    assert_eq!(r.slot.stride, 2 * BLOCK);
    assert_eq!(r.new_extent, Some((0, 1, 2 * BLOCK)));
    // Slot 0 follows the extent header and the extent's table.
    let start = |stride| crate::l2::format::slots_start(EB, stride);
    assert_eq!(r.slot.file_offset, EXTENT_BASE + start(2 * BLOCK));
    let r2 = ix.reserve(2, 4097, 0).unwrap();
    assert_eq!(r2.slot.stride, 3 * BLOCK);
    assert_eq!(r2.new_extent, Some((1, 2, 3 * BLOCK)), "epochs are global");
    assert_eq!(r2.slot.file_offset, EXTENT_BASE + EB + start(3 * BLOCK));
    let r3 = ix.reserve(3, 4096, 0).unwrap();
    assert_eq!(r3.new_extent, None);
    assert_eq!((r3.slot.extent, r3.slot.index), (0, 1));
    assert_eq!(
        r3.slot.file_offset,
        EXTENT_BASE + start(2 * BLOCK) + 2 * BLOCK
    );
    let big = ix.reserve(4, ix.max_object_len(), 0).unwrap();
    assert_eq!(big.slot.stride, EB - 2 * BLOCK);
    ok(&ix);
    let s = ix.stats();
    assert_eq!(s.capacity_bytes, 4 * EB);
    assert_eq!(
        s.used_bytes,
        2 * BLOCK + 3 * BLOCK + 2 * BLOCK + EB - 2 * BLOCK
    );
    assert_eq!(
        (s.writing, s.objects, s.free_extents, s.extents),
        (4, 0, 1, 4)
    );
    // Degenerate geometry: nothing fits, nothing panics.
    let mut tiny = L2Index::<u32>::new(0, 100);
    assert_eq!(tiny.max_object_len(), 0);
    assert!(matches!(
        tiny.reserve(1, 1, 0),
        Err(ReserveError::TooLarge { .. })
    ));
    ok(&tiny);
}

#[test]
fn writing_is_invisible_and_commit_is_paired() {
    let mut ix = L2Index::<u32>::new(2, EB);
    let r = ix.reserve(1, SMALL, 9).unwrap();
    assert_eq!(ix.get(&1), None);
    assert!(!ix.contains(&1));
    assert_eq!(ix.pin(&1), None);
    assert_eq!(ix.reserve(1, SMALL, 9).unwrap_err(), ReserveError::Exists);
    let mut wrong = r.slot;
    wrong.epoch += 1;
    assert_eq!(ix.commit(1, wrong, 5, 0), Err(StateError::WrongState));
    assert_eq!(ix.abort(1, wrong), Err(StateError::WrongState));
    assert_eq!(ix.commit(2, r.slot, 5, 0), Err(StateError::NotFound));
    ix.commit(1, r.slot, 5, 0).unwrap();
    assert_eq!(ix.commit(1, r.slot, 5, 0), Err(StateError::WrongState));
    assert_eq!(ix.abort(1, r.slot), Err(StateError::WrongState));
    let l = ix.get(&1).unwrap();
    assert_eq!(
        (l.slot, l.object_len, l.checksum, l.seq),
        (r.slot, SMALL, 5, 9)
    );
    assert!(ix.contains(&1));
    // Abort frees the slot for reuse.
    let r2 = ix.reserve(2, SMALL, 0).unwrap();
    ix.abort(2, r2.slot).unwrap();
    assert_eq!(ix.abort(2, r2.slot), Err(StateError::NotFound));
    let r3 = ix.reserve(3, SMALL, 0).unwrap();
    assert_eq!(r3.slot, r2.slot);
    ok(&ix);
    assert_eq!(ix.stats().used_bytes, 2 * 256 * KIB);
}

#[test]
fn lru_eviction_within_stride() {
    let mut ix = L2Index::<u32>::new(1, EB);
    let slots: Vec<SlotRef> = (0..7).map(|k| ready(&mut ix, k, SMALL).slot).collect();
    ix.touch(&0);
    let r = ix.reserve(7, SMALL, 0).unwrap();
    assert_eq!(r.evicted, vec![1]);
    assert_eq!(r.slot, slots[1]);
    assert_eq!(r.new_extent, None);
    assert_eq!(ix.get(&1), None);
    ix.commit(7, r.slot, 0, 0).unwrap();
    // pin refreshes recency and protects: 2 is pinned, so 3 goes, then 4.
    ix.pin(&2).unwrap();
    assert_eq!(ix.reserve(8, SMALL, 0).unwrap().evicted, vec![3]);
    assert_eq!(ix.reserve(9, SMALL, 0).unwrap().evicted, vec![4]);
    ix.unpin(&2, slots[2]).unwrap();
    // get does not touch; 5 is now the oldest.
    ix.get(&5).unwrap();
    assert_eq!(ix.reserve(10, SMALL, 0).unwrap().evicted, vec![5]);
    ok(&ix);
}

#[test]
fn extent_reclaim_across_strides() {
    let mut ix = L2Index::<u32>::new(3, EB);
    for k in 0..7 {
        ready(&mut ix, k, SMALL); // extent 0
    }
    for k in 10..17 {
        ready(&mut ix, k, SMALL); // extent 1
    }
    let b = ready(&mut ix, 20, BIG); // extent 2
    assert_eq!(b.slot.extent, 2);
    ix.pin(&20).unwrap();
    // Extent 0 holds the newest stamp after this touch, so extent 1 is reclaimed.
    ix.touch(&3);
    let r = ix.reserve(21, BIG, 0).unwrap();
    assert_eq!(r.new_extent, Some((1, 4, MIB)), "a fresh global epoch");
    assert_eq!(r.slot.extent, 1);
    assert_eq!(r.slot.epoch, 4);
    let mut ev = r.evicted.clone();
    ev.sort();
    assert_eq!(ev, (10..17).collect::<Vec<_>>());
    assert!(ev.iter().all(|k| ix.get(k).is_none()));
    ok(&ix);
    // Extent 1 holds a Writing entry, extent 2 a pinned one: extent 0 is
    // the only candidate, even though it is the newest.
    let r = ix.reserve(22, BIG, 0).unwrap();
    assert_eq!(r.new_extent, Some((0, 5, MIB)));
    assert_eq!(r.evicted.len(), 7);
    ok(&ix);
    assert_eq!(ix.reserve(23, BIG, 0), Err(ReserveError::NoSpace));
    assert_eq!(ix.reserve(23, SMALL, 0), Err(ReserveError::NoSpace));
    ok(&ix);
}

#[test]
fn pinned_and_writing_never_evicted_nospace() {
    let mut ix = L2Index::<u32>::new(1, EB);
    let a = ix.reserve(1, BIG, 0).unwrap();
    assert_eq!(ix.reserve(2, BIG, 0), Err(ReserveError::NoSpace));
    assert_eq!(ix.reserve(2, SMALL, 0), Err(ReserveError::NoSpace));
    ix.commit(1, a.slot, 0, 0).unwrap();
    let l = ix.pin(&1).unwrap();
    ix.pin(&1).unwrap();
    assert_eq!(ix.stats().pinned, 1);
    assert_eq!(ix.reserve(2, BIG, 0), Err(ReserveError::NoSpace));
    assert_eq!(ix.reserve(2, SMALL, 0), Err(ReserveError::NoSpace));
    ix.unpin(&1, l.slot).unwrap();
    assert_eq!(ix.reserve(2, BIG, 0), Err(ReserveError::NoSpace));
    ix.unpin(&1, l.slot).unwrap();
    assert_eq!(ix.unpin(&1, l.slot), Err(StateError::WrongState));
    assert_eq!(ix.unpin(&9, l.slot), Err(StateError::NotFound));
    ok(&ix);
    // Unpinned: evicted by a same-stride reserve, its slot reused.
    let r = ix.reserve(2, BIG, 0).unwrap();
    assert_eq!((r.evicted, r.slot), (vec![1], a.slot));
    ok(&ix);
}

#[test]
fn doomed_freed_on_unpin_commit_and_abort() {
    let mut ix = L2Index::<u32>::new(1, EB);
    let a = ready(&mut ix, 1, MID);
    let l = ix.pin(&1).unwrap();
    assert!(ix.remove(&1));
    assert!(ix.remove(&1));
    assert_eq!(ix.get(&1), None);
    assert_eq!(ix.pin(&1), None);
    assert_eq!(ix.reserve(1, MID, 0), Err(ReserveError::Exists));
    let s = ix.stats();
    assert_eq!((s.objects, s.pinned, s.used_bytes), (0, 1, 512 * KIB));
    ok(&ix);
    ix.unpin(&1, l.slot).unwrap();
    assert_eq!(ix.stats().used_bytes, 0);
    ok(&ix);
    assert_eq!(ix.reserve(1, MID, 0).unwrap().slot, a.slot);

    let b = ix.reserve(2, MID, 0).unwrap();
    assert!(ix.remove(&2));
    assert_eq!(ix.commit(2, b.slot, 0, 0), Err(StateError::Doomed));
    assert_eq!(ix.commit(2, b.slot, 0, 0), Err(StateError::NotFound));
    let c = ix.reserve(3, MID, 0).unwrap();
    assert_eq!(c.slot, b.slot);
    assert!(ix.remove(&3));
    ix.abort(3, c.slot).unwrap();
    assert!(!ix.remove(&3));
    // Ready, unpinned: freed at once.
    ix.commit(1, a.slot, 0, 0).unwrap();
    assert!(ix.remove(&1));
    assert_eq!(ix.stats().used_bytes, 0);
    ok(&ix);
}

#[test]
fn clear_frees_extents() {
    let mut ix = L2Index::<u32>::new(4, EB);
    for k in 0..3 {
        ready(&mut ix, k, SMALL); // extent 0
    }
    ready(&mut ix, 10, BIG); // extent 1
    ready(&mut ix, 11, MID); // extent 2
    let w = ix.reserve(12, SMALL, 0).unwrap(); // extent 0
    let l = ix.pin(&11).unwrap();
    assert_eq!(ix.clear(), (4, 2));
    ok(&ix);
    let s = ix.stats();
    assert_eq!(
        (s.objects, s.free_extents, s.used_bytes),
        (0, 2, 256 * KIB + 512 * KIB)
    );
    // Draining extents take no new entries: new reserves use free extents.
    let n = ix.reserve(20, MID, 0).unwrap();
    assert_eq!(n.new_extent, Some((1, 4, 512 * KIB)));
    ok(&ix);
    ix.unpin(&11, l.slot).unwrap();
    assert_eq!(ix.stats().free_extents, 2);
    assert_eq!(ix.commit(12, w.slot, 0, 0), Err(StateError::Doomed));
    assert_eq!(ix.stats().free_extents, 3);
    ok(&ix);
    // Reassignment bumps the epoch again.
    let again = ix.reserve(21, BIG, 0).unwrap();
    assert_eq!(again.new_extent, Some((0, 5, MIB)));
    assert_eq!(ix.clear(), (0, 2));
    ix.abort(20, n.slot).unwrap();
    ix.abort(21, again.slot).unwrap();
    assert_eq!(ix.stats().free_extents, 4);
    ok(&ix);
}

#[test]
fn recovery() {
    let mut ix = L2Index::<u32>::new(4, EB);
    let bad = |r: Result<(), RecoverError>| assert!(matches!(r, Err(RecoverError::BadExtent(_))));
    bad(ix.recover_extent(4, 1, MIB));
    bad(ix.recover_extent(0, 0, MIB));
    bad(ix.recover_extent(0, u64::MAX, MIB));
    bad(ix.recover_extent(0, 1, MIB + 1));
    bad(ix.recover_extent(0, 1, BLOCK));
    bad(ix.recover_extent(0, 1, EB));
    ix.recover_extent(0, 5, 256 * KIB).unwrap();
    bad(ix.recover_extent(0, 6, 256 * KIB));
    ix.recover_extent(1, 3, 256 * KIB).unwrap();
    ix.recover_extent(2, 1, MIB).unwrap();
    ok(&ix);
    use RecoverOutcome::*;
    let rej = |o: RecoverOutcome| assert!(matches!(o, Rejected(_)), "{o:?}");
    assert_eq!(
        ix.recover_entry(
            1,
            0,
            0,
            Recovered {
                object_len: SMALL,
                checksum: 11,
                seq: 10,
                layout: 0
            }
        ),
        Inserted
    );
    rej(ix.recover_entry(
        2,
        0,
        0,
        Recovered {
            object_len: SMALL,
            checksum: 0,
            seq: 1,
            layout: 0,
        },
    )); // slot taken
    rej(ix.recover_entry(
        2,
        7,
        0,
        Recovered {
            object_len: SMALL,
            checksum: 0,
            seq: 1,
            layout: 0,
        },
    )); // outside extent
    rej(ix.recover_entry(
        2,
        1,
        0,
        Recovered {
            object_len: SMALL + 1,
            checksum: 0,
            seq: 1,
            layout: 0,
        },
    )); // too large
    rej(ix.recover_entry(
        2,
        1,
        0,
        Recovered {
            object_len: 0,
            checksum: 0,
            seq: 1,
            layout: 0,
        },
    )); // empty
    rej(ix.recover_entry(
        2,
        0,
        3,
        Recovered {
            object_len: SMALL,
            checksum: 0,
            seq: 1,
            layout: 0,
        },
    )); // unassigned extent
    rej(ix.recover_entry(
        2,
        0,
        9,
        Recovered {
            object_len: SMALL,
            checksum: 0,
            seq: 1,
            layout: 0,
        },
    )); // out of range
        // Same key elsewhere, newer: replaces, old slot freed.
    assert_eq!(
        ix.recover_entry(
            1,
            0,
            1,
            Recovered {
                object_len: SMALL,
                checksum: 12,
                seq: 20,
                layout: 0
            }
        ),
        ReplacedOlder
    );
    let l = ix.get(&1).unwrap();
    assert_eq!(
        (l.slot.extent, l.slot.index, l.slot.epoch, l.checksum, l.seq),
        (1, 0, 3, 12, 20)
    );
    // Older or equal: kept.
    assert_eq!(
        ix.recover_entry(
            1,
            1,
            0,
            Recovered {
                object_len: SMALL,
                checksum: 13,
                seq: 15,
                layout: 0
            }
        ),
        KeptNewer
    );
    assert_eq!(
        ix.recover_entry(
            1,
            1,
            0,
            Recovered {
                object_len: SMALL,
                checksum: 13,
                seq: 20,
                layout: 0
            }
        ),
        KeptNewer
    );
    assert_eq!(ix.get(&1).unwrap().checksum, 12);
    // Fill extent 1 with seqs out of order; recency follows seq.
    for (k, idx, seq) in [
        (2, 1, 50),
        (3, 2, 30),
        (4, 3, 40),
        (5, 4, 35),
        (6, 5, 60),
        (7, 6, 45),
    ] {
        assert_eq!(
            ix.recover_entry(
                k,
                idx,
                1,
                Recovered {
                    object_len: SMALL,
                    checksum: 0,
                    seq,
                    layout: 0
                }
            ),
            Inserted
        );
    }
    ok(&ix);
    ix.finish_recovery();
    ok(&ix);
    let s = ix.stats();
    // Extents 0 (now empty) and 2 (never filled) are free; extent 3 was never assigned.
    assert_eq!((s.free_extents, s.objects), (3, 7));
    // Next small reserve takes a free extent (epochs keep growing).
    let r = ix.reserve(100, SMALL, 0).unwrap();
    assert_eq!(r.new_extent, Some((0, 6, 256 * KIB)));
    ix.abort(100, r.slot).unwrap();
    // Fill the 21 free slots left (4 extents x 7, extent 1 full).
    let mut k = 200;
    while k < 221 {
        let r = ix.reserve(k, SMALL, 0).unwrap();
        assert!(r.evicted.is_empty());
        ix.commit(k, r.slot, 0, 0).unwrap();
        k += 1;
    }
    assert_eq!(ix.stats().free_extents, 0);
    ok(&ix);
    // Evictions follow seq order of the recovered entries, which are older
    // than anything created after recovery.
    let mut order = Vec::new();
    for _ in 0..7 {
        let r = ix.reserve(k, SMALL, 0).unwrap();
        order.extend(r.evicted);
        ix.commit(k, r.slot, 0, 0).unwrap();
        k += 1;
    }
    assert_eq!(order, vec![1, 3, 5, 4, 7, 2, 6]);
    ok(&ix);
}

#[test]
fn error_display() {
    let e: &dyn std::error::Error = &ReserveError::TooLarge {
        object_len: 5,
        max: 4,
    };
    assert!(e.to_string().contains("max 4"));
    assert!(!ReserveError::Exists.to_string().is_empty());
    assert!(!ReserveError::NoSpace.to_string().is_empty());
    for e in [
        StateError::NotFound,
        StateError::WrongState,
        StateError::Doomed,
    ] {
        assert!(!e.to_string().is_empty());
    }
    assert!(RecoverError::BadExtent("x".into())
        .to_string()
        .contains('x'));
}

mod model;
mod reclaim;
