//! Who may use the LMCache endpoint.
//!
//! LMCache's clients speak ZMQ over TCP, which carries no credentials. kvnode identifies each
//! connection by what the kernel recorded: libzmq tags every message it receives with the
//! properties of the connection it came from, among them the connection's descriptor (`__fd`,
//! what the deprecated `ZMQ_SRCFD` reads). The socket open at that descriptor gives the
//! connection's two addresses, and the kernel (netlink `sock_diag`, else the socket table
//! `/proc/net/tcp{,6}`) the uid owning the peer's end. The node's [`AccessPolicy`] then makes
//! that uid an admin (the node's user, root, `admin_uids`, `admin_gids`), a client
//! (`allow_uids`, `allow_gids`) or refused. `gate` keeps the answer per connection.
//!
//! * A refused peer's requests get the operation's negative answer (LMCache's protocol has no
//!   error reply its released clients understand) and a rate-limited warning naming its uid.
//! * A client may use the data path; node-wide operations (CLEAR) need an admin.
//! * The endpoint binds loopback addresses only unless the operator passes `--allow-remote`:
//!   peers on other machines (or in other network namespaces) are in no socket table of this
//!   node's, so nothing tells who they are. With the flag they are served as clients (never
//!   admins), and protecting the port (firewall, private network) is the operator's job.

use std::net::IpAddr;
use std::os::fd::RawFd;

use super::reply::{LmReply, Reply};
use super::wire::Op;
use crate::access::{AccessPolicy, Role};
use crate::error::{Error, Result};

mod gate;

pub use gate::{LmPeer, PeerGate, MAX_KEPT_FRAME_BYTES, MAX_LM_PEERS, REFUSAL_LOG_INTERVAL};

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

/// The connection a received request came from, as libzmq recorded it.
pub struct Source {
    /// Identifies the connection while it or any of its messages is alive: the address of the
    /// descriptor property's value, which lives in the connection's property set (one per
    /// connection, freed only when the connection and all its messages are gone).
    key: usize,
    /// The connection's descriptor number (open while the connection is).
    fd: RawFd,
    /// A small message of the connection, which keeps its property set (and `key`) alive while
    /// the gate remembers the connection; `None` when the message was too large to keep.
    keep: Option<zmq::Message>,
}

/// Receives one multipart request without blocking, with the connection it came from (`None`
/// when libzmq recorded none).
pub fn recv_request(router: &zmq::Socket) -> zmq::Result<(Vec<Vec<u8>>, Option<Source>)> {
    let mut frames = Vec::with_capacity(4);
    let mut source = None;
    loop {
        // The parts of a message arrive together: after the first, the rest is there already.
        let mut m = router.recv_msg(zmq::DONTWAIT)?;
        let more = m.get_more();
        frames.push(m.to_vec());
        // The identity frame the ROUTER makes carries no properties when poll pre-fetched the
        // message; the peer's own frames always do.
        if source.is_none() {
            let found = m.gets(SOURCE_FD_PROPERTY).map(|v| {
                (
                    v.as_ptr() as usize,
                    v.parse::<RawFd>().ok().filter(|fd| *fd >= 0),
                )
            });
            if let Some((key, Some(fd))) = found {
                let keep = (m.len() <= MAX_KEPT_FRAME_BYTES).then_some(m);
                source = Some(Source { key, fd, keep });
            }
        }
        if !more {
            return Ok((frames, source));
        }
    }
}

/// Whether a received message is a ROUTER connect/disconnect notification (see
/// `kvnode_hw::zmq_notify`): the routing id and one empty frame, and no connection properties
/// (an empty frame a peer sends carries its connection's, so a peer cannot forge one).
pub fn is_notification(frames: &[Vec<u8>], source: &Option<Source>) -> bool {
    source.is_none() && frames.len() == 2 && frames[1].is_empty()
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
}
