//! Who sent a request: the connection it came over and what the kernel recorded about the peer
//! process. Instances, transfers and lookup sessions are bound to it.

use kvnode_hw::PeerCred;

use super::instances::Instance;
use super::lookup::{SessionOwner, UNKNOWN_OWNER};
use super::NodeContext;
use crate::access::Role;
use crate::error::{Error, Result};

/// The sender of a request. Invariant: `role` is the access policy's decision for `peer`, made
/// when the connection was first used; `peer` is the kernel's record (`SO_PEERCRED`), never
/// something the client claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The connection's unique id.
    pub connection: u64,
    /// The peer's credentials, when the transport knows them.
    pub peer: Option<PeerCred>,
    /// What the peer may do.
    pub role: Role,
    /// The name space of its lookup sessions and the user its quotas count against: the
    /// peer's uid, [`REMOTE_OWNER_CLIENT`] / [`REMOTE_OWNER_ADMIN`] for remote engines (one
    /// token is one trust domain), `UNKNOWN_OWNER` without credentials.
    pub owner: SessionOwner,
    /// Whether the caller is another node of this node's cluster (its handshake name starts
    /// with [`PEER_NODE_NAME_PREFIX`]): its lookups and retrieves see this node's own cache
    /// only, never fetched from further peers (one hop, no chains or loops). Claiming it only
    /// takes cluster-wide hits away from the claimant.
    pub peer_node: bool,
}

/// The handshake name prefix of a node's connections to its cluster peers.
pub const PEER_NODE_NAME_PREFIX: &str = "kvnode-peer ";

/// The session owner (and quota user) of remote engines that proved the client token (outside
/// the range of uids, so no local user shares it).
pub const REMOTE_OWNER_CLIENT: SessionOwner = 1 << 32;
/// The session owner (and quota user) of remote engines that proved the admin token.
pub const REMOTE_OWNER_ADMIN: SessionOwner = (1 << 32) + 1;
/// The session owner (and quota user) of other nodes of the cluster (connections whose
/// handshake name starts with [`PEER_NODE_NAME_PREFIX`]): their instances, sessions and
/// reservations never count against the remote engines' quotas. The token is the trust
/// boundary: a client of the same token that claims the name only moves itself into the peers'
/// bucket (and loses cluster-wide hits).
pub const REMOTE_OWNER_PEER: SessionOwner = (1 << 32) + 2;

impl Caller {
    /// The caller of connection `connection` whose peer is `peer`, with its role under `ctx`'s
    /// access policy.
    pub fn new(ctx: &NodeContext, connection: u64, peer: Option<PeerCred>) -> Caller {
        Caller {
            connection,
            peer,
            role: ctx.access.role(peer.as_ref()),
            owner: peer.map_or(UNKNOWN_OWNER, |p| u64::from(p.uid)),
            peer_node: false,
        }
    }

    /// The caller of remote connection `connection` that proved a token giving `role` (no
    /// kernel credentials: the handshake decided the role).
    pub fn remote(connection: u64, role: Role) -> Caller {
        Caller {
            connection,
            peer: None,
            role,
            owner: if role >= Role::Admin {
                REMOTE_OWNER_ADMIN
            } else {
                REMOTE_OWNER_CLIENT
            },
            peer_node: false,
        }
    }

    /// The name space of this caller's lookup sessions (its uid, or its remote trust domain).
    pub fn session_owner(&self) -> SessionOwner {
        self.owner
    }

    /// `Ok` for admins; a `PermissionDenied` naming `what` otherwise.
    pub fn require_admin(&self, what: &str) -> Result<()> {
        if self.role >= Role::Admin {
            return Ok(());
        }
        Err(Error::denied(format!(
            "{what} is for the node's administrators (its own user, root, or [access] \
             admin_uids/admin_gids); user {} is not one",
            self.describe()
        )))
    }

    /// Who this caller is, for messages: a uid, a remote token's domain, or "unknown".
    pub fn describe(&self) -> String {
        match (self.peer, self.owner) {
            (Some(p), _) => p.uid.to_string(),
            (None, REMOTE_OWNER_CLIENT) => "remote (client token)".to_owned(),
            (None, REMOTE_OWNER_ADMIN) => "remote (admin token)".to_owned(),
            (None, REMOTE_OWNER_PEER) => "cluster peer".to_owned(),
            (None, _) => "unknown".to_owned(),
        }
    }

    /// `Ok` when this connection registered `inst` (requests for an instance are accepted only
    /// over the connections that registered it); a `PermissionDenied` otherwise.
    pub fn require_attached(&self, inst: &Instance) -> Result<()> {
        if inst.connections.lock().contains(&self.connection) {
            return Ok(());
        }
        Err(Error::denied(format!(
            "instance {} was not registered over this connection (register it here first; \
             only a connection of the process that registered it may)",
            inst.id
        )))
    }

    /// Whether this caller may join (register again over its own connection) an instance
    /// owned by `owner`: only a connection of the same process (same pid and uid).
    pub fn same_process_as(&self, owner: Option<&PeerCred>) -> bool {
        match (self.peer, owner) {
            (Some(me), Some(o)) => me.uid == o.uid && me.pid.is_some() && me.pid == o.pid,
            _ => false,
        }
    }
}
