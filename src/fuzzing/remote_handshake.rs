//! Fuzz harness of the remote (TCP) handshake: the node's state machine
//! ([`crate::transport::tcp::handshake::ServerHandshake`]) fed arbitrary client bytes in arbitrary
//! pieces, and, when an authenticated client chose RDMA, the node's side of the RDMA queue-pair
//! exchange ([`crate::transport::tcp::handshake::RdmaExchange`]) fed the bytes that follow.
//! Target `fuzz/fuzz_targets/remote_handshake.rs`, corpus `fuzz/corpus/remote_handshake/`.

use crate::access::Role;
use crate::transport::tcp::auth::{transcript, Token};
use crate::transport::tcp::handshake::codec::{
    ClientHello, RdmaOffer, ServerAuth, ServerHello, Status, RDMA_OFFER_BYTES,
};
use crate::transport::tcp::handshake::{
    FrameRange, Offer, RdmaExchange, RdmaStep, ServerHandshake, ServerKeys, Step,
    HANDSHAKE_MAX_BYTES,
};
use kvnode_hw::fabric::{FabricKind, RdmaEndpoint};

/// [`remote_handshake`] mode bit: the node runs in insecure mode (no keys).
pub const HS_MODE_INSECURE: u8 = 1;
/// Mode bit: the harness plays an honest client's proof: it overwrites the 32 MAC bytes of the
/// `ClientAuth` in the stream with the genuine MAC under the client key (for the fabric bytes the
/// input carries), so the success path is fuzzed too.
pub const HS_MODE_GENUINE: u8 = 2;
/// Mode bit (with [`HS_MODE_GENUINE`]): the genuine MAC is under the admin key.
pub const HS_MODE_ADMIN: u8 = 4;
/// Mode bit: pieces are not cut at message boundaries (a client sending early bytes).
pub const HS_MODE_RAW: u8 = 8;
/// Mode bits 4-5: the fabric bits the node offers.
pub const HS_MODE_FABRICS_SHIFT: u8 = 4;

/// The tokens of the harness node: only [`HS_MODE_GENUINE`] uses them on the client's behalf.
const HS_CLIENT_TOKEN: &[u8] = b"fuzz harness client token: 9f2c41d87e0b53a6";
const HS_ADMIN_TOKEN: &[u8] = b"fuzz harness admin token: 1b7e9a04c3d25f86";

/// Builds a [`remote_handshake`] input: a chunking control byte (as [`super::native_frame`]'s), a mode
/// byte (`HS_MODE_*`), then the client's byte stream.
pub fn remote_handshake_input(chunking: u8, mode: u8, stream: &[u8]) -> Vec<u8> {
    let mut v = vec![chunking, mode];
    v.extend_from_slice(stream);
    v
}

/// The node's side of the remote handshake ([`crate::transport::tcp::handshake::ServerHandshake`])
/// fed a client's bytes in pieces chosen by the control byte (build inputs with
/// [`remote_handshake_input`]).
///
/// Invariants checked (a violation panics):
/// * nothing panics; the machine never holds more than `HANDSHAKE_MAX_BYTES` of input, and asks
///   for more only while it needs it;
/// * every reply is one well-formed message: a `ServerHello` (status ok after a `ClientHello`
///   that decodes and re-encodes to the same bytes, or a refusal), a `ServerAuth`;
/// * in token mode the node reaches "authenticated" **only** when the harness supplied the
///   genuine MAC ([`HS_MODE_GENUINE`]), with the role of the key used and a `mac_s` the client
///   accepts; in insecure mode only with the client role;
/// * after the handshake finished (done, refused or failed) every further byte is an error;
/// * after a handshake that chose RDMA, the exchange machine buffers at most one `RdmaOffer`,
///   yields the client's endpoint only for an offer that re-encodes to the same bytes (then
///   the node's offer and ready byte are well-formed), reaches "ready" only after the client's
///   ready byte, and accepts nothing after it finished.
pub fn remote_handshake(data: &[u8]) {
    run(data);
}

/// The node's queue pair the harness answers with.
const HS_NODE_EP: RdmaEndpoint = RdmaEndpoint {
    qpn: 0x00_0abc,
    psn: 0x12_3456,
    gid: [0xfe; 16],
    lid: 0,
    mtu: 5,
};

/// How the RDMA exchange after an authenticated handshake ended.
#[derive(Debug, PartialEq, Eq)]
enum Exchange {
    /// The handshake chose TCP: no exchange.
    None,
    /// The input ran out mid-exchange.
    Incomplete,
    /// The exchange failed (malformed, refused, out of order).
    Failed,
    /// Both queue pairs ready.
    Ready,
}

/// Runs the node's side of the RDMA exchange over `stream` (the bytes after the `ClientAuth`),
/// cut by the same rule as the handshake.
fn run_exchange(ctl: u8, raw: bool, stream: &[u8]) -> Exchange {
    let mut ex = RdmaExchange::node();
    let (mut pos, mut calls) = (0usize, 0usize);
    let mut offer_at = 0usize;
    while pos < stream.len() {
        calls += 1;
        let c = usize::from(ctl & 0x7f);
        let mut n = if c == 0 {
            stream.len()
        } else {
            1 + (c * 5 + calls * 11) % (c * 3 + 1)
        };
        if !raw {
            n = n.min(ex.wanted().max(1));
        }
        let piece = &stream[pos..(pos + n).min(stream.len())];
        pos += piece.len();
        let step = ex.feed(piece);
        assert!(
            ex.buffered() <= RDMA_OFFER_BYTES,
            "buffered {}",
            ex.buffered()
        );
        match step {
            Ok(RdmaStep::NeedMore) => {}
            Ok(RdmaStep::Peer(ep)) => {
                let offer = &stream[offer_at..pos];
                assert_eq!(
                    RdmaOffer::Ok(ep).encode().as_bytes(),
                    offer,
                    "an accepted offer re-encodes differently"
                );
                let ours = ex
                    .local(Some(&HS_NODE_EP))
                    .expect("the node's offer, in order");
                assert_eq!(
                    RdmaOffer::decode(ours.as_bytes()).expect("the node's offer decodes"),
                    RdmaOffer::Ok(HS_NODE_EP)
                );
                let ready = ex.connected(true).expect("the node's ready byte, in order");
                assert_eq!(ready.as_bytes(), &[0]);
                offer_at = pos;
            }
            Ok(RdmaStep::Ready) => {
                assert_eq!(pos - offer_at, 1, "ready is one byte after the offers");
                assert!(ex.is_finished() && ex.wanted() == 0);
                assert!(ex.feed(b"K").is_err(), "bytes accepted after the exchange");
                return Exchange::Ready;
            }
            Err(_) => {
                assert!(ex.is_finished());
                assert!(ex.feed(b"K").is_err(), "bytes accepted after a failure");
                return Exchange::Failed;
            }
        }
    }
    Exchange::Incomplete
}

/// How a [`remote_handshake`] run ended (for the harness's own tests).
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The input ran out mid-handshake.
    Incomplete,
    /// The node failed without a reply.
    Failed,
    /// The node sent a refusal.
    Refused,
    /// The node authenticated the client with this role (and how the RDMA exchange that
    /// follows went).
    Done(Role, Exchange),
}

fn run(data: &[u8]) -> Outcome {
    let [ctl, mode, stream @ ..] = data else {
        return Outcome::Incomplete;
    };
    let (client, admin) = (
        Token::from_bytes(HS_CLIENT_TOKEN),
        Token::from_bytes(HS_ADMIN_TOKEN),
    );
    let (Ok(client), Ok(admin)) = (client, admin) else {
        panic!("harness tokens are valid");
    };
    let insecure = mode & HS_MODE_INSECURE != 0;
    let genuine = !insecure && mode & HS_MODE_GENUINE != 0;
    let as_admin = genuine && mode & HS_MODE_ADMIN != 0;
    let keys = if insecure {
        ServerKeys::Insecure
    } else {
        ServerKeys::Token {
            client: Token::from_bytes(HS_CLIENT_TOKEN).expect("valid"),
            admin: Some(Token::from_bytes(HS_ADMIN_TOKEN).expect("valid")),
        }
    };
    let offer = Offer {
        frames: FrameRange { min: 2, max: 3 },
        fabrics: u16::from((mode >> HS_MODE_FABRICS_SHIFT) & 3),
        node_id: [0x42; 16],
    };
    let mut hs = ServerHandshake::new(&keys, offer, [0x5e; 32]);
    let mut buf = stream.to_vec();
    let (mut pos, mut calls, mut t) = (0usize, 0usize, None);
    while pos < buf.len() {
        calls += 1;
        let c = usize::from(ctl & 0x7f);
        let mut n = if c == 0 {
            buf.len()
        } else {
            1 + (c * 7 + calls * 13) % (c * 3 + 1)
        };
        if mode & HS_MODE_RAW == 0 {
            n = n.min(hs.wanted().max(1));
        }
        let piece = &buf[pos..(pos + n).min(buf.len())];
        pos += piece.len();
        let step = hs.feed(piece);
        assert!(
            hs.buffered() <= HANDSHAKE_MAX_BYTES,
            "buffered {}",
            hs.buffered()
        );
        let finished = match step {
            Err(_) => Some(Outcome::Failed),
            Ok(Step::NeedMore) => {
                assert!(hs.wanted() > 0, "needs more but wants nothing");
                None
            }
            Ok(Step::Send(sh)) => {
                let hello = &buf[..pos];
                let ch = ClientHello::decode(hello).expect("a hello the node answered decodes");
                assert_eq!(
                    ch.encode().as_bytes(),
                    hello,
                    "ClientHello re-encodes differently"
                );
                let d = ServerHello::decode(sh.as_bytes()).expect("the ServerHello decodes");
                assert_eq!(d.status, Status::Ok);
                let tr = transcript(hello, sh.as_bytes());
                // The honest client's proof, patched over whatever the input carries.
                if genuine && buf.len() >= pos + 34 {
                    let fabric = u16::from_le_bytes([buf[pos], buf[pos + 1]]);
                    let key = if as_admin { &admin } else { &client };
                    let mac = key.client_mac(&tr, fabric);
                    buf[pos + 2..pos + 34].copy_from_slice(mac.as_bytes());
                }
                t = Some(tr);
                None
            }
            Ok(Step::Done { reply, negotiated }) => {
                assert!(
                    insecure || genuine,
                    "authenticated without the key: {negotiated:?}"
                );
                let sa = ServerAuth::decode(reply.as_bytes()).expect("the ServerAuth decodes");
                assert_eq!(sa.status, Status::Ok);
                let want = if as_admin { Role::Admin } else { Role::Client };
                assert_eq!(negotiated.role, want);
                assert_eq!(negotiated.authenticated, !insecure);
                if genuine {
                    let (tr, at) = (t.expect("a ServerHello came first"), pos - 34);
                    let fabric = u16::from_le_bytes([buf[at], buf[at + 1]]);
                    let mac_c: [u8; 32] = buf[at + 2..pos].try_into().expect("32 bytes");
                    let key = if as_admin { &admin } else { &client };
                    assert_eq!(
                        key.server_mac(&tr, &mac_c, fabric, sa.role).as_bytes(),
                        &sa.mac
                    );
                }
                let exchange = if negotiated.fabric == FabricKind::Rdma {
                    run_exchange(*ctl, mode & HS_MODE_RAW != 0, &buf[pos..])
                } else {
                    Exchange::None
                };
                Some(Outcome::Done(negotiated.role, exchange))
            }
            Ok(Step::Refuse { reply, .. }) => {
                let r = reply.as_bytes();
                assert!(
                    ServerHello::decode(r).is_ok_and(|h| h.status != Status::Ok)
                        || ServerAuth::decode(r).is_ok_and(|a| a.status != Status::Ok),
                    "a refusal that is not a refusing message"
                );
                Some(Outcome::Refused)
            }
        };
        if let Some(outcome) = finished {
            assert_eq!(hs.wanted(), 0);
            assert!(
                hs.feed(b"K").is_err(),
                "bytes accepted after the handshake finished"
            );
            return outcome;
        }
    }
    Outcome::Incomplete
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed seeds reach the outcomes their names promise: the genuine path really
    /// authenticates (so "never without the key" is not vacuous) and the same bytes without the
    /// harness's MAC never do.
    #[test]
    fn seeds_reach_their_outcomes() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/remote_handshake");
        use Exchange::None as Tcp;
        let want = [
            ("genuine-client", Outcome::Done(Role::Client, Tcp)),
            ("genuine-admin", Outcome::Done(Role::Admin, Tcp)),
            (
                "genuine-rdma-chunked",
                Outcome::Done(Role::Client, Exchange::Incomplete),
            ),
            (
                "genuine-rdma-exchange",
                Outcome::Done(Role::Client, Exchange::Ready),
            ),
            (
                "genuine-rdma-bad-offer",
                Outcome::Done(Role::Client, Exchange::Failed),
            ),
            ("genuine-interleaved", Outcome::Done(Role::Client, Tcp)),
            ("genuine-fabric-not-offered", Outcome::Refused),
            ("wrong-mac", Outcome::Refused),
            ("insecure", Outcome::Done(Role::Client, Tcp)),
            ("insecure-chunked", Outcome::Done(Role::Client, Tcp)),
            ("raw-early-auth", Outcome::Failed),
            ("version-mismatch", Outcome::Refused),
            ("handshake-v2", Outcome::Refused),
            ("name-too-long", Outcome::Failed),
            ("truncated-hello", Outcome::Incomplete),
            ("http-probe", Outcome::Failed),
        ];
        for (name, outcome) in want {
            let data = std::fs::read(dir.join(format!("seed-{name}"))).expect("committed seed");
            assert_eq!(run(&data), outcome, "{name}");
            if matches!(outcome, Outcome::Done(..)) && data[1] & HS_MODE_GENUINE != 0 {
                let mut forged = data.clone();
                forged[1] &= !HS_MODE_GENUINE;
                assert_eq!(
                    run(&forged),
                    Outcome::Refused,
                    "{name} without the genuine MAC"
                );
            }
        }
    }

    /// Seeded random bytes after the genuine RDMA handshake, in every chunking: the exchange's
    /// invariants hold (a small in-tree stand-in for the fuzzer on the new machine).
    #[test]
    fn random_exchanges_keep_the_invariants() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/remote_handshake");
        let base = std::fs::read(dir.join("seed-genuine-rdma-exchange")).expect("committed seed");
        let prefix = base.len() - RDMA_OFFER_BYTES - 1;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut ready = 0;
        for i in 0..4000u64 {
            let mut data = base.clone();
            data[0] = (next() % 9) as u8 | if i % 5 == 0 { 0x80 } else { 0 };
            if i % 7 == 0 {
                data[1] |= HS_MODE_RAW;
            }
            // Mutate a few bytes of the exchange (or none), and sometimes the length.
            for _ in 0..(next() % 4) {
                let at = prefix + (next() as usize % (data.len() - prefix));
                data[at] = next() as u8;
            }
            match next() % 6 {
                0 => data.truncate(prefix + (next() as usize % (RDMA_OFFER_BYTES + 1))),
                1 => data.push(next() as u8),
                _ => {}
            }
            if let Outcome::Done(_, Exchange::Ready) = run(&data) {
                ready += 1;
            }
        }
        assert!(ready > 0, "some runs complete the exchange");
    }
}
