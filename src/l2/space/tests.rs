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

/// Issue 10, defect 4: a stride that arrives after the disk filled must win space from
/// colder objects of another stride, not stay confined to one extent.
#[test]
fn new_stride_on_full_disk_reclaims_colder_extents() {
    const X: u64 = 8 * MIB; // 120 slots of 64 KiB objects, 7 of 1 MiB ones
    const EXTENTS: u32 = 32;
    const NEW: u32 = 100;
    let mut ix = L2Index::<u32>::new(EXTENTS, X);
    let old = EXTENTS * ((X - BLOCK) / (68 * KIB)) as u32; // 3840: the disk is full
    for k in 0..old {
        let r = ix.reserve(k, 64 * KIB, u64::from(k)).unwrap();
        assert!(r.evicted.is_empty());
        ix.commit(k, r.slot, 0, 0).unwrap();
    }
    let s = ix.stats();
    assert_eq!((s.objects, s.free_extents), (u64::from(old), 0));
    ok(&ix);
    // As the tier does: a batch of reservations, written, then committed and touched.
    for batch in (old..old + NEW).collect::<Vec<u32>>().chunks(4) {
        let slots: Vec<SlotRef> = batch
            .iter()
            .map(|&k| ix.reserve(k, MIB, u64::from(k)).unwrap().slot)
            .collect();
        for (&k, slot) in batch.iter().zip(slots) {
            ix.commit(k, slot, 0, 0).unwrap();
            ix.touch(&k);
        }
        ok(&ix);
    }
    let present = (old..old + NEW).filter(|k| ix.contains(k)).count() as u32;
    let extents: HashSet<u32> = (old..old + NEW)
        .filter_map(|k| ix.get(&k).map(|l| l.slot.extent))
        .collect();
    let small_left = (0..old).filter(|k| ix.contains(k)).count();
    eprintln!(
        "defect 4: {present}/{NEW} new 1 MiB objects present in {} extents, {small_left}/{old} old 64 KiB ones",
        extents.len()
    );
    // Every old object is colder than every new one: all the new ones stay.
    assert_eq!(present, NEW, "new stride confined");
    assert_eq!(extents.len() as u32, NEW.div_ceil(7));
}

fn sorted(mut v: Vec<u32>) -> Vec<u32> {
    v.sort_unstable();
    v
}

#[test]
fn reclaim_weighs_own_lru_against_older_extents() {
    let mut ix = L2Index::<u32>::new(3, EB);
    for k in 0..3 {
        ready(&mut ix, k, MID); // extent 0, the oldest
    }
    ready(&mut ix, 10, BIG); // extent 1
    ready(&mut ix, 11, BIG); // extent 2
                             // Extent 0's newest entry is older than BIG's LRU head (10): the extent goes.
    let r = ready(&mut ix, 12, BIG);
    assert_eq!(sorted(r.evicted), vec![0, 1, 2]);
    assert_eq!(r.new_extent, Some((0, 4, MIB)));
    // No other stride left: BIG's own LRU entry goes.
    assert_eq!(ready(&mut ix, 13, BIG).evicted, vec![10]);
    // MID has no entry at all: the oldest BIG extent (11's) is reclaimed.
    let r = ready(&mut ix, 20, MID);
    assert_eq!(
        (r.evicted, r.new_extent),
        (vec![11], Some((2, 5, 512 * KIB)))
    );
    ready(&mut ix, 21, MID);
    ready(&mut ix, 22, MID);
    // A touch makes the whole extent newer than BIG's LRU head: the head goes, twice.
    ix.touch(&20);
    assert_eq!(ready(&mut ix, 14, BIG).evicted, vec![12]);
    assert_eq!(ready(&mut ix, 15, BIG).evicted, vec![13]);
    // BIG's head (14) is now newer than the touch: extent 2 is reclaimed.
    let r = ready(&mut ix, 16, BIG);
    assert_eq!(sorted(r.evicted), vec![20, 21, 22]);
    assert_eq!(r.new_extent, Some((2, 6, MIB)));
    ok(&ix);
}

#[test]
fn own_stride_without_evictable_entry_reclaims_any_age() {
    let mut ix = L2Index::<u32>::new(3, EB);
    for k in 0..3 {
        ready(&mut ix, k, MID); // extent 0
    }
    let w = ix.reserve(10, BIG, 0).unwrap(); // extent 1, Writing
    ready(&mut ix, 11, BIG); // extent 2
    ix.pin(&11).unwrap();
    ix.touch(&0); // extent 0 is the newest
                  // BIG has only Writing and pinned entries: extent 0 goes although it is newer.
    let r = ix.reserve(12, BIG, 0).unwrap();
    assert_eq!(sorted(r.evicted), vec![0, 1, 2]);
    assert_eq!(r.slot.extent, 0);
    ok(&ix);
    // Nothing evictable anywhere: NoSpace, nothing changed.
    let before = format!("{ix:?}");
    assert_eq!(ix.reserve(13, BIG, 0), Err(ReserveError::NoSpace));
    assert_eq!(ix.reserve(13, MID, 0), Err(ReserveError::NoSpace));
    assert_eq!(format!("{ix:?}"), before);
    // Committed, the Writing entry becomes BIG's LRU head and is evicted.
    ix.commit(10, w.slot, 0, 0).unwrap();
    assert_eq!(ix.reserve(13, BIG, 0).unwrap().evicted, vec![10]);
    ok(&ix);
}

#[test]
fn extents_with_busy_or_doomed_entries_are_not_reclaimed() {
    let mut ix = L2Index::<u32>::new(3, EB);
    for k in 0..3 {
        ready(&mut ix, k, MID); // extent 0
    }
    let l = ix.pin(&1).unwrap();
    assert!(ix.remove(&1)); // doomed, pinned
    let w = ix.reserve(10, SMALL, 0).unwrap(); // extent 1
    assert!(ix.remove(&10)); // doomed, Writing
    for k in 11..17 {
        ready(&mut ix, k, SMALL);
    }
    ready(&mut ix, 20, BIG); // extent 2, the newest
                             // Both older extents hold a doomed entry: BIG's own LRU entry goes.
    assert_eq!(ready(&mut ix, 21, BIG).evicted, vec![20]);
    // The last pin frees the doomed entry: extent 0 (older than 21) is reclaimed.
    ix.unpin(&1, l.slot).unwrap();
    ok(&ix);
    let r = ready(&mut ix, 22, BIG);
    assert_eq!((sorted(r.evicted), r.slot.extent), (vec![0, 2], 0));
    // The doomed Writing entry is freed at commit: extent 1 goes next.
    assert_eq!(ix.commit(10, w.slot, 0, 0), Err(StateError::Doomed));
    let r = ready(&mut ix, 23, BIG);
    assert_eq!((sorted(r.evicted), r.slot.extent), ((11..17).collect(), 1));
    ok(&ix);
}

#[test]
fn draining_extents_are_not_reclaimed() {
    let mut ix = L2Index::<u32>::new(3, EB);
    ready(&mut ix, 0, SMALL);
    let w = ix.reserve(1, SMALL, 0).unwrap(); // extent 0
    assert_eq!(ix.clear(), (1, 1)); // extent 0 drains; the others are free
    ok(&ix);
    for k in 10..13 {
        ready(&mut ix, k, MID); // extent 1
    }
    for k in 20..23 {
        ready(&mut ix, k, MID); // extent 2
    }
    // Extent 0 holds only a doomed entry and six free slots: never a candidate.
    let r = ready(&mut ix, 30, BIG);
    assert_eq!((sorted(r.evicted), r.slot.extent), (vec![10, 11, 12], 1));
    let r = ready(&mut ix, 31, BIG);
    assert_eq!((sorted(r.evicted), r.slot.extent), (vec![20, 21, 22], 2));
    assert_eq!(ready(&mut ix, 32, BIG).evicted, vec![30]);
    assert_eq!(ix.reserve(40, SMALL, 0).unwrap().evicted, vec![31]);
    ok(&ix);
    // Drained, extent 0 is free again and taken before any eviction.
    ix.abort(1, w.slot).unwrap();
    let r = ix.reserve(41, MID, 0).unwrap();
    assert_eq!((r.evicted, r.slot.extent), (vec![], 0));
    ok(&ix);
}

#[test]
fn stale_newest_bound_only_delays_reclaim() {
    let mut ix = L2Index::<u32>::new(3, EB);
    ready(&mut ix, 0, MID); // extent 0
    ready(&mut ix, 1, MID);
    ready(&mut ix, 10, BIG); // extent 1
    ready(&mut ix, 11, BIG); // extent 2
    ix.touch(&1);
    assert!(ix.remove(&1));
    // Extent 0 now only holds 0, older than 10, but its bound still says "touched after
    // 11": BIG evicts its own head (the documented cost of not rescanning).
    assert_eq!(ready(&mut ix, 12, BIG).evicted, vec![10]);
    ok(&ix);
    // Empty, its bound is exact again (none): it is reclaimed before any entry goes.
    assert!(ix.remove(&0));
    let r = ready(&mut ix, 13, BIG);
    assert_eq!((r.evicted, r.new_extent), (vec![], Some((0, 4, MIB))));
    ok(&ix);
}

#[test]
fn recovered_extents_are_weighed_by_seq() {
    let mut ix = L2Index::<u32>::new(4, EB);
    ix.recover_extent(0, 5, 512 * KIB).unwrap(); // MID
    ix.recover_extent(1, 6, MIB).unwrap();
    ix.recover_extent(2, 7, MIB).unwrap();
    ix.recover_extent(3, 8, 256 * KIB).unwrap(); // stays empty
    ok(&ix);
    let found = |seq| Recovered {
        object_len: 1,
        checksum: 0,
        seq,
        layout: 0,
    };
    use RecoverOutcome::*;
    assert_eq!(ix.recover_entry(0, 0, 0, found(10)), Inserted);
    assert_eq!(ix.recover_entry(1, 1, 0, found(30)), Inserted);
    assert_eq!(ix.recover_entry(10, 0, 1, found(20)), Inserted);
    assert_eq!(ix.recover_entry(11, 0, 2, found(40)), Inserted);
    ok(&ix);
    // A newer copy of 1 in the same extent: the old slot is freed, the bound follows seq 45.
    assert_eq!(ix.recover_entry(1, 2, 0, found(45)), ReplacedOlder);
    assert_eq!(ix.recover_entry(1, 1, 0, found(44)), KeptNewer);
    ok(&ix);
    ix.finish_recovery();
    ok(&ix);
    assert_eq!(ix.stats().free_extents, 1);
    // The empty extent 3 was freed: taken first, with an epoch above every one seen.
    let r = ready(&mut ix, 12, BIG);
    assert_eq!((r.evicted, r.new_extent), (vec![], Some((3, 9, MIB))));
    // BIG's head (seq 20, then 40) is older than extent 0 (seq 45): own entries go first.
    assert_eq!(ready(&mut ix, 13, BIG).evicted, vec![10]);
    assert_eq!(ready(&mut ix, 14, BIG).evicted, vec![11]);
    // Entries made after recovery are newer than any recovered one: extent 0 goes.
    let r = ready(&mut ix, 15, BIG);
    assert_eq!(sorted(r.evicted), vec![0, 1]);
    assert_eq!(r.new_extent, Some((0, 10, MIB)));
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

// ---- property test against a model ----

#[derive(Debug, Clone)]
enum Op {
    Reserve(u32, usize),
    Commit(u32),
    Abort(u32),
    Pin(u32),
    Unpin(u32),
    Remove(u32),
    Touch(u32),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0u32..10;
    prop_oneof![
        6 => (k.clone(), 0usize..3).prop_map(|(k, s)| Op::Reserve(k, s)),
        4 => k.clone().prop_map(Op::Commit),
        1 => k.clone().prop_map(Op::Abort),
        2 => k.clone().prop_map(Op::Pin),
        2 => k.clone().prop_map(Op::Unpin),
        1 => k.clone().prop_map(Op::Remove),
        1 => k.prop_map(Op::Touch),
        1 => Just(Op::Clear),
    ]
}

#[derive(Debug, Clone)]
struct M {
    slot: SlotRef,
    ready: bool,
    pins: u32,
    doomed: bool,
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    const SIZES: [u64; 3] = [SMALL, MID, BIG];
    let mut ix = L2Index::<u32>::new(4, EB);
    let mut m: HashMap<u32, M> = HashMap::new();
    let mut epochs = [0u64; 4];
    for op in ops {
        match op {
            Op::Reserve(k, s) => match ix.reserve(k, SIZES[s], 1) {
                Ok(r) => {
                    prop_assert!(!m.contains_key(&k));
                    for v in &r.evicted {
                        let e = m.remove(v);
                        prop_assert!(
                            matches!(
                                e,
                                Some(M {
                                    ready: true,
                                    pins: 0,
                                    doomed: false,
                                    ..
                                })
                            ),
                            "evicted {v}: {e:?}"
                        );
                        prop_assert!(ix.get(v).is_none());
                    }
                    if let Some((x, epoch, stride)) = r.new_extent {
                        prop_assert!(epoch > epochs[x as usize]);
                        prop_assert_eq!(stride, r.slot.stride);
                        epochs[x as usize] = epoch;
                    }
                    prop_assert_eq!(r.slot.epoch, epochs[r.slot.extent as usize]);
                    m.insert(
                        k,
                        M {
                            slot: r.slot,
                            ready: false,
                            pins: 0,
                            doomed: false,
                        },
                    );
                }
                Err(ReserveError::Exists) => prop_assert!(m.contains_key(&k)),
                Err(ReserveError::NoSpace) => {
                    prop_assert!(!m.contains_key(&k));
                    prop_assert!(r_nospace_plausible(&m));
                }
                Err(e) => prop_assert!(false, "unexpected {e:?}"),
            },
            Op::Commit(k) => {
                let slot = m.get(&k).map(|e| e.slot);
                let res = ix.commit(k, slot.unwrap_or(DUMMY), 3, 0);
                match m.get_mut(&k) {
                    None => prop_assert_eq!(res, Err(StateError::NotFound)),
                    Some(e) if e.ready => prop_assert_eq!(res, Err(StateError::WrongState)),
                    Some(e) if e.doomed => {
                        prop_assert_eq!(res, Err(StateError::Doomed));
                        m.remove(&k);
                    }
                    Some(e) => {
                        prop_assert_eq!(res, Ok(()));
                        e.ready = true;
                    }
                }
            }
            Op::Abort(k) => {
                let slot = m.get(&k).map(|e| e.slot);
                let res = ix.abort(k, slot.unwrap_or(DUMMY));
                match m.get(&k) {
                    None => prop_assert_eq!(res, Err(StateError::NotFound)),
                    Some(e) if e.ready => prop_assert_eq!(res, Err(StateError::WrongState)),
                    Some(_) => {
                        prop_assert_eq!(res, Ok(()));
                        m.remove(&k);
                    }
                }
            }
            Op::Pin(k) => {
                let res = ix.pin(&k);
                match m.get_mut(&k) {
                    Some(e) if e.ready && !e.doomed => {
                        prop_assert_eq!(res.map(|l| l.slot), Some(e.slot));
                        e.pins += 1;
                    }
                    _ => prop_assert!(res.is_none()),
                }
            }
            Op::Unpin(k) => {
                let slot = m.get(&k).map(|e| e.slot);
                let res = ix.unpin(&k, slot.unwrap_or(DUMMY));
                match m.get_mut(&k) {
                    None => prop_assert_eq!(res, Err(StateError::NotFound)),
                    Some(e) if e.pins == 0 => prop_assert_eq!(res, Err(StateError::WrongState)),
                    Some(e) => {
                        prop_assert_eq!(res, Ok(()));
                        e.pins -= 1;
                        if e.pins == 0 && e.doomed {
                            m.remove(&k);
                        }
                    }
                }
            }
            Op::Remove(k) => {
                prop_assert_eq!(ix.remove(&k), m.contains_key(&k));
                if let Some(e) = m.get_mut(&k) {
                    if e.ready && e.pins == 0 {
                        m.remove(&k);
                    } else {
                        e.doomed = true;
                    }
                }
            }
            Op::Touch(k) => ix.touch(&k),
            Op::Clear => {
                let before = m.len() as u64;
                m.retain(|_, e| !(e.ready && e.pins == 0));
                for e in m.values_mut() {
                    e.doomed = true;
                }
                let kept = m.len() as u64;
                prop_assert_eq!(ix.clear(), (before - kept, kept));
            }
        }
        if let Err(e) = ix.check() {
            prop_assert!(false, "check: {}", e);
        }
        let mut slots = HashSet::new();
        for k in 0..10u32 {
            let vis = m.get(&k).is_some_and(|e| e.ready && !e.doomed);
            prop_assert_eq!(ix.get(&k).is_some(), vis, "key {}", k);
            prop_assert_eq!(ix.contains(&k), vis);
            if let Some(e) = m.get(&k) {
                prop_assert!(slots.insert((e.slot.extent, e.slot.index)), "shared slot");
            }
            if let Some(l) = ix.get(&k) {
                prop_assert_eq!(Some(l.slot), m.get(&k).map(|e| e.slot));
            }
        }
        let s = ix.stats();
        let count = |f: fn(&M) -> bool| m.values().filter(|e| f(e)).count() as u64;
        prop_assert_eq!(s.objects, count(|e| e.ready && !e.doomed));
        prop_assert_eq!(s.writing, count(|e| !e.ready));
        prop_assert_eq!(s.pinned, count(|e| e.pins > 0));
        prop_assert_eq!(s.used_bytes, m.values().map(|e| e.slot.stride).sum::<u64>());
    }
    Ok(())
}

/// NoSpace needs at least one blocked entry (4 extents can hold any single object).
fn r_nospace_plausible(m: &HashMap<u32, M>) -> bool {
    m.values().any(|e| !e.ready || e.pins > 0 || e.doomed)
}

const DUMMY: SlotRef = SlotRef {
    extent: 99,
    index: 0,
    stride: 0,
    epoch: 0,
    file_offset: 0,
};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn model_check(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops)?;
    }
}

// ---- randomized operations, summaries and reclaim choices checked after every step ----

/// splitmix64: a deterministic generator, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The keys of the entries in extent `ext`, found by brute force over every entry.
fn held(ix: &L2Index<u32>, ext: u32) -> Vec<u32> {
    let mut ks: Vec<u32> = ix
        .entries
        .iter()
        .filter(|(_, e)| e.slot.extent == ext)
        .map(|(k, _)| *k)
        .collect();
    ks.sort_unstable();
    ks
}

/// The victim `reserve` must pick for `stride` in `ix`, found by brute force over every
/// extent: `Some(Ok(key))` for the stride's LRU entry, `Some(Err(extent))` for an extent to
/// reclaim, `None` for no space. Only asked when the stride has no free slot and no extent
/// is free. Extents are ordered by their summary's bound (exact or above, see `check`).
fn expected_victim(ix: &L2Index<u32>, stride: u64) -> Option<Result<u32, u32>> {
    let head = ix
        .strides
        .get(&stride)
        .and_then(|s| s.lru.first_key_value())
        .map(|(s, k)| (*s, *k));
    let mut best: Option<(Option<Stamp>, u32)> = None;
    for (i, x) in ix.extents.iter().enumerate() {
        let i = i as u32;
        if x.stride == 0 || x.stride == stride || x.draining {
            continue;
        }
        let all_evictable = held(ix, i).iter().all(|k| ix.entries[k].evictable());
        if all_evictable && best.is_none_or(|b| (x.summary.newest, i) < b) {
            best = Some((x.summary.newest, i));
        }
    }
    match (head, best) {
        (Some((stamp, _)), Some((newest, i))) if newest < Some(stamp) => {
            let exact = held(ix, i).iter().map(|k| ix.entries[k].stamp).max();
            assert!(exact < Some(stamp), "a stale bound allowed a reclaim");
            Some(Err(i))
        }
        (Some((_, k)), _) => Some(Ok(k)),
        (None, Some((_, i))) => Some(Err(i)),
        (None, None) => None,
    }
}

/// Checks a successful reservation against the state before it.
fn check_reservation(before: &L2Index<u32>, stride: u64, r: &Reservation<u32>) {
    let set = before.strides.get(&stride);
    let had_partial = set.is_some_and(|s| !s.partial.is_empty());
    let x = &before.extents[r.slot.extent as usize];
    for k in &r.evicted {
        assert!(before.entries[k].evictable(), "evicted busy {k}");
    }
    // At the cap, a path that evicts nothing evicts the least recently used entry too.
    let at_cap = before.entries.len() as u64 >= before.max_entries;
    let with_cap = |normal: Vec<u32>| {
        if at_cap && normal.is_empty() {
            vec![oldest(before).expect("reserved at the cap with nothing evictable")]
        } else {
            normal
        }
    };
    if had_partial {
        assert_eq!(x.stride, stride);
        assert_eq!(r.evicted, with_cap(Vec::new()));
        return;
    }
    if !before.free_extents.is_empty() {
        assert_eq!(x.stride, 0);
        assert_eq!(r.evicted, with_cap(Vec::new()));
        assert_eq!(r.slot.extent, *before.free_extents.first().unwrap());
        return;
    }
    match expected_victim(before, stride) {
        Some(Ok(k)) => assert_eq!(r.evicted, vec![k], "own LRU entry"),
        Some(Err(ext)) => {
            assert_eq!(r.slot.extent, ext, "reclaimed extent");
            let mut want = with_cap(held(before, ext));
            let mut ev = r.evicted.clone();
            want.sort_unstable();
            ev.sort_unstable();
            assert_eq!(want, ev);
        }
        None => panic!("reserved although nothing was evictable"),
    }
    if let Some((ext, epoch, s)) = r.new_extent {
        assert_eq!((ext, s), (r.slot.extent, stride));
        assert!(epoch > before.extents[ext as usize].epoch && epoch >= before.next_epoch);
    }
}

/// The least recently used evictable entry, by brute force.
fn oldest(ix: &L2Index<u32>) -> Option<u32> {
    ix.entries
        .iter()
        .filter(|(_, e)| e.evictable())
        .min_by_key(|(_, e)| e.stamp)
        .map(|(k, _)| *k)
}

/// A restart: a fresh index rebuilt, as the tier does, from what is on "disk": the headers
/// of every assigned extent and of every visible entry, plus stale copies of some keys in
/// free slots (older or newer seqs). Checked after every step.
fn recovered(ix: &L2Index<u32>, rng: &mut Rng) -> L2Index<u32> {
    let mut n = match ix.limit_bytes {
        u64::MAX => L2Index::<u32>::new(ix.extents.len() as u32, ix.extent_bytes),
        limit => L2Index::with_limit(ix.extents.len() as u32, ix.extent_bytes, limit).unwrap(),
    };
    n.note_epoch(ix.next_epoch - 1);
    for (i, x) in ix.extents.iter().enumerate() {
        if x.stride != 0 {
            n.recover_extent(i as u32, x.epoch, x.stride).unwrap();
            n.check().unwrap();
        }
    }
    let mut found: Vec<(u32, Entry)> = ix
        .entries
        .iter()
        .filter(|(_, e)| e.visible())
        .map(|(k, e)| (*k, *e))
        .collect();
    found.sort_unstable_by_key(|(k, _)| *k);
    for (k, e) in found {
        let rec = Recovered {
            object_len: e.object_len,
            checksum: e.checksum,
            seq: e.seq,
            layout: e.layout,
        };
        let out = n.recover_entry(k, e.slot.index, e.slot.extent, rec);
        assert!(
            matches!(out, RecoverOutcome::Inserted | RecoverOutcome::KeptNewer),
            "{out:?}"
        );
        n.check().unwrap();
    }
    for _ in 0..rng.below(4) {
        let ext = rng.below(ix.extents.len() as u64) as u32;
        let x = &ix.extents[ext as usize];
        if x.stride == 0 || x.slots == 0 {
            continue;
        }
        let slot = rng.below(u64::from(x.slots)) as u32;
        let rec = Recovered {
            object_len: 1 + rng.below(x.stride - BLOCK),
            checksum: 0,
            seq: rng.below(ix.clock + 2),
            layout: 0,
        };
        n.recover_entry(rng.below(96) as u32, slot, ext, rec);
        n.check().unwrap();
    }
    n.finish_recovery();
    n
}

/// Random operations on 8 extents of 2 MiB, with at most `cap` entries when given.
fn random_run(seed: u64, steps: u64, cap: Option<u64>) {
    /// Strides 64 KiB (31 slots), 256 KiB (7), 512 KiB (3), 1 MiB (1).
    const LENS: [u64; 4] = [60 * KIB, SMALL, MID, BIG];
    let mut rng = Rng(seed);
    let mut ix = match cap {
        None => L2Index::<u32>::new(8, EB),
        Some(cap) => capped(8, EB, cap),
    };
    for step in 0..steps {
        // Commit, abort and unpin mostly pick a key they apply to.
        let pick = |ix: &L2Index<u32>, rng: &mut Rng, f: fn(&Entry) -> bool| {
            let mut ks: Vec<u32> = ix
                .entries
                .iter()
                .filter(|(_, e)| f(e))
                .map(|(k, _)| *k)
                .collect();
            ks.sort_unstable();
            match ks.len() {
                0 => rng.below(96) as u32,
                n if rng.below(8) > 0 => ks[rng.below(n as u64) as usize],
                _ => rng.below(96) as u32,
            }
        };
        let mut k = rng.below(96) as u32;
        let op = rng.below(1000);
        if (300..650).contains(&op) {
            k = pick(&ix, &mut rng, |e| e.state == State::Writing);
        } else if (730..810).contains(&op) {
            k = pick(&ix, &mut rng, |e| e.pins > 0);
        }
        let slot = ix.entries.get(&k).map_or(DUMMY, |e| e.slot);
        match op {
            0..=299 => {
                let len = LENS[rng.below(LENS.len() as u64) as usize];
                let before = ix.clone();
                match ix.reserve(k, len, step) {
                    Ok(r) => check_reservation(&before, stride_of(len), &r),
                    Err(e) => {
                        assert_eq!(format!("{before:?}"), format!("{ix:?}"), "{e:?} changed");
                        let at_cap = before.entries.len() as u64 >= before.max_entries;
                        if e == ReserveError::NoSpace && !(at_cap && oldest(&before).is_none()) {
                            assert!(before.free_extents.is_empty());
                            assert_eq!(expected_victim(&before, stride_of(len)), None);
                        }
                    }
                }
            }
            300..=599 => {
                let _ = ix.commit(k, slot, 1, 2);
            }
            600..=649 => {
                let _ = ix.abort(k, slot);
            }
            650..=729 => {
                ix.pin(&k);
            }
            730..=809 => {
                let _ = ix.unpin(&k, slot);
            }
            810..=869 => {
                ix.remove(&k);
            }
            870..=989 => ix.touch(&k),
            990..=994 => {
                ix.clear();
            }
            _ => ix = recovered(&ix, &mut rng),
        }
        if let Err(e) = ix.check() {
            panic!("seed {seed} step {step}: {e}");
        }
    }
}

#[test]
fn randomized_operations_keep_summaries() {
    for seed in 1..=4 {
        random_run(seed, 2500, None);
    }
}

#[test]
fn randomized_operations_at_an_entry_cap() {
    for (seed, cap) in [(11, 3), (12, 12), (13, 40)] {
        random_run(seed, 2500, Some(cap));
    }
}

// ---- the memory bound (budget.rs) ----

/// An index of `extents` extents of `eb` bytes whose limit holds exactly `cap` entries.
fn capped(extents: u32, eb: u64, cap: u64) -> L2Index<u32> {
    let limit = L2Index::<u32>::fixed_bytes(extents, eb) + cap * L2Index::<u32>::BYTES_PER_OBJECT;
    let ix = L2Index::with_limit(extents, eb, limit).unwrap();
    assert_eq!(ix.max_entries(), cap);
    ix
}

#[test]
fn entry_cap_evicts_the_least_recently_used_of_any_stride() {
    let mut ix = capped(8, EB, 5);
    for (k, len) in [(1, SMALL), (2, MID), (3, BIG), (4, SMALL), (5, MID)] {
        ready(&mut ix, k, len);
    }
    let s = ix.stats();
    assert_eq!((s.entries, s.max_entries, s.free_extents), (5, 5, 5));
    assert!(s.index_bytes <= s.index_limit_bytes);
    ix.touch(&1); // 2 (MID) is now the oldest
                  // A new BIG extent is free: only the cap makes room, with the oldest of any stride.
    let r = ix.reserve(6, BIG, 6).unwrap();
    assert_eq!(r.evicted, vec![2]);
    assert_eq!(ix.get(&2), None);
    assert_eq!(ix.stats().entries, 5);
    ix.commit(6, r.slot, 0, 0).unwrap();
    ok(&ix);
    // Pinned and Writing entries are never evicted: 3 is pinned (and touched), so 4 goes.
    ix.pin(&3).unwrap();
    let r = ix.reserve(7, SMALL, 7).unwrap();
    assert_eq!(r.evicted, vec![4]);
    assert_eq!(r.slot, ix.entries[&7].slot);
    ok(&ix);
    // At the cap with every other entry pinned and 7 still Writing: NoSpace, nothing changed.
    for k in [5, 1, 6] {
        ix.pin(&k).unwrap();
    }
    let before = format!("{ix:?}");
    assert_eq!(ix.reserve(8, SMALL, 8), Err(ReserveError::NoSpace));
    assert_eq!(before, format!("{ix:?}"));
    // Once 1 is unpinned it is the only evictable entry.
    ix.unpin(&1, ix.entries[&1].slot).unwrap();
    assert_eq!(ix.reserve(8, SMALL, 8).unwrap().evicted, vec![1]);
    assert_eq!(ix.stats().entries, 5);
    ok(&ix);
    // An eviction the space search makes counts: no second one for the cap.
    let mut ix = capped(1, EB, 7);
    for k in 0..7 {
        ready(&mut ix, k, SMALL); // the only extent, full
    }
    assert_eq!(ix.reserve(9, SMALL, 9).unwrap().evicted, vec![0]);
    assert_eq!(ix.stats().entries, 7);
    ok(&ix);
}

#[test]
fn recovery_at_the_cap_keeps_the_most_recently_written() {
    let mut ix = capped(4, EB, 3);
    ix.recover_extent(0, 5, 256 * KIB).unwrap(); // 7 slots
    let rec = |seq| Recovered {
        object_len: SMALL,
        checksum: 1,
        seq,
        layout: 0,
    };
    let seqs = [40, 10, 70, 20, 60, 30, 50];
    let outcomes: Vec<RecoverOutcome> = seqs
        .iter()
        .enumerate()
        .map(|(slot, &seq)| {
            let out = ix.recover_entry(100 + slot as u32, slot as u32, 0, rec(seq));
            ok(&ix);
            out
        })
        .collect();
    use RecoverOutcome::{Inserted, OverCap, ReplacedOlder};
    // 20 displaces 10, 60 displaces 20, 30 is older than all three, 50 displaces 40.
    assert_eq!(
        outcomes,
        [Inserted, Inserted, Inserted, Inserted, Inserted, OverCap, Inserted]
    );
    let mut held: Vec<u32> = ix.keys().copied().collect();
    held.sort_unstable();
    assert_eq!(held, [102, 104, 106], "seqs 70, 60, 50");
    assert_eq!(ix.unindexed(), 4);
    // A newer copy of a held key replaces it: no growth, nothing more left out.
    assert_eq!(ix.recover_entry(102, 1, 0, rec(80)), ReplacedOlder);
    assert_eq!((ix.stats().entries, ix.unindexed()), (3, 4));
    ix.finish_recovery();
    ok(&ix);
    assert_eq!(ix.stats().unindexed, 4);
    // The slots of the records left out are free: the next reservation takes the lowest
    // (slot 0), evicting the least recent entry (seq 50).
    let r = ix.reserve(200, SMALL, 100).unwrap();
    assert_eq!((r.slot.extent, r.slot.index, r.evicted), (0, 0, vec![106]));
    ok(&ix);
}

#[test]
fn with_limit_charges_the_geometry_and_refuses_a_limit_below_it() {
    let per = L2Index::<u32>::BYTES_PER_OBJECT;
    let fixed = L2Index::<u32>::fixed_bytes(4, EB);
    // One bit per slot at the smallest stride (255 slots: 4 words and a block header) plus
    // the per-extent share, for each extent.
    assert_eq!(
        fixed - L2Index::<u32>::fixed_bytes(0, EB),
        4 * (L2Index::<u32>::BYTES_PER_EXTENT + 4 * 8 + 16)
    );
    let e = L2Index::<u32>::with_limit(4, EB, fixed + per - 1).unwrap_err();
    assert_eq!(
        (e.limit_bytes, e.fixed_bytes, e.bytes_per_object),
        (fixed + per - 1, fixed, per)
    );
    let msg = e.to_string();
    for n in [fixed + per - 1, fixed, fixed + per] {
        assert!(msg.contains(&n.to_string()), "{n} not in {msg:?}");
    }
    assert!(L2Index::<u32>::with_limit(4, EB, 0).is_err());
    assert_eq!(
        L2Index::<u32>::with_limit(4, EB, fixed + per)
            .unwrap()
            .max_entries(),
        1
    );
    let ix = L2Index::<u32>::with_limit(4, EB, fixed + 11 * per - 1).unwrap();
    assert_eq!(ix.max_entries(), 10);
    let s = ix.stats();
    assert_eq!(
        (s.index_bytes, s.index_limit_bytes),
        (fixed, fixed + 11 * per - 1)
    );
    // Without a limit: no cap but the slots.
    let s = L2Index::<u32>::new(4, EB).stats();
    assert_eq!((s.max_entries, s.index_limit_bytes), (u64::MAX, u64::MAX));
}
