//! Adversarial remote engines (found by review): bytes moving slowly past the TTL safety net,
//! trailers announced on frames that take none. Each failed on the code before its fix.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::remote::{raw_call, raw_connect, read_reply, RemoteNode};
use common::{payloads, range, reg, tokens};
use kvnode::protocol::frame::{
    encode_request, encode_request_with_trailer, FrameHeader, HEADER_BYTES, HEARTBEAT_REQUEST_ID,
};
use kvnode::protocol::{DataPath, RegisterRequest, Request, Response};

/// 4 MiB objects.
fn reg_big(instance_id: u64) -> RegisterRequest {
    RegisterRequest {
        num_layers: 32,
        hidden_dim: 1024,
        ..reg(instance_id)
    }
}

/// Bytes per second the slow engines move: fast enough for the node's pace (each 4 MiB piece
/// within `dead_after_ms` plus its size at `min_transfer_mbps`, about 0.83 s), slow enough for
/// 32 MiB to outlive a 1 s TTL.
const SLOW_RATE: f64 = 12e6;
/// When the other engine acts: past the 1 s TTL, well before the 32 MiB are through.
const ACT_AT: Duration = Duration::from_millis(1600);
/// Scenarios tried: on a loaded machine the node may end a slow transfer (a piece later than
/// its pace) before the other engine acted; the scenario then proves nothing and runs again.
const ATTEMPTS: usize = 4;

/// Sleeps until `done` bytes are due at [`SLOW_RATE`] since `t0`.
fn pace(t0: Instant, done: usize) {
    let due = Duration::from_secs_f64(done as f64 / SLOW_RATE);
    if let Some(w) = due.checked_sub(t0.elapsed()) {
        std::thread::sleep(w);
    }
}

/// A store whose bytes arrive slowly outlives its reservation's TTL: the reservation must stay
/// (pinned) until the bytes are in, so another engine's store never gets its slots and is never
/// overwritten by the late bytes.
#[test]
fn a_slow_store_keeps_its_slots_past_the_write_ttl() {
    let ran = (0..ATTEMPTS).any(|k| slow_store(k as u32));
    assert!(
        ran,
        "in {ATTEMPTS} attempts the second store never ran while the first moved"
    );
}

/// One attempt; `false` if the node ended the slow store before the second one ran.
fn slow_store(attempt: u32) -> bool {
    let rn = RemoteNode::start_with_config(
        "adv-ttl-store",
        Some("write_ttl_secs = 1\n"),
        &["--pool-size", "256MiB"],
    );
    let mut s1 = raw_connect(&rn);
    // A node that stopped answering fails the test instead of hanging it.
    s1.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let Response::Registered(r) = raw_call(&mut s1, 1, &Request::Register(reg_big(1))) else {
        panic!("register")
    };
    let len = r.object_bytes as usize;
    let n = 8u32;
    let Response::StorePrepared {
        transfer_id, slots, ..
    } = raw_call(
        &mut s1,
        2,
        &Request::PrepareStore {
            instance_id: 1,
            range: range(&tokens(50 + attempt, n)),
        },
    )
    else {
        panic!("prepare")
    };
    let first: Vec<u64> = slots.iter().map(|s| s.offset).collect();
    let total = n as usize * len;
    let req = Request::WriteSlots {
        instance_id: 1,
        transfer_id,
        data: DataPath::Inline,
        commit: true,
    };
    s1.write_all(&encode_request_with_trailer(3, &req, total as u64).unwrap())
        .unwrap();
    let mut c2 = rn.client();
    c2.register(&reg_big(2)).unwrap();
    let rg = range(&tokens(60 + attempt, n));
    let data = payloads(&rg, len);
    let step = 64 << 10;
    let chunk = vec![0xABu8; step];
    let (t0, mut sent, mut second) = (Instant::now(), 0, None);
    while sent < total {
        if s1.write_all(&chunk).is_err() {
            break; // the node ended the transfer (a slow machine): nothing to overwrite then
        }
        sent += step;
        pace(t0, sent);
        if second.is_none() && t0.elapsed() > ACT_AT {
            // Past the 1 s TTL: the second store must get other slots.
            let p = c2.prepare_store(2, &rg).unwrap();
            let refs: Vec<&[u8]> = p
                .chunk_indices
                .iter()
                .map(|&i| data[i as usize].as_slice())
                .collect();
            c2.write_slots(2, p.transfer_id, &refs, true).unwrap();
            second = Some(p.slots.iter().map(|s| s.offset).collect::<Vec<u64>>());
        }
    }
    if sent == total {
        let (_, resp) = read_reply(&mut s1);
        assert_eq!(
            resp,
            Response::SlotsWritten {
                bytes: total as u64,
                published: Some(n)
            },
            "the slow store completes: its reservation was kept"
        );
    }
    let Some(second) = second else {
        return false;
    };
    assert!(
        second.iter().all(|o| !first.contains(o)),
        "the second store got slots {second:?} of the first {first:?}"
    );
    let got = c2.retrieve(2, &rg).unwrap().expect("a hit");
    assert!(got == data, "the second engine's chunks were overwritten");
    let (ok, problems) = rn.client_with(&rn.admin_file).memcheck().unwrap();
    assert!(ok, "{problems:?}");
    true
}

/// A retrieve whose bytes leave slowly outlives its read locks' TTL: the locks must stay
/// (pinned), so CLEAR cannot free the slots and another store cannot put its bytes there
/// while they are being sent.
#[test]
fn a_slow_retrieve_keeps_its_read_locks_past_the_read_ttl() {
    let ran = (0..ATTEMPTS).any(|_| slow_retrieve());
    assert!(
        ran,
        "in {ATTEMPTS} attempts CLEAR never ran while the retrieve moved"
    );
}

/// One attempt; `false` if the node ended the slow retrieve before CLEAR ran.
fn slow_retrieve() -> bool {
    let rn = RemoteNode::start_with_config(
        "adv-ttl-retrieve",
        Some("read_ttl_secs = 1\n"),
        &["--pool-size", "256MiB"],
    );
    let n = 8u32;
    let mut c1 = rn.client();
    let len = c1.register(&reg_big(1)).unwrap().object_bytes as usize;
    let rg_a = range(&tokens(70, n));
    let a = payloads(&rg_a, len);
    let refs: Vec<&[u8]> = a.iter().map(Vec::as_slice).collect();
    c1.store(1, &rg_a, &refs).unwrap();
    let mut s2 = raw_connect(&rn);
    s2.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    // A small receive window: the node cannot hand the whole retrieve to the kernel's buffers
    // at once, so its send is still running while this engine reads slowly.
    rustix::net::sockopt::set_socket_recv_buffer_size(&s2, 64 << 10).unwrap();
    let Response::Registered(_) = raw_call(&mut s2, 1, &Request::Register(reg_big(2))) else {
        panic!("register")
    };
    let resp = raw_call(
        &mut s2,
        2,
        &Request::PrepareRetrieve {
            instance_id: 2,
            range: rg_a.clone(),
            lookup_session: None,
        },
    );
    let Response::RetrievePrepared { transfer_id, .. } = resp else {
        panic!("{resp:?}")
    };
    let req = Request::ReadSlots {
        instance_id: 2,
        transfer_id,
        data: DataPath::Inline,
        commit: false,
    };
    s2.write_all(&encode_request(3, &req).unwrap()).unwrap();
    let (h, resp) = read_reply(&mut s2);
    assert!(matches!(resp, Response::SlotsRead { .. }), "{resp:?}");
    let total = h.trailer_len as usize;
    let mut got = vec![0u8; total];
    let rg_b = range(&tokens(80, n));
    let b = payloads(&rg_b, len);
    let (t0, mut off, mut cleared) = (Instant::now(), 0, None);
    while off < total {
        let m = (64 << 10).min(total - off);
        if s2.read_exact(&mut got[off..off + m]).is_err() {
            break; // the node ended the transfer (a slow machine)
        }
        off += m;
        pace(t0, off);
        if cleared.is_none() && t0.elapsed() > ACT_AT {
            let mut admin = rn.client_with(&rn.admin_file);
            let moving = admin.status().unwrap()["remote"]["mover"]["waiting"]
                .as_u64()
                .unwrap_or(0);
            if moving == 0 {
                return false; // the node's send already ended: nothing to prove this time
            }
            cleared = Some(admin.clear().unwrap());
            let refs: Vec<&[u8]> = b.iter().map(Vec::as_slice).collect();
            c1.store(1, &rg_b, &refs).unwrap();
        }
    }
    let Some((_deleted, deferred)) = cleared else {
        return false;
    };
    // The retrieve's objects were pinned and read-locked while the bytes moved: CLEAR could
    // only defer them (their deletion waits for the locks), never free their slots.
    assert!(
        deferred > 0,
        "CLEAR deferred nothing while the retrieve moved"
    );
    for i in 0..off / len {
        assert!(
            got[i * len..(i + 1) * len] == a[i][..],
            "chunk {i} of the retrieve is not the bytes stored under its key"
        );
    }
    true
}

/// A frame that takes no trailer but announces one (a heartbeat, REGISTER_BUFFERS): refused
/// and the connection closed; the trailer's bytes are never read as frames.
#[test]
fn a_trailer_on_a_frame_that_takes_none_closes_the_connection() {
    let rn = RemoteNode::start("adv-trailer", &[]);
    for (id, req) in [
        (HEARTBEAT_REQUEST_ID, Request::Noop),
        (5, Request::RegisterBuffers { regions: vec![] }),
        (6, Request::Status),
    ] {
        let mut s = raw_connect(&rn);
        let inner = encode_request(77, &Request::Noop).unwrap();
        s.write_all(&encode_request_with_trailer(id, &req, inner.len() as u64).unwrap())
            .unwrap();
        s.write_all(&inner).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        let mut ids = Vec::new();
        let mut at = 0;
        while rest.len() >= at + HEADER_BYTES {
            let h = FrameHeader::decode(rest[at..at + HEADER_BYTES].try_into().unwrap()).unwrap();
            ids.push(h.request_id);
            at += HEADER_BYTES + h.payload_len as usize;
        }
        assert!(
            !ids.contains(&77),
            "{req:?}: the trailer was served as a frame: {ids:?}"
        );
        assert_eq!(ids, vec![id], "{req:?}: one refusal, then the close");
    }
}
