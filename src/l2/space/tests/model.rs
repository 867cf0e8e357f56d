//! The index against a model: proptest operation sequences and seeded random runs, with and
//! without an entry cap, checking every reservation's victim and the summaries.

use super::*;

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
