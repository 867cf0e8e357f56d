//! Unit tests of the handshake's wire handling: versions, malformed and truncated input, bytes
//! after the end, and chunking equivalence (helpers in `tests.rs`).

use proptest::prelude::*;

use super::codec::*;
use super::tests::{offer, run, tok, token_keys, wanted, ADMIN, CN, OTHER, SN, TOKEN};
use super::*;
use crate::transport::tcp::auth::transcript;

#[test]
fn another_handshake_version_is_refused_with_the_nodes_version() {
    let keys = token_keys();
    let mut s = ServerHandshake::new(&keys, offer(), SN);
    let mut hello = b"KVNH".to_vec();
    hello.extend_from_slice(&2u16.to_le_bytes());
    match s.feed(&hello) {
        Ok(Step::Refuse { reply, error }) => {
            assert!(matches!(
                error,
                HandshakeError::HandshakeVersion { ours: 1, theirs: 2 }
            ));
            let sh = ServerHello::decode(reply.as_bytes()).unwrap();
            assert_eq!((sh.hs_version, sh.status), (1, Status::Version));
        }
        other => panic!("{other:?}"),
    }
    let t = tok(TOKEN);
    let (mut c, _) = ClientHandshake::new(Some(&t), "x", &wanted(), CN).unwrap();
    let mut sh = ServerHello::refusal(Status::Ok, true, offer().frames, 1, [0; 16])
        .encode()
        .as_bytes()
        .to_vec();
    sh[4] = 7;
    assert!(matches!(
        c.feed(&sh[..6]),
        Err(HandshakeError::HandshakeVersion { ours: 1, theirs: 7 })
    ));
}

#[test]
fn fabrics_rdma_preferred_and_no_common_fabric_refused() {
    let keys = token_keys();
    let t = tok(TOKEN);
    let both = Offer {
        fabrics: FABRIC_TCP | FABRIC_RDMA,
        ..offer()
    };
    let r = run(Some(&t), &keys, &wanted(), &both, &[]);
    assert_eq!(
        r.client.unwrap().fabric,
        kvnode_hw::fabric::FabricKind::Rdma
    );
    assert_eq!(
        r.server.unwrap().fabric,
        kvnode_hw::fabric::FabricKind::Rdma
    );
    let rdma_only = ClientOffer {
        fabrics: FABRIC_RDMA,
        ..wanted()
    };
    let r = run(Some(&t), &keys, &rdma_only, &offer(), &[]);
    assert!(matches!(
        r.client,
        Err(HandshakeError::NoCommonFabric { ours: 2, theirs: 1 })
    ));
    let e = r.server.unwrap_err();
    assert!(matches!(
        e,
        HandshakeError::NoCommonFabric { ours: 1, theirs: 0 }
    ));
    assert!(e.to_string().contains("accepts tcp, the peer none"), "{e}");
    // A wrong token with no common fabric is still a wrong token (the MAC is checked first).
    let o = tok(OTHER);
    let r = run(Some(&o), &keys, &rdma_only, &offer(), &[]);
    assert!(matches!(r.server, Err(HandshakeError::BadToken)));
}

#[test]
fn a_fabric_the_node_did_not_offer_is_refused_even_with_a_valid_mac() {
    let keys = token_keys();
    let t = tok(TOKEN);
    let mut s = ServerHandshake::new(&keys, offer(), SN);
    let (_, hello) = ClientHandshake::new(Some(&t), "x", &wanted(), CN).unwrap();
    let Ok(Step::Send(sh)) = s.feed(hello.as_bytes()) else {
        panic!()
    };
    let tr = transcript(hello.as_bytes(), sh.as_bytes());
    for fabric in [FABRIC_RDMA, 4, FABRIC_TCP | FABRIC_RDMA] {
        let mut s = ServerHandshake::new(&keys, offer(), SN);
        s.feed(hello.as_bytes()).unwrap();
        let ca = ClientAuth {
            fabric,
            mac: *t.client_mac(&tr, fabric).as_bytes(),
        };
        assert!(matches!(
            s.feed(ca.encode().as_bytes()),
            Ok(Step::Refuse {
                error: HandshakeError::NoCommonFabric { .. },
                ..
            })
        ));
    }
    // A MAC for one fabric does not authenticate another.
    let ca = ClientAuth {
        fabric: FABRIC_TCP,
        mac: *t.client_mac(&tr, FABRIC_RDMA).as_bytes(),
    };
    let mut s = ServerHandshake::new(&keys, offer(), SN);
    s.feed(hello.as_bytes()).unwrap();
    assert!(matches!(
        s.feed(ca.encode().as_bytes()),
        Ok(Step::Refuse {
            error: HandshakeError::BadToken,
            ..
        })
    ));
}

#[test]
fn garbage_truncated_and_oversized_hellos_are_typed_errors() {
    let keys = token_keys();
    let feed = |b: &[u8]| ServerHandshake::new(&keys, offer(), SN).feed(b);
    let malformed = |r: Result<Step, HandshakeError>, what: &str| match r {
        Err(HandshakeError::Malformed(m)) => assert!(m.contains(what), "{m} lacks {what}"),
        other => panic!("{other:?}, expected Malformed({what})"),
    };
    // An HTTP probe is rejected at its first byte.
    malformed(feed(b"G"), "magic");
    malformed(feed(b"GET / HTTP/1.1\r\n\r\n"), "magic");
    let t = tok(TOKEN);
    let (_, hello) = ClientHandshake::new(Some(&t), "golden", &wanted(), CN).unwrap();
    let h = hello.as_bytes();
    // Truncated: the machine waits for the rest.
    assert!(matches!(feed(&h[..h.len() - 1]), Ok(Step::NeedMore)));
    assert!(matches!(feed(&h[..10]), Ok(Step::NeedMore)));
    // A name longer than the limit is refused as soon as its length byte arrives.
    let mut long = h[..45].to_vec();
    long[44] = 65;
    malformed(feed(&long), "65 bytes");
    let mut bad = h.to_vec();
    bad[45] = 0xff;
    malformed(feed(&bad), "UTF-8");
    let mut empty = h.to_vec();
    empty[6] = 9; // min 9 > max 3
    malformed(feed(&empty), "empty range");
    // Trailing bytes before the node's reply.
    let mut extra = h.to_vec();
    extra.push(0);
    malformed(feed(&extra), "1 bytes after the ClientHello");
    // Decoders alone: exact lengths.
    assert!(ClientHello::decode(&h[..44]).is_err());
    assert!(ServerHello::decode(&[0; 63]).is_err());
    assert!(ServerAuth::decode(&[0; 35]).is_err());
    assert!(ClientAuth::decode(&[0; 33]).is_err());
    let mut sa = [0u8; 34];
    sa[0] = 9;
    assert!(
        matches!(ServerAuth::decode(&sa), Err(HandshakeError::Malformed(m)) if m.contains("unknown status 9"))
    );
    let mut sh = ServerHello::refusal(Status::Ok, true, offer().frames, 1, [0; 16])
        .encode()
        .as_bytes()
        .to_vec();
    sh[7] = 5;
    assert!(
        matches!(ServerHello::decode(&sh), Err(HandshakeError::Malformed(m)) if m.contains("auth mode 5"))
    );
}

#[test]
fn nothing_is_accepted_after_the_handshake_finished() {
    let keys = token_keys();
    let t = tok(TOKEN);
    let (mut c, hello) = ClientHandshake::new(Some(&t), "x", &wanted(), CN).unwrap();
    let mut s = ServerHandshake::new(&keys, offer(), SN);
    let Ok(Step::Send(sh)) = s.feed(hello.as_bytes()) else {
        panic!()
    };
    let Ok(ClientStep::Send(ca)) = c.feed(sh.as_bytes()) else {
        panic!()
    };
    let Ok(Step::Done { reply, .. }) = s.feed(ca.as_bytes()) else {
        panic!()
    };
    assert_eq!(s.wanted(), 0);
    assert!(matches!(s.feed(b"K"), Err(HandshakeError::Malformed(_))));
    assert!(matches!(
        s.feed(ca.as_bytes()),
        Err(HandshakeError::Malformed(_))
    ));
    assert!(matches!(c.feed(reply.as_bytes()), Ok(ClientStep::Done(_))));
    assert!(matches!(
        c.feed(reply.as_bytes()),
        Err(HandshakeError::Malformed(_))
    ));
    // A failed machine stays failed.
    let mut s = ServerHandshake::new(&keys, offer(), SN);
    assert!(s.feed(b"X").is_err());
    assert!(s.feed(hello.as_bytes()).is_err());
}

#[test]
fn a_busy_hello_reads_as_busy_and_long_names_are_cut() {
    let keys = token_keys();
    let t = tok(TOKEN);
    let (mut c, _) = ClientHandshake::new(Some(&t), "x", &wanted(), CN).unwrap();
    let e = c.feed(busy_hello(&keys, &offer()).as_bytes()).unwrap_err();
    assert!(matches!(e, HandshakeError::Busy));
    let name = "é".repeat(40); // 80 bytes
    let (_, hello) = ClientHandshake::new(None, &name, &wanted(), CN).unwrap();
    let h = ClientHello::decode(hello.as_bytes()).unwrap();
    assert_eq!(h.name, "é".repeat(32));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Delivering every message in arbitrary pieces gives the same bytes and outcomes as whole
    /// messages, for every kind of client.
    #[test]
    fn arbitrary_chunking_equals_one_shot(
        cuts in proptest::collection::vec(1usize..40, 1..8),
        who in 0u8..5,
        fabrics in 1u16..4,
    ) {
        let keys = token_keys();
        let (t, a, o) = (tok(TOKEN), tok(ADMIN), tok(OTHER));
        let (token, keys) = match who {
            0 => (Some(&t), &keys),
            1 => (Some(&a), &keys),
            2 => (Some(&o), &keys),
            3 => (None, &keys),
            _ => (None, &ServerKeys::Insecure),
        };
        let w = ClientOffer { fabrics, ..wanted() };
        let whole = run(token, keys, &w, &offer(), &[]);
        let pieces = run(token, keys, &w, &offer(), &cuts);
        prop_assert_eq!(&whole.wire, &pieces.wire);
        prop_assert_eq!(format!("{:?}", whole.client), format!("{:?}", pieces.client));
        prop_assert_eq!(format!("{:?}", whole.server), format!("{:?}", pieces.server));
    }
}
