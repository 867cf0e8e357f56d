//! The TCP handshake over real loopback sockets: both blocking drivers against each other, with
//! token files generated and loaded as an operator would, refusals, stalled and vanishing peers
//! cut off at the deadline, and the byte boundary with the frames that follow.
//! (The node's listener wires these drivers into `kvnode serve`; its process tests live with it.)

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use kvnode::access::Role;
use kvnode::transport::tcp::auth::{generate_token_file, Token};
use kvnode::transport::tcp::handshake::{
    client_handshake, send_busy, server_handshake, ClientNegotiated, ClientOffer, FrameRange,
    HandshakeError, Negotiated, Offer, ServerKeys, FABRIC_TCP,
};

mod common;
use common::TestDir;

/// Generous: only the stall tests wait for a deadline, and they use `STALL`.
const DEADLINE: Duration = Duration::from_secs(20);
/// How long a stalled peer is given in the stall tests (the outcome, not the time, is asserted).
const STALL: Duration = Duration::from_millis(300);

fn offer() -> Offer {
    Offer {
        frames: FrameRange { min: 2, max: 3 },
        fabrics: FABRIC_TCP,
        node_id: *b"node-id-16-bytes",
    }
}

fn wanted() -> ClientOffer {
    ClientOffer {
        frames: FrameRange { min: 2, max: 3 },
        fabrics: FABRIC_TCP,
    }
}

/// Token files as an operator makes them (`kvnode token generate`), loaded back.
fn tokens(dir: &TestDir, names: &[&str]) -> Vec<Token> {
    names
        .iter()
        .map(|n| {
            let p = dir.join(n);
            generate_token_file(&p).unwrap();
            Token::from_file(&p).unwrap()
        })
        .collect()
}

/// Runs `server` on the accepted end and `client` on the connecting end of a loopback TCP
/// connection; returns both results.
fn pair<S, C>(
    server: impl FnOnce(TcpStream) -> S + Send + 'static,
    client: impl FnOnce(TcpStream) -> C,
) -> (S, C)
where
    S: Send + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || server(l.accept().unwrap().0));
    let c = client(TcpStream::connect(addr).unwrap());
    (t.join().unwrap(), c)
}

fn serve(keys: ServerKeys) -> impl FnOnce(TcpStream) -> Result<Negotiated, HandshakeError> {
    move |s| server_handshake(&s, &keys, &offer(), Instant::now() + DEADLINE)
}

fn connect(
    token: Option<Token>,
) -> impl FnOnce(TcpStream) -> Result<ClientNegotiated, HandshakeError> {
    move |s| {
        client_handshake(
            &s,
            token.as_ref(),
            "engine-7",
            &wanted(),
            Instant::now() + DEADLINE,
        )
    }
}

#[test]
fn generated_token_files_authenticate_both_ways_and_frames_follow_untouched() {
    let dir = TestDir::new("hs-ok");
    let mut t = tokens(&dir, &["client", "admin"]);
    let (admin_c, client_c) = {
        let p = dir.join("client");
        let a = dir.join("admin");
        (Token::from_file(&a).unwrap(), Token::from_file(&p).unwrap())
    };
    let admin = t.pop();
    let client = t.pop().unwrap();
    let keys = std::sync::Arc::new(ServerKeys::Token { client, admin });
    for (token, role) in [(client_c, Role::Client), (admin_c, Role::Admin)] {
        let k = keys.clone();
        let (s, c) = pair(
            move |mut s| {
                let n = server_handshake(&s, &k, &offer(), Instant::now() + DEADLINE)?;
                // The first frame bytes are still in the socket for the frame layer.
                let mut first = [0u8; 8];
                s.read_exact(&mut first).map_err(HandshakeError::Io)?;
                assert_eq!(&first, b"KVN1next");
                Ok::<_, HandshakeError>(n)
            },
            |mut s| {
                let n = connect(Some(token))(s.try_clone().unwrap())?;
                s.write_all(b"KVN1next").unwrap();
                Ok::<_, HandshakeError>(n)
            },
        );
        let (s, c) = (s.unwrap(), c.unwrap());
        assert_eq!((s.role, c.role), (role, role));
        assert_eq!((s.frame_version, c.frame_version), (3, 3));
        assert_eq!(s.client_name, "engine-7");
        assert_eq!(&c.node_id, b"node-id-16-bytes");
        assert!(s.authenticated && c.authenticated);
    }
}

#[test]
fn a_wrong_token_fails_on_both_sides_with_bad_token() {
    let dir = TestDir::new("hs-wrong");
    let mut t = tokens(&dir, &["node", "stranger"]);
    let stranger = t.pop();
    let node = t.pop().unwrap();
    let (s, c) = pair(
        serve(ServerKeys::Token {
            client: node,
            admin: None,
        }),
        connect(stranger),
    );
    let c = c.unwrap_err();
    assert!(matches!(c, HandshakeError::BadToken), "{c}");
    assert!(c.is_auth_failure());
    assert_eq!(
        c.to_string(),
        "authentication failed: the token was rejected"
    );
    assert!(matches!(s, Err(HandshakeError::BadToken)), "{s:?}");
}

#[test]
fn insecure_mode_serves_tokenless_clients_and_is_refused_by_token_clients() {
    let (s, c) = pair(serve(ServerKeys::Insecure), connect(None));
    let (s, c) = (s.unwrap(), c.unwrap());
    assert_eq!((s.role, c.role), (Role::Client, Role::Client));
    assert!(!s.authenticated && !c.authenticated);

    let dir = TestDir::new("hs-insecure");
    let t = tokens(&dir, &["t"]).pop();
    let (s, c) = pair(serve(ServerKeys::Insecure), move |st| {
        let r = connect(t)(st.try_clone().unwrap());
        drop(st); // the client closes, as a refusing client does
        r
    });
    assert!(matches!(c, Err(HandshakeError::NotAuthenticating)), "{c:?}");
    assert!(matches!(s, Err(HandshakeError::Closed)), "{s:?}");
}

#[test]
fn a_tokenless_client_of_a_token_node_is_told_a_token_is_required() {
    let dir = TestDir::new("hs-tokenless");
    let node = tokens(&dir, &["n"]).pop().unwrap();
    let (s, c) = pair(
        serve(ServerKeys::Token {
            client: node,
            admin: None,
        }),
        connect(None),
    );
    assert!(matches!(c, Err(HandshakeError::TokenRequired)), "{c:?}");
    assert!(matches!(s, Err(HandshakeError::BadToken)), "{s:?}");
}

#[test]
fn stalled_peers_time_out_at_the_deadline() {
    let dir = TestDir::new("hs-stall");
    let client_token = tokens(&dir, &["a"]).pop();
    // A client that connects and says nothing, and one that stops halfway through its hello.
    for partial in [&b""[..], &b"KVNH\x01\x00\x02"[..]] {
        let (s, hold) = pair(
            {
                let keys = ServerKeys::Insecure;
                move |s| server_handshake(&s, &keys, &offer(), Instant::now() + STALL)
            },
            |mut st| {
                st.write_all(partial).unwrap();
                st // kept open until the node gave up
            },
        );
        assert!(matches!(s, Err(HandshakeError::TimedOut)), "{s:?}");
        drop(hold);
    }
    // A node that accepts and never answers.
    let (_, c) = pair(
        move |s| {
            // Waits for the client to give up (its close), never answering.
            let mut buf = [0u8; 256];
            let mut s2 = &s;
            while matches!(s2.read(&mut buf), Ok(n) if n > 0) {}
        },
        move |st| {
            let r = client_handshake(
                &st,
                client_token.as_ref(),
                "x",
                &wanted(),
                Instant::now() + STALL,
            );
            st.shutdown(Shutdown::Both).unwrap();
            r
        },
    );
    assert!(matches!(c, Err(HandshakeError::TimedOut)), "{c:?}");
}

#[test]
fn a_peer_that_vanishes_mid_handshake_is_closed_not_hung() {
    let (s, _) = pair(serve(ServerKeys::Insecure), |mut st| {
        st.write_all(b"KVNH\x01\x00").unwrap();
        drop(st);
    });
    assert!(matches!(s, Err(HandshakeError::Closed)), "{s:?}");
    let (_, c) = pair(
        |mut s| {
            let mut b = [0u8; 4];
            s.read_exact(&mut b).unwrap();
            s.write_all(b"KVNH").unwrap();
        },
        connect(None),
    );
    assert!(matches!(c, Err(HandshakeError::Closed)), "{c:?}");
}

#[test]
fn a_busy_node_is_reported_as_busy() {
    // The accept loop answers without reading the hello and closes at once; repeated, so a
    // close racing the client's hello (a reset) would show.
    for _ in 0..20 {
        let (s, c) = pair(
            |st| {
                send_busy(
                    &st,
                    &ServerKeys::Insecure,
                    &offer(),
                    Instant::now() + DEADLINE,
                )?;
                drop(st);
                Ok::<_, HandshakeError>(())
            },
            connect(None),
        );
        s.unwrap();
        assert!(matches!(c, Err(HandshakeError::Busy)), "{c:?}");
    }
    // The node closed before the client even sent its hello (the hello meets a reset).
    for _ in 0..5 {
        let (tx, rx) = std::sync::mpsc::channel();
        let (_, c) = pair(
            move |st| {
                send_busy(
                    &st,
                    &ServerKeys::Insecure,
                    &offer(),
                    Instant::now() + DEADLINE,
                )
                .unwrap();
                drop(st);
                tx.send(()).unwrap();
            },
            |st| {
                rx.recv().unwrap();
                connect(None)(st)
            },
        );
        assert!(matches!(c, Err(HandshakeError::Busy)), "{c:?}");
    }
}

#[test]
fn a_non_kvnode_peer_is_rejected_at_its_first_bytes() {
    let (s, _) = pair(serve(ServerKeys::Insecure), |mut st| {
        st.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        st
    });
    match s {
        Err(HandshakeError::Malformed(m)) => assert!(m.contains("magic"), "{m}"),
        other => panic!("{other:?}"),
    }
    let (_, c) = pair(
        |mut s| {
            let mut b = [0u8; 8];
            s.read_exact(&mut b).unwrap();
            s.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").unwrap();
            s
        },
        connect(None),
    );
    assert!(matches!(c, Err(HandshakeError::Malformed(_))), "{c:?}");
}
