//! Reclaim across strides: which extent a full disk gives up for a new stride or object.

use super::*;

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
