//! `l2.max_index_bytes`: devices whose index would not fit, and recovery beyond the cap.

use super::*;

/// The index budget of the unit-test device (`l2.max_index_bytes`) that holds `objects`.
fn index_budget_for(r: &Rig, objects: u64) -> u64 {
    let s = r.tier.status();
    let extents = crate::l2::format::extent_count(s.bytes, s.extent_bytes);
    L2Index::<StorageKey>::fixed_bytes(extents, s.extent_bytes) + objects * INDEX_BYTES_PER_OBJECT
}

/// Issue 10, defect 5: a device whose index would not fit `l2.max_index_bytes` with even one
/// object is refused at start-up, naming the limit and what the geometry needs; the default
/// leaves the small device unconstrained.
#[test]
fn a_device_whose_index_exceeds_max_index_bytes_is_refused() {
    let mut r = rig("capopen", "pread");
    let s = r.tier.status();
    assert_eq!(s.index_limit_bytes, 1 << 30);
    assert!(s.index_bytes <= s.index_limit_bytes);
    let extents = crate::l2::format::extent_count(s.bytes, s.extent_bytes);
    let slots_at_min_stride = extents as u64 * ((s.extent_bytes - 4096) / 8192);
    assert!(
        s.index_max_objects > slots_at_min_stride,
        "the default never binds here"
    );
    let (one, fixed) = (index_budget_for(&r, 1), index_budget_for(&r, 0));
    let owner = r.dir.take().expect("first rig owns the directory");
    let dir = owner.0.clone();
    drop(r);
    let too_small = one - 1;
    let err = match try_open_rig(dir.clone(), Fault::None, |c| c.max_index_bytes = too_small) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("opened with {too_small} bytes of index"),
    };
    for needle in [
        too_small.to_string(),
        fixed.to_string(),
        one.to_string(),
        "l2.max_index_bytes".to_string(),
    ] {
        assert!(err.contains(&needle), "{needle:?} not in {err:?}");
    }
    // One object's worth opens, with a cap of one object.
    let r = try_open_rig(dir, Fault::None, |c| c.max_index_bytes = one).unwrap();
    let s = r.tier.status();
    assert_eq!((s.index_max_objects, s.index_limit_bytes), (1, one));
    let keys = r.keys(3);
    r.store(&keys);
    // In one batch the second object finds the first still being written (not evictable):
    // skipped. One at a time, each evicts the one before.
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..2]), 1);
    assert_eq!(r.tier.status().skipped, 1);
    for k in &keys[1..] {
        assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &[*k]), 1);
    }
    let s = r.tier.status();
    assert_eq!(
        (s.objects, s.evictions),
        (1, 2),
        "at the cap, each write evicts"
    );
    assert!(r.tier.contains(&keys[2]));
    r.check_clean();
    drop(r);
    drop(owner);
}

/// Issue 10, defect 5: recovery indexes at most the cap, the objects written last; the others
/// are treated as evicted: their slots are reused (a header overwritten there never brings
/// the old object back), and those not overwritten come back under a larger limit.
#[test]
fn recovery_beyond_the_index_cap_keeps_the_newest_and_reuses_the_rest() {
    let mut r = rig("caprec", "pread");
    let keys = r.keys(14);
    r.store(&keys[..10]);
    assert_eq!(r.tier.persist(&r.storage, &r.namespaces, &keys[..10]), 10);
    let cap4 = index_budget_for(&r, 4);
    let owner = r.dir.take().expect("first rig owns the directory");
    let dir = owner.0.clone();
    drop(r);
    // Run 2: room for 4 entries; keys were written in order, so 6..10 are the newest.
    let r2 = try_open_rig(dir.clone(), Fault::None, |c| c.max_index_bytes = cap4).unwrap();
    let s = r2.tier.status();
    assert_eq!(
        (s.recovered, s.objects, s.unindexed, s.index_max_objects),
        (4, 4, 6, 4)
    );
    assert!(s.index_bytes <= s.index_limit_bytes && s.index_limit_bytes == cap4);
    let keys2 = r2.keys(14);
    let held: Vec<usize> = (0..14).filter(|&i| r2.tier.contains(&keys2[i])).collect();
    assert_eq!(held, [6, 7, 8, 9]);
    r2.check_clean();
    // New objects at the cap evict the least recently used and take the lowest free slots:
    // those of the unindexed keys 0..4.
    r2.store(&keys2[10..]);
    assert_eq!(
        r2.tier.persist(&r2.storage, &r2.namespaces, &keys2[10..]),
        4
    );
    let s = r2.tier.status();
    assert_eq!((s.objects, s.evictions), (4, 4));
    let held: Vec<usize> = (0..14).filter(|&i| r2.tier.contains(&keys2[i])).collect();
    assert_eq!(held, [10, 11, 12, 13]);
    r2.check_clean();
    drop(r2);
    // Run 3, default limit: keys 0..4 were overwritten and stay gone; 4..10 (unindexed or
    // evicted, intact) come back; every object loads with its own bytes.
    let r3 = open_rig(dir, "pread", 1024, Fault::None);
    let keys3 = r3.keys(14);
    let back: Vec<usize> = (0..14).filter(|&i| r3.tier.contains(&keys3[i])).collect();
    assert_eq!(back, (4..14).collect::<Vec<_>>());
    assert_eq!(r3.tier.status().unindexed, 0);
    let l = r3.tier.load(&r3.storage, &keys3[4..], 0, None);
    assert!(l.iter().all(Option::is_some));
    assert!(keys3[4..].iter().all(|k| r3.bytes_ok(k)));
    r3.unlock(&keys3[4..], &l, 0);
    r3.check_clean();
    drop(owner);
}
