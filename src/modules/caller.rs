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
}

impl Caller {
    /// The caller of connection `connection` whose peer is `peer`, with its role under `ctx`'s
    /// access policy.
    pub fn new(ctx: &NodeContext, connection: u64, peer: Option<PeerCred>) -> Caller {
        Caller {
            connection,
            peer,
            role: ctx.access.role(peer.as_ref()),
        }
    }

    /// The name space of this caller's lookup sessions (its uid).
    pub fn session_owner(&self) -> SessionOwner {
        self.peer.map_or(UNKNOWN_OWNER, |p| p.uid)
    }

    /// `Ok` for admins; a `PermissionDenied` naming `what` otherwise.
    pub fn require_admin(&self, what: &str) -> Result<()> {
        if self.role >= Role::Admin {
            return Ok(());
        }
        Err(Error::denied(format!(
            "{what} is for the node's administrators (its own user, root, or [access] \
             admin_uids/admin_gids); user {} is not one",
            self.peer
                .map_or_else(|| "unknown".to_owned(), |p| p.uid.to_string())
        )))
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
