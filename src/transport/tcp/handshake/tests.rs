//! Unit tests of the handshake: golden vectors and every outcome of a client/node pair run in
//! memory (codec rejections and chunking: `tests_wire.rs`).

use super::codec::*;
use super::*;
use crate::transport::tcp::auth::{transcript, Token};

pub(super) const TOKEN: &[u8] = b"0123456789abcdef0123456789abcdef";
pub(super) const ADMIN: &[u8] = b"admin-admin-admin-admin-admin-admin!";
pub(super) const OTHER: &[u8] = b"fedcba9876543210fedcba9876543210";
pub(super) const CN: [u8; 32] = [0xc1; 32];
pub(super) const SN: [u8; 32] = [0x5e; 32];

pub(super) fn tok(b: &[u8]) -> Token {
    Token::from_bytes(b).unwrap()
}

pub(super) fn offer() -> Offer {
    Offer {
        frames: FrameRange { min: 2, max: 3 },
        fabrics: FABRIC_TCP,
        node_id: [0x11; 16],
    }
}

pub(super) fn wanted() -> ClientOffer {
    ClientOffer {
        frames: FrameRange { min: 2, max: 3 },
        fabrics: FABRIC_TCP | FABRIC_RDMA,
    }
}

pub(super) fn token_keys() -> ServerKeys {
    ServerKeys::Token {
        client: tok(TOKEN),
        admin: Some(tok(ADMIN)),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// What a run of both machines gave, and every message that crossed.
pub(super) struct Run {
    pub(super) client: Result<ClientNegotiated, HandshakeError>,
    pub(super) server: Result<Negotiated, HandshakeError>,
    pub(super) wire: Vec<Vec<u8>>,
}

/// Feeds `bytes` to `feed` in pieces chosen by `cuts` (each cut a piece length, cycled; empty =
/// one piece), stopping at the first step that is not "need more".
fn chunked<S>(
    bytes: &[u8],
    cuts: &[usize],
    mut feed: impl FnMut(&[u8]) -> Result<S, HandshakeError>,
    need_more: impl Fn(&S) -> bool,
) -> Result<S, HandshakeError> {
    if cuts.is_empty() {
        return feed(bytes);
    }
    let mut rest = bytes;
    let mut i = 0;
    loop {
        let n = cuts[i % cuts.len()]
            .clamp(1, rest.len().max(1))
            .min(rest.len());
        i += 1;
        let (piece, tail) = rest.split_at(n);
        rest = tail;
        let s = feed(piece)?;
        if !need_more(&s) || rest.is_empty() {
            return Ok(s);
        }
    }
}

/// Runs a client against a node in memory, each message delivered in pieces per `cuts`.
pub(super) fn run(
    token: Option<&Token>,
    keys: &ServerKeys,
    w: &ClientOffer,
    o: &Offer,
    cuts: &[usize],
) -> Run {
    let mut wire = Vec::new();
    let (mut c, hello) = ClientHandshake::new(token, "golden", w, CN).unwrap();
    let mut s = ServerHandshake::new(keys, *o, SN);
    wire.push(hello.as_bytes().to_vec());
    let mut to_server = hello.as_bytes().to_vec();
    loop {
        assert!(s.buffered() <= HANDSHAKE_MAX_BYTES);
        let step = chunked(
            &to_server,
            cuts,
            |b| s.feed(b),
            |s| matches!(s, Step::NeedMore),
        );
        let to_client = match step {
            Err(e) => {
                return Run {
                    client: Err(HandshakeError::Closed),
                    server: Err(e),
                    wire,
                }
            }
            Ok(Step::NeedMore) => panic!("a whole message left the node needing more"),
            Ok(Step::Send(o)) => o,
            Ok(Step::Done { reply, negotiated }) => {
                wire.push(reply.as_bytes().to_vec());
                let c = chunked(
                    reply.as_bytes(),
                    cuts,
                    |b| c.feed(b),
                    |s| matches!(s, ClientStep::NeedMore),
                );
                let client = match c {
                    Ok(ClientStep::Done(n)) => Ok(n),
                    Ok(other) => panic!("client after ServerAuth: {other:?}"),
                    Err(e) => Err(e),
                };
                return Run {
                    client,
                    server: Ok(negotiated),
                    wire,
                };
            }
            Ok(Step::Refuse { reply, error }) => {
                wire.push(reply.as_bytes().to_vec());
                let c = chunked(
                    reply.as_bytes(),
                    cuts,
                    |b| c.feed(b),
                    |s| matches!(s, ClientStep::NeedMore),
                );
                let client = match c {
                    Err(e) => Err(e),
                    Ok(other) => panic!("client accepted a refusal: {other:?}"),
                };
                return Run {
                    client,
                    server: Err(error),
                    wire,
                };
            }
        };
        wire.push(to_client.as_bytes().to_vec());
        let step = chunked(
            to_client.as_bytes(),
            cuts,
            |b| c.feed(b),
            |s| matches!(s, ClientStep::NeedMore),
        );
        match step {
            Ok(ClientStep::Send(o)) => {
                wire.push(o.as_bytes().to_vec());
                to_server = o.as_bytes().to_vec();
            }
            Ok(other) => panic!("client after ServerHello: {other:?}"),
            Err(e) => {
                return Run {
                    client: Err(e),
                    server: Err(HandshakeError::Closed),
                    wire,
                }
            }
        }
    }
}

#[test]
fn golden_vectors() {
    let keys = token_keys();
    let t = tok(TOKEN);
    let r = run(Some(&t), &keys, &wanted(), &offer(), &[]);
    let n = r.client.unwrap();
    assert_eq!(n.fabric, kvnode_hw::fabric::FabricKind::Tcp);
    assert_eq!(n.frame_version, 3);
    assert_eq!(n.role, Role::Client);
    assert_eq!(n.node_id, [0x11; 16]);
    assert!(n.authenticated);
    let s = r.server.unwrap();
    assert_eq!(s.client_name, "golden");
    assert_eq!(
        (s.role, s.frame_version, s.authenticated),
        (Role::Client, 3, true)
    );
    let w: Vec<String> = r.wire.iter().map(|m| hex(m)).collect();
    assert_eq!(w.len(), 4);
    assert_eq!(w[0], "4b564e480100020003000300c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c1c106676f6c64656e");
    assert_eq!(w[1], "4b564e480100000103000200030001005e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e11111111111111111111111111111111");
    assert_eq!(
        w[2],
        "0100c75c6b6afe7fb86d75f5ed01d325e46cc5cd4dd1456ee9d1bd722ae2a6fb2043"
    );
    assert_eq!(
        w[3],
        "0001e4c0cdec317a3aca19744f73cfe7c955e252782bbda583286d7d1c2cdf0cb5b1"
    );
    assert_eq!(
        hex(&transcript(&r.wire[0], &r.wire[1])),
        "98f28a0b8f6e4959b91bad615761e17f0927499b0056f39ab1e3cc84244ca851"
    );
    // The MACs are what the specification says, computed independently here.
    let k = blake3::derive_key("kvnode tcp token v1", TOKEN);
    let tr = transcript(&r.wire[0], &r.wire[1]);
    let mut m = b"kvnode-auth/v1/client".to_vec();
    m.extend_from_slice(&tr);
    m.extend_from_slice(&FABRIC_TCP.to_le_bytes());
    let mac_c = blake3::keyed_hash(&k, &m);
    assert_eq!(&r.wire[2][2..], mac_c.as_bytes());
    let mut m = b"kvnode-auth/v1/server".to_vec();
    m.extend_from_slice(&tr);
    m.extend_from_slice(mac_c.as_bytes());
    m.extend_from_slice(&FABRIC_TCP.to_le_bytes());
    m.push(1);
    assert_eq!(&r.wire[3][2..], blake3::keyed_hash(&k, &m).as_bytes());
    assert_eq!(&r.wire[3][..2], &[0, 1]);
}

#[test]
fn an_admin_token_equal_to_the_client_token_is_refused() {
    let e = ServerKeys::token(tok(TOKEN), Some(tok(TOKEN))).unwrap_err();
    assert!(e.to_string().contains("admin token is the same"), "{e}");
    assert!(ServerKeys::token(tok(TOKEN), Some(tok(ADMIN))).is_ok());
    assert!(ServerKeys::token(tok(TOKEN), None).is_ok());
}

#[test]
fn control_characters_in_the_client_name_do_not_reach_the_logs() {
    let keys = ServerKeys::Insecure;
    let (_, hello) = ClientHandshake::new(None, "evil\nINFO forged", &wanted(), CN).unwrap();
    let mut s = ServerHandshake::new(&keys, offer(), SN);
    let Ok(Step::Send(_)) = s.feed(hello.as_bytes()) else {
        panic!()
    };
    let ca = ClientAuth {
        fabric: FABRIC_TCP,
        mac: [0; 32],
    };
    let Ok(Step::Done { negotiated, .. }) = s.feed(ca.encode().as_bytes()) else {
        panic!()
    };
    assert_eq!(negotiated.client_name, "evil?INFO forged");
}

#[test]
fn admin_token_gets_the_admin_role() {
    let keys = token_keys();
    let a = tok(ADMIN);
    let r = run(Some(&a), &keys, &wanted(), &offer(), &[]);
    assert_eq!(r.client.unwrap().role, Role::Admin);
    assert_eq!(r.server.unwrap().role, Role::Admin);
    // Without an admin key, the admin token is just a wrong token.
    let keys = ServerKeys::Token {
        client: tok(TOKEN),
        admin: None,
    };
    let r = run(Some(&a), &keys, &wanted(), &offer(), &[]);
    assert!(matches!(r.client, Err(HandshakeError::BadToken)));
    assert!(matches!(r.server, Err(HandshakeError::BadToken)));
}

#[test]
fn wrong_token_is_bad_token_on_both_sides() {
    let keys = token_keys();
    let o = tok(OTHER);
    let r = run(Some(&o), &keys, &wanted(), &offer(), &[]);
    let e = r.client.unwrap_err();
    assert!(matches!(e, HandshakeError::BadToken), "{e}");
    assert!(e.is_auth_failure());
    assert!(e.to_string().starts_with("authentication failed"), "{e}");
    assert!(matches!(r.server, Err(HandshakeError::BadToken)));
    assert_eq!(
        r.wire[3],
        ServerAuth::refusal(Status::BadToken).encode().as_bytes()
    );
    let err: crate::Error = e.into();
    assert_eq!(err.kind, crate::ErrorKind::PermissionDenied);
}

#[test]
fn tokenless_client_of_a_token_node_is_told_a_token_is_required() {
    let keys = token_keys();
    let r = run(None, &keys, &wanted(), &offer(), &[]);
    assert!(matches!(r.client, Err(HandshakeError::TokenRequired)));
    assert!(matches!(r.server, Err(HandshakeError::BadToken)));
}

#[test]
fn insecure_node_and_tokenless_client_agree_on_the_client_role() {
    let r = run(None, &ServerKeys::Insecure, &wanted(), &offer(), &[]);
    let c = r.client.unwrap();
    let s = r.server.unwrap();
    assert_eq!((c.role, c.authenticated), (Role::Client, false));
    assert_eq!((s.role, s.authenticated), (Role::Client, false));
    assert_eq!(r.wire[1][7], 0, "auth = 0 in the ServerHello");
    assert_eq!(
        &r.wire[2][2..],
        &[0; 32],
        "a tokenless client sends a zero mac"
    );
}

#[test]
fn a_token_client_refuses_an_insecure_node() {
    let t = tok(TOKEN);
    let r = run(Some(&t), &ServerKeys::Insecure, &wanted(), &offer(), &[]);
    let e = r.client.unwrap_err();
    assert!(matches!(e, HandshakeError::NotAuthenticating), "{e}");
    assert!(e.to_string().contains("--insecure-no-auth"), "{e}");
    assert_eq!(r.wire.len(), 2, "the client sent no ClientAuth");
}

/// Plays a node that does not know the token but claims to authenticate: sends a `ServerHello`
/// with `auth = 1`, then a `ServerAuth` "ok" with `mac`, `role`.
fn impostor(
    t: &Token,
    role: u8,
    mac: impl FnOnce(&[u8], &[u8], &[u8]) -> [u8; 32],
) -> HandshakeError {
    let (mut c, hello) = ClientHandshake::new(Some(t), "x", &wanted(), CN).unwrap();
    let sh = ServerHello {
        hs_version: HS_VERSION,
        status: Status::Ok,
        auth: true,
        frame_version: 3,
        frames: FrameRange { min: 3, max: 3 },
        fabrics: FABRIC_TCP,
        nonce: SN,
        node_id: [9; 16],
    }
    .encode();
    let ClientStep::Send(ca) = c.feed(sh.as_bytes()).unwrap() else {
        panic!("no ClientAuth");
    };
    let sa = ServerAuth {
        status: Status::Ok,
        role,
        mac: mac(hello.as_bytes(), sh.as_bytes(), ca.as_bytes()),
    }
    .encode();
    c.feed(sa.as_bytes()).unwrap_err()
}

#[test]
fn a_node_that_cannot_prove_the_token_is_refused() {
    let t = tok(TOKEN);
    // Zeros, random bytes, the client's own MAC reflected back: none proves the token.
    let e = impostor(&t, 1, |_, _, _| [0; 32]);
    assert!(matches!(e, HandshakeError::ServerProofFailed), "{e}");
    assert!(e.is_auth_failure());
    let e = impostor(&t, 1, |_, _, ca| ca[2..].try_into().unwrap());
    assert!(matches!(e, HandshakeError::ServerProofFailed), "{e}");
    // A node with another token.
    let o = tok(OTHER);
    let e = impostor(&t, 1, |ch, sh, ca| {
        *o.server_mac(
            &transcript(ch, sh),
            ca[2..].try_into().unwrap(),
            FABRIC_TCP,
            1,
        )
        .as_bytes()
    });
    assert!(matches!(e, HandshakeError::ServerProofFailed), "{e}");
    // The genuine proof for role 1, with the role byte changed to admin on the way.
    let e = impostor(&t, 2, |ch, sh, ca| {
        *t.server_mac(
            &transcript(ch, sh),
            ca[2..].try_into().unwrap(),
            FABRIC_TCP,
            1,
        )
        .as_bytes()
    });
    assert!(matches!(e, HandshakeError::ServerProofFailed), "{e}");
    // ... while unchanged it is accepted.
    let (mut c, hello) = ClientHandshake::new(Some(&t), "x", &wanted(), CN).unwrap();
    let sh =
        ServerHello::refusal(Status::Ok, true, FrameRange { min: 3, max: 3 }, 1, [9; 16]).encode();
    let mut sh = sh.as_bytes().to_vec();
    sh[8] = 3; // frame_version 3
    let ClientStep::Send(ca) = c.feed(&sh).unwrap() else {
        panic!()
    };
    let mac = t.server_mac(
        &transcript(hello.as_bytes(), &sh),
        ca.as_bytes()[2..].try_into().unwrap(),
        1,
        1,
    );
    let sa = ServerAuth {
        status: Status::Ok,
        role: 1,
        mac: *mac.as_bytes(),
    }
    .encode();
    assert!(matches!(c.feed(sa.as_bytes()), Ok(ClientStep::Done(_))));
}

#[test]
fn version_ranges_that_do_not_overlap_fail_on_both_sides() {
    let keys = token_keys();
    let t = tok(TOKEN);
    for (c, s) in [((1, 2), (3, 3)), ((4, 9), (2, 3))] {
        let w = ClientOffer {
            frames: FrameRange { min: c.0, max: c.1 },
            ..wanted()
        };
        let o = Offer {
            frames: FrameRange { min: s.0, max: s.1 },
            ..offer()
        };
        let r = run(Some(&t), &keys, &w, &o, &[]);
        match r.client {
            Err(HandshakeError::Version { ours, theirs }) => {
                assert_eq!((ours, theirs), (w.frames, o.frames));
            }
            other => panic!("{other:?}"),
        }
        let e = r.server.unwrap_err();
        assert!(
            matches!(e, HandshakeError::Version { ours, theirs } if ours == o.frames && theirs == w.frames)
        );
        assert!(e.to_string().contains("no common protocol version"), "{e}");
    }
    // Overlap: the highest common version.
    let w = ClientOffer {
        frames: FrameRange { min: 1, max: 2 },
        ..wanted()
    };
    assert_eq!(
        run(Some(&t), &keys, &w, &offer(), &[])
            .client
            .unwrap()
            .frame_version,
        2
    );
}
