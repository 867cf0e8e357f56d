//! Unit tests of the slab allocator (rounding, class selection, all-or-nothing batches, bad
//! frees, coalescing, class limits, odd pools) and a property test against a model.

use super::classes::slab_geometry;
use super::*;
use proptest::prelude::*;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;

fn ok(a: &SlabAllocator, live: &[Slot]) {
    if let Err(e) = a.check(live) {
        panic!("check failed: {e}");
    }
}

/// Small deterministic PRNG (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[test]
fn alignment_and_rounding() {
    let mut a = SlabAllocator::new(256 * MIB);
    let mut live = Vec::new();
    for len in [
        1,
        4095,
        4096,
        4097,
        100_000,
        3 * MIB / 2,
        3 * MIB,
        32 * MIB,
        2 * MIB + 1,
    ] {
        let s = a.allocate(len).unwrap();
        assert_eq!(s.len, len);
        assert_eq!(s.class_bytes, round_up(len));
        assert_eq!(s.offset % ALIGN, 0);
        assert_eq!(s.class_bytes % ALIGN, 0);
        assert!(s.offset + s.class_bytes <= a.capacity());
        if s.class_bytes.is_multiple_of(PAGE) {
            assert_eq!(s.offset % PAGE, 0);
        }
        live.push(s);
        ok(&a, &live);
    }
    let big = a.allocate_batch(32 * MIB, 3).unwrap();
    assert!(big.iter().all(|s| s.offset.is_multiple_of(PAGE)));
}

#[test]
fn class_selection() {
    assert_eq!(slab_geometry(3 * MIB / 2, 1024), (3, 4));
    assert_eq!(slab_geometry(32 * MIB, 1024), (16, 1));
    assert_eq!(slab_geometry(64 * KIB, 1024), (1, 32));
    assert_eq!(slab_geometry(4 * KIB, 1024), (1, 512));
    assert_eq!(slab_geometry(2 * MIB, 1024), (1, 1));
    assert_eq!(slab_geometry(3 * MIB, 1024), (3, 2));
    assert_eq!(slab_geometry(33 * MIB, 1024), (17, 1));
    assert_eq!(slab_geometry(100 * MIB, 1024), (50, 1));
    // 100 KiB: 20 per page, tail 48 KiB = 2.3% < 1/16 -> one page.
    assert_eq!(slab_geometry(100 * KIB, 1024), (1, 20));
    // Small pool: slab pages limited to the pool.
    assert_eq!(slab_geometry(3 * MIB / 2, 2), (1, 1));

    let mut a = SlabAllocator::new(64 * MIB);
    let s = a.allocate_batch(3 * MIB / 2, 4).unwrap();
    assert_eq!(a.class_stats(), vec![(3 * MIB / 2, 4, 1)]);
    let offs: Vec<u64> = s.iter().map(|s| s.offset).collect();
    assert_eq!(offs, vec![0, 3 * MIB / 2, 3 * MIB, 9 * MIB / 2]);
    a.allocate(3 * MIB / 2).unwrap();
    assert_eq!(a.class_stats(), vec![(3 * MIB / 2, 5, 2)]);
    a.allocate_batch(64 * KIB, 33).unwrap();
    assert_eq!(a.class_stats()[0], (64 * KIB, 33, 2));
}

#[test]
fn oom_leaves_state_unchanged() {
    let mut a = SlabAllocator::new(16 * MIB); // 8 pages
    let mut live = a.allocate_batch(3 * MIB / 2, 5).unwrap(); // two 3-page slabs
    live.push(a.allocate(64 * KIB).unwrap()); // page 6
    let before = a.snapshot();
    // 4 MiB class needs 2 pages; only page 7 is free.
    let e = a.allocate(4 * MIB).unwrap_err();
    assert_eq!(
        e,
        AllocError::OutOfMemory {
            requested_bytes: 4 * MIB,
            free_bytes: a.free_bytes()
        }
    );
    assert!(!a.can_allocate(4 * MIB, 1));
    assert_eq!(a.snapshot(), before);
    ok(&a, &live);
    assert!(a.allocate_batch(64 * KIB, 64).is_err());
    assert_eq!(a.snapshot(), before);
    // Exactly what is left of this class still fits: 31 in page 6 + 32 in page 7.
    assert!(a.can_allocate(64 * KIB, 63));
    live.extend(a.allocate_batch(64 * KIB, 63).unwrap());
    ok(&a, &live);
}

#[test]
fn batch_all_or_nothing() {
    let mut a = SlabAllocator::new(64 * MIB); // 32 pages
    let mut live = a.allocate_batch(3 * MIB / 2, 20).unwrap(); // 5 slabs = 15 pages
    ok(&a, &live);
    let before = a.snapshot();
    // 17 pages left: 5 more slabs of 4 -> 20 objects fit, 21 would not.
    assert!(!a.can_allocate(3 * MIB / 2, 21));
    assert!(matches!(
        a.allocate_batch(3 * MIB / 2, 21),
        Err(AllocError::OutOfMemory { .. })
    ));
    assert_eq!(a.snapshot(), before);
    assert!(matches!(
        a.allocate_batch(4096, usize::MAX),
        Err(AllocError::OutOfMemory { .. })
    ));
    assert_eq!(a.snapshot(), before);
    assert_eq!(a.allocate_batch(3 * MIB / 2, 0).unwrap(), vec![]);
    assert_eq!(a.allocate_batch(0, 0), Err(AllocError::ZeroLength));
    assert_eq!(a.snapshot(), before);
    let more = a.allocate_batch(3 * MIB / 2, 20).unwrap();
    assert_eq!(more.len(), 20);
    live.extend(more);
    ok(&a, &live);
}

#[test]
fn bad_frees_rejected() {
    let mut a = SlabAllocator::new(64 * MIB);
    let s = a.allocate_batch(3 * MIB / 2, 2).unwrap();
    let before = a.snapshot();
    let na = |offset| Err(AllocError::NotAllocated { offset });
    let cases = [
        Slot {
            offset: s[0].offset + ALIGN,
            ..s[0]
        }, // inside an object
        Slot {
            offset: 3 * MIB,
            ..s[0]
        }, // boundary, never allocated
        Slot {
            offset: 6 * MIB - 4096,
            ..s[0]
        }, // slab tail area
        Slot {
            offset: 40 * MIB,
            ..s[0]
        }, // free page
        Slot {
            offset: u64::MAX - 4095,
            ..s[0]
        }, // beyond pool
        Slot {
            class_bytes: 2 * MIB,
            len: 2 * MIB,
            ..s[0]
        }, // wrong class
        Slot { len: 0, ..s[0] },   // bogus len
        Slot { len: MIB, ..s[0] }, // len of another class
        Slot {
            len: 2 * MIB,
            ..s[0]
        }, // len > class
    ];
    for c in cases {
        assert_eq!(a.free(c), na(c.offset), "{c:?}");
        assert_eq!(a.snapshot(), before);
    }
    a.free(s[0]).unwrap();
    let after = a.snapshot();
    assert_eq!(a.free(s[0]), na(s[0].offset)); // double free
    assert_eq!(a.snapshot(), after);
    ok(&a, &s[1..]);
    a.free(s[1]).unwrap();
    assert_eq!(a.free(s[1]), na(s[1].offset)); // double free of cached slab's object
    ok(&a, &[]);
}

#[test]
fn fully_freed_pool_coalesces() {
    let mut a = SlabAllocator::new(128 * MIB);
    let mut live = Vec::new();
    let sizes = [64 * KIB, 3 * MIB / 2, 5 * MIB, 4096];
    let mut i = 0;
    let mut fails = 0;
    while fails < sizes.len() {
        match a.allocate(sizes[i % sizes.len()]) {
            Ok(s) => {
                live.push(s);
                fails = 0;
            }
            Err(AllocError::OutOfMemory { .. }) => fails += 1,
            Err(e) => panic!("{e}"),
        }
        i += 1;
    }
    ok(&a, &live);
    let mut rng = Rng(7);
    while !live.is_empty() {
        let k = (rng.next() % live.len() as u64) as usize;
        a.free(live.swap_remove(k)).unwrap();
    }
    ok(&a, &[]);
    assert_eq!(a.allocated_bytes(), 0);
    assert_eq!(a.live_slots(), 0);
    assert_eq!(a.free_bytes(), a.capacity());
    // Cached empty slabs are handed back when needed: a max-size object fits.
    let all = a.allocate(a.capacity()).unwrap();
    assert_eq!(all.offset, 0);
    ok(&a, &[all]);
    a.free(all).unwrap();
    a.release_all_cached();
    ok(&a, &[]);
    assert_eq!(a.runs, BTreeMap::from([(0, 64)]));
    assert!(a.class_stats().is_empty());
}

#[test]
fn too_many_classes() {
    let mut a = SlabAllocator::new(1024 * MIB);
    let mut live = Vec::new();
    for k in 1..=MAX_SIZE_CLASSES as u64 {
        live.push(a.allocate(k * 4096).unwrap());
    }
    let before = a.snapshot();
    let e = a.allocate(65 * 4096).unwrap_err();
    assert_eq!(
        e,
        AllocError::TooManyClasses {
            limit: MAX_SIZE_CLASSES
        }
    );
    assert!(!a.can_allocate(65 * 4096, 1));
    assert_eq!(a.snapshot(), before);
    // Existing classes still work.
    live.push(a.allocate(4096).unwrap());
    // A class with no live slots is evicted for a new one.
    let s = live.remove(9); // 10 * 4096
    a.free(s).unwrap();
    assert_eq!(a.class_stats().len(), MAX_SIZE_CLASSES);
    live.push(a.allocate(65 * 4096).unwrap());
    assert_eq!(a.class_stats().len(), MAX_SIZE_CLASSES);
    assert!(a.class_stats().iter().all(|c| c.0 != 10 * 4096));
    ok(&a, &live);
}

#[test]
fn zero_and_too_large() {
    let mut a = SlabAllocator::new(64 * MIB);
    assert_eq!(a.allocate(0), Err(AllocError::ZeroLength));
    assert_eq!(a.allocate_batch(0, 3), Err(AllocError::ZeroLength));
    let tl = |len| {
        Err(AllocError::TooLarge {
            len,
            pool_bytes: 64 * MIB,
        })
    };
    assert_eq!(a.allocate(64 * MIB + 1), tl(64 * MIB + 1));
    assert_eq!(a.allocate(u64::MAX), tl(u64::MAX));
    assert_eq!(
        a.allocate_batch(u64::MAX, usize::MAX).err(),
        tl(u64::MAX).err()
    );
    assert!(!a.can_allocate(u64::MAX, 1));
    assert!(a.can_allocate(64 * MIB, 1));
    assert!(!a.can_allocate(64 * MIB, 2));
    ok(&a, &[]);
    assert!(!AllocError::ZeroLength.to_string().is_empty());
}

#[test]
fn tiny_and_odd_pools() {
    for bytes in [0, 1, 4096, PAGE - 1] {
        let mut a = SlabAllocator::new(bytes);
        assert_eq!(a.capacity(), 0);
        assert_eq!(a.free_bytes(), 0);
        assert_eq!(
            a.allocate(1),
            Err(AllocError::TooLarge {
                len: 1,
                pool_bytes: 0
            })
        );
        assert_eq!(a.allocate(0), Err(AllocError::ZeroLength));
        let bogus = Slot {
            offset: 0,
            len: 4096,
            class_bytes: 4096,
        };
        assert_eq!(a.free(bogus), Err(AllocError::NotAllocated { offset: 0 }));
        ok(&a, &[]);
    }
    let mut a = SlabAllocator::new(PAGE);
    let s = a.allocate(PAGE).unwrap();
    assert_eq!(
        a.allocate(1),
        Err(AllocError::OutOfMemory {
            requested_bytes: 4096,
            free_bytes: 0
        })
    );
    a.free(s).unwrap();
    // The 2 MiB class's cached slab is reclaimed for a new class.
    let t = a.allocate(1).unwrap();
    ok(&a, &[t]);
    assert_eq!(SlabAllocator::new(3 * PAGE + 5).capacity(), 3 * PAGE);
    // 1.5 MiB in a 2-page pool uses 1-page slabs.
    let mut b = SlabAllocator::new(2 * PAGE);
    let v = b.allocate_batch(3 * MIB / 2, 2).unwrap();
    ok(&b, &v);
    // Absurd pool sizes are clamped, and nothing is allocated up front.
    let mut c = SlabAllocator::new(u64::MAX);
    assert_eq!(c.capacity(), MAX_POOL_BYTES);
    let x = c.allocate(64 << 30).unwrap();
    let y = c.allocate(4096).unwrap();
    assert!(y.offset >= x.offset + x.class_bytes);
    c.free(x).unwrap();
    c.free(y).unwrap();
}

#[test]
fn freed_class_pages_are_reused_by_another_class() {
    let mut a = SlabAllocator::new(256 * MIB);
    let (ca, cb, cc) = (64 * KIB, 3 * MIB / 2, 3 * MIB);
    let sizes = [ca, cb, cc];
    let mut live = Vec::new();
    let mut i = 0;
    let mut fails = 0;
    while fails < 3 {
        match a.allocate(sizes[i % 3]) {
            Ok(s) => {
                live.push(s);
                fails = 0;
            }
            Err(_) => fails += 1,
        }
        i += 1;
    }
    ok(&a, &live);
    // Free a random half.
    let mut rng = Rng(42);
    for _ in 0..live.len() / 2 {
        let k = (rng.next() % live.len() as u64) as usize;
        a.free(live.swap_remove(k)).unwrap();
    }
    ok(&a, &live);
    // Free everything of class B.
    let b_pages: BTreeSet<u64> = a
        .slabs
        .iter()
        .flatten()
        .filter(|s| a.class(s.class).is_some_and(|c| c.class_bytes == cb))
        .flat_map(|s| s.start_page..s.start_page + s.pages)
        .collect();
    assert!(!b_pages.is_empty());
    let (b, rest): (Vec<Slot>, Vec<Slot>) = live.into_iter().partition(|s| s.class_bytes == cb);
    live = rest;
    for s in b {
        a.free(s).unwrap();
    }
    ok(&a, &live);
    // Fill with class C (same 3-page slab size), then class A.
    for class in [cc, ca] {
        while let Ok(s) = a.allocate(class) {
            live.push(s);
        }
        ok(&a, &live);
    }
    // Every page that class B held now belongs to another class, and B is gone.
    for p in &b_pages {
        let sid = a.owner_of(*p).expect("page left unused");
        let c = a.class(a.slab(sid).unwrap().class).unwrap();
        assert_ne!(c.class_bytes, cb);
    }
    assert!(a.class_stats().iter().all(|c| c.0 != cb));
    assert!(a.runs.is_empty());
    // Neither class has slab tails and both ran out of free slots, so the
    // pool is completely used: nothing stayed stranded in B's old slabs.
    assert_eq!(a.free_bytes(), 0);
}

// ----- property test --------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        class: usize,
        shave: u64,
    },
    Batch {
        class: usize,
        count: usize,
    },
    Free {
        pick: usize,
    },
    Bogus {
        pick: usize,
        kind: u8,
        page: u64,
        obj: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..4, 0u64..4096).prop_map(|(class, shave)| Op::Alloc { class, shave }),
        2 => (0usize..4, 0usize..12).prop_map(|(class, count)| Op::Batch { class, count }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => (any::<usize>(), 0u8..5, 0u64..80, 0u64..40)
            .prop_map(|(pick, kind, page, obj)| Op::Bogus { pick, kind, page, obj }),
    ]
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(64 * KIB),
        Just(3 * MIB / 2),
        Just(2 * MIB),
        Just(3 * MIB),
        Just(32 * MIB),
        4096u64..=(12 * MIB),
    ]
}

fn assert_model(a: &SlabAllocator, model: &[Slot]) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.check(model), Ok(()));
    let sum: u64 = model.iter().map(|s| s.class_bytes).sum();
    prop_assert_eq!(a.allocated_bytes(), sum);
    prop_assert_eq!(a.free_bytes(), a.capacity() - sum);
    prop_assert_eq!(a.live_slots(), model.len());
    let mut v = model.to_vec();
    v.sort_by_key(|s| s.offset);
    for w in v.windows(2) {
        prop_assert!(
            w[0].offset + w[0].class_bytes <= w[1].offset,
            "overlap {:?}",
            w
        );
    }
    for s in &v {
        prop_assert!(s.offset.is_multiple_of(ALIGN) && s.len <= s.class_bytes);
        prop_assert!(s.offset + s.class_bytes <= a.capacity());
    }
    Ok(())
}

fn check_new(
    a: &SlabAllocator,
    model: &[Slot],
    new: &[Slot],
    len: u64,
) -> Result<(), TestCaseError> {
    for s in new {
        prop_assert_eq!(s.len, len);
        prop_assert_eq!(s.class_bytes, round_up(len));
        prop_assert!(s.offset + s.class_bytes <= a.capacity());
        for m in model {
            prop_assert!(
                s.offset + s.class_bytes <= m.offset || m.offset + m.class_bytes <= s.offset,
                "new {:?} overlaps live {:?}",
                s,
                m
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn random_ops_match_model(
        pool_pages in 32u64..=64,
        sizes in prop::collection::vec(size(), 2..=4),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut a = SlabAllocator::new(pool_pages * PAGE);
        let mut model: Vec<Slot> = Vec::new();
        let mut dead: Vec<Slot> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc { class, shave } => {
                    let len = (sizes[class % sizes.len()] - shave).max(1);
                    let can = a.can_allocate(len, 1);
                    let before = a.snapshot();
                    match a.allocate(len) {
                        Ok(s) => {
                            prop_assert!(can);
                            check_new(&a, &model, &[s], len)?;
                            model.push(s);
                        }
                        Err(e) => {
                            prop_assert!(!can);
                            prop_assert!(matches!(e, AllocError::OutOfMemory { .. }), "{:?}", e);
                            prop_assert_eq!(a.snapshot(), before);
                            // An empty pool always has room for one object.
                            prop_assert!(!model.is_empty());
                        }
                    }
                }
                Op::Batch { class, count } => {
                    let len = sizes[class % sizes.len()];
                    let can = a.can_allocate(len, count);
                    let before = a.snapshot();
                    match a.allocate_batch(len, count) {
                        Ok(v) => {
                            prop_assert!(can);
                            prop_assert_eq!(v.len(), count);
                            check_new(&a, &model, &v, len)?;
                            let mut offs: Vec<u64> = v.iter().map(|s| s.offset).collect();
                            offs.sort_unstable();
                            offs.dedup();
                            prop_assert_eq!(offs.len(), count);
                            model.extend(v);
                        }
                        Err(e) => {
                            prop_assert!(!can);
                            prop_assert!(matches!(e, AllocError::OutOfMemory { .. }), "{:?}", e);
                            prop_assert_eq!(a.snapshot(), before);
                        }
                    }
                }
                Op::Free { pick } => {
                    if !model.is_empty() {
                        let s = model.swap_remove(pick % model.len());
                        prop_assert_eq!(a.free(s), Ok(()));
                        dead.push(s);
                    }
                }
                Op::Bogus { pick, kind, page, obj } => {
                    let base = if model.is_empty() || kind == 0 {
                        dead.get(pick % dead.len().max(1)).copied()
                    } else {
                        Some(model[pick % model.len()])
                    };
                    let cand = match (kind, base) {
                        (1, Some(b)) => Slot { offset: b.offset + ALIGN, ..b },
                        (2, Some(b)) => Slot { class_bytes: b.class_bytes + ALIGN, len: b.class_bytes + ALIGN, ..b },
                        (3, Some(b)) => Slot { offset: b.offset + b.class_bytes, ..b },
                        (_, Some(b)) if kind == 0 => b,
                        (_, b) => {
                            let cb = b.map_or(64 * KIB, |b| b.class_bytes);
                            Slot { offset: page * PAGE + obj * cb, len: cb, class_bytes: cb }
                        }
                    };
                    let before = a.snapshot();
                    let res = a.free(cand);
                    let pos = model.iter().position(|m| {
                        m.offset == cand.offset
                            && m.class_bytes == cand.class_bytes
                            && cand.len > 0
                            && cand.len <= cand.class_bytes
                            && cand.len > cand.class_bytes - ALIGN
                    });
                    match pos {
                        Some(i) => {
                            prop_assert_eq!(res, Ok(()));
                            dead.push(model.swap_remove(i));
                        }
                        None => {
                            prop_assert_eq!(res, Err(AllocError::NotAllocated { offset: cand.offset }));
                            prop_assert_eq!(a.snapshot(), before);
                        }
                    }
                }
            }
            assert_model(&a, &model)?;
        }
        for s in model.drain(..) {
            prop_assert_eq!(a.free(s), Ok(()));
        }
        assert_model(&a, &model)?;
        prop_assert_eq!(a.allocated_bytes(), 0);
        prop_assert!(a.can_allocate(a.capacity(), 1));
        a.release_all_cached();
        prop_assert_eq!(a.check(&[]), Ok(()));
        prop_assert_eq!(a.runs.len(), 1);
    }
}
