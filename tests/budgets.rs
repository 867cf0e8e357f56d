//! Budgets in bytes and deadlines of the native protocol (issue 11), against the real binary:
//! lookup sessions keep only what they hit and stay within `limits.max_session_bytes`; frames
//! that stall are cut off after `limits.frame_timeout_ms`; idle connections without instances
//! are closed after `limits.idle_timeout_secs`; payload bytes being received stay within
//! `limits.max_inflight_payload_bytes`. Memory is the node's anonymous resident set (`RssAnon`:
//! heap and stacks, not the shared pool). Every wait polls for a condition under a generous
//! deadline; nothing assumes a speed.

mod common;

use std::io::{ErrorKind as IoKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvnode::client::ChunkRangeBuilder;
use kvnode::protocol::frame::{decode_response, encode_request, FrameHeader, HEADER_BYTES};
use kvnode::protocol::{ChunkRange, Request, Response, MAX_PAYLOAD_BYTES};
use kvnode::ErrorKind;
use rkyv::util::AlignedVec;

const MIB: u64 = 1 << 20;

/// The node's anonymous resident memory in bytes (`RssAnon` in /proc/<pid>/status).
fn rss_anon(node: &NodeProc) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", node.child.id())).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("RssAnon in /proc/<pid>/status");
    kb * 1024
}

/// An all-ranks range over `hashes` (world size 1).
fn lookup_range(hashes: Vec<[u8; 32]>) -> ChunkRange {
    ChunkRangeBuilder::all_ranks(MODEL, 1).hashes(0, hashes)
}

/// `n` hashes that name nothing stored.
fn unknown_hashes(n: usize) -> Vec<[u8; 32]> {
    (0..n as u64)
        .map(|i| *blake3::hash(&i.to_le_bytes()).as_bytes())
        .collect()
}

/// Stores `chunks` chunks of conversation 1 through instance 1 (registered over `c`) and
/// returns their hashes.
fn store_chunks(c: &mut kvnode::client::Client, chunks: u32) -> Vec<[u8; 32]> {
    let len = c.register(&reg(1)).unwrap().object_bytes as usize;
    let r = range(&tokens(1, chunks));
    let data = payloads(&r, len);
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    assert_eq!(c.store(1, &r, &refs).unwrap(), chunks as usize);
    r.chunk_hashes
}

/// Before issue 11 every LOOKUP kept its whole hash list as a session, even a complete miss
/// (1000 lookups of 65,536 hashes added 2 GB). Now a miss keeps no session and a hit keeps
/// only its locks: 256 lookups of 32,768 hashes (256 MiB of hash lists) leave the node's memory
/// within the session budget plus the buffers of the requests in flight.
#[test]
fn lookups_of_long_prompts_keep_only_their_hits() {
    const BUDGET: u64 = 16 * MIB;
    let node = NodeProc::start_with_config(
        "sessions-mem",
        &format!("[limits]\nmax_session_bytes = {BUDGET}\n"),
        &[],
    );
    let mut c = node.client();
    let stored = store_chunks(&mut c, 4);
    let mut hashes = unknown_hashes(32_768);
    // Warm-up: the allocator's buffers for one such request exist before the baseline.
    c.lookup("warm", &lookup_range(hashes.clone()), 1).unwrap();
    let before = rss_anon(&node);
    for i in 0..256 {
        // Every other lookup starts with the 4 stored chunks (4 hits), the rest miss at once.
        let hits = i % 2 == 1;
        if hits {
            hashes[..4].copy_from_slice(&stored);
        } else {
            hashes[..4].copy_from_slice(&unknown_hashes(4));
        }
        let got = c
            .lookup(&format!("req-{i}"), &lookup_range(hashes.clone()), 1)
            .unwrap();
        assert_eq!(got, if hits { 4 } else { 0 }, "lookup {i}");
    }
    let grown = rss_anon(&node).saturating_sub(before);
    eprintln!("256 lookups grew the node's RssAnon by {} KiB", grown >> 10);
    let status = node.status();
    assert_eq!(
        num(&status, &["sessions"]),
        128,
        "only the lookups that hit keep a session"
    );
    let bytes = num(&status, &["session_bytes"]);
    assert!(bytes > 0 && bytes <= BUDGET, "session_bytes {bytes}");
    // The sessions' budget, plus room for the transient buffers of a request and the
    // allocator's slack (a hash list kept per lookup would add 256 MiB).
    let bound = BUDGET + 48 * MIB;
    assert!(
        grown < bound,
        "the node's memory grew by {} MiB over 256 lookups (bound {} MiB)",
        grown / MIB,
        bound / MIB
    );
}

/// Sessions stay within `limits.max_session_bytes`: new ones evict old ones (whose read locks
/// are released), and a single session larger than the whole budget is refused, naming it.
#[test]
fn sessions_stay_within_their_byte_budget() {
    const BUDGET: u64 = 32 << 10;
    let node = NodeProc::start_with_config(
        "sessions-budget",
        &format!("[limits]\nmax_session_bytes = {BUDGET}\n"),
        &[],
    );
    let mut c = node.client();
    let stored = store_chunks(&mut c, 600);
    // 50 sessions hitting 64 chunks each (about 4 KiB of locks apiece): only a few fit.
    let mut hashes = stored[..64].to_vec();
    hashes.extend(unknown_hashes(10));
    for i in 0..50 {
        let got = c
            .lookup(&format!("s{i}"), &lookup_range(hashes.clone()), 1)
            .unwrap();
        assert_eq!(
            got, 64,
            "a lookup is never refused for room that eviction can make"
        );
    }
    let status = node.status();
    let (sessions, bytes) = (
        num(&status, &["sessions"]),
        num(&status, &["session_bytes"]),
    );
    assert!(
        (1..50).contains(&sessions) && bytes <= BUDGET,
        "{sessions} sessions of {bytes} bytes"
    );
    assert_eq!(num(&status, &["objects", "read_locked"]), 64);
    // One session of 600 chunks needs more than the whole budget.
    let e = c
        .lookup("huge", &lookup_range(stored.clone()), 1)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
    assert!(e.to_string().contains("max_session_bytes"), "{e}");
    // Ending the sessions that are left unlocks everything: the evicted ones (and the refused
    // one) released their locks when they went.
    for i in 0..50 {
        c.end_session(&format!("s{i}")).unwrap();
    }
    let status = node.status();
    assert_eq!(num(&status, &["objects", "read_locked"]), 0, "{status:#}");
    assert_eq!(num(&status, &["session_bytes"]), 0);
    assert_eq!(status["memcheck_ok"], true);
}

/// A frame header announcing `payload_len` bytes for LOOKUP request `id`.
fn header(id: u64, payload_len: u32) -> [u8; HEADER_BYTES] {
    let opcode = Request::Lookup {
        request_id: String::new(),
        range: lookup_range(Vec::new()),
        tp_size: 1,
        readers: 0,
    }
    .opcode();
    FrameHeader {
        opcode,
        flags: 0,
        request_id: id,
        payload_len,
        trailer_len: 0,
    }
    .encode()
}

/// Reads from a socket with a read timeout until the node closes it; returns the bytes read.
/// Panics if the connection stays open for `deadline`.
fn read_until_closed(s: &mut UnixStream, deadline: Duration, what: &str) -> Vec<u8> {
    let end = Instant::now() + deadline;
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => {}
            Err(e) if e.kind() == IoKind::Interrupted => {}
            Err(_) => return out,
        }
        assert!(
            Instant::now() < end,
            "{what}: the node kept the connection open for {deadline:?}"
        );
    }
}

/// The typed error reply at the start of `bytes`.
fn error_reply(bytes: &[u8]) -> (u64, ErrorKind, String) {
    assert!(bytes.len() >= HEADER_BYTES, "no reply: {bytes:?}");
    let h = FrameHeader::decode(bytes[..HEADER_BYTES].try_into().unwrap()).unwrap();
    let mut p = AlignedVec::<16>::new();
    p.extend_from_slice(&bytes[HEADER_BYTES..HEADER_BYTES + h.payload_len as usize]);
    match decode_response(&p).unwrap() {
        Response::Error { kind, message } => (h.request_id, ErrorKind::from_code(kind), message),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

/// 256 connections each announce a 16 MiB payload, send 2 MiB of it and stall. Before issue 11
/// the node received every byte into a growing buffer per connection (about 1 GiB) and kept the
/// connections forever; now payload buffers stay within `limits.max_inflight_payload_bytes`
/// (connections beyond it are not read: back-pressure) and every connection is cut off at its
/// frame deadline.
#[test]
fn stalled_frames_are_cut_off_and_payload_memory_is_capped() {
    const CAP: u64 = MAX_PAYLOAD_BYTES as u64;
    const CONNS: usize = 256;
    const SENT: usize = 2 << 20;
    let node = NodeProc::start_with_config(
        "stalled-frames",
        &format!("[limits]\nframe_timeout_ms = 1000\nmax_inflight_payload_bytes = {CAP}\n"),
        &[],
    );
    let before = rss_anon(&node);
    let mut peak = before;
    let mut conns: Vec<(UnixStream, usize, bool)> = (0..CONNS)
        .map(|i| {
            let mut s = UnixStream::connect(&node.socket).unwrap();
            s.write_all(&header(i as u64 + 1, MAX_PAYLOAD_BYTES))
                .unwrap();
            s.set_nonblocking(true).unwrap();
            (s, 0, false)
        })
        .collect();
    // Push payload bytes wherever the node takes them, until each connection has sent its
    // share or was closed; then wait for every connection to be closed.
    let chunk = vec![0u8; 64 << 10];
    let end = Instant::now() + Duration::from_secs(90);
    loop {
        let mut open = 0;
        for (s, sent, closed) in conns.iter_mut().filter(|c| !c.2) {
            if *sent < SENT {
                match s.write(&chunk[..(SENT - *sent).min(chunk.len())]) {
                    Ok(n) => *sent += n,
                    Err(e) if e.kind() == IoKind::WouldBlock => {}
                    Err(_) => *closed = true,
                }
            }
            let mut buf = [0u8; 4096];
            match s.read(&mut buf) {
                Ok(0) => *closed = true,
                Ok(_) => {}
                Err(e) if e.kind() == IoKind::WouldBlock => {}
                Err(_) => *closed = true,
            }
            if !*closed {
                open += 1;
            }
        }
        peak = peak.max(rss_anon(&node));
        if open == 0 {
            break;
        }
        assert!(
            Instant::now() < end,
            "{open} of {CONNS} stalled connections still open (RssAnon peaked {} MiB above the \
             start); log:\n{}",
            peak.saturating_sub(before) / MIB,
            node.log()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let grown = peak.saturating_sub(before);
    eprintln!(
        "{CONNS} stalled frames: RssAnon peaked {} KiB above the start",
        grown >> 10
    );
    // The payload cap, plus per connection its 64 KiB read buffer, a payload buffer of at most
    // 128 KiB kept between frames and its thread's stack, plus slack.
    let bound = CAP + CONNS as u64 * (512 << 10) + 32 * MIB;
    assert!(
        grown < bound,
        "the node's memory grew by {} MiB (bound {} MiB)",
        grown / MIB,
        bound / MIB
    );
    // The node serves on, with nothing left behind.
    node.client().noop().unwrap();
    let status = node.wait_status("stalled connections gone", |s| {
        num(s, &["connections"]) <= 1
    });
    assert_eq!(status["memcheck_ok"], true);
}

/// A client that sends part of a header, or a header and part of its payload, and stalls is
/// answered `LimitExceeded` naming the frame deadline and disconnected.
#[test]
fn partial_frames_are_refused_at_the_frame_deadline() {
    let node =
        NodeProc::start_with_config("partial-frames", "[limits]\nframe_timeout_ms = 500\n", &[]);
    let mut part_header = UnixStream::connect(&node.socket).unwrap();
    part_header.write_all(&header(7, 100)[..10]).unwrap();
    let mut part_payload = UnixStream::connect(&node.socket).unwrap();
    part_payload.write_all(&header(8, 1000)).unwrap();
    part_payload.write_all(&[0u8; 10]).unwrap();
    let deadline = Duration::from_secs(60);
    for (s, want_id, what) in [
        (&mut part_header, 0, "part of a header"),
        (&mut part_payload, 8, "part of a payload"),
    ] {
        let reply = read_until_closed(s, deadline, what);
        let (id, kind, message) = error_reply(&reply);
        assert_eq!((id, kind), (want_id, ErrorKind::LimitExceeded), "{what}");
        assert!(message.contains("frame_timeout_ms"), "{what}: {message}");
    }
    node.client().noop().unwrap();
}

/// With `limits.idle_timeout_secs = 2`: a connection without instances that sends nothing is
/// closed, whether it sent a request before or none at all; one that keeps pinging stays open,
/// and so does an idle one whose instance is still registered (liveness watches that one).
#[test]
fn idle_connections_without_instances_are_closed() {
    let node = NodeProc::start_with_config("idle-conns", "[limits]\nidle_timeout_secs = 2\n", &[]);
    let mut with_instance = node.client();
    with_instance.register(&reg(1)).unwrap();
    // A client that pings all along.
    let stop = Arc::new(AtomicBool::new(false));
    let pings = Arc::new(AtomicU64::new(0));
    let pinger = {
        let (mut c, stop, pings) = (node.client(), stop.clone(), pings.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                c.ping(None).expect("a pinging connection is never closed");
                pings.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(100));
            }
            c
        })
    };
    // One request, then silence.
    let mut quiet = UnixStream::connect(&node.socket).unwrap();
    quiet
        .write_all(&encode_request(1, &Request::Noop).unwrap())
        .unwrap();
    let reply = read_until_closed(&mut quiet, Duration::from_secs(60), "idle after a request");
    assert!(reply.len() > HEADER_BYTES, "the NOOP was answered first");
    // Not a single request.
    let mut silent = UnixStream::connect(&node.socket).unwrap();
    let reply = read_until_closed(&mut silent, Duration::from_secs(60), "silent");
    assert!(
        reply.is_empty(),
        "an idle connection is closed without a reply"
    );
    // Both idle periods went by while the others kept their connections.
    stop.store(true, Ordering::Relaxed);
    let mut pinger = pinger.join().expect("the pinging client was never cut off");
    assert!(pings.load(Ordering::Relaxed) > 0);
    pinger.noop().unwrap();
    with_instance.noop().unwrap();
    with_instance.ping(Some(1)).unwrap();
}
