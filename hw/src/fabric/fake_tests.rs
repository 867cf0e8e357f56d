//! Tests of [`FakeFabric`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::{PagePreference, PoolOptions, SharedPool};

const MIB: u64 = 1 << 20;
const POOL: u64 = 4 * MIB;

fn pool() -> Arc<SharedPool> {
    Arc::new(
        SharedPool::create(&PoolOptions {
            bytes: POOL,
            prefer: PagePreference::Pages4K,
            prefault: false,
            name: "kvnode-fabric-test".into(),
            ..PoolOptions::default()
        })
        .expect("pool"),
    )
}

fn quiet() -> FakeOptions {
    FakeOptions {
        delay_ms: (0, 0),
        reorder: false,
        ..FakeOptions::default()
    }
}

fn setup(opts: FakeOptions) -> (Arc<SharedPool>, FakeFabric) {
    let p = pool();
    let f = FakeFabric::new(opts, p.clone()).expect("fabric");
    let regions = f.register(&p).expect("register");
    assert!(!regions.is_empty());
    assert_eq!(f.register(&p).expect("again"), regions, "idempotent");
    (p, f)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A peer with region rkey 7 at 0x10000 holding `pattern(1, 64 KiB)` and a zeroed region rkey 9
/// at 0x80000 of 64 KiB.
fn peer() -> FakePeer {
    FakePeer {
        regions: vec![
            FakeRegion {
                addr: 0x10000,
                rkey: 7,
                bytes: pattern(1, 65536),
            },
            FakeRegion {
                addr: 0x80000,
                rkey: 9,
                bytes: vec![0; 65536],
            },
        ],
    }
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

fn item(offset: u64, len: u64, addr: u64, rkey: u32) -> WorkItem {
    WorkItem {
        local: LocalRange { offset, len },
        remote: RemoteSeg::Rdma { addr, rkey },
    }
}

fn batch(op: u64, conn: ConnId, dir: Dir, items: &[WorkItem]) -> PostBatch<'_> {
    PostBatch {
        op: OpId(op),
        conn,
        dir,
        items,
        deadline: far(),
    }
}

fn drain(f: &FakeFabric) -> Vec<Completion> {
    let mut out = Vec::new();
    while f.poll(&mut out, 1000, Duration::ZERO) > 0 {}
    out
}

fn pool_bytes(p: &SharedPool, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    p.region().read_at(offset, &mut v).unwrap();
    v
}

#[test]
fn pull_then_push_round_trips_the_bytes() {
    let (p, f) = setup(quiet());
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    p.region().fill_at(0, 2 * MIB, 0xEE).unwrap();
    // Two pieces of the source into two slots 1 MiB apart.
    let pull = [
        item(0, 4096, 0x10000, 7),
        item(MIB, 8192, 0x10000 + 4096, 7),
    ];
    f.post(batch(1, c, Dir::Pull, &pull)).unwrap();
    // Bytes move when the op is due, not at post.
    assert_eq!(pool_bytes(&p, 0, 4096), vec![0xEE; 4096]);
    f.advance_to(0);
    let done = drain(&f);
    assert_eq!(
        done,
        vec![Completion {
            op: OpId(1),
            conn: c,
            result: Ok(12288)
        }]
    );
    let src = pattern(1, 65536);
    assert_eq!(pool_bytes(&p, 0, 4096), src[..4096]);
    assert_eq!(pool_bytes(&p, MIB, 8192), src[4096..12288]);
    assert_eq!(
        pool_bytes(&p, 4096, 16),
        vec![0xEE; 16],
        "nothing past the range"
    );

    let push = [
        item(MIB, 8192, 0x80000, 9),
        item(0, 4096, 0x80000 + 8192, 9),
    ];
    f.post(batch(2, c, Dir::Push, &push)).unwrap();
    f.advance_to(1);
    assert_eq!(drain(&f)[0].result, Ok(12288));
    let dst = f.peer_region(c, 9).unwrap();
    assert_eq!(dst[..8192], src[4096..12288]);
    assert_eq!(dst[8192..12288], src[..4096]);
    assert!(dst[12288..].iter().all(|&b| b == 0));
}

#[test]
fn invalid_batches_are_refused_and_nothing_is_posted() {
    let (p, f) = setup(FakeOptions {
        region_bytes: MIB,
        max_inflight_ops: 1,
        ..quiet()
    });
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    let ok = item(0, 4096, 0x10000, 7);
    let cases: Vec<(&str, Vec<WorkItem>, u64)> = vec![
        ("empty batch", vec![], 1),
        ("zero length", vec![item(0, 0, 0x10000, 7)], 1),
        ("overflow", vec![item(u64::MAX - 10, 4096, 0x10000, 7)], 1),
        (
            "past the pool",
            vec![item(POOL - 4096, 8192, 0x10000, 7)],
            1,
        ),
        (
            "spans two regions",
            vec![item(MIB - 4096, 8192, 0x10000, 7)],
            1,
        ),
        (
            "overlap in the batch",
            vec![ok, item(2048, 4096, 0x20000, 7)],
            1,
        ),
        (
            "stream segment",
            vec![WorkItem {
                local: LocalRange { offset: 0, len: 16 },
                remote: RemoteSeg::Stream,
            }],
            1,
        ),
        ("reserved op id", vec![ok], OpId::TEARDOWN_DONE.0),
    ];
    for (what, items, op) in cases {
        let r = f.post(batch(op, c, Dir::Pull, &items));
        assert!(matches!(r, Err(PostError::Invalid(_))), "{what}: {r:?}");
    }
    assert_eq!(f.stats().posted_ops, 0);
    assert!(f.inflight_ranges().is_empty());

    // Unknown connection.
    assert_eq!(
        f.post(batch(1, ConnId(999), Dir::Pull, &[ok])),
        Err(PostError::ConnGone)
    );
    // Duplicate op id, then the in-flight bound.
    f.post(batch(5, c, Dir::Pull, &[ok])).unwrap();
    let other = item(8192, 4096, 0x10000, 7);
    assert!(matches!(
        f.post(batch(5, c, Dir::Pull, &[other])),
        Err(PostError::Invalid(_))
    ));
    assert_eq!(
        f.post(batch(6, c, Dir::Pull, &[other])),
        Err(PostError::Full)
    );
    assert_eq!(f.stats().posted_ops, 1);
    f.advance_to(0);
    assert_eq!(drain(&f).len(), 1);
    assert_eq!(
        pool_bytes(&p, 8192, 4096),
        vec![0; 4096],
        "refused ops moved nothing"
    );

    // Before register: every post is refused.
    let f2 = FakeFabric::new(quiet(), p.clone()).unwrap();
    let c2 = f2.connect(ConnSetup::Fake(peer())).unwrap();
    assert!(matches!(
        f2.post(batch(1, c2, Dir::Pull, &[ok])),
        Err(PostError::Invalid(_))
    ));
    // Another pool, another kind of setup, bad options.
    assert!(f2.register(&pool()).is_err());
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    assert!(f2.connect(ConnSetup::Tcp(a.into())).is_err());
    for bad in [
        FakeOptions {
            delay_ms: (5, 1),
            ..quiet()
        },
        FakeOptions {
            drop_pct: 101,
            ..quiet()
        },
        FakeOptions {
            region_bytes: 0,
            ..quiet()
        },
    ] {
        assert!(FakeFabric::new(bad, p.clone()).is_err());
    }
}

#[test]
fn bad_rkey_or_bounds_complete_with_rem_access_err_and_break_the_connection() {
    let cases = [
        ("bad rkey", item(0, 4096, 0x10000, 8)),
        ("past the end", item(0, 4096, 0x10000 + 65536 - 4095, 7)),
        ("before the start", item(0, 4096, 0x10000 - 1, 7)),
        ("address overflow", item(0, 4096, u64::MAX - 100, 7)),
    ];
    for (what, bad) in cases {
        let (_p, f) = setup(quiet());
        let c = f.connect(ConnSetup::Fake(peer())).unwrap();
        // A later op of the same connection is flushed when the QP goes to error.
        f.post(batch(1, c, Dir::Pull, &[bad])).unwrap();
        f.post(batch(2, c, Dir::Pull, &[item(8192, 16, 0x10000, 7)]))
            .unwrap();
        f.advance_to(0);
        let done = drain(&f);
        assert_eq!(done.len(), 2, "{what}");
        assert_eq!(
            done[0].result,
            Err(FabricError::Remote(REM_ACCESS_ERR.into())),
            "{what}"
        );
        assert_eq!(done[1].op, OpId(2), "{what}");
        assert_eq!(done[1].result, Err(FabricError::Flushed), "{what}");
        assert!(f.is_broken(c), "{what}");
        assert_eq!(
            f.post(batch(3, c, Dir::Pull, &[item(8192, 16, 0x10000, 7)])),
            Err(PostError::ConnGone),
            "{what}"
        );
        assert_eq!(f.stats().errors, 2);
    }
}

#[test]
fn an_access_error_flushes_the_other_ops_of_its_connection_only() {
    let (_p, f) = setup(FakeOptions {
        delay_ms: (0, 0),
        reorder: false,
        ..FakeOptions::default()
    });
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    let d = f.connect(ConnSetup::Fake(peer())).unwrap();
    f.post(batch(1, c, Dir::Pull, &[item(0, 16, 0x10000, 99)]))
        .unwrap();
    f.advance_to(0);
    // Posted after the error was produced but before it was polled: refused (broken).
    assert_eq!(
        f.post(batch(2, c, Dir::Pull, &[item(4096, 16, 0x10000, 7)])),
        Err(PostError::ConnGone)
    );
    f.post(batch(3, d, Dir::Pull, &[item(8192, 16, 0x10000, 7)]))
        .unwrap();
    f.advance_to(1);
    let done = drain(&f);
    assert_eq!(done.len(), 2);
    assert_eq!(done[1].result, Ok(16), "the other connection is unaffected");
}

/// Posts 40 single-item pulls at varying times and records (time, completion) as they appear.
fn scripted_run(opts: FakeOptions) -> Vec<(u64, Completion)> {
    let (_p, f) = setup(opts);
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    let mut seen = Vec::new();
    for t in 0..200u64 {
        if t < 40 {
            let it = [item(t * 4096, 1024, 0x10000 + t * 16, 7)];
            f.post(batch(t, c, Dir::Pull, &it)).unwrap();
        }
        f.advance_to(t);
        for comp in drain(&f) {
            seen.push((t, comp));
        }
    }
    seen
}

#[test]
fn delay_and_reorder_are_reproducible_with_a_seed() {
    let opts = FakeOptions {
        seed: 42,
        delay_ms: (0, 30),
        reorder: true,
        ..FakeOptions::default()
    };
    let a = scripted_run(opts.clone());
    let b = scripted_run(opts.clone());
    assert_eq!(a.len(), 40);
    assert_eq!(
        a, b,
        "same seed, same calls => same completions at the same times"
    );
    let order: Vec<u64> = a.iter().map(|(_, c)| c.op.0).collect();
    assert!(
        order.windows(2).any(|w| w[0] > w[1]),
        "completions were reordered: {order:?}"
    );
    assert!(
        a.iter().any(|(t, c)| *t > c.op.0),
        "some completion was delayed"
    );
    assert!(a.iter().all(|(t, c)| *t >= c.op.0 && *t <= c.op.0 + 30));
    let other = scripted_run(FakeOptions { seed: 43, ..opts });
    assert_ne!(a, other, "another seed gives another schedule");

    let fifo = scripted_run(FakeOptions {
        seed: 42,
        delay_ms: (0, 30),
        reorder: false,
        ..FakeOptions::default()
    });
    let order: Vec<u64> = fifo.iter().map(|(_, c)| c.op.0).collect();
    assert_eq!(
        order,
        (0..40).collect::<Vec<_>>(),
        "no reorder => post order"
    );
}

#[test]
fn teardown_completes_every_inflight_op_before_teardown_done() {
    let (p, f) = setup(FakeOptions {
        delay_ms: (100, 100),
        ..FakeOptions::default()
    });
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    let d = f.connect(ConnSetup::Fake(peer())).unwrap();
    for i in 0..10u64 {
        f.post(batch(i, c, Dir::Pull, &[item(i * 8192, 4096, 0x10000, 7)]))
            .unwrap();
    }
    f.post(batch(100, d, Dir::Pull, &[item(MIB, 4096, 0x10000, 7)]))
        .unwrap();
    assert_eq!(f.inflight_ranges().len(), 11);
    f.advance_to(50);
    f.teardown(c);
    f.teardown(c); // idempotent
                   // Ranges stay in flight until poll returns their completions.
    assert_eq!(f.inflight_ranges().len(), 11);
    let done = drain(&f);
    assert_eq!(done.len(), 11, "10 flushed + one TEARDOWN_DONE: {done:?}");
    let mut ops: Vec<u64> = done[..10].iter().map(|c| c.op.0).collect();
    ops.sort();
    assert_eq!(ops, (0..10).collect::<Vec<_>>());
    assert!(done[..10]
        .iter()
        .all(|x| x.conn == c && x.result == Err(FabricError::Flushed)));
    assert_eq!(done[10].op, OpId::TEARDOWN_DONE);
    assert_eq!(done[10].conn, c);
    let left = f.inflight_ranges();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].1, d);
    assert_eq!(
        f.post(batch(50, c, Dir::Pull, &[item(0, 16, 0x10000, 7)])),
        Err(PostError::ConnGone)
    );
    // The other connection's op still completes normally, and its bytes are right.
    f.advance_to(100);
    let done = drain(&f);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].result, Ok(4096));
    assert_eq!(pool_bytes(&p, MIB, 4096), pattern(1, 4096));
    let s = f.stats();
    assert_eq!((s.posted_ops, s.completed_ops, s.inflight_ops), (11, 11, 0));
    assert_eq!(s.errors, 10);
}

#[test]
fn peer_death_leaves_garbage_only_in_the_failed_items_ranges() {
    let mut prefixes = Vec::new();
    for seed in 0..16 {
        let (p, f) = setup(FakeOptions {
            seed,
            delay_ms: (0, 0),
            reorder: false,
            peer_death_pct: 100,
            ..FakeOptions::default()
        });
        let c = f.connect(ConnSetup::Fake(peer())).unwrap();
        p.region().fill_at(0, 64 * 1024, 0xEE).unwrap();
        // 6 items of 4 KiB at 8 KiB strides: the gaps must stay untouched.
        let items: Vec<WorkItem> = (0..6u64)
            .map(|i| item(i * 8192, 4096, 0x10000 + i * 4096, 7))
            .collect();
        f.post(batch(1, c, Dir::Pull, &items)).unwrap();
        f.advance_to(0);
        let done = drain(&f);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].result, Err(FabricError::PeerGone));
        assert!(f.is_broken(c));
        let src = pattern(1, 65536);
        let mut k = 0;
        while k < 6 && pool_bytes(&p, k as u64 * 8192, 4096) == src[k * 4096..(k + 1) * 4096] {
            k += 1;
        }
        assert!(k < 6, "a death never completes the whole batch");
        for i in k..6 {
            let got = pool_bytes(&p, i as u64 * 8192, 4096);
            assert_ne!(got, src[i * 4096..(i + 1) * 4096], "seed {seed} item {i}");
            assert_ne!(
                got,
                vec![0xEE; 4096],
                "seed {seed} item {i}: garbage written"
            );
        }
        for i in 0..6u64 {
            assert_eq!(
                pool_bytes(&p, i * 8192 + 4096, 4096),
                vec![0xEE; 4096],
                "seed {seed}: gap after item {i} untouched"
            );
        }
        assert_eq!(f.stats().bytes_pulled, k as u64 * 4096);
        prefixes.push(k);
    }
    assert!(prefixes.iter().any(|&k| k > 0), "{prefixes:?}");
    assert!(prefixes.contains(&0), "{prefixes:?}");
}

#[test]
fn without_partial_garbage_a_failed_pull_leaves_the_ranges_alone() {
    let (p, f) = setup(FakeOptions {
        delay_ms: (0, 0),
        error_pct: 100,
        partial_garbage: false,
        ..FakeOptions::default()
    });
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    p.region().fill_at(0, 8192, 0xEE).unwrap();
    f.post(batch(1, c, Dir::Pull, &[item(0, 4096, 0x10000, 7)]))
        .unwrap();
    f.advance_to(0);
    let done = drain(&f);
    assert_eq!(
        done[0].result,
        Err(FabricError::Remote(INJECTED_OP_ERR.into()))
    );
    assert_eq!(pool_bytes(&p, 0, 4096), vec![0xEE; 4096]);
    // An injected error leaves the connection usable.
    assert!(!f.is_broken(c));
    f.post(batch(2, c, Dir::Pull, &[item(0, 4096, 0x10000, 7)]))
        .unwrap();
}

#[test]
fn a_dropped_completion_ends_at_its_deadline_or_at_teardown() {
    let (p, f) = setup(FakeOptions {
        drop_pct: 100,
        ..FakeOptions::default()
    });
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    p.region().fill_at(0, 8192, 0xEE).unwrap();
    // Deadline already passed: due now, fails with Deadline and garbage.
    let it = [item(0, 4096, 0x10000, 7)];
    f.post(PostBatch {
        deadline: Instant::now(),
        ..batch(1, c, Dir::Pull, &it)
    })
    .unwrap();
    // A far deadline: never completes on its own.
    f.post(batch(2, c, Dir::Pull, &[item(4096, 4096, 0x10000, 7)]))
        .unwrap();
    f.advance_to(100_000);
    let done = drain(&f);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].op, OpId(1));
    assert_eq!(done[0].result, Err(FabricError::Deadline));
    assert_ne!(pool_bytes(&p, 0, 4096), vec![0xEE; 4096]);
    f.teardown(c);
    let done = drain(&f);
    assert_eq!(done.len(), 2);
    assert_eq!(done[0].result, Err(FabricError::Flushed));
    assert_eq!(done[1].op, OpId::TEARDOWN_DONE);
}

#[test]
#[should_panic(expected = "still in flight")]
fn posting_over_a_range_in_flight_panics() {
    let (_p, f) = setup(quiet());
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    f.post(batch(1, c, Dir::Pull, &[item(4096, 4096, 0x10000, 7)]))
        .unwrap();
    // Completed but not yet polled: still in flight for the caller.
    f.advance_to(0);
    let _ = f.post(batch(2, c, Dir::Push, &[item(6144, 4096, 0x80000, 9)]));
}

#[test]
fn a_range_can_be_reused_once_its_completion_was_polled() {
    let (_p, f) = setup(quiet());
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    let it = [item(4096, 4096, 0x10000, 7)];
    f.post(batch(1, c, Dir::Pull, &it)).unwrap();
    // Adjacent ranges do not overlap.
    f.post(batch(2, c, Dir::Pull, &[item(0, 4096, 0x10000, 7)]))
        .unwrap();
    f.post(batch(3, c, Dir::Pull, &[item(8192, 4096, 0x10000, 7)]))
        .unwrap();
    f.advance_to(0);
    assert_eq!(drain(&f).len(), 3);
    assert!(f.inflight_ranges().is_empty());
    f.post(batch(1, c, Dir::Pull, &it)).unwrap();
}

#[test]
fn stats_count_ops_items_bytes_and_errors() {
    let (_p, f) = setup(quiet());
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    f.post(batch(
        1,
        c,
        Dir::Pull,
        &[item(0, 100, 0x10000, 7), item(4096, 200, 0x10000, 7)],
    ))
    .unwrap();
    f.post(batch(2, c, Dir::Push, &[item(8192, 300, 0x80000, 9)]))
        .unwrap();
    let s = f.stats();
    assert_eq!(
        (s.posted_ops, s.inflight_ops, s.inflight_wr, s.completed_ops),
        (2, 2, 3, 0)
    );
    f.advance_to(0);
    let mut out = Vec::new();
    assert_eq!(f.poll(&mut out, 1, Duration::ZERO), 1, "max is honoured");
    assert_eq!(f.stats().inflight_ops, 1);
    drain(&f);
    f.post(batch(3, c, Dir::Push, &[item(0, 16, 0x80000, 1234)]))
        .unwrap();
    f.advance_to(1);
    drain(&f);
    let s = f.stats();
    assert_eq!(s.posted_ops, 3);
    assert_eq!(s.completed_ops, 3);
    assert_eq!(s.inflight_ops, 0);
    assert_eq!(s.inflight_wr, 0);
    assert_eq!(s.bytes_pulled, 300);
    assert_eq!(s.bytes_pushed, 300);
    assert_eq!(s.errors, 1);
    assert_eq!(f.kind().as_str(), "fake");
}

#[test]
fn poll_waits_for_a_completion_made_due_by_another_thread() {
    let (_p, f) = setup(FakeOptions {
        delay_ms: (10, 10),
        ..FakeOptions::default()
    });
    let f = Arc::new(f);
    let c = f.connect(ConnSetup::Fake(peer())).unwrap();
    f.post(batch(1, c, Dir::Pull, &[item(0, 16, 0x10000, 7)]))
        .unwrap();
    let mut out = Vec::new();
    assert_eq!(f.poll(&mut out, 8, Duration::ZERO), 0, "not due yet");
    let f2 = f.clone();
    let t = std::thread::spawn(move || f2.advance_to(10));
    // Generous: the other thread may be slow to start on a loaded machine.
    assert_eq!(f.poll(&mut out, 8, Duration::from_secs(60)), 1);
    t.join().unwrap();
    assert_eq!(out[0].result, Ok(16));
}
