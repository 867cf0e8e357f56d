//! Who may use the LMCache endpoint.
//!
//! LMCache's clients speak ZMQ over TCP, which carries no credentials. kvnode identifies each
//! connection by what the kernel recorded: libzmq tags every received message with the
//! descriptor of the connection it came from (the `__fd` property behind the deprecated
//! `ZMQ_SRCFD`); the socket open at that descriptor gives the connection's two addresses, and the
//! kernel's socket table (`/proc/net/tcp{,6}`) the uid owning the peer's end. The node's
//! [`AccessPolicy`] then makes that uid an admin (the node's user, root, `admin_uids`,
//! `admin_gids`), a client (`allow_uids`, `allow_gids`) or refused.
//!
//! * A refused peer's requests get the operation's negative answer (LMCache's protocol has no
//!   error reply its released clients understand) and a rate-limited warning naming its uid.
//! * A client may use the data path; node-wide operations (CLEAR) need an admin.
//! * The endpoint binds loopback addresses only unless the operator passes `--allow-remote`:
//!   peers on other machines (or in other network namespaces) are not in this kernel's socket
//!   table, so nothing tells who they are. With the flag they are served as clients (never
//!   admins), and protecting the port (firewall, private network) is the operator's job.
//!
//! Cost: a connection is identified once, at its first message (one read of the socket table);
//! later messages cost one `fstat` of the descriptor, which pins the answer to that socket (its
//! inode), plus a map lookup. Limit of the scheme: a message that a peer left queued before
//! closing its connection is judged by whatever socket holds that descriptor number when it is
//! read. A refused user therefore needs an allowed user's client to connect in the instant
//! between its own close and kvnode reading its last message, on the same descriptor number;
//! a message whose ZMQ identity differs from the one first seen on a socket is refused, which
//! closes that window for every connection identified before.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::reply::{LmReply, Reply};
use super::wire::Op;
use crate::access::{AccessPolicy, Role};
use crate::error::{Error, Result};

/// Connections whose identification is kept (one per open descriptor; beyond it the table is
/// emptied and connections are identified again).
pub const MAX_LM_PEERS: usize = 65_536;
/// At most one refusal warning per user (or per unidentified peer) in this interval; the
/// warning counts the refusals it stood for.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Users whose refusal warnings are rate-limited separately (beyond: one shared limiter).
pub const MAX_REFUSAL_LOG_KEYS: usize = 1024;
/// The libzmq message property holding the descriptor of the connection a message came from.
const SOURCE_FD_PROPERTY: &str = "__fd";

/// How the LMCache endpoint decides who may use it.
#[derive(Debug, Clone)]
pub struct LmAccessOptions {
    /// The node's access policy (`[access]` and the `--allow-*`/`--admin-*` flags).
    pub policy: AccessPolicy,
    /// Whether a non-loopback address may be bound; peers the kernel's socket table does not
    /// list (other machines) are then served as clients.
    pub allow_remote: bool,
}

/// Whether `ip` only reaches this machine: 127.0.0.0/8, ::1, or an IPv4-mapped 127.x address.
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// Checks the host the endpoint is about to bind (`127.0.0.1`, `[::1]`, `*`, any IP literal):
/// a host that is not loopback needs `allow_remote`. Host names are resolved before this (the
/// libzmq kvnode links binds addresses only); `localhost` is accepted as loopback.
pub fn check_bind_host(host: &str, allow_remote: bool) -> Result<()> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = bare == "localhost" || bare.parse::<IpAddr>().is_ok_and(is_loopback);
    if loopback || allow_remote {
        return Ok(());
    }
    Err(Error::denied(format!(
        "the LMCache endpoint would listen on {host}, which is not a loopback address: other \
         machines could reach it, and kvnode cannot tell who they are. Bind a loopback address \
         (--host localhost, the default, or 127.0.0.1), or pass --allow-remote once the port is \
         protected at the network level (firewall, private network); remote peers are then \
         served as clients (data path, never CLEAR)"
    )))
}

/// Receives one multipart request without blocking, with the descriptor of the connection it
/// came from (`None` when libzmq did not record one).
pub fn recv_request(router: &zmq::Socket) -> zmq::Result<(Vec<Vec<u8>>, Option<RawFd>)> {
    let mut frames = Vec::with_capacity(4);
    let mut fd = None;
    loop {
        // The parts of a message arrive together: after the first, the rest is there already.
        let mut m = router.recv_msg(zmq::DONTWAIT)?;
        // The identity frame the ROUTER makes carries no properties when poll pre-fetched the
        // message; the peer's own frames always do.
        if fd.is_none() {
            fd = m
                .gets(SOURCE_FD_PROPERTY)
                .and_then(|v| v.parse::<RawFd>().ok())
                .filter(|fd| *fd >= 0);
        }
        let more = m.get_more();
        frames.push(m.to_vec());
        if !more {
            return Ok((frames, fd));
        }
    }
}

/// Who sent one request, as the endpoint judged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LmPeer {
    /// What the peer may do.
    pub role: Role,
    /// The uid owning the peer's socket (`None`: not identified, e.g. a remote peer).
    pub uid: Option<u32>,
    /// Why an unidentified or refused peer was judged so (for the log line).
    pub reason: &'static str,
}

impl LmPeer {
    fn unknown(reason: &'static str) -> LmPeer {
        LmPeer {
            role: Role::Refused,
            uid: None,
            reason,
        }
    }
}

/// What is known about the socket at one descriptor number.
struct Known {
    inode: u64,
    /// The ZMQ identity its first message carried (a connection has exactly one).
    identity: Vec<u8>,
    peer: LmPeer,
}

/// One refusal warning limiter.
struct LogSlot {
    last: Instant,
    suppressed: u64,
}

/// The endpoint's access check, owned by the I/O thread. Invariant: an entry of `known` was
/// resolved from the socket whose inode it records, and is used only while that socket is still
/// the one open at its descriptor number.
pub struct PeerGate {
    opts: LmAccessOptions,
    port: u16,
    known: HashMap<RawFd, Known>,
    logs: HashMap<Option<u32>, LogSlot>,
}

impl PeerGate {
    /// The check for an endpoint listening on `port`.
    pub fn new(opts: LmAccessOptions, port: u16) -> PeerGate {
        PeerGate {
            opts,
            port,
            known: HashMap::new(),
            logs: HashMap::new(),
        }
    }

    /// Who sent a message that came over descriptor `fd` with ZMQ identity `identity`.
    pub fn peer(&mut self, fd: Option<RawFd>, identity: &[u8]) -> LmPeer {
        let Some(fd) = fd else {
            return LmPeer::unknown("libzmq recorded no connection for the message");
        };
        let inode = match kvnode_hw::socket_inode(fd) {
            Ok(Some(i)) => i,
            Ok(None) | Err(_) => {
                return LmPeer::unknown("its connection closed before the message was read")
            }
        };
        if let Some(k) = self.known.get_mut(&fd) {
            if k.inode == inode {
                if k.identity == identity {
                    return k.peer;
                }
                // One socket, two identities: one of them is a closed connection's leftover
                // whose descriptor number was reused. Refuse this message; a live peer's next
                // one is served again.
                k.identity = identity.to_vec();
                return LmPeer::unknown(
                    "a second ZMQ identity on one connection (a closed connection's leftover)",
                );
            }
        }
        let peer = self.resolve(fd, inode);
        if self.known.len() >= MAX_LM_PEERS {
            self.known.clear();
        }
        self.known.insert(
            fd,
            Known {
                inode,
                identity: identity.to_vec(),
                peer,
            },
        );
        peer
    }

    /// Identifies the socket open at `fd` (inode `inode`).
    fn resolve(&self, fd: RawFd, inode: u64) -> LmPeer {
        let (local, remote) = match kvnode_hw::tcp_socket_addresses(fd) {
            Ok(Some(a)) => a,
            Ok(None) | Err(_) => return LmPeer::unknown("not a TCP connection"),
        };
        if local.port() != self.port {
            return LmPeer::unknown("not a connection of the LMCache endpoint");
        }
        let owner = kvnode_hw::tcp_peer_uid(local, remote);
        // The socket table was read for the socket whose addresses we took only if that socket
        // is still the one at `fd`.
        if !matches!(kvnode_hw::socket_inode(fd), Ok(Some(i)) if i == inode) {
            return LmPeer::unknown("its connection closed while it was identified");
        }
        match owner {
            Ok(Some(uid)) => {
                let gid = kvnode_hw::user_groups(uid)
                    .first()
                    .copied()
                    .unwrap_or(u32::MAX);
                LmPeer {
                    role: self.opts.policy.role_of(uid, gid),
                    uid: Some(uid),
                    reason:
                        "not allowed by [access] (the node's user, root, allow_uids, allow_gids)",
                }
            }
            Ok(None) if !is_remote(remote) => {
                LmPeer::unknown("its socket is not in the kernel's socket table")
            }
            Ok(None) if self.opts.allow_remote => LmPeer {
                role: Role::Client,
                uid: None,
                reason: "a remote peer (served as a client under --allow-remote)",
            },
            Ok(None) => LmPeer::unknown("a remote peer, and --allow-remote is not set"),
            Err(_) => LmPeer::unknown("the kernel's socket table could not be read"),
        }
    }

    /// Logs a refused request: at most one line per user per [`REFUSAL_LOG_INTERVAL`].
    pub fn note_refusal(&mut self, peer: &LmPeer, op: &str) {
        let now = Instant::now();
        let key = if self.logs.len() >= MAX_REFUSAL_LOG_KEYS && !self.logs.contains_key(&peer.uid) {
            None
        } else {
            peer.uid
        };
        let slot = self.logs.entry(key).or_insert(LogSlot {
            last: now - REFUSAL_LOG_INTERVAL,
            suppressed: 0,
        });
        if now.duration_since(slot.last) < REFUSAL_LOG_INTERVAL {
            slot.suppressed += 1;
            return;
        }
        let uid = peer
            .uid
            .map_or_else(|| "unknown".to_owned(), |u| u.to_string());
        tracing::warn!(
            uid = %uid,
            op,
            role = ?peer.role,
            reason = peer.reason,
            refused_since_last_warning = slot.suppressed,
            "LMCache request refused: user {uid} may not {}",
            if peer.role == Role::Refused { "use this node" } else { "run node-wide operations" }
        );
        slot.last = now;
        slot.suppressed = 0;
    }
}

/// Whether `ip` may be another machine (not loopback).
fn is_remote(addr: SocketAddr) -> bool {
    !is_loopback(addr.ip())
}

/// Whether a peer with `role` may run `op`: refused peers nothing, clients everything but the
/// node-wide operations (CLEAR), admins everything.
pub fn permits(role: Role, op: Op) -> bool {
    match role {
        Role::Refused => false,
        Role::Client => !is_admin_op(op),
        Role::Admin => true,
    }
}

/// The LMCache operations that act on the whole node rather than on the caller's data.
pub fn is_admin_op(op: Op) -> bool {
    matches!(op, Op::Clear)
}

/// The answer to a refused request where it differs from the frontend's stateless negative
/// answer (which is the answer otherwise): those whose stateless answer is positive (PING and
/// COMMIT_RETRIEVE `true`, the chunk size, NOOP's `"OK"`, the experimental list) get `false` or
/// no reply frame (the client sees `None`).
pub fn refusal(op: Op) -> Option<Reply> {
    match op {
        Op::Ping | Op::CommitRetrieve => Some(LmReply::Bool(false).encode()),
        Op::GetChunkSize | Op::Noop | Op::GetExperimental => Some(None),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::AccessConfig;

    #[test]
    fn loopback_hosts_bind_and_others_need_the_flag() {
        for h in [
            "127.0.0.1",
            "127.3.4.5",
            "[::1]",
            "::1",
            "localhost",
            "[::ffff:127.0.0.1]",
        ] {
            check_bind_host(h, false).unwrap_or_else(|e| panic!("{h}: {e}"));
        }
        for h in ["*", "0.0.0.0", "10.1.2.3", "[::]", "[2001:db8::1]", "eth0"] {
            let e = check_bind_host(h, false).unwrap_err();
            assert!(e.context.contains("--allow-remote"), "{h}: {e}");
            assert!(e.context.contains(h), "names the host: {e}");
            check_bind_host(h, true).unwrap();
        }
    }

    #[test]
    fn clients_may_not_clear_and_refused_peers_may_do_nothing() {
        for op in [Op::Clear, Op::Ping, Op::PrepareStore, Op::GetChunkSize] {
            assert!(permits(Role::Admin, op));
            assert!(!permits(Role::Refused, op));
        }
        assert!(!permits(Role::Client, Op::Clear));
        assert!(permits(Role::Client, Op::RegisterEngineDriven));
        assert!(permits(Role::Client, Op::UnregisterEngineDriven));
    }

    #[test]
    fn refusals_never_answer_positively() {
        assert_eq!(refusal(Op::Ping), Some(LmReply::Bool(false).encode()));
        assert_eq!(refusal(Op::GetChunkSize), Some(None));
        assert_eq!(
            refusal(Op::PrepareStore),
            None,
            "the stateless negative answer"
        );
    }

    #[test]
    fn a_message_without_a_connection_or_over_a_foreign_socket_is_refused() {
        let opts = LmAccessOptions {
            policy: AccessPolicy::new(AccessConfig::default()),
            allow_remote: false,
        };
        let mut gate = PeerGate::new(opts, 1);
        assert_eq!(gate.peer(None, b"x").role, Role::Refused);
        // A TCP connection of another port is not one of the endpoint's.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, _) = listener.accept().unwrap();
        use std::os::fd::AsRawFd;
        let p = gate.peer(Some(server_side.as_raw_fd()), b"x");
        assert_eq!(p.role, Role::Refused);
        assert_eq!(p.reason, "not a connection of the LMCache endpoint");
    }

    #[test]
    fn our_own_loopback_connection_is_an_admin_and_a_second_identity_is_refused() {
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_side, _) = listener.accept().unwrap();
        let opts = LmAccessOptions {
            policy: AccessPolicy::new(AccessConfig::default()),
            allow_remote: false,
        };
        let mut gate = PeerGate::new(opts, port);
        let fd = Some(server_side.as_raw_fd());
        let p = gate.peer(fd, b"id-1");
        assert_eq!(p.role, Role::Admin, "{p:?}");
        assert_eq!(p.uid, Some(kvnode_hw::effective_uid()));
        assert_eq!(gate.peer(fd, b"id-1"), p, "served from the table");
        assert_eq!(gate.peer(fd, b"id-2").role, Role::Refused);
        assert_eq!(
            gate.peer(fd, b"id-2"),
            p,
            "the live identity is served again"
        );
    }
}

#[cfg(test)]
mod recv_tests {
    use super::*;

    #[test]
    fn received_requests_name_their_connection_also_after_a_poll() {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind("tcp://127.0.0.1:0").unwrap();
        let ep = router.get_last_endpoint().unwrap().unwrap();
        let port: u16 = ep.rsplit(':').next().unwrap().parse().unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.connect(&ep).unwrap();
        for round in 0..2 {
            dealer
                .send_multipart([b"a".to_vec(), b"b".to_vec()], 0)
                .unwrap();
            // Polling pre-fetches the message (its identity frame then has no properties).
            let mut items = [router.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, 10_000).unwrap();
            assert!(items[0].is_readable(), "round {round}");
            let (frames, fd) = recv_request(&router).unwrap();
            assert_eq!(frames.len(), 3);
            assert_eq!(&frames[1..], &[b"a".to_vec(), b"b".to_vec()]);
            let (local, _) = kvnode_hw::tcp_socket_addresses(fd.unwrap())
                .unwrap()
                .unwrap();
            assert_eq!(local.port(), port);
        }
    }
}
