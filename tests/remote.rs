//! Remote engines over TCP, end to end with the real `kvnode` binary: every byte verified,
//! authentication enforced, isolation between connections, and a remote engine that dies or
//! falls silent (mid-transfer too) released with nothing published.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::remote::{new_token, options, raw_call, raw_connect, RemoteNode};
use common::{kvnode_until_exit, num, payloads, range, reg, tokens, NodeProc, TestDir, MODEL};
use kvnode::client::RemoteClient;
use kvnode::error::ErrorKind;
use kvnode::protocol::frame::{
    decode_response, encode_request_with_trailer, FrameHeader, HEADER_BYTES,
};
use kvnode::protocol::{DataPath, RegisterRequest, Request, Response};
use kvnode::transport::tcp::auth::Token;

/// A registration whose objects are `layers * 2 * CHUNK * hidden * 4` bytes.
fn reg_sized(instance_id: u64, layers: u32, hidden: u32) -> RegisterRequest {
    RegisterRequest {
        num_layers: layers,
        hidden_dim: hidden,
        ..reg(instance_id)
    }
}

/// Waits until the node has no instance left and no pending transfer, then checks memcheck.
fn wait_released(node: &NodeProc, what: &str) -> serde_json::Value {
    let st = node.wait_status(what, |s| {
        s["instances"].as_array().is_some_and(Vec::is_empty)
            && s["pending_writes"] == 0
            && s["pending_reads"] == 0
    });
    let (ok, problems) = node.client().memcheck().unwrap();
    assert!(ok, "memcheck: {problems:?}");
    st
}

#[test]
fn remote_store_and_retrieve_move_every_byte() {
    store_and_retrieve_every_byte("uring");
}

#[test]
fn the_plain_tcp_engine_moves_every_byte_too() {
    store_and_retrieve_every_byte("plain");
}

fn store_and_retrieve_every_byte(engine: &str) {
    let rn = RemoteNode::start(
        &format!("remote-bytes-{engine}"),
        &["--pool-size", "256MiB", "--tcp-engine", engine],
    );
    assert_eq!(rn.node.status()["transports"]["tcp_engine"], engine);
    // Small objects (16 KiB) and large ones (4 MiB): the trailer crosses the reader's buffer
    // and the fabric receives most of it straight into the slots.
    for (inst, layers, hidden) in [(1u64, 2u32, 64u32), (2, 32, 1024)] {
        let mut c = rn.client();
        let r = c.register(&reg_sized(inst, layers, hidden)).unwrap();
        assert!(!r.fd_attached, "no pool fd over TCP");
        let len = r.object_bytes as usize;
        let rg = range(&tokens(inst as u32, 5));
        let data = payloads(&rg, len);
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        assert_eq!(c.store(inst, &rg, &refs).unwrap(), 5);
        assert_eq!(
            c.store(inst, &rg, &refs).unwrap(),
            0,
            "dedupe: nothing resent"
        );
        let got = c.retrieve(inst, &rg).unwrap().expect("a hit");
        assert!(got == data, "retrieved bytes differ ({len}-byte objects)");
        // A local engine sees the same bytes through the pool.
        let mut local = rn.node.client();
        local
            .register(&reg_sized(inst + 100, layers, hidden))
            .unwrap();
        let got_local = local.retrieve(inst + 100, &rg).unwrap().expect("a hit");
        assert!(
            got_local == data,
            "a local reader sees what the remote engine stored"
        );
        let miss = c.retrieve(inst, &range(&tokens(999, 1))).unwrap();
        assert!(miss.is_none());
    }
    let st = rn.node.status();
    assert_eq!(st["transports"]["tcp_auth"], "token", "{st:#}");
    assert!(num(&st, &["remote", "bytes_in"]) >= 20 << 20, "{st:#}");
    assert!(num(&st, &["remote", "bytes_out"]) >= 20 << 20, "{st:#}");
    assert_eq!(num(&st, &["pending_writes"]), 0);
}

#[test]
fn lookups_and_sessions_work_for_remote_engines() {
    let rn = RemoteNode::start("remote-lookup", &[]);
    let mut c = rn.client();
    let r = c.register(&reg(1)).unwrap();
    let rg = range(&tokens(3, 4));
    let data = payloads(&rg, r.object_bytes as usize);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    c.store(1, &rg, &refs).unwrap();
    let all = kvnode::client::ChunkRangeBuilder::all_ranks(MODEL, 1).tokens(&tokens(3, 4), 16);
    assert_eq!(c.lookup("req-1", &all, 1).unwrap(), 4);
    let mut bufs = vec![vec![0u8; r.object_bytes as usize]; 4];
    let mut out: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    assert!(c.retrieve_into(1, &rg, Some("req-1"), &mut out).unwrap());
    assert!(bufs == data);
    c.end_session("req-1").unwrap();
    let st = rn.node.status();
    assert_eq!(num(&st, &["objects", "read_locked"]), 0, "{st:#}");
}

#[test]
fn tokens_are_enforced_and_failures_exit_3() {
    let rn = RemoteNode::start("remote-auth", &[]);
    let dir = TestDir::new("remote-auth-cli");
    let wrong = new_token(&dir, "wrong.token");
    let url = rn.url.clone();
    let ok = kvnode_until_exit(
        &dir,
        &[
            "ping",
            "--remote",
            &url,
            "--token-file",
            rn.token_file.to_str().unwrap(),
        ],
    );
    assert!(ok.status.is_some_and(|s| s.success()), "{}", ok.stderr);
    assert!(
        ok.stdout.contains("pong") && ok.stdout.contains("via tcp"),
        "{}",
        ok.stdout
    );
    let bad = kvnode_until_exit(
        &dir,
        &[
            "ping",
            "--remote",
            &url,
            "--token-file",
            wrong.to_str().unwrap(),
        ],
    );
    assert_eq!(bad.status.and_then(|s| s.code()), Some(3), "{}", bad.stderr);
    assert!(
        bad.stderr.contains("authentication failed"),
        "{}",
        bad.stderr
    );
    let none = kvnode_until_exit(&dir, &["status", "--remote", &url]);
    assert_eq!(
        none.status.and_then(|s| s.code()),
        Some(3),
        "{}",
        none.stderr
    );
    let st = kvnode_until_exit(
        &dir,
        &[
            "status",
            "--remote",
            &url,
            "--token-file",
            rn.token_file.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(st.status.is_some_and(|s| s.success()), "{}", st.stderr);
    let v: serde_json::Value = serde_json::from_str(&st.stdout).unwrap();
    assert_eq!(
        v["transports"]["tcp_auth"], "token",
        "a client sees the transports: {v:#}"
    );
    assert!(
        v["remote"].is_null(),
        "only admins see the remote connections: {v:#}"
    );
    let st = kvnode_until_exit(
        &dir,
        &[
            "status",
            "--remote",
            &url,
            "--token-file",
            rn.admin_file.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(st.status.is_some_and(|s| s.success()), "{}", st.stderr);
    let v: serde_json::Value = serde_json::from_str(&st.stdout).unwrap();
    assert!(
        num(&v, &["remote", "handshakes", "auth_failed"]) >= 2,
        "{v:#}"
    );
    // A wrong token never reaches a request: no instance, nothing allocated.
    assert!(v["instances"].as_array().unwrap().is_empty());
    // The client token may not CLEAR; the admin token may.
    let mut c = rn.client();
    let e = c.clear().unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    rn.client_with(&rn.admin_file).clear().unwrap();
}

#[test]
fn serve_refuses_an_open_port_without_a_token() {
    let dir = TestDir::new("remote-noauth");
    let sock = dir.join("n.sock");
    let out = kvnode_until_exit(
        &dir,
        &[
            "serve",
            "--socket",
            sock.to_str().unwrap(),
            "--pool-size",
            "16MiB",
            "--listen",
            "tcp://127.0.0.1:0",
        ],
    );
    assert!(out.failed(), "the node started: {}", out.stderr);
    assert!(out.stderr.contains("--auth-token-file"), "{}", out.stderr);
    // A token file others may read is refused, naming it.
    let loose = dir.join("loose.token");
    std::fs::write(&loose, "0123456789abcdef0123456789abcdef0123").unwrap();
    std::fs::set_permissions(&loose, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = kvnode_until_exit(
        &dir,
        &[
            "serve",
            "--socket",
            sock.to_str().unwrap(),
            "--pool-size",
            "16MiB",
            "--listen",
            "tcp://127.0.0.1:0",
            "--auth-token-file",
            loose.to_str().unwrap(),
        ],
    );
    assert!(out.failed(), "the node started: {}", out.stderr);
    assert!(out.stderr.contains("loose.token"), "{}", out.stderr);
}

#[test]
fn insecure_mode_serves_tokenless_clients_and_token_clients_refuse_it() {
    let node = NodeProc::start(
        "remote-insecure",
        &["--listen", "tcp://127.0.0.1:0", "--insecure-no-auth"],
    );
    let url = common::remote::listen_url(&node);
    assert_eq!(node.status()["transports"]["tcp_auth"], "none");
    let mut c = RemoteClient::connect_remote(&url, None, &options()).unwrap();
    assert_eq!(c.noop().unwrap(), "OK");
    let dir = TestDir::new("remote-insecure-tok");
    let t = Token::from_file(&new_token(&dir, "t")).unwrap();
    let e = RemoteClient::connect_remote(&url, Some(&t), &options())
        .err()
        .expect("a token client refuses a node that does not authenticate");
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
}

#[test]
fn a_connection_cannot_touch_another_connections_transfer() {
    let rn = RemoteNode::start("remote-isolation", &[]);
    let mut a = rn.client();
    let r = a.register(&reg(1)).unwrap();
    let rg = range(&tokens(5, 2));
    let p = a.prepare_store(1, &rg).unwrap();
    assert_eq!(p.slots.len(), 2);
    let junk = vec![0xEEu8; r.object_bytes as usize];
    let mut b = rn.client();
    let e = b
        .write_slots(1, p.transfer_id, &[&junk, &junk], true)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    let mut out = vec![vec![0u8; r.object_bytes as usize]; 2];
    let mut outs: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
    let e = b.read_slots(1, p.transfer_id, &mut outs, true).unwrap_err();
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    // B's refused trailer was drained: its connection still works.
    assert_eq!(b.noop().unwrap(), "OK");
    // A's store is intact and completes.
    let data = payloads(&rg, r.object_bytes as usize);
    let refs: Vec<&[u8]> = p
        .chunk_indices
        .iter()
        .map(|&i| data[i as usize].as_slice())
        .collect();
    let (bytes, published) = a.write_slots(1, p.transfer_id, &refs, true).unwrap();
    assert_eq!((bytes, published), (2 * r.object_bytes, Some(2)));
    assert!(a.retrieve(1, &rg).unwrap().unwrap() == data);
}

#[test]
fn a_trailer_of_the_wrong_size_is_refused_and_the_store_stays_prepared() {
    let rn = RemoteNode::start("remote-size", &[]);
    let mut a = rn.client();
    let r = a.register(&reg(1)).unwrap();
    let rg = range(&tokens(6, 2));
    let p = a.prepare_store(1, &rg).unwrap();
    let short = vec![1u8; r.object_bytes as usize - 1];
    let full = vec![1u8; r.object_bytes as usize];
    let e = a
        .write_slots(1, p.transfer_id, &[&full, &short], true)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidRequest, "{e}");
    assert!(e.to_string().contains("trailer"), "{e}");
    // Still prepared: the right bytes complete it.
    let (_, published) = a
        .write_slots(1, p.transfer_id, &[&full, &full], true)
        .unwrap();
    assert_eq!(published, Some(2));
}

/// Connects with the token in `file`, retrying while the node answers busy (a closed
/// connection's place is given back when its thread ends).
fn retry_connect(rn: &RemoteNode, file: &std::path::Path) -> RemoteClient {
    let token = Token::from_file(file).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match RemoteClient::connect_remote(&rn.url, Some(&token), &options()) {
            Ok(c) => return c,
            Err(e) if e.kind == ErrorKind::LimitExceeded && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("connect: {e}"),
        }
    }
}

/// Registers instance 1 over `s`, prepares a 2-chunk store, and sends the WRITE_SLOTS frame
/// with `sent` bytes of its trailer. Returns the store's total bytes.
fn half_store(s: &mut TcpStream, conv: u32, sent: usize) -> usize {
    let Response::Registered(r) = raw_call(s, 1, &Request::Register(reg(1))) else {
        panic!("register")
    };
    let rg = range(&tokens(conv, 2));
    let Response::StorePrepared {
        transfer_id, slots, ..
    } = raw_call(
        s,
        2,
        &Request::PrepareStore {
            instance_id: 1,
            range: rg,
        },
    )
    else {
        panic!("prepare")
    };
    assert_eq!(slots.len(), 2);
    let total = 2 * r.object_bytes as usize;
    let req = Request::WriteSlots {
        instance_id: 1,
        transfer_id,
        data: DataPath::Inline,
        commit: true,
    };
    s.write_all(&encode_request_with_trailer(3, &req, total as u64).unwrap())
        .unwrap();
    s.write_all(&vec![0xABu8; sent]).unwrap();
    total
}

/// The chunks of conversation `conv` are not readable (the half store was never published).
fn assert_unpublished(rn: &RemoteNode, conv: u32) {
    let mut c = rn.node.client();
    c.register(&reg(77)).unwrap();
    assert!(
        c.retrieve(77, &range(&tokens(conv, 2))).unwrap().is_none(),
        "a store cut mid-trailer was published"
    );
    c.unregister(77).unwrap();
}

#[test]
fn an_engine_that_disconnects_mid_trailer_is_released_and_nothing_published() {
    let rn = RemoteNode::start("remote-cut", &[]);
    let mut s = raw_connect(&rn);
    let total = half_store(&mut s, 8, 1000);
    assert!(total > 1000);
    drop(s);
    wait_released(&rn.node, "release after a cut trailer");
    assert_unpublished(&rn, 8);
}

#[test]
fn a_silent_engine_is_released_mid_trailer_and_when_idle() {
    let rn = RemoteNode::start("remote-silent", &[]);
    // Mid-trailer: no byte for remote.dead_after_ms (750 ms) ends the transfer.
    let mut s = raw_connect(&rn);
    half_store(&mut s, 9, 1000);
    wait_released(&rn.node, "release after a stalled trailer");
    assert_unpublished(&rn, 9);
    // Idle, registered, no heartbeat: remote.dead_after_ms (750 ms) ends it.
    let mut s2 = raw_connect(&rn);
    let Response::Registered(_) = raw_call(&mut s2, 1, &Request::Register(reg(1))) else {
        panic!("register")
    };
    wait_released(&rn.node, "release of a silent engine");
    // A client with heartbeats stays registered across the same silence.
    let mut c = rn.client();
    c.register(&reg(2)).unwrap();
    std::thread::sleep(Duration::from_millis(2000));
    let st = rn.node.status();
    assert_eq!(st["instances"].as_array().unwrap().len(), 1, "{st:#}");
    assert!(c.transport().heartbeats() > 0);
    drop(s);
    drop(s2);
}

#[test]
fn every_remote_limit_is_enforced_with_an_error_naming_it() {
    let rn = RemoteNode::start_with_config(
        "remote-limits",
        Some(
            "[remote]\nmax_handshakes = 1\nmax_connections_per_ip = 3\nhandshake_timeout_ms = 1500\n\
             max_trailer_bytes = 40000\nmax_registered_regions = 1\n",
        ),
        &["--pool-size", "128MiB"],
    );
    let addr = kvnode::config::parse_tcp_url(&rn.url).unwrap();
    // A connection that never completes its handshake holds the only handshake place: the next
    // one is answered busy at once, and the stalled one is closed at its deadline.
    let stalled = TcpStream::connect(addr).unwrap();
    let e = loop {
        match RemoteClient::connect_remote(
            &rn.url,
            Some(&Token::from_file(&rn.token_file).unwrap()),
            &options(),
        ) {
            Err(e) => break e,
            // The stalled connection may not have been accepted yet: try again.
            Ok(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
    assert!(e.to_string().contains("busy"), "{e}");
    let mut buf = [0u8; 1];
    stalled
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    assert_eq!(
        (&stalled).read(&mut buf).unwrap_or(0),
        0,
        "closed at the handshake deadline"
    );
    let st = retry_connect(&rn, &rn.admin_file).status().unwrap();
    assert!(
        num(&st, &["remote", "handshakes", "timed_out"]) >= 1,
        "{st:#}"
    );
    assert!(num(&st, &["remote", "handshakes", "busy"]) >= 1, "{st:#}");
    // Connections per address (places are given back as closed connections' threads end).
    let a = retry_connect(&rn, &rn.token_file);
    let b = retry_connect(&rn, &rn.token_file);
    let c = retry_connect(&rn, &rn.token_file);
    let e = RemoteClient::connect_remote(
        &rn.url,
        Some(&Token::from_file(&rn.token_file).unwrap()),
        &options(),
    )
    .err()
    .expect("a fourth connection from one address is refused");
    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
    drop((b, c));
    // A store above max_trailer_bytes, larger than the socket buffers, is refused and the
    // connection closed; the client still gets the node's answer (not a reset).
    let mut a = a;
    let r = a.register(&reg_sized(1, 32, 1024)).unwrap();
    let rg = range(&tokens(12, 8));
    let data = payloads(&rg, r.object_bytes as usize);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let e = a.store(1, &rg, &refs).unwrap_err();
    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
    assert!(e.to_string().contains("max_trailer_bytes"), "{e}");
    drop(a);
    wait_released(&rn.node, "release after the oversized store");
    // Registered regions per connection.
    let mut d = rn.client();
    let region = |id| kvnode::protocol::RemoteRegion {
        id,
        addr: 0x1000,
        len: 4096,
        rkey: 1,
    };
    let resp = d
        .call(&Request::RegisterBuffers {
            regions: vec![region(1)],
        })
        .unwrap();
    assert_eq!(resp, Response::BuffersRegistered { count: 1 });
    let e = d
        .call(&Request::RegisterBuffers {
            regions: vec![region(2)],
        })
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::LimitExceeded, "{e}");
    assert!(e.to_string().contains("max_registered_regions"), "{e}");
}

#[test]
fn a_local_connection_may_not_send_a_trailer() {
    let node = NodeProc::start("remote-uds-trailer", &[]);
    let mut s = std::os::unix::net::UnixStream::connect(&node.socket).unwrap();
    let req = Request::WriteSlots {
        instance_id: 1,
        transfer_id: 1,
        data: DataPath::Inline,
        commit: true,
    };
    s.write_all(&encode_request_with_trailer(5, &req, 100).unwrap())
        .unwrap();
    s.write_all(&[0u8; 100]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let h = FrameHeader::decode(got[..HEADER_BYTES].try_into().unwrap()).unwrap();
    let mut p = rkyv::util::AlignedVec::<16>::new();
    p.extend_from_slice(&got[HEADER_BYTES..HEADER_BYTES + h.payload_len as usize]);
    let Response::Error { message, .. } = decode_response(&p).unwrap() else {
        panic!("an error")
    };
    assert!(message.contains("trailer"), "{message}");
    // A data op without a trailer over the Unix socket is answered: remote engines only.
    let mut c = node.client();
    let e = c.call(&req).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unsupported, "{e}");
}
