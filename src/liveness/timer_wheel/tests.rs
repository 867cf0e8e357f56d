//! Unit tests of the timer wheel (ordering, ties, cancel and reschedule, stale ids, overflow and
//! huge jumps, capacity, the reaper's refresh pattern) and a property test against a model.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};

/// Small deterministic PRNG (xorshift64*), so tests need no extra crates.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn check(w: &TimerWheel<u32>) {
    if let Err(e) = w.check_invariants() {
        panic!("invariant violated: {e}");
    }
}

fn advance(w: &mut TimerWheel<u32>, now: u64) -> Vec<(TimerId, u64, u32)> {
    let mut out = Vec::new();
    w.advance(now, &mut out);
    check(w);
    out
}

#[test]
fn ordering_random_deadlines_random_steps() {
    for seed in 1..=20u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let start = rng.below(1 << 40);
        let mut w = TimerWheel::new(start, 10_000);
        // item = insertion order; deadline per item.
        let mut deadlines = Vec::new();
        for i in 0..2_000u32 {
            let d = match rng.below(4) {
                0 => start + rng.below(64),
                1 => start + rng.below(5_000),
                2 => start + rng.below(1 << 20),
                _ => start.saturating_sub(rng.below(10)),
            };
            w.insert(d, i).unwrap();
            deadlines.push(d);
        }
        check(&w);
        let mut fired = vec![false; deadlines.len()];
        let mut now = start;
        while !w.is_empty() {
            let step = match rng.below(3) {
                0 => rng.below(3),
                1 => rng.below(200),
                _ => rng.below(1 << 16),
            };
            let prev = now;
            now += step;
            assert_eq!(
                w.next_deadline(),
                deadlines
                    .iter()
                    .zip(&fired)
                    .filter(|(_, f)| !**f)
                    .map(|(d, _)| *d)
                    .min()
            );
            let batch = advance(&mut w, now);
            for pair in batch.windows(2) {
                assert!(
                    (pair[0].1, pair[0].2) < (pair[1].1, pair[1].2),
                    "batch not sorted: {pair:?}"
                );
            }
            for (id, d, item) in &batch {
                let i = *item as usize;
                assert!(!fired[i], "fired twice");
                fired[i] = true;
                assert_eq!(*d, deadlines[i]);
                assert!(*d <= now);
                // First advance with now >= deadline: previous now was earlier,
                // unless it was already due at insert time (fires on first advance).
                assert!(*d > prev || *d <= start, "fired late: d={d} prev={prev}");
                assert_eq!(w.deadline(*id), None);
            }
            // Nothing left that should have fired.
            for (i, d) in deadlines.iter().enumerate() {
                assert_eq!(fired[i], *d <= now, "timer {i} d={d} now={now}");
            }
        }
        assert!(fired.iter().all(|f| *f));
    }
}

#[test]
fn ties_fire_in_insertion_order() {
    let mut w = TimerWheel::new(0, 100);
    let a = w.insert(500, 1).unwrap();
    let _b = w.insert(500, 2).unwrap();
    let _c = w.insert(100, 3).unwrap();
    let _d = w.insert(500, 4).unwrap();
    // Rescheduling keeps a's place in insertion order.
    assert!(w.reschedule(a, 700));
    assert!(w.reschedule(a, 500));
    let out = advance(&mut w, 1_000);
    let items: Vec<u32> = out.iter().map(|e| e.2).collect();
    assert_eq!(items, vec![3, 1, 2, 4]);
}

#[test]
fn cancel_and_reschedule_before_firing() {
    let mut w = TimerWheel::new(10, 100);
    let a = w.insert(20, 1).unwrap();
    let b = w.insert(5_000, 2).unwrap();
    let c = w.insert(30, 3).unwrap();
    check(&w);
    assert_eq!(w.cancel(a), Some(1));
    assert_eq!(w.cancel(a), None);
    assert!(!w.reschedule(a, 40));
    assert_eq!(w.deadline(a), None);
    assert!(w.reschedule(b, 25));
    assert_eq!(w.deadline(b), Some(25));
    assert!(w.reschedule(c, 9)); // already due
    assert_eq!(w.next_deadline(), Some(9));
    check(&w);
    let out = advance(&mut w, 10);
    assert_eq!(out, vec![(c, 9, 3)]);
    assert_eq!(advance(&mut w, 24), vec![]);
    assert_eq!(advance(&mut w, 25), vec![(b, 25, 2)]);
    assert!(w.is_empty());
    assert_eq!(w.next_deadline(), None);
}

#[test]
fn stale_ids_rejected_after_fire_cancel_and_slot_reuse() {
    let mut w = TimerWheel::new(0, 4);
    let a = w.insert(5, 1).unwrap();
    assert_eq!(advance(&mut w, 5).len(), 1);
    // a fired; its slab entry is reused by b.
    let b = w.insert(7, 2).unwrap();
    assert_ne!(a, b);
    assert_eq!(w.cancel(a), None);
    assert!(!w.reschedule(a, 100));
    assert_eq!(w.deadline(a), None);
    assert_eq!(w.deadline(b), Some(7));
    // b cancelled, its entry reused by c; b must not touch c.
    assert_eq!(w.cancel(b), Some(2));
    let c = w.insert(9, 3).unwrap();
    assert_eq!(w.cancel(b), None);
    assert!(!w.reschedule(b, 1));
    assert_eq!(w.deadline(c), Some(9));
    // Foreign / garbage id.
    let bogus = TimerId {
        index: usize::MAX,
        generation: 0,
    };
    assert_eq!(w.cancel(bogus), None);
    assert!(!w.reschedule(bogus, 3));
    check(&w);
    // Ids are unique across many reuses.
    let mut ids = HashSet::new();
    ids.insert(a);
    ids.insert(b);
    ids.insert(c);
    for i in 0..1_000 {
        let id = w.insert(w.now() + 1 + (i % 3), i as u32).unwrap();
        assert!(ids.insert(id), "id reused");
        if i % 2 == 0 {
            w.cancel(id);
        } else {
            let now = w.now() + 5;
            advance(&mut w, now);
        }
    }
}

#[test]
fn retired_generation_never_reused() {
    let mut w: TimerWheel<u32> = TimerWheel::new(0, 4);
    let a = w.insert(5, 1).unwrap();
    w.slab[a.index].generation = u64::MAX - 1;
    let a = TimerId {
        index: a.index,
        generation: u64::MAX - 1,
    };
    assert_eq!(w.cancel(a), Some(1));
    check(&w);
    let b = w.insert(5, 2).unwrap();
    assert_ne!(b.index, a.index, "retired entry was reused");
    check(&w);
}

#[test]
fn refresh_pattern_fires_once_at_last_deadline() {
    let mut w = TimerWheel::new(0, 10);
    let id = w.insert(50, 7).unwrap();
    let mut deadline = 50;
    for now in (0..10_000).step_by(10) {
        assert!(advance(&mut w, now).is_empty(), "fired early at {now}");
        deadline = now + 50;
        assert!(w.reschedule(id, deadline));
        assert_eq!(w.deadline(id), Some(deadline));
    }
    assert!(advance(&mut w, deadline - 1).is_empty());
    assert_eq!(advance(&mut w, deadline + 1_000), vec![(id, deadline, 7)]);
    assert!(advance(&mut w, u64::MAX).is_empty());
    assert!(!w.reschedule(id, 1));
}

#[test]
fn far_deadlines_overflow_and_huge_jumps() {
    let mut w = TimerWheel::new(0, 100);
    let ds = [
        u64::MAX,
        u64::MAX - 1,
        u64::MAX - 64,
        1u64 << 36,
        (1u64 << 36) - 1,
        (1u64 << 40) + 5,
        1_000_000_000_000,
        1_000_000_000_001,
        3,
        1u64 << 63,
    ];
    let ids: Vec<TimerId> = ds
        .iter()
        .enumerate()
        .map(|(i, d)| w.insert(*d, i as u32).unwrap())
        .collect();
    check(&w);
    assert_eq!(w.next_deadline(), Some(3));
    let out = advance(&mut w, 1_000_000_000_000);
    let got: Vec<u64> = out.iter().map(|e| e.1).collect();
    assert_eq!(got, vec![3, (1 << 36) - 1, 1 << 36, 1_000_000_000_000]);
    assert_eq!(w.now(), 1_000_000_000_000);
    assert_eq!(w.next_deadline(), Some(1_000_000_000_001));
    assert_eq!(w.deadline(ids[9]), Some(1 << 63));
    let out = advance(&mut w, u64::MAX - 2);
    let got: Vec<u64> = out.iter().map(|e| e.1).collect();
    assert_eq!(
        got,
        vec![1_000_000_000_001, (1 << 40) + 5, 1 << 63, u64::MAX - 64]
    );
    assert_eq!(w.next_deadline(), Some(u64::MAX - 1));
    let out = advance(&mut w, u64::MAX);
    let got: Vec<u64> = out.iter().map(|e| e.1).collect();
    assert_eq!(got, vec![u64::MAX - 1, u64::MAX]);
    assert!(w.is_empty());
    // At the end of time, everything is due immediately.
    let id = w.insert(u64::MAX, 1).unwrap();
    assert_eq!(advance(&mut w, u64::MAX), vec![(id, u64::MAX, 1)]);
    // Rescheduling into and out of the overflow list.
    let mut w = TimerWheel::new(5, 10);
    let id = w.insert(6, 1).unwrap();
    assert!(w.reschedule(id, u64::MAX));
    check(&w);
    assert!(w.reschedule(id, 1 << 37));
    assert!(w.reschedule(id, 70));
    check(&w);
    assert_eq!(advance(&mut w, 70), vec![(id, 70, 1)]);
}

#[test]
fn huge_jump_with_many_timers_is_fast() {
    let mut w = TimerWheel::new(0, 1 << 16);
    let mut rng = Rng(42);
    for i in 0..10_000u32 {
        w.insert(rng.next(), i).unwrap();
    }
    let t = std::time::Instant::now();
    let mut now = 0u64;
    let mut fired = 0;
    for _ in 0..64 {
        now = now.saturating_add(u64::MAX / 64);
        fired += advance(&mut w, now).len();
    }
    fired += advance(&mut w, u64::MAX).len();
    assert_eq!(fired, 10_000);
    assert!(t.elapsed() < std::time::Duration::from_secs(20));
}

#[test]
fn starts_near_end_of_time() {
    let mut w = TimerWheel::new(u64::MAX - 10, 10);
    let a = w.insert(u64::MAX, 1).unwrap();
    let b = w.insert(u64::MAX - 5, 2).unwrap();
    let c = w.insert(0, 3).unwrap();
    check(&w);
    assert_eq!(w.next_deadline(), Some(0));
    assert_eq!(advance(&mut w, u64::MAX - 10), vec![(c, 0, 3)]);
    assert_eq!(advance(&mut w, u64::MAX - 5), vec![(b, u64::MAX - 5, 2)]);
    assert_eq!(advance(&mut w, u64::MAX), vec![(a, u64::MAX, 1)]);
}

#[test]
fn advance_backwards_is_noop() {
    let mut w = TimerWheel::new(100, 10);
    let a = w.insert(50, 1).unwrap();
    assert!(advance(&mut w, 10).is_empty());
    assert_eq!(w.now(), 100);
    assert_eq!(w.deadline(a), Some(50));
    assert_eq!(advance(&mut w, 100), vec![(a, 50, 1)]);
}

#[test]
fn capacity_limit_enforced() {
    let mut w = TimerWheel::new(0, 3);
    let a = w.insert(1, 1).unwrap();
    w.insert(2, 2).unwrap();
    w.insert(3, 3).unwrap();
    let err = w.insert(4, 4).unwrap_err();
    assert_eq!(
        err,
        WheelFull {
            capacity: 3,
            item: 4
        }
    );
    assert_eq!(err.to_string(), "timer wheel full (3 live timers)");
    assert_eq!(err.into_inner(), 4);
    assert_eq!(w.len(), 3);
    check(&w);
    w.cancel(a);
    let d = w.insert(4, 4).unwrap();
    assert_eq!(w.insert(5, 5).unwrap_err().item, 5);
    assert_eq!(advance(&mut w, 2).len(), 1);
    w.insert(5, 5).unwrap();
    assert_eq!(w.len(), 3);
    assert_eq!(w.deadline(d), Some(4));

    let mut z: TimerWheel<u32> = TimerWheel::new(0, 0);
    assert_eq!(z.insert(1, 9).unwrap_err().item, 9);
    assert!(z.is_empty());
    let big: TimerWheel<u32> = TimerWheel::new(0, usize::MAX);
    assert_eq!(big.capacity(), usize::MAX);
}

#[test]
fn liveness_reaper_pattern() {
    // tick = 100 ms; instances heartbeat at various periods; TTL 30 ticks.
    const TTL: u64 = 30;
    let mut w = TimerWheel::new(0, 64);
    let mut last_seen = [0u64; 16];
    let period: Vec<u64> = (0..16).map(|i| if i < 12 { 10 } else { 1_000 }).collect();
    for i in 0..16u32 {
        w.insert(TTL, i).unwrap();
    }
    let mut reaped = Vec::new();
    let mut out = Vec::new();
    for now in 1..=200u64 {
        for (i, seen) in last_seen.iter_mut().enumerate() {
            if now % period[i] == 0 && !reaped.contains(&i) {
                *seen = now;
            }
        }
        out.clear();
        w.advance(now, &mut out);
        for (_, _, inst) in out.drain(..) {
            let i = inst as usize;
            let due = last_seen[i] + TTL;
            if due <= now {
                reaped.push(i);
            } else {
                w.insert(due, inst).unwrap();
            }
        }
        check(&w);
    }
    reaped.sort_unstable();
    assert_eq!(reaped, vec![12, 13, 14, 15]);
    assert_eq!(w.len(), 12);
}

// ----- model-based property test -----

#[derive(Debug, Clone)]
enum Op {
    Insert {
        kind: u8,
        raw: u64,
    },
    Cancel {
        pick: usize,
        stale: bool,
    },
    Reschedule {
        pick: usize,
        stale: bool,
        kind: u8,
        raw: u64,
    },
    Advance {
        kind: u8,
        raw: u64,
    },
    Backwards {
        raw: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<u8>(), any::<u64>()).prop_map(|(kind, raw)| Op::Insert { kind, raw }),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(pick, stale)| Op::Cancel { pick, stale }),
        2 => (any::<usize>(), any::<bool>(), any::<u8>(), any::<u64>())
            .prop_map(|(pick, stale, kind, raw)| Op::Reschedule { pick, stale, kind, raw }),
        3 => (any::<u8>(), any::<u64>()).prop_map(|(kind, raw)| Op::Advance { kind, raw }),
        1 => any::<u64>().prop_map(|raw| Op::Backwards { raw }),
    ]
}

fn pick_deadline(now: u64, kind: u8, raw: u64) -> u64 {
    match kind % 7 {
        0 => now.saturating_add(raw % 70),
        1 => now.saturating_add(raw % 5_000),
        2 => now.saturating_sub(raw % 10),
        3 => now.saturating_add(raw % (1 << 38)),
        4 => u64::MAX - raw % 100,
        5 => raw,
        _ => block_start(now)
            .saturating_add(1 << 36)
            .saturating_add(raw % 200),
    }
}

fn pick_advance(now: u64, kind: u8, raw: u64) -> u64 {
    match kind % 6 {
        0 => now,
        1 => now.saturating_add(raw % 70),
        2 => now.saturating_add(raw % 10_000),
        3 => now.saturating_add(raw % (1 << 40)),
        4 => now.saturating_add(raw),
        _ => u64::MAX - raw % 50,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn matches_btreemap_model(
        start_kind in 0u8..3,
        start_raw in any::<u64>(),
        capacity in 0usize..40,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let start = match start_kind {
            0 => start_raw % 1_000,
            1 => start_raw,
            _ => u64::MAX - start_raw % 1_000,
        };
        let mut w: TimerWheel<u32> = TimerWheel::new(start, capacity);
        // model: id -> (deadline, insertion seq, item)
        let mut model: BTreeMap<TimerId, (u64, u64, u32)> = BTreeMap::new();
        let mut now = start;
        let mut seq = 0u64;
        let mut dead: Vec<TimerId> = Vec::new();
        let mut all_ids: HashSet<TimerId> = HashSet::new();
        let mut next_item = 0u32;
        for op in ops {
            match op {
                Op::Insert { kind, raw } => {
                    let d = pick_deadline(now, kind, raw);
                    let item = next_item;
                    next_item += 1;
                    match w.insert(d, item) {
                        Ok(id) => {
                            prop_assert!(model.len() < capacity);
                            prop_assert!(all_ids.insert(id), "duplicate id");
                            model.insert(id, (d, seq, item));
                            seq += 1;
                        }
                        Err(e) => {
                            prop_assert_eq!(model.len(), capacity);
                            prop_assert_eq!(e, WheelFull { capacity, item });
                        }
                    }
                }
                Op::Cancel { pick, stale } => {
                    if stale || model.is_empty() {
                        if !dead.is_empty() {
                            let id = dead[pick % dead.len()];
                            prop_assert_eq!(w.cancel(id), None);
                        }
                    } else {
                        let id = *model.keys().nth(pick % model.len()).unwrap();
                        let (_, _, item) = model.remove(&id).unwrap();
                        prop_assert_eq!(w.cancel(id), Some(item));
                        dead.push(id);
                    }
                }
                Op::Reschedule { pick, stale, kind, raw } => {
                    let d = pick_deadline(now, kind, raw);
                    if stale || model.is_empty() {
                        if !dead.is_empty() {
                            let id = dead[pick % dead.len()];
                            prop_assert!(!w.reschedule(id, d));
                            prop_assert_eq!(w.deadline(id), None);
                        }
                    } else {
                        let id = *model.keys().nth(pick % model.len()).unwrap();
                        prop_assert!(w.reschedule(id, d));
                        model.get_mut(&id).unwrap().0 = d;
                    }
                }
                Op::Advance { kind, raw } => {
                    let target = pick_advance(now, kind, raw);
                    let mut out = vec![(TimerId { index: 0, generation: 0 }, 0, u32::MAX)];
                    w.advance(target, &mut out);
                    // A target behind `now` is a no-op: nothing fires.
                    let mut want: Vec<(u64, u64, TimerId, u32)> = model
                        .iter()
                        .filter(|(_, v)| target >= now && v.0 <= target)
                        .map(|(id, v)| (v.0, v.1, *id, v.2))
                        .collect();
                    want.sort();
                    let want: Vec<(TimerId, u64, u32)> =
                        want.into_iter().map(|(d, _, id, item)| (id, d, item)).collect();
                    prop_assert_eq!(out[0].2, u32::MAX, "existing entries disturbed");
                    prop_assert_eq!(&out[1..], &want[..]);
                    for (id, _, _) in &want {
                        model.remove(id);
                        dead.push(*id);
                    }
                    now = now.max(target);
                }
                Op::Backwards { raw } => {
                    let target = now.saturating_sub(1 + raw % 1_000);
                    if target < now {
                        let mut out = Vec::new();
                        w.advance(target, &mut out);
                        prop_assert!(out.is_empty());
                    }
                }
            }
            if let Err(e) = w.check_invariants() {
                prop_assert!(false, "invariant: {}", e);
            }
            prop_assert_eq!(w.now(), now);
            prop_assert_eq!(w.len(), model.len());
            prop_assert_eq!(w.is_empty(), model.is_empty());
            prop_assert_eq!(w.next_deadline(), model.values().map(|v| v.0).min());
            for (id, v) in &model {
                prop_assert_eq!(w.deadline(*id), Some(v.0));
            }
        }
    }
}
