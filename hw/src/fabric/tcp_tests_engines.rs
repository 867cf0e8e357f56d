//! Teardown races and throughput of [`TcpFabric`], and the per-engine instantiation of every
//! shared test body (`tcp_tests.rs` and this file).

use std::io::{Read, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use super::fake_peer::Rng;
use super::tcp_tests::*;
use super::*;

/// Rounds of the teardown race.
const TEARDOWN_ROUNDS: u64 = 300;

/// Each round: a fresh connection with 1-3 ops (Pull and Push, random sizes), a peer that sends a
/// random amount and reads everything, and a teardown at a random moment. Every op completes
/// exactly once (`Ok` with its full length, or `Flushed`) before the single `TEARDOWN_DONE`.
pub(super) fn teardown_mid_op_loop(opts: TcpFabricOptions) {
    let (_p, f) = setup(opts, 8 * MIB);
    let mut rng = Rng(0x7ea4_d0e5);
    for round in 0..TEARDOWN_ROUNDS {
        let (node, peer) = tcp_pair();
        let conn = connect(&f, &node);
        let mut ops = Vec::new();
        for k in 0..1 + rng.below(3) {
            let dir = if rng.pct(50) { Dir::Pull } else { Dir::Push };
            let len = 1 + rng.below(MIB);
            let op = round * 8 + k;
            post(
                &f,
                op,
                conn,
                dir,
                &stream_items(&[(k * 2 * MIB, len)]),
                far(),
            )
            .expect("post");
            ops.push((OpId(op), len));
        }
        let sends = rng.below(3 * MIB / 2) as usize;
        let mut reader = peer.try_clone().expect("dup");
        let writer = std::thread::spawn(move || {
            let mut peer = peer;
            let _ = peer.write_all(&vec![0xC3; sends]);
            peer
        });
        let drain = std::thread::spawn(move || {
            let mut buf = vec![0u8; 256 << 10];
            while matches!(reader.read(&mut buf), Ok(n) if n > 0) {}
        });
        match rng.below(4) {
            0 => {}
            1 => std::thread::yield_now(),
            2 => std::thread::sleep(Duration::from_micros(rng.below(2000))),
            _ => {
                let mut out = Vec::new();
                f.poll(&mut out, 1, Duration::from_millis(rng.below(5)));
                for c in out {
                    assert!(c.result.is_ok(), "round {round}: {c:?} before teardown");
                    let (_, len) = ops.iter().find(|o| o.0 == c.op).expect("own op");
                    assert_eq!(c.result, Ok(*len));
                    ops.retain(|o| o.0 != c.op);
                }
            }
        }
        f.teardown(conn);
        let before = wait_teardown(&f, conn);
        let mut seen: Vec<OpId> = before.iter().map(|c| c.op).collect();
        seen.sort();
        let mut want: Vec<OpId> = ops.iter().map(|o| o.0).collect();
        want.sort();
        assert_eq!(
            seen, want,
            "round {round}: each op exactly once before TEARDOWN_DONE"
        );
        for c in &before {
            assert_eq!(c.conn, conn);
            let (_, len) = ops.iter().find(|o| o.0 == c.op).expect("own op");
            assert!(
                c.result == Ok(*len) || c.result == Err(FabricError::Flushed),
                "round {round}: {c:?}"
            );
        }
        assert_eq!(
            post(
                &f,
                1 << 40,
                conn,
                Dir::Pull,
                &stream_items(&[(0, 1)]),
                far()
            ),
            Err(PostError::ConnGone)
        );
        // The fabric closed its copy; closing ours resets the connection and frees the peer.
        let _ = node.shutdown(Shutdown::Both);
        drop(node);
        drop(writer.join().expect("writer"));
        drain.join().expect("drain");
    }
    let s = f.stats();
    assert_eq!(s.inflight_ops, 0);
    assert_eq!(s.posted_ops, s.completed_ops);
    assert_eq!(s.inflight_wr, 0);
}

/// Teardown of a large Push to a peer that never reads (uring: zero-copy pages held by the
/// kernel): the op still completes and `TEARDOWN_DONE` follows, once the kernel let go.
pub(super) fn teardown_stalled_push(opts: TcpFabricOptions) {
    let uring = opts.engine == TcpEngine::Uring;
    let (_p, f) = setup(opts, 32 * MIB);
    let (node, peer) = tcp_pair();
    small_buffers(&node, &peer);
    let conn = connect(&f, &node);
    post(
        &f,
        1,
        conn,
        Dir::Push,
        &stream_items(&[(0, 24 * MIB)]),
        far(),
    )
    .expect("post");
    let mut none = Vec::new();
    assert_eq!(
        f.poll(&mut none, 1, Duration::from_millis(100)),
        0,
        "peer reads nothing"
    );
    f.teardown(conn);
    let before = wait_teardown(&f, conn);
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].result, Err(FabricError::Flushed));
    let zc = f.zc_counters();
    assert_eq!(
        zc.notifications, zc.sends,
        "every notification reaped first: {zc:?}"
    );
    if uring {
        assert!(zc.sends >= 1, "the push went zero-copy: {zc:?}");
    }
    assert_eq!(f.stats().inflight_ops, 0);
    drop(peer);
}

/// Dropping the fabric with ops in flight returns (everything torn down and drained).
pub(super) fn drop_with_ops_in_flight(opts: TcpFabricOptions) {
    let (_p, f) = setup(opts, 4 * MIB);
    let (node, _peer) = tcp_pair();
    let conn = connect(&f, &node);
    post(&f, 1, conn, Dir::Pull, &stream_items(&[(0, MIB)]), far()).expect("post");
    post(&f, 2, conn, Dir::Pull, &stream_items(&[(MIB, MIB)]), far()).expect("post");
    drop(f);
}

/// At the bound on ops in flight `post` answers `Full`; after one completion was polled it
/// accepts again.
pub(super) fn full_at_bound(opts: TcpFabricOptions) {
    let (_p, f) = setup(
        TcpFabricOptions {
            max_inflight_ops: 2,
            ..opts
        },
        4 * MIB,
    );
    let (node, mut peer) = tcp_pair();
    let conn = connect(&f, &node);
    post(&f, 1, conn, Dir::Pull, &stream_items(&[(0, 10)]), far()).expect("1");
    post(&f, 2, conn, Dir::Pull, &stream_items(&[(100, 10)]), far()).expect("2");
    assert_eq!(
        post(&f, 3, conn, Dir::Pull, &stream_items(&[(200, 10)]), far()),
        Err(PostError::Full)
    );
    peer.write_all(&[4; 10]).expect("write");
    let done = wait_n(&f, 1);
    assert_eq!(done[0].op, OpId(1));
    post(&f, 3, conn, Dir::Pull, &stream_items(&[(200, 10)]), far()).expect("3 after poll");
    peer.write_all(&[5; 20]).expect("write");
    let done = wait_n(&f, 2);
    assert!(done.iter().all(|c| c.result == Ok(10)), "{done:?}");
    assert_eq!(f.stats().inflight_ops, 0);
}

/// Several connections at once (spread over the rings), each pulling then pushing its own
/// ranges: every byte arrives, ops of one connection in order.
pub(super) fn many_connections(opts: TcpFabricOptions) {
    const CONNS: u64 = 6;
    const LEN: u64 = 512 << 10;
    let (p, f) = setup(opts, 8 * MIB);
    let mut peers = Vec::new();
    for i in 0..CONNS {
        let (node, peer) = tcp_pair();
        let conn = connect(&f, &node);
        let off = i * LEN;
        post(
            &f,
            2 * i,
            conn,
            Dir::Pull,
            &stream_items(&[(off, LEN)]),
            far(),
        )
        .expect("pull");
        post(
            &f,
            2 * i + 1,
            conn,
            Dir::Push,
            &stream_items(&[(off, LEN)]),
            far(),
        )
        .expect("push");
        peers.push(std::thread::spawn(move || {
            let data = pattern(i as u8, LEN as usize);
            let mut peer = send_in_pieces(peer, data.clone(), i);
            let mut back = vec![0u8; LEN as usize];
            peer.read_exact(&mut back).expect("echo");
            assert!(back == data, "connection {i}: echo differs");
            node
        }));
    }
    let done = wait_n(&f, 2 * CONNS as usize);
    assert!(done.iter().all(|c| c.result == Ok(LEN)), "{done:?}");
    for t in peers {
        drop(t.join().expect("peer"));
    }
    let _ = p;
    let s = f.stats();
    assert_eq!((s.bytes_pulled, s.bytes_pushed), (CONNS * LEN, CONNS * LEN));
}

/// Local loopback throughput of 32 MiB Pull and Push batches (printed, not asserted):
/// `cargo test -p kvnode-hw --release tcp_throughput -- --ignored --nocapture`.
pub(super) fn throughput(opts: TcpFabricOptions) {
    const LEN: u64 = 32 * MIB;
    const ITEM: u64 = 2 * MIB;
    const ROUNDS: u64 = 20;
    let name = format!(
        "{}{}",
        opts.engine.as_str(),
        if opts.engine == TcpEngine::Uring && !opts.register_buffers {
            " (no fixed buffers)"
        } else {
            ""
        }
    );
    let (_p, f) = setup(opts, 64 * MIB);
    let (node, peer) = tcp_pair();
    let conn = connect(&f, &node);
    let ranges: Vec<(u64, u64)> = (0..LEN / ITEM).map(|i| (i * ITEM, ITEM)).collect();
    let items = stream_items(&ranges);
    let mut reader = peer.try_clone().expect("dup");
    let writer = std::thread::spawn(move || {
        let mut peer = peer;
        let chunk = vec![0x5Au8; MIB as usize];
        for _ in 0..ROUNDS * (LEN / MIB) {
            peer.write_all(&chunk).expect("write");
        }
        peer
    });
    let cpu0 = crate::process_cpu_seconds();
    let t0 = Instant::now();
    for r in 0..ROUNDS {
        post(&f, r, conn, Dir::Pull, &items, far()).expect("pull");
        assert_eq!(wait_n(&f, 1)[0].result, Ok(LEN));
    }
    let pull_s = t0.elapsed().as_secs_f64();
    let pull_cpu = crate::process_cpu_seconds().zip(cpu0).map(|(a, b)| a - b);
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; MIB as usize];
        let mut left = ROUNDS * LEN;
        while left > 0 {
            let n = reader.read(&mut buf).expect("read");
            assert!(n > 0);
            left -= n as u64;
        }
    });
    let cpu1 = crate::process_cpu_seconds();
    let t1 = Instant::now();
    for r in 0..ROUNDS {
        post(&f, 100 + r, conn, Dir::Push, &items, far()).expect("push");
        assert_eq!(wait_n(&f, 1)[0].result, Ok(LEN));
    }
    drain.join().expect("drain");
    let push_s = t1.elapsed().as_secs_f64();
    let push_cpu = crate::process_cpu_seconds().zip(cpu1).map(|(a, b)| a - b);
    let gb = (ROUNDS * LEN) as f64 / 1e9;
    println!(
        "tcp fabric {name}: pull {:.2} GB/s, push {:.2} GB/s (32 MiB batches of 2 MiB items, \
         loopback; process CPU s/GB incl. the peer thread: pull {:.2?}, push {:.2?})",
        gb / pull_s,
        gb / push_s,
        pull_cpu.map(|c| c / gb),
        push_cpu.map(|c| c / gb),
    );
    drop(writer.join().expect("writer"));
}

macro_rules! engine_suite {
    ($($engine:ident: $opts:ident),* $(,)?) => {$(
        mod $engine {
            use super::*;

            #[test]
            fn pull_odd_sizes() {
                super::pull_odd_sizes($opts())
            }
            #[test]
            fn push_round_trip() {
                super::push_round_trip($opts())
            }
            #[test]
            fn push_large_slow_reader() {
                super::push_large_slow_reader($opts())
            }
            #[test]
            fn deadline_stalled_sender() {
                super::deadline_stalled_sender($opts())
            }
            #[test]
            fn deadline_stalled_reader() {
                super::deadline_stalled_reader($opts())
            }
            #[test]
            fn peer_closes_mid_pull() {
                super::peer_closes_mid_pull($opts())
            }
            #[test]
            fn post_validation() {
                super::post_validation($opts())
            }
            #[test]
            fn connect_and_options() {
                super::connect_and_options($opts())
            }
            #[test]
            fn full_at_bound() {
                super::full_at_bound($opts())
            }
            #[test]
            fn many_connections() {
                super::many_connections($opts())
            }
            #[test]
            fn teardown_mid_op_loop() {
                super::teardown_mid_op_loop($opts())
            }
            #[test]
            fn teardown_stalled_push() {
                super::teardown_stalled_push($opts())
            }
            #[test]
            fn drop_with_ops_in_flight() {
                super::drop_with_ops_in_flight($opts())
            }
            #[test]
            #[ignore = "prints loopback throughput; run with --release --ignored --nocapture"]
            fn tcp_throughput() {
                super::throughput($opts())
            }
        }
    )*};
}

engine_suite!(uring: uring_fixed, uring_nofixed: uring_unregistered, plain: plain);
