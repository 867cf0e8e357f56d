//! Tests of the RDMA queue-pair exchange: golden vectors, the sans-IO machines of both sides in
//! memory (every order, every refusal, any chunking), and the blocking drivers over loopback TCP
//! with fake endpoints (no RDMA device here: the queue pairs themselves are untested on
//! hardware).

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvnode_hw::fabric::RdmaEndpoint;

use super::codec::*;
use super::rdma::*;
use super::*;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn ep(qpn: u32) -> RdmaEndpoint {
    let mut gid = [0u8; 16];
    for (i, g) in gid.iter_mut().enumerate() {
        *g = i as u8;
    }
    RdmaEndpoint {
        qpn,
        psn: 0xab_cdef,
        gid,
        lid: 0x0102,
        mtu: 5,
    }
}

#[test]
fn golden_rdma_offer_and_ready() {
    let o = RdmaOffer::Ok(ep(0x12_3456)).encode();
    assert_eq!(
        hex(o.as_bytes()),
        "0005020156341200efcdab00000102030405060708090a0b0c0d0e0f"
    );
    assert_eq!(o.as_bytes().len(), RDMA_OFFER_BYTES);
    assert_eq!(
        RdmaOffer::decode(o.as_bytes()).unwrap(),
        RdmaOffer::Ok(ep(0x12_3456))
    );
    let f = RdmaOffer::Failed.encode();
    assert_eq!(hex(f.as_bytes()), format!("01{}", "00".repeat(27)));
    assert_eq!(RdmaOffer::decode(f.as_bytes()).unwrap(), RdmaOffer::Failed);
    assert_eq!(hex(codec::encode_rdma_ready(true).as_bytes()), "00");
    assert_eq!(hex(codec::encode_rdma_ready(false).as_bytes()), "01");
    assert!(codec::decode_rdma_ready(&[0]).unwrap());
    assert!(!codec::decode_rdma_ready(&[1]).unwrap());
}

#[test]
fn malformed_offers_are_typed_errors_naming_the_field() {
    let good = RdmaOffer::Ok(ep(7)).encode().as_bytes().to_vec();
    let mut cases: Vec<(Vec<u8>, &str)> = vec![
        (good[..27].to_vec(), "27 bytes"),
        ([good.clone(), vec![0]].concat(), "29 bytes"),
        (
            {
                let mut b = good.clone();
                b[0] = 2;
                b
            },
            "status 2",
        ),
        (
            {
                let mut b = good.clone();
                b[0] = 1;
                b
            },
            "failed RdmaOffer carries",
        ),
        (
            {
                let mut b = good.clone();
                b[1] = 0;
                b
            },
            "MTU",
        ),
        (
            {
                let mut b = good.clone();
                b[1] = 6;
                b
            },
            "MTU",
        ),
        (
            {
                let mut b = good.clone();
                b[4..8].copy_from_slice(&0u32.to_le_bytes());
                b
            },
            "queue pair number",
        ),
        (
            {
                let mut b = good.clone();
                b[4..8].copy_from_slice(&(1u32 << 24).to_le_bytes());
                b
            },
            "queue pair number",
        ),
        (
            {
                let mut b = good.clone();
                b[8..12].copy_from_slice(&(1u32 << 24).to_le_bytes());
                b
            },
            "sequence number",
        ),
    ];
    for (bytes, what) in cases.drain(..) {
        let e = RdmaOffer::decode(&bytes).unwrap_err();
        assert!(matches!(e, HandshakeError::Malformed(_)), "{what}: {e}");
        assert!(e.to_string().contains(what), "{what}: {e}");
    }
    assert!(codec::decode_rdma_ready(&[2]).is_err());
    assert!(codec::decode_rdma_ready(&[]).is_err());
    assert!(codec::decode_rdma_ready(&[0, 0]).is_err());
}

/// Feeds `bytes` one byte at a time when `bytewise`, else at once; returns the final step.
fn feed_all(
    m: &mut RdmaExchange,
    bytes: &[u8],
    bytewise: bool,
) -> Result<RdmaStep, HandshakeError> {
    if !bytewise {
        return m.feed(bytes);
    }
    let mut last = Ok(RdmaStep::NeedMore);
    for b in bytes {
        assert!(m.wanted() >= 1);
        last = m.feed(std::slice::from_ref(b));
        if !matches!(last, Ok(RdmaStep::NeedMore)) {
            break;
        }
    }
    last
}

#[test]
fn both_machines_exchange_endpoints_and_ready_bytes_in_any_chunking() {
    for bytewise in [false, true] {
        let (c_ep, n_ep) = (ep(0x11), ep(0x22));
        let (mut client, c_offer) = RdmaExchange::client(Some(&c_ep));
        let mut node = RdmaExchange::node();
        assert_eq!(node.wanted(), RDMA_OFFER_BYTES);
        // Client offer -> node: the node learns the client's endpoint, then creates its QP.
        assert_eq!(
            feed_all(&mut node, c_offer.as_bytes(), bytewise).unwrap(),
            RdmaStep::Peer(c_ep)
        );
        assert_eq!(
            node.wanted(),
            0,
            "the client sends nothing before the node's offer"
        );
        let n_offer = node.local(Some(&n_ep)).unwrap();
        assert_eq!(
            feed_all(&mut client, n_offer.as_bytes(), bytewise).unwrap(),
            RdmaStep::Peer(n_ep)
        );
        // Each connects and sends its ready byte; each reads the other's.
        let n_ready = node.connected(true).unwrap();
        let c_ready = client.connected(true).unwrap();
        assert_eq!(client.feed(n_ready.as_bytes()).unwrap(), RdmaStep::Ready);
        assert_eq!(node.feed(c_ready.as_bytes()).unwrap(), RdmaStep::Ready);
        assert!(client.is_finished() && node.is_finished());
        assert!(node.feed(b"x").is_err(), "nothing after the exchange");
    }
}

#[test]
fn refusals_and_out_of_order_calls_finish_the_exchange_with_a_clear_error() {
    // The client could not create its queue pair: the node says so.
    let (c, refusal) = RdmaExchange::client(None);
    assert!(c.is_finished());
    let mut node = RdmaExchange::node();
    let e = node.feed(refusal.as_bytes()).unwrap_err().to_string();
    assert!(
        e.contains("the client could not create an RDMA queue pair"),
        "{e}"
    );
    assert!(node.is_finished());

    // The node could not create its queue pair: the client says so.
    let (mut client, offer) = RdmaExchange::client(Some(&ep(1)));
    let mut node = RdmaExchange::node();
    node.feed(offer.as_bytes()).unwrap();
    let failed = node.local(None).unwrap();
    assert!(node.is_finished());
    let e = client.feed(failed.as_bytes()).unwrap_err().to_string();
    assert!(
        e.contains("the node could not create an RDMA queue pair"),
        "{e}"
    );

    // The node could not connect: its ready byte says failed.
    let (mut client, offer) = RdmaExchange::client(Some(&ep(1)));
    let mut node = RdmaExchange::node();
    node.feed(offer.as_bytes()).unwrap();
    client
        .feed(node.local(Some(&ep(2))).unwrap().as_bytes())
        .unwrap();
    let n_ready = node.connected(false).unwrap();
    client.connected(true).unwrap();
    let e = client.feed(n_ready.as_bytes()).unwrap_err().to_string();
    assert!(
        e.contains("the node could not connect its RDMA queue pair"),
        "{e}"
    );

    // Out of order: the node offering before the client's offer, a ready byte before the
    // offers crossed, the client's ready byte glued to its offer.
    let mut node = RdmaExchange::node();
    assert!(node.local(Some(&ep(2))).is_err());
    assert!(node.is_finished());
    let mut node = RdmaExchange::node();
    assert!(node.connected(true).is_err());
    let (_, offer) = RdmaExchange::client(Some(&ep(1)));
    let mut node = RdmaExchange::node();
    let glued = [offer.as_bytes(), &[0u8]].concat();
    let e = node.feed(&glued).unwrap_err().to_string();
    assert!(e.contains("past the message"), "{e}");
    // A client offer to a node that has not answered yet: no bytes expected.
    let (_, offer) = RdmaExchange::client(Some(&ep(1)));
    let mut node = RdmaExchange::node();
    node.feed(offer.as_bytes()).unwrap();
    assert!(node.feed(&[0]).is_err());
}

/// A fake queue-pair setup: hands out a fixed endpoint, records the peer's, can fail on cue.
struct FakeSetup {
    local: RdmaEndpoint,
    fail_prepare: bool,
    fail_connect: bool,
    peer: Option<RdmaEndpoint>,
    prepared: usize,
    abandoned: usize,
}

impl FakeSetup {
    fn new(qpn: u32) -> FakeSetup {
        FakeSetup {
            local: ep(qpn),
            fail_prepare: false,
            fail_connect: false,
            peer: None,
            prepared: 0,
            abandoned: 0,
        }
    }
}

impl QpSetup for FakeSetup {
    type Pending = u32;
    type Conn = u32;
    fn prepare(&mut self) -> Result<(u32, RdmaEndpoint), String> {
        if self.fail_prepare {
            return Err("no queue pairs left (fake)".into());
        }
        self.prepared += 1;
        Ok((self.local.qpn, self.local))
    }
    fn connect(&mut self, pending: u32, peer: RdmaEndpoint) -> Result<u32, String> {
        if self.fail_connect {
            return Err("modify_qp RTR: invalid argument (fake)".into());
        }
        self.peer = Some(peer);
        Ok(pending)
    }
    fn abandon(&mut self, _: u32) {
        self.abandoned += 1;
    }
}

fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

fn run_drivers(
    mut client: FakeSetup,
    mut node: FakeSetup,
) -> (
    Result<u32, HandshakeError>,
    FakeSetup,
    Result<u32, HandshakeError>,
    FakeSetup,
) {
    let (c, s) = pair();
    let deadline = Instant::now() + Duration::from_secs(30);
    let t = std::thread::spawn(move || {
        let r = server_rdma_exchange(&s, &mut node, deadline);
        (r, node)
    });
    let rc = client_rdma_exchange(&c, &mut client, deadline);
    drop(c);
    let (rn, node) = t.join().unwrap();
    (rc, client, rn, node)
}

#[test]
fn drivers_exchange_endpoints_over_tcp() {
    let (rc, client, rn, node) = run_drivers(FakeSetup::new(0x101), FakeSetup::new(0x202));
    assert_eq!(rc.unwrap(), 0x101);
    assert_eq!(rn.unwrap(), 0x202);
    assert_eq!(
        client.peer,
        Some(ep(0x202)),
        "the client connected to the node's QP"
    );
    assert_eq!(
        node.peer,
        Some(ep(0x101)),
        "the node connected to the client's QP"
    );
    assert_eq!((client.abandoned, node.abandoned), (0, 0));
}

#[test]
fn drivers_report_which_side_failed_and_keep_nothing() {
    // The node cannot create a queue pair.
    let mut n = FakeSetup::new(2);
    n.fail_prepare = true;
    let (rc, _, rn, _) = run_drivers(FakeSetup::new(1), n);
    let e = rc.unwrap_err().to_string();
    assert!(
        e.contains("the node could not create an RDMA queue pair"),
        "{e}"
    );
    assert!(rn.unwrap_err().to_string().contains("no queue pairs left"));

    // The client cannot create one: the node never creates its own.
    let mut c = FakeSetup::new(1);
    c.fail_prepare = true;
    let (rc, _, rn, node) = run_drivers(c, FakeSetup::new(2));
    assert!(rc
        .unwrap_err()
        .to_string()
        .contains("this client could not create"));
    let e = rn.unwrap_err().to_string();
    assert!(
        e.contains("the client could not create an RDMA queue pair"),
        "{e}"
    );
    assert_eq!(node.prepared, 0, "no node QP for a client that has none");

    // The client cannot connect: the node abandons its connected QP.
    let mut c = FakeSetup::new(1);
    c.fail_connect = true;
    let (rc, _, rn, node) = run_drivers(c, FakeSetup::new(2));
    assert!(rc.unwrap_err().to_string().contains("modify_qp RTR"));
    let e = rn.unwrap_err().to_string();
    assert!(
        e.contains("the client could not connect its RDMA queue pair"),
        "{e}"
    );
    assert_eq!(node.abandoned, 1, "the node's connected QP is torn down");
}

#[test]
fn a_silent_peer_is_cut_off_at_the_deadline() {
    let (c, s) = pair();
    let mut node = FakeSetup::new(2);
    let e = server_rdma_exchange(&s, &mut node, Instant::now() + Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(e, HandshakeError::TimedOut), "{e}");
    assert_eq!(node.prepared, 0);
    drop(c);
}
