//! Who may use the node, and who may run node-wide (admin) operations.
//!
//! Every transport identifies its peer by what the kernel recorded, never by what the peer says:
//! `SO_PEERCRED` on Unix sockets, the owner of the peer's socket in the kernel's socket table for
//! loopback TCP (LMCache's ZMQ endpoint). A peer is a **client** when its uid is the node's own,
//! root, or listed in `allow_uids`, or one of its groups is in `allow_gids`; an **admin** (CLEAR,
//! MEMCHECK, the full STATUS) when its uid is the node's own, root, or in `admin_uids`, or one of
//! its groups is in `admin_gids`. Everyone else is refused with a clear error and a log line.

use serde::Deserialize;

pub use kvnode_hw::PeerCred;

/// Most entries in each of the four access lists.
pub const MAX_ACCESS_ENTRIES: usize = 256;

/// The `[access]` table of the node's configuration. Invariant after [`AccessConfig::validate`]:
/// each list holds at most [`MAX_ACCESS_ENTRIES`] ids.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct AccessConfig {
    /// Users (besides the node's own and root) that may connect as clients.
    pub allow_uids: Vec<u32>,
    /// Groups whose members may connect as clients.
    pub allow_gids: Vec<u32>,
    /// Users (besides the node's own and root) that may run admin operations.
    pub admin_uids: Vec<u32>,
    /// Groups whose members may run admin operations.
    pub admin_gids: Vec<u32>,
}

impl AccessConfig {
    /// Checks the list lengths.
    pub fn validate(&self) -> crate::Result<()> {
        for (name, v) in [
            ("access.allow_uids", &self.allow_uids),
            ("access.allow_gids", &self.allow_gids),
            ("access.admin_uids", &self.admin_uids),
            ("access.admin_gids", &self.admin_gids),
        ] {
            if v.len() > MAX_ACCESS_ENTRIES {
                return Err(crate::Error::invalid(format!(
                    "{name} lists {} ids (limit {MAX_ACCESS_ENTRIES})",
                    v.len()
                )));
            }
        }
        Ok(())
    }

    /// Whether any group list is set (then a peer's groups must be resolved).
    fn uses_groups(&self) -> bool {
        !self.allow_gids.is_empty() || !self.admin_gids.is_empty()
    }
}

/// What a peer may do. Ordered: an admin may do everything a client may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Not allowed in at all.
    Refused,
    /// May register instances and move data.
    Client,
    /// May also run node-wide operations (CLEAR, MEMCHECK, the full STATUS).
    Admin,
}

/// The access decision of a running node. Invariant: `node_uid` is the node's effective uid at
/// start-up; decisions depend only on the peer's kernel-recorded ids.
#[derive(Debug, Clone)]
pub struct AccessPolicy {
    config: AccessConfig,
    node_uid: u32,
}

impl AccessPolicy {
    /// The policy for a node running as this process's effective user.
    pub fn new(config: AccessConfig) -> AccessPolicy {
        AccessPolicy {
            config,
            node_uid: kvnode_hw::effective_uid(),
        }
    }

    /// The node's own uid.
    pub fn node_uid(&self) -> u32 {
        self.node_uid
    }

    /// The role of a peer with user `uid` and primary group `gid`. Group lists also match the
    /// user's supplementary groups from the user database.
    pub fn role_of(&self, uid: u32, gid: u32) -> Role {
        let c = &self.config;
        // The common cases decide without the user database (whose lookups may go to NSS
        // services): the node's own user and root, and listed uids.
        if uid == self.node_uid || uid == 0 || c.admin_uids.contains(&uid) {
            return Role::Admin;
        }
        if !c.uses_groups() {
            return if c.allow_uids.contains(&uid) {
                Role::Client
            } else {
                Role::Refused
            };
        }
        let own = false;
        let groups = if c.uses_groups() {
            let mut g = kvnode_hw::user_groups(uid);
            g.push(gid);
            g
        } else {
            Vec::new()
        };
        let in_any = |list: &[u32]| groups.iter().any(|g| list.contains(g));
        if own || c.admin_uids.contains(&uid) || in_any(&c.admin_gids) {
            Role::Admin
        } else if c.allow_uids.contains(&uid) || in_any(&c.allow_gids) {
            Role::Client
        } else {
            Role::Refused
        }
    }

    /// The role of a peer whose credentials the transport read; `None` (the transport could not
    /// tell who it is) is refused.
    pub fn role(&self, peer: Option<&PeerCred>) -> Role {
        peer.map_or(Role::Refused, |p| self.role_of(p.uid, p.gid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(c: AccessConfig) -> AccessPolicy {
        AccessPolicy {
            config: c,
            node_uid: 1000,
        }
    }

    #[test]
    fn the_node_user_and_root_are_admins_others_are_refused_by_default() {
        let p = policy(AccessConfig::default());
        assert_eq!(p.role_of(1000, 1000), Role::Admin);
        assert_eq!(p.role_of(0, 0), Role::Admin);
        assert_eq!(p.role_of(65534, 65534), Role::Refused);
        assert_eq!(p.role(None), Role::Refused);
    }

    #[test]
    fn allowed_users_are_clients_and_admin_lists_make_admins() {
        let p = policy(AccessConfig {
            allow_uids: vec![2000],
            allow_gids: vec![4242],
            admin_uids: vec![3000],
            ..Default::default()
        });
        assert_eq!(p.role_of(2000, 2000), Role::Client);
        assert_eq!(p.role_of(2001, 4242), Role::Client, "primary gid matches");
        assert_eq!(p.role_of(3000, 3000), Role::Admin);
        assert_eq!(p.role_of(2002, 2002), Role::Refused);
        assert!(Role::Admin > Role::Client && Role::Client > Role::Refused);
    }

    #[test]
    fn oversized_lists_are_refused_naming_the_list() {
        let c = AccessConfig {
            admin_gids: vec![1; MAX_ACCESS_ENTRIES + 1],
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().context.contains("admin_gids"));
    }
}
