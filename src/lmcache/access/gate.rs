//! The endpoint's per-connection identification, owned by the I/O thread.
//!
//! A connection is identified at its first message: the socket at its descriptor (pinned by the
//! socket's inode, read before and after) gives its addresses, the kernel the owner of the
//! peer's end. The answer is kept under the connection's libzmq property set (see
//! [`Source`](super::Source)), so later messages cost a property lookup and a map lookup, no
//! system call. A kept connection holds one small message of its own, which keeps its property
//! set alive: its key cannot name another connection meanwhile. Every [`SWEEP_INTERVAL`] the
//! connections whose socket has gone are marked, and those marked at the previous sweep too are
//! forgotten (their queued messages, if any, were read long before).
//!
//! Limit of the scheme: a connection's *first* message is judged by the socket open at its
//! descriptor when it is read. If the peer closed its connection before kvnode read that first
//! message and another user's client was accepted on the same descriptor number meanwhile, the
//! message is judged as that user's. The peer cannot cause the other user's connection; a peer
//! of a connection that kvnode identified before it closed is recognised by its key.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::{is_loopback, LmAccessOptions, Source};
use crate::access::Role;

/// Connections whose identification is kept at once (beyond: a new connection is identified
/// again at each message until a sweep makes room). Bounds the kept messages and their
/// property sets (well under 1 KiB each).
pub const MAX_LM_PEERS: usize = 4096;
/// Largest frame kept to hold a connection's property set alive (the identity or request-id
/// frame; a larger one is not kept and its connection is identified again next time).
pub const MAX_KEPT_FRAME_BYTES: usize = 256;
/// How often the kept connections are checked against the open sockets.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(10);
/// Messages between two looks at the clock for a sweep.
const SWEEP_CHECK_EVERY: u64 = 4096;
/// At most one refusal warning per user (or per unidentified peer) in this interval; the
/// warning counts the refusals it stood for.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Users whose refusal warnings are rate-limited separately (beyond: one shared limiter).
pub const MAX_REFUSAL_LOG_KEYS: usize = 1024;
/// The "no group" gid ((gid_t)-1) passed for TCP peers, whose primary group the socket table
/// does not record (the policy finds the user's groups in the user database).
const NO_GID: u32 = u32::MAX;

/// Who sent one request, as the endpoint judged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LmPeer {
    /// What the peer may do.
    pub role: Role,
    /// The uid owning the peer's socket (`None`: not identified, e.g. a remote peer).
    pub uid: Option<u32>,
    /// Why the peer was judged so (for the log line).
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

/// A connection the gate identified.
struct Known {
    /// Keeps the connection's property set, and so its key, alive.
    _keep: zmq::Message,
    fd: RawFd,
    inode: u64,
    peer: LmPeer,
    /// Its socket was gone at the last sweep.
    gone: bool,
}

/// One refusal warning limiter.
struct LogSlot {
    last: Instant,
    suppressed: u64,
}

/// The endpoint's access check. Invariant: an entry of `known` was identified from the socket
/// of the connection whose property set its key names, and holds a message of that connection.
pub struct PeerGate {
    opts: LmAccessOptions,
    port: u16,
    known: HashMap<usize, Known>,
    messages: u64,
    last_sweep: Instant,
    logs: HashMap<Option<u32>, LogSlot>,
}

impl PeerGate {
    /// The check for an endpoint listening on `port`.
    pub fn new(opts: LmAccessOptions, port: u16) -> PeerGate {
        PeerGate {
            opts,
            port,
            known: HashMap::new(),
            messages: 0,
            last_sweep: Instant::now(),
            logs: HashMap::new(),
        }
    }

    /// Who sent a message that came over the connection `source`.
    pub fn peer(&mut self, source: Option<Source>) -> LmPeer {
        self.messages += 1;
        if self.messages.is_multiple_of(SWEEP_CHECK_EVERY) {
            self.sweep_if_due();
        }
        let Some(src) = source else {
            return LmPeer::unknown("libzmq recorded no connection for the message");
        };
        if let Some(k) = self.known.get(&src.key) {
            return k.peer;
        }
        self.sweep_if_due();
        let inode = match kvnode_hw::socket_inode(src.fd) {
            Ok(Some(i)) => i,
            Ok(None) | Err(_) => {
                return LmPeer::unknown("its connection closed before the message was read")
            }
        };
        let (peer, definitive) = self.resolve(src.fd, inode);
        if let (true, Some(keep)) = (definitive, src.keep) {
            if self.known.len() < MAX_LM_PEERS {
                self.known.insert(
                    src.key,
                    Known {
                        _keep: keep,
                        fd: src.fd,
                        inode,
                        peer,
                        gone: false,
                    },
                );
            }
        }
        peer
    }

    /// Forgets the connections whose socket was gone at this sweep and the previous one.
    fn sweep_if_due(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_sweep) < SWEEP_INTERVAL {
            return;
        }
        self.last_sweep = now;
        self.known.retain(|_, k| {
            let alive = matches!(kvnode_hw::socket_inode(k.fd), Ok(Some(i)) if i == k.inode);
            let keep = alive || !k.gone;
            k.gone = !alive;
            keep
        });
    }

    /// Identifies the socket open at `fd` (inode `inode`); `definitive` is false for answers a
    /// later message might not get (a transient failure).
    fn resolve(&self, fd: RawFd, inode: u64) -> (LmPeer, bool) {
        let (local, remote) = match kvnode_hw::tcp_socket_addresses(fd) {
            Ok(Some(a)) => a,
            Ok(None) => return (LmPeer::unknown("not a TCP connection"), true),
            Err(_) => {
                return (
                    LmPeer::unknown("its connection closed while it was read"),
                    true,
                )
            }
        };
        if local.port() != self.port {
            return (
                LmPeer::unknown("not a connection of the LMCache endpoint"),
                true,
            );
        }
        // The peer's socket has the addresses the other way round. The kernel's direct lookup,
        // else (no sock_diag) the socket table.
        let owner = kvnode_hw::tcp_socket_owner(remote, local)
            .or_else(|_| kvnode_hw::tcp_peer_uid(local, remote));
        // The owner found is the peer of the socket the addresses came from only if that
        // socket is still the one at `fd`.
        if !matches!(kvnode_hw::socket_inode(fd), Ok(Some(i)) if i == inode) {
            let p = LmPeer::unknown("its connection closed while it was identified");
            return (p, true);
        }
        match owner {
            Ok(Some(uid)) => (
                LmPeer {
                    role: self.opts.policy.role_of(uid, NO_GID),
                    uid: Some(uid),
                    reason:
                        "not allowed by [access] (the node's user, root, allow_uids, allow_gids)",
                },
                true,
            ),
            Ok(None) if !is_remote(remote) => (
                LmPeer::unknown("its socket is not in the kernel's socket table"),
                false,
            ),
            Ok(None) if self.opts.allow_remote => (
                LmPeer {
                    role: Role::Client,
                    uid: None,
                    reason: "a remote peer (served as a client under --allow-remote)",
                },
                true,
            ),
            Ok(None) => (
                LmPeer::unknown("a remote peer, and --allow-remote is not set"),
                true,
            ),
            Err(_) => (
                LmPeer::unknown("the kernel's socket table could not be read"),
                false,
            ),
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
            last: now.checked_sub(REFUSAL_LOG_INTERVAL).unwrap_or(now),
            suppressed: 0,
        });
        if now.duration_since(slot.last) < REFUSAL_LOG_INTERVAL && slot.suppressed < u64::MAX {
            slot.suppressed += 1;
            return;
        }
        let uid = peer
            .uid
            .map_or_else(|| "unknown".to_owned(), |u| u.to_string());
        let may_not = if peer.role == Role::Refused {
            "use this node"
        } else {
            "run node-wide operations"
        };
        tracing::warn!(
            uid = %uid,
            op,
            role = ?peer.role,
            reason = peer.reason,
            refused_since_last_warning = slot.suppressed,
            "LMCache request refused: user {uid} may not {may_not}"
        );
        slot.last = now;
        slot.suppressed = 0;
    }
}

/// Whether `addr` may be on another machine (it is not loopback).
fn is_remote(addr: SocketAddr) -> bool {
    !is_loopback(addr.ip())
}

#[cfg(test)]
mod tests {
    use super::super::recv_request;
    use super::*;
    use crate::access::{AccessConfig, AccessPolicy};

    fn gate(port: u16) -> PeerGate {
        PeerGate::new(
            LmAccessOptions {
                policy: AccessPolicy::new(AccessConfig::default()),
                allow_remote: false,
            },
            port,
        )
    }

    /// A ROUTER on loopback, a DEALER connected to it, and the ROUTER's port.
    fn pair(ctx: &zmq::Context) -> (zmq::Socket, zmq::Socket, u16) {
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind("tcp://127.0.0.1:0").unwrap();
        let ep = router.get_last_endpoint().unwrap().unwrap();
        let port = ep.rsplit(':').next().unwrap().parse().unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.connect(&ep).unwrap();
        (router, dealer, port)
    }

    fn next(router: &zmq::Socket) -> (Vec<Vec<u8>>, Option<Source>) {
        // Polling pre-fetches the message (its identity frame then has no properties).
        let mut items = [router.as_poll_item(zmq::POLLIN)];
        zmq::poll(&mut items, 10_000).unwrap();
        assert!(items[0].is_readable());
        recv_request(router).unwrap()
    }

    #[test]
    fn our_own_connection_is_an_admin_identified_once() {
        let ctx = zmq::Context::new();
        let (router, dealer, port) = pair(&ctx);
        let mut g = gate(port);
        for round in 0..3 {
            dealer
                .send_multipart([b"a".to_vec(), b"b".to_vec()], 0)
                .unwrap();
            let (frames, src) = next(&router);
            assert_eq!(&frames[1..], &[b"a".to_vec(), b"b".to_vec()]);
            let p = g.peer(src);
            assert_eq!(p.role, Role::Admin, "round {round}: {p:?}");
            assert_eq!(p.uid, Some(kvnode_hw::effective_uid()));
            assert_eq!(g.known.len(), 1, "one connection, identified once");
        }
        // A second connection is another entry.
        let d2 = ctx.socket(zmq::DEALER).unwrap();
        d2.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
        d2.send_multipart([b"c".to_vec()], 0).unwrap();
        let (_, src) = next(&router);
        assert_eq!(g.peer(src).role, Role::Admin);
        assert_eq!(g.known.len(), 2);
    }

    #[test]
    fn messages_of_another_endpoint_or_without_a_connection_are_refused() {
        let ctx = zmq::Context::new();
        let (router, dealer, port) = pair(&ctx);
        assert_eq!(gate(port).peer(None).role, Role::Refused);
        dealer.send_multipart([b"a".to_vec()], 0).unwrap();
        let (_, src) = next(&router);
        let p = gate(port.wrapping_add(1)).peer(src);
        assert_eq!(p.role, Role::Refused);
        assert_eq!(p.reason, "not a connection of the LMCache endpoint");
    }

    #[test]
    fn a_large_first_frame_is_not_kept() {
        let ctx = zmq::Context::new();
        let (router, dealer, port) = pair(&ctx);
        let mut g = gate(port);
        dealer
            .send_multipart([vec![7u8; MAX_KEPT_FRAME_BYTES + 1]], 0)
            .unwrap();
        let (_, src) = next(&router);
        assert!(src.as_ref().unwrap().keep.is_none());
        assert_eq!(g.peer(src).role, Role::Admin, "still identified");
        assert!(g.known.is_empty());
    }

    #[test]
    fn closed_connections_are_forgotten_after_two_sweeps() {
        let ctx = zmq::Context::new();
        let (router, dealer, port) = pair(&ctx);
        let mut g = gate(port);
        dealer.send_multipart([b"a".to_vec()], 0).unwrap();
        let (_, src) = next(&router);
        g.peer(src);
        assert_eq!(g.known.len(), 1);
        drop(dealer);
        // libzmq closes its end once it sees the peer's close.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let fd = g.known.values().next().unwrap().fd;
            let inode = g.known.values().next().unwrap().inode;
            if !matches!(kvnode_hw::socket_inode(fd), Ok(Some(i)) if i == inode) {
                break;
            }
            assert!(Instant::now() < deadline, "libzmq never closed the socket");
            // Let libzmq's I/O thread run (the ROUTER processes the disconnect).
            let mut items = [router.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, 20).unwrap();
        }
        g.last_sweep = g.last_sweep.checked_sub(SWEEP_INTERVAL).unwrap();
        g.sweep_if_due();
        assert_eq!(g.known.len(), 1, "marked at the first sweep");
        g.last_sweep = g.last_sweep.checked_sub(SWEEP_INTERVAL).unwrap();
        g.sweep_if_due();
        assert!(g.known.is_empty(), "forgotten at the second");
    }

    #[test]
    fn refusal_warnings_are_rate_limited_per_user() {
        let mut g = gate(1);
        let p = LmPeer::unknown("test");
        g.note_refusal(&p, "clear");
        g.note_refusal(&p, "clear");
        assert_eq!(g.logs[&None].suppressed, 1);
        let q = LmPeer { uid: Some(5), ..p };
        g.note_refusal(&q, "clear");
        assert_eq!(
            g.logs[&Some(5)].suppressed,
            0,
            "another user has its own limiter"
        );
    }
}
