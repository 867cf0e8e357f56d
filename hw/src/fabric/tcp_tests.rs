//! Tests of [`TcpFabric`]: one set of test bodies run against each engine (io_uring with fixed
//! buffers, io_uring without, plain), over loopback TCP pairs and a small pool.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::fake_peer::Rng;
use super::*;
use crate::{PagePreference, PoolOptions, SharedPool};

pub(super) const MIB: u64 = 1 << 20;

/// A generous bound for conditions that must come true; only a hang hits it.
pub(super) const PATIENCE: Duration = Duration::from_secs(60);

pub(super) fn pool(bytes: u64) -> Arc<SharedPool> {
    Arc::new(
        SharedPool::create(&PoolOptions {
            bytes,
            prefer: PagePreference::Pages4K,
            prefault: false,
            name: "kvnode-tcp-fabric-test".into(),
            ..PoolOptions::default()
        })
        .expect("pool"),
    )
}

pub(super) fn uring_fixed() -> TcpFabricOptions {
    TcpFabricOptions::default()
}

pub(super) fn uring_unregistered() -> TcpFabricOptions {
    TcpFabricOptions {
        register_buffers: false,
        ..TcpFabricOptions::default()
    }
}

pub(super) fn plain() -> TcpFabricOptions {
    TcpFabricOptions {
        engine: TcpEngine::Plain,
        ..TcpFabricOptions::default()
    }
}

/// A fabric with a registered pool of `pool_bytes`.
pub(super) fn setup(opts: TcpFabricOptions, pool_bytes: u64) -> (Arc<SharedPool>, TcpFabric) {
    let p = pool(pool_bytes);
    let want_fixed = opts.engine == TcpEngine::Uring && opts.register_buffers;
    let f = TcpFabric::new(opts).expect("fabric");
    assert!(
        !f.registered_buffers(),
        "nothing registered before register"
    );
    let regions = f.register(&p).expect("register");
    assert_eq!(regions.len() as u64, pool_bytes.div_ceil(TCP_REGION_BYTES));
    assert_eq!(f.register(&p).expect("again"), regions, "idempotent");
    if !want_fixed {
        assert!(!f.registered_buffers());
    } else if crate::effective_uid() == 0 {
        // Root is not bound by RLIMIT_MEMLOCK: the registration must have worked.
        assert!(f.registered_buffers());
    }
    (p, f)
}

/// A loopback pair: (the node's socket, the peer's socket).
pub(super) fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let peer = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (node, _) = l.accept().expect("accept");
    (node, peer)
}

/// Hands a duplicate of `node` to the fabric, as the node does (its own copy keeps
/// `SO_RCVTIMEO` = 1 ms, which the fabric must not depend on).
pub(super) fn connect(f: &TcpFabric, node: &TcpStream) -> ConnId {
    node.set_read_timeout(Some(Duration::from_millis(1)))
        .expect("rcvtimeo");
    let dup = node.try_clone().expect("dup");
    f.connect(ConnSetup::Tcp(OwnedFd::from(dup)))
        .expect("connect")
}

/// Caps the kernel's buffering between a stalled peer and the node (`SO_SNDBUF` on the node,
/// `SO_RCVBUF` on the peer, 128 KiB each), so that a Push of a few MiB cannot fit in the socket
/// buffers whatever the host's `tcp_rmem`.
pub(super) fn small_buffers(node: &TcpStream, peer: &TcpStream) {
    use std::os::fd::AsRawFd;
    for (s, opt) in [(node, libc::SO_SNDBUF), (peer, libc::SO_RCVBUF)] {
        let v: libc::c_int = 128 << 10;
        // SAFETY: setsockopt reads one c_int from a live local.
        let r = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0, "setsockopt");
    }
}

pub(super) fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

pub(super) fn stream_items(ranges: &[(u64, u64)]) -> Vec<WorkItem> {
    ranges
        .iter()
        .map(|&(offset, len)| WorkItem {
            local: LocalRange { offset, len },
            remote: RemoteSeg::Stream,
        })
        .collect()
}

pub(super) fn far() -> Instant {
    Instant::now() + PATIENCE
}

pub(super) fn post(
    f: &TcpFabric,
    op: u64,
    conn: ConnId,
    dir: Dir,
    items: &[WorkItem],
    deadline: Instant,
) -> Result<(), PostError> {
    f.post(PostBatch {
        op: OpId(op),
        conn,
        dir,
        items,
        deadline,
    })
}

/// Polls until `n` completions arrived (panics after [`PATIENCE`]).
pub(super) fn wait_n(f: &TcpFabric, n: usize) -> Vec<Completion> {
    let end = Instant::now() + PATIENCE;
    let mut out = Vec::new();
    while out.len() < n {
        assert!(Instant::now() < end, "only {out:?} of {n} completions came");
        let want = n - out.len();
        f.poll(&mut out, want, Duration::from_millis(10));
    }
    out
}

/// Polls until `conn`'s `TEARDOWN_DONE`; returns the completions before it.
pub(super) fn wait_teardown(f: &TcpFabric, conn: ConnId) -> Vec<Completion> {
    let end = Instant::now() + PATIENCE;
    let mut out = Vec::new();
    loop {
        assert!(Instant::now() < end, "no TEARDOWN_DONE; got {out:?}");
        let mut got = Vec::new();
        f.poll(&mut got, 64, Duration::from_millis(10));
        for c in got {
            if c.op == OpId::TEARDOWN_DONE && c.conn == conn {
                return out;
            }
            out.push(c);
        }
    }
}

fn read_range(p: &SharedPool, offset: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    p.region().read_at(offset, &mut v).expect("read");
    v
}

/// Writes `data` in random-size pieces (1 B .. 300 KiB), yielding now and then.
pub(super) fn send_in_pieces(mut s: TcpStream, data: Vec<u8>, seed: u64) -> TcpStream {
    let mut rng = Rng(seed);
    let mut at = 0;
    while at < data.len() {
        let n = (1 + rng.below(300 << 10) as usize).min(data.len() - at);
        s.write_all(&data[at..at + n]).expect("peer write");
        at += n;
        if rng.pct(20) {
            std::thread::yield_now();
        }
    }
    s
}

/// Pull of items of odd sizes (1 B .. 4 MiB) in two batches on one connection; the sender writes
/// in random pieces; every byte lands in its range, the gaps stay untouched.
pub(super) fn pull_odd_sizes(opts: TcpFabricOptions) {
    let (p, f) = setup(opts, 16 * MIB);
    p.region().fill_at(0, 16 * MIB, 0xEE).expect("fill");
    let (node, peer) = tcp_pair();
    let conn = connect(&f, &node);
    // The node may switch its socket (and so the fabric's duplicate) to non-blocking.
    node.set_nonblocking(true).expect("nonblocking");
    let a = [(0, 1), (4096, 4095), (3 * MIB, 65537), (8 * MIB, 4 * MIB)];
    let b = [(MIB, 3), (MIB + 100, MIB + 1)];
    let total: u64 = a.iter().chain(&b).map(|r| r.1).sum();
    let data = pattern(7, total as usize);
    post(&f, 1, conn, Dir::Pull, &stream_items(&a), far()).expect("post a");
    post(&f, 2, conn, Dir::Pull, &stream_items(&b), far()).expect("post b");
    assert_eq!(f.stats().inflight_ops, 2);
    assert_eq!(f.stats().inflight_wr, 6);
    let sender = std::thread::spawn({
        let data = data.clone();
        move || send_in_pieces(peer, data, 42)
    });
    let mut got = wait_n(&f, 2);
    got.sort_by_key(|c| c.op);
    let sum = |r: &[(u64, u64)]| r.iter().map(|x| x.1).sum::<u64>();
    assert_eq!(got[0].result, Ok(sum(&a)));
    assert_eq!(got[1].result, Ok(sum(&b)));
    let mut at = 0usize;
    for &(off, len) in a.iter().chain(&b) {
        let want = &data[at..at + len as usize];
        assert!(read_range(&p, off, len) == want, "range at {off} differs");
        at += len as usize;
    }
    assert_eq!(read_range(&p, 4095, 1), vec![0xEE], "gap byte untouched");
    assert_eq!(read_range(&p, MIB + 3, 97), vec![0xEE; 97]);
    let s = f.stats();
    assert_eq!((s.posted_ops, s.completed_ops, s.inflight_ops), (2, 2, 0));
    assert_eq!(
        (s.bytes_pulled, s.bytes_pushed, s.errors, s.inflight_wr),
        (total, 0, 0, 0)
    );
    drop(sender.join().expect("sender"));
    f.teardown(conn);
    assert!(wait_teardown(&f, conn).is_empty());
}

/// Push of items below and above the zero-copy threshold: the peer reads exactly the ranges'
/// bytes in item order; zero-copy sends (uring) are all notified before the completion.
pub(super) fn push_round_trip(opts: TcpFabricOptions) {
    let uring = opts.engine == TcpEngine::Uring;
    let zc = opts.zc_min_bytes as u64;
    let (p, f) = setup(opts, 16 * MIB);
    let ranges = [
        (5 * MIB, 100),
        (0, zc - 1),
        (MIB, zc),
        (8 * MIB, 3 * MIB + 5),
        (2 * MIB, 1),
    ];
    let mut want = Vec::new();
    for (i, &(off, len)) in ranges.iter().enumerate() {
        let bytes = pattern(i as u8 * 17 + 3, len as usize);
        p.region().write_at(off, &bytes).expect("write");
        want.extend_from_slice(&bytes);
    }
    let (node, mut peer) = tcp_pair();
    let conn = connect(&f, &node);
    let total = want.len();
    let reader = std::thread::spawn(move || {
        let mut got = vec![0u8; total];
        peer.read_exact(&mut got).expect("peer read");
        (peer, got)
    });
    post(&f, 9, conn, Dir::Push, &stream_items(&ranges), far()).expect("post");
    let done = wait_n(&f, 1);
    assert_eq!(done[0].result, Ok(total as u64));
    let zc_now = f.zc_counters();
    let (_peer, got) = reader.join().expect("reader");
    assert!(got == want, "pushed bytes differ");
    let s = f.stats();
    assert_eq!(
        (s.bytes_pushed, s.bytes_pulled, s.completed_ops),
        (total as u64, 0, 1)
    );
    if uring {
        // The first large item takes SendZc; the second does too unless the kernel already
        // reported the first as copied (loopback), which switches the connection to plain
        // sends (`copied_zero_copy_sends_switch_the_connection_to_plain_sends`).
        assert!(zc_now.sends >= 1, "a large item takes SendZc: {zc_now:?}");
        assert!(
            zc_now.sends >= 2 || zc_now.copied >= 1,
            "both large items take SendZc unless the first was copied: {zc_now:?}"
        );
        assert_eq!(zc_now.notifications, zc_now.sends, "all notified first");
    } else {
        assert_eq!(zc_now, ZcCounters::default());
    }
}

/// A large Push (SendZc on uring) to a slow reader: the completion comes only after the peer
/// could read everything and every notification was reaped.
pub(super) fn push_large_slow_reader(opts: TcpFabricOptions) {
    let uring = opts.engine == TcpEngine::Uring;
    let (p, f) = setup(opts, 32 * MIB);
    let len = 24 * MIB;
    let bytes = pattern(99, len as usize);
    p.region().write_at(4 * MIB, &bytes).expect("write");
    let (node, mut peer) = tcp_pair();
    let conn = connect(&f, &node);
    node.set_nonblocking(true).expect("nonblocking");
    post(
        &f,
        1,
        conn,
        Dir::Push,
        &stream_items(&[(4 * MIB, len)]),
        far(),
    )
    .expect("post");
    let reader = std::thread::spawn(move || {
        let mut got = vec![0u8; len as usize];
        let mut rng = Rng(5);
        let mut at = 0;
        while at < got.len() {
            let n = (1 + rng.below(MIB) as usize).min(got.len() - at);
            peer.read_exact(&mut got[at..at + n]).expect("read");
            at += n;
            std::thread::yield_now();
        }
        got
    });
    let done = wait_n(&f, 1);
    assert_eq!(done[0].result, Ok(len));
    let zc = f.zc_counters();
    assert!(reader.join().expect("reader") == bytes, "bytes differ");
    if uring {
        assert!(zc.sends >= 1 && zc.notifications == zc.sends, "{zc:?}");
    }
    assert_eq!(f.stats().bytes_pushed, len);
}

/// A sender that stalls: the op completes with `Deadline`; the bytes the sender writes later
/// never reach the range; the connection is broken; its teardown still ends.
pub(super) fn deadline_stalled_sender(opts: TcpFabricOptions) {
    let (p, f) = setup(opts, 4 * MIB);
    p.region().fill_at(0, 4 * MIB, 0x11).expect("fill");
    let (node, mut peer) = tcp_pair();
    let conn = connect(&f, &node);
    let range = (MIB, 256 << 10);
    let deadline = Instant::now() + Duration::from_millis(200);
    post(&f, 1, conn, Dir::Pull, &stream_items(&[range]), deadline).expect("post");
    peer.write_all(&[0x22; 1000]).expect("first bytes");
    let done = wait_n(&f, 1);
    assert_eq!(done[0].result, Err(FabricError::Deadline));
    let at_completion = read_range(&p, range.0, range.1);
    // The sender goes on; nothing of it may land in the range any more.
    peer.write_all(&vec![0x33; range.1 as usize])
        .expect("late bytes");
    peer.flush().expect("flush");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        read_range(&p, range.0, range.1) == at_completion,
        "the range changed after its Deadline completion"
    );
    assert!(!read_range(&p, range.0, range.1).contains(&0x33));
    assert_eq!(
        post(&f, 2, conn, Dir::Pull, &stream_items(&[(0, 10)]), far()),
        Err(PostError::ConnGone)
    );
    let s = f.stats();
    assert_eq!((s.errors, s.bytes_pulled, s.inflight_ops), (1, 0, 0));
    f.teardown(conn);
    assert!(wait_teardown(&f, conn).is_empty());
}

/// A Push to a peer that never reads, with a short deadline: `Deadline` (uring: after the cancel
/// and every notification of the partly queued data).
pub(super) fn deadline_stalled_reader(opts: TcpFabricOptions) {
    let uring = opts.engine == TcpEngine::Uring;
    let (p, f) = setup(opts, 32 * MIB);
    let (node, peer) = tcp_pair();
    small_buffers(&node, &peer);
    let conn = connect(&f, &node);
    let deadline = Instant::now() + Duration::from_millis(200);
    p.region().fill_at(0, 24 * MIB, 0x5A).expect("fill");
    post(
        &f,
        1,
        conn,
        Dir::Push,
        &stream_items(&[(0, 24 * MIB)]),
        deadline,
    )
    .expect("post");
    let done = wait_n(&f, 1);
    assert_eq!(done[0].result, Err(FabricError::Deadline));
    let zc = f.zc_counters();
    assert_eq!(
        zc.notifications, zc.sends,
        "every notification reaped first: {zc:?}"
    );
    if uring {
        assert!(zc.sends >= 1, "the push went zero-copy: {zc:?}");
    }
    f.teardown(conn);
    assert!(wait_teardown(&f, conn).is_empty());
    drop(peer);
}

/// The peer closes mid-Pull: `PeerGone`; later posts `ConnGone`; the queued op is flushed.
pub(super) fn peer_closes_mid_pull(opts: TcpFabricOptions) {
    let (_p, f) = setup(opts, 4 * MIB);
    let (node, mut peer) = tcp_pair();
    let conn = connect(&f, &node);
    post(&f, 1, conn, Dir::Pull, &stream_items(&[(0, MIB)]), far()).expect("post");
    post(&f, 2, conn, Dir::Pull, &stream_items(&[(MIB, 10)]), far()).expect("post");
    peer.write_all(&[1; 5000]).expect("write");
    drop(peer);
    let mut done = wait_n(&f, 2);
    done.sort_by_key(|c| c.op);
    assert_eq!(done[0].result, Err(FabricError::PeerGone));
    assert_eq!(done[1].result, Err(FabricError::Flushed));
    assert_eq!(
        post(&f, 3, conn, Dir::Pull, &stream_items(&[(0, 10)]), far()),
        Err(PostError::ConnGone)
    );
    assert_eq!(f.stats().errors, 2);
    f.teardown(conn);
    assert!(wait_teardown(&f, conn).is_empty());
}

/// `post` refusals: every malformed batch is `Invalid`, an unknown connection `ConnGone`, and
/// nothing of a refused batch counts as posted.
pub(super) fn post_validation(opts: TcpFabricOptions) {
    let f = TcpFabric::new(opts.clone()).expect("fabric");
    let (node, _peer) = tcp_pair();
    let conn = connect(&f, &node);
    let one = stream_items(&[(0, 10)]);
    assert!(matches!(
        post(&f, 1, conn, Dir::Pull, &one, far()),
        Err(PostError::Invalid(m)) if m.contains("no pool")
    ));
    let p = pool(4 * MIB);
    f.register(&p).expect("register");
    assert!(matches!(
        f.register(&pool(2 * MIB)),
        Err(crate::HwError::Invalid(_))
    ));
    let bad: Vec<(Vec<WorkItem>, &str)> = vec![
        (vec![], "no items"),
        (stream_items(&[(0, 0)]), "empty"),
        (stream_items(&[(u64::MAX - 1, 5)]), "overflows"),
        (stream_items(&[(4 * MIB - 1, 2)]), "not inside"),
        (stream_items(&[(0, 100), (50, 100)]), "overlap"),
        (
            vec![WorkItem {
                local: LocalRange { offset: 0, len: 8 },
                remote: RemoteSeg::Rdma { addr: 0, rkey: 1 },
            }],
            "stream",
        ),
    ];
    for (items, why) in &bad {
        match post(&f, 1, conn, Dir::Pull, items, far()) {
            Err(PostError::Invalid(m)) => assert!(m.contains(why), "{m} lacks {why}"),
            other => panic!("{why}: {other:?}"),
        }
    }
    let many = stream_items(&vec![(0, 1); TCP_MAX_ITEMS_PER_BATCH + 1]);
    assert!(matches!(
        post(&f, 1, conn, Dir::Push, &many, far()),
        Err(PostError::Invalid(m)) if m.contains("TCP_MAX_ITEMS_PER_BATCH")
    ));
    assert!(matches!(
        post(&f, u64::MAX, conn, Dir::Pull, &one, far()),
        Err(PostError::Invalid(m)) if m.contains("reserved")
    ));
    assert_eq!(
        post(&f, 1, ConnId(999), Dir::Pull, &one, far()),
        Err(PostError::ConnGone)
    );
    assert_eq!(f.stats(), FabricStats::default());
    post(&f, 1, conn, Dir::Pull, &one, far()).expect("valid post");
    assert!(matches!(
        post(&f, 1, conn, Dir::Pull, &stream_items(&[(100, 10)]), far()),
        Err(PostError::Invalid(m)) if m.contains("already in flight")
    ));
    f.teardown(conn);
    f.teardown(conn); // idempotent
    let before = wait_teardown(&f, conn);
    assert_eq!(before.len(), 1);
    assert_eq!(before[0].result, Err(FabricError::Flushed));
    assert_eq!(
        post(&f, 2, conn, Dir::Pull, &one, far()),
        Err(PostError::ConnGone)
    );
    f.teardown(conn); // unknown now: ignored
    let mut rest = Vec::new();
    assert_eq!(f.poll(&mut rest, 8, Duration::from_millis(50)), 0);
    let s = f.stats();
    assert_eq!(
        (s.posted_ops, s.completed_ops, s.errors, s.inflight_ops),
        (1, 1, 1, 0)
    );
}

/// `connect` refuses what is not a TCP stream; `new` refuses options out of bounds.
pub(super) fn connect_and_options(opts: TcpFabricOptions) {
    let f = TcpFabric::new(opts.clone()).expect("fabric");
    assert_eq!(f.kind(), FabricKind::Tcp);
    assert_eq!(f.engine(), opts.engine);
    assert!(f.prepare_endpoint().expect("none").is_none());
    let file = std::fs::File::open("/proc/self/stat").expect("file");
    assert!(f.connect(ConnSetup::Tcp(OwnedFd::from(file))).is_err());
    assert!(f.connect(ConnSetup::Fake(FakePeer::default())).is_err());
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    assert!(f.connect(ConnSetup::Tcp(OwnedFd::from(udp))).is_err());
    for bad in [
        TcpFabricOptions {
            rings: 0,
            ..opts.clone()
        },
        TcpFabricOptions {
            rings: TCP_MAX_RINGS + 1,
            ..opts.clone()
        },
        TcpFabricOptions {
            max_inflight_ops: 0,
            ..opts.clone()
        },
        TcpFabricOptions {
            max_inflight_ops: TCP_MAX_INFLIGHT_OPS + 1,
            ..opts.clone()
        },
    ] {
        assert!(matches!(
            TcpFabric::new(bad),
            Err(crate::HwError::Invalid(_))
        ));
    }
}

/// An item that spans a registered piece is moved in two I/Os cut at the piece boundary (a
/// fixed-buffer request never crosses one); short transfers continue where they stopped.
#[test]
fn op_run_cuts_at_piece_boundaries_and_continues_short_transfers() {
    use super::tcp_core::{Job, OpRun, PIECE_BYTES};
    let job = Job {
        op: OpId(1),
        conn: ConnId(1),
        dir: Dir::Pull,
        items: vec![
            LocalRange {
                offset: PIECE_BYTES - 10,
                len: 30,
            },
            LocalRange { offset: 0, len: 5 },
        ],
        deadline: far(),
    };
    let mut run = OpRun::new(job);
    let io = run.next_io().expect("io");
    assert_eq!((io.offset, io.len, io.item_len), (PIECE_BYTES - 10, 10, 30));
    run.advance(4);
    let io = run.next_io().expect("io");
    assert_eq!((io.offset, io.len), (PIECE_BYTES - 6, 6));
    run.advance(6);
    let io = run.next_io().expect("io");
    assert_eq!((io.offset, io.len), (PIECE_BYTES, 20));
    assert_eq!(run.moved(), 0, "the item is not complete yet");
    run.advance(20);
    assert_eq!(run.moved(), 30);
    let io = run.next_io().expect("io");
    assert_eq!((io.offset, io.len, io.item_len), (0, 5, 5));
    run.advance(5);
    assert!(run.is_done() && run.next_io().is_none());
    assert_eq!(run.moved(), 35);
}

/// A connection whose zero-copy sends the kernel reports as copied (a local peer: loopback)
/// sends with plain copies from then on: the second Push adds no `SendZc`, and its bytes are
/// right.
#[test]
fn copied_zero_copy_sends_switch_the_connection_to_plain_sends() {
    let len = 2 * MIB;
    let (p, f) = setup(uring_fixed(), 8 * MIB);
    let (node, mut peer) = tcp_pair();
    let conn = connect(&f, &node);
    let bytes = pattern(9, len as usize);
    p.region().write_at(0, &bytes).expect("fill");
    for op in 1..=2 {
        post(&f, op, conn, Dir::Push, &stream_items(&[(0, len)]), far()).expect("post");
        let mut got = vec![0u8; len as usize];
        peer.read_exact(&mut got).expect("read");
        assert!(got == bytes, "push {op}: bytes differ");
        assert_eq!(wait_n(&f, 1)[0].result, Ok(len));
        let zc = f.zc_counters();
        if op == 1 {
            assert!(zc.sends >= 1, "the first push is a zero-copy send: {zc:?}");
            assert!(zc.copied >= 1, "loopback copies: {zc:?}");
        } else {
            let first = zc.sends;
            post(&f, 3, conn, Dir::Push, &stream_items(&[(0, len)]), far()).expect("post");
            peer.read_exact(&mut got).expect("read");
            assert_eq!(wait_n(&f, 1)[0].result, Ok(len));
            assert_eq!(f.zc_counters().sends, first, "no more zero-copy sends");
        }
    }
}
