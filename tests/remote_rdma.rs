//! RDMA negotiation with the real `kvnode` binary on a host without RDMA (this one: the kernel
//! has no InfiniBand support, `ibv_get_device_list` fails with ENOSYS). The node says why in
//! `transports.rdma` and offers TCP only; a client that asks for RDMA gets an error naming why,
//! one that says `Auto` falls back to TCP and works. The RDMA data path itself is untested on
//! hardware (its node half is tested through the fake fabric in `src/remote/rdma_ops_tests.rs`).
//! On a host that has RDMA these tests skip, saying so.

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::remote::{options, RemoteNode};
use common::{payloads, range, reg, tokens};
use kvnode::client::{FabricChoice, RemoteClient, RemoteOptions};
use kvnode::error::ErrorKind;
use kvnode::protocol::{DataPath, RemoteBuf, Request};
use kvnode::transport::tcp::auth::Token;
use kvnode::transport::tcp::handshake::{
    client_handshake, ClientOffer, FrameRange, HandshakeError, FABRIC_RDMA, FABRIC_TCP,
};

/// Whether this host has usable RDMA (then these tests do not apply).
fn host_has_rdma() -> bool {
    match kvnode_hw::fabric::rdma_availability("auto") {
        Ok(dev) => {
            eprintln!("this host has RDMA ({dev}): the no-RDMA tests are skipped");
            true
        }
        Err(_) => false,
    }
}

fn opts(fabric: FabricChoice) -> RemoteOptions {
    RemoteOptions {
        fabric,
        ..options()
    }
}

/// The fabric bits the node offers, read from its ServerHello through a handshake that asks
/// for RDMA only.
fn rdma_only_handshake(rn: &RemoteNode) -> HandshakeError {
    let addr = rn.url.trim_start_matches("tcp://");
    let s = TcpStream::connect(addr).unwrap();
    let token = Token::from_file(&rn.token_file).unwrap();
    let wanted = ClientOffer {
        frames: FrameRange {
            min: kvnode::protocol::frame::VERSION,
            max: kvnode::protocol::frame::VERSION,
        },
        fabrics: FABRIC_RDMA,
    };
    client_handshake(
        &s,
        Some(&token),
        "rdma-probe",
        &wanted,
        Instant::now() + Duration::from_secs(20),
    )
    .expect_err("the node offers no RDMA here")
}

#[test]
fn a_node_without_rdma_says_why_and_offers_tcp_only() {
    if host_has_rdma() {
        return;
    }
    let rn = RemoteNode::start("rdma-unavailable", &[]);
    let st = rn.node.status();
    let rdma = st["transports"]["rdma"].as_str().unwrap_or_default();
    assert!(rdma.starts_with("unavailable: "), "{st:#}");
    assert!(
        rdma.len() > "unavailable: ".len(),
        "a reason is given: {rdma}"
    );
    assert!(
        rn.node.log().contains("RDMA unavailable"),
        "the reason is logged once: {}",
        rn.node.log()
    );
    match rdma_only_handshake(&rn) {
        HandshakeError::NoCommonFabric { ours, theirs } => {
            assert_eq!(ours, FABRIC_RDMA);
            assert_eq!(theirs, FABRIC_TCP, "the node offers TCP only");
        }
        e => panic!("expected no common fabric, got {e}"),
    }
    // The node still serves: a TCP client works after the refused handshake.
    rn.client().ping(None).unwrap();
}

#[test]
fn rdma_device_none_and_a_missing_device_leave_tcp_serving() {
    if host_has_rdma() {
        return;
    }
    let rn = RemoteNode::start("rdma-none", &["--rdma-device", "none"]);
    let st = rn.node.status();
    assert_eq!(
        st["transports"]["rdma"], "disabled (remote.rdma_device = \"none\")",
        "{st:#}"
    );
    assert!(matches!(
        rdma_only_handshake(&rn),
        HandshakeError::NoCommonFabric { .. }
    ));
    drop(rn);

    // A device named in the configuration that cannot be opened: a warning, TCP only.
    let rn = RemoteNode::start_with_config(
        "rdma-missing",
        Some("[remote]\nrdma_device = \"mlx5_9\"\nrdma_gid_index = 3\n"),
        &[],
    );
    let st = rn.node.status();
    let rdma = st["transports"]["rdma"].as_str().unwrap_or_default();
    assert!(rdma.starts_with("unavailable: "), "{st:#}");
    let mut c = rn.client();
    c.ping(None).unwrap();
    assert_eq!(c.transport().fabric(), kvnode_hw::fabric::FabricKind::Tcp);

    // A bad device name is refused at start, naming the setting.
    let dir = common::TestDir::new("rdma-bad-name");
    let sock = dir.join("x.sock");
    let out = common::kvnode_until_exit(
        &dir,
        &[
            "serve",
            "--socket",
            sock.to_str().unwrap(),
            "--listen",
            "tcp://127.0.0.1:0",
            "--insecure-no-auth",
            "--rdma-device",
            "../mlx5_0",
        ],
    );
    assert!(out.failed());
    assert!(out.stderr.contains("remote.rdma_device"), "{}", out.stderr);
}

#[test]
fn a_client_asking_for_rdma_gets_a_clear_error_and_auto_falls_back_to_tcp() {
    if host_has_rdma() {
        return;
    }
    let rn = RemoteNode::start("rdma-client", &["--pool-size", "64MiB"]);
    let token = Token::from_file(&rn.token_file).unwrap();
    let Err(e) = RemoteClient::connect_remote(&rn.url, Some(&token), &opts(FabricChoice::Rdma))
    else {
        panic!("connected with RDMA on a host without it");
    };
    assert_eq!(e.kind, ErrorKind::Unsupported, "{e}");
    let m = e.to_string();
    assert!(
        m.contains("RDMA was asked for") && m.contains("cannot use it"),
        "{m}"
    );

    // Auto: TCP, every byte verified.
    let mut c =
        RemoteClient::connect_remote(&rn.url, Some(&token), &opts(FabricChoice::Auto)).unwrap();
    assert_eq!(c.transport().fabric(), kvnode_hw::fabric::FabricKind::Tcp);
    let r = c.register(&reg(1)).unwrap();
    let rg = range(&tokens(1, 3));
    let data = payloads(&rg, r.object_bytes as usize);
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    assert_eq!(c.store(1, &rg, &refs).unwrap(), 3);
    assert!(c.retrieve(1, &rg).unwrap().expect("a hit") == data);
    let st = rn.node.status();
    let conns = st["remote"]["connections"].as_array().unwrap();
    assert!(
        conns.iter().all(|c| c["fabric"] == "tcp"),
        "every connection is on TCP: {st:#}"
    );

    // Registered-buffer calls need an RDMA connection: a clear error, nothing sent.
    #[cfg(feature = "rdma")]
    {
        let buf = kvnode_hw::fabric::EngineBuffer::new(1 << 20).unwrap();
        let e = c.register_buffer(buf).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("chose tcp"), "{e}");
    }

    // Descriptors sent anyway on a TCP connection are refused by the node, the store stays
    // prepared and the connection usable.
    let rg2 = range(&tokens(2, 1));
    let p = c.prepare_store(1, &rg2).unwrap();
    let e = c
        .call(&Request::WriteSlots {
            instance_id: 1,
            transfer_id: p.transfer_id,
            data: DataPath::Remote(vec![RemoteBuf {
                region: 1,
                offset: 0,
                len: r.object_bytes,
            }]),
            commit: true,
        })
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("chose TCP"), "{e}");
    assert_eq!(c.abort_store(1, p.transfer_id).unwrap(), 1);
}
