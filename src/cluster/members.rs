//! The cluster's members: the descriptor each node publishes in etcd under its lease, and the
//! view every node keeps of the live ones.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::placement::{node_hash, weight_of, Candidate};
use crate::error::{Error, Result};

/// Version of the descriptor and of the node-to-node calls: a node ignores members of another
/// version (logged once per member), so a rolling upgrade never mixes protocols.
pub const CLUSTER_PROTOCOL_VERSION: u32 = 1;

/// Largest descriptor accepted from etcd (anything bigger is not a kvnode's).
pub const MAX_DESCRIPTOR_BYTES: usize = 4096;

/// Members a view holds at most (beyond: the rest are ignored, logged).
pub const MAX_MEMBERS: usize = 1024;

/// What a node publishes about itself under `/kvnode/clusters/<name>/members/<node_id>`,
/// leased (it disappears within the lease TTL when the node dies). JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Descriptor {
    /// The node's id, unique in the cluster (equals the key's last part).
    pub node_id: String,
    /// Fabric endpoints other nodes reach it at (`tcp://HOST:PORT`; the first is used).
    pub endpoints: Vec<String>,
    /// Pool bytes available to objects (placement weight).
    pub capacity_bytes: u64,
    /// Bytes in use when last published.
    pub used_bytes: u64,
    /// Objects held when last published.
    pub objects: u64,
    /// [`CLUSTER_PROTOCOL_VERSION`] of the node.
    pub protocol_version: u32,
    /// The node's software version.
    pub version: String,
    /// Whether it serves the LMCache protocol too (`kvnode lmcache-server`).
    pub lmcache: bool,
    /// Unix milliseconds when the node started.
    pub started_unix_ms: u64,
    /// The etcd lease the descriptor is published under: a new one each time the node
    /// (re)joins, so peers tell a rejoin after a partition from a descriptor refresh.
    #[serde(default)]
    pub lease: i64,
}

impl Descriptor {
    /// Parses a descriptor read from etcd key `key` (whose last part must be its node id).
    pub fn parse(key: &str, value: &[u8]) -> Result<Descriptor> {
        if value.len() > MAX_DESCRIPTOR_BYTES {
            return Err(Error::invalid(format!(
                "member {key}: descriptor of {} bytes (at most {MAX_DESCRIPTOR_BYTES})",
                value.len()
            )));
        }
        let d: Descriptor = serde_json::from_slice(value)
            .map_err(|e| Error::invalid(format!("member {key}: bad descriptor: {e}")))?;
        if !key.ends_with(&format!("/{}", d.node_id)) {
            return Err(Error::invalid(format!(
                "member {key}: descriptor names node {:?}",
                d.node_id
            )));
        }
        if d.endpoints.is_empty() {
            return Err(Error::invalid(format!("member {key}: no endpoint")));
        }
        for e in &d.endpoints {
            crate::config::parse_tcp_url(e).map_err(|x| x.context(format!("member {key}")))?;
        }
        Ok(d)
    }
}

/// One live member as the view holds it.
#[derive(Debug, Clone)]
pub struct Member {
    /// Its descriptor.
    pub desc: Descriptor,
    /// Its placement candidate (id hash, weight).
    pub candidate: Candidate,
    /// Whether it is this node.
    pub local: bool,
}

/// An immutable snapshot of the live members, sorted by node id. Invariant: node ids are
/// unique; `candidates[i]` is `members[i].candidate`; at most [`MAX_MEMBERS`].
#[derive(Debug, Clone, Default)]
pub struct View {
    /// The members.
    pub members: Vec<Member>,
    /// Their placement candidates, in the same order.
    pub candidates: Vec<Candidate>,
    /// etcd revision the view was built at (0: none yet).
    pub revision: i64,
}

impl View {
    /// A view of `descs` (any order; duplicates by id: the last wins; other protocol versions
    /// left out), with `local_id` marked as this node.
    pub fn build(descs: Vec<Descriptor>, local_id: &str, revision: i64) -> View {
        let mut by_id = std::collections::BTreeMap::new();
        for d in descs {
            if d.protocol_version != CLUSTER_PROTOCOL_VERSION {
                continue;
            }
            by_id.insert(d.node_id.clone(), d);
        }
        let members: Vec<Member> = by_id
            .into_values()
            .take(MAX_MEMBERS)
            .map(|desc| Member {
                candidate: Candidate {
                    hash: node_hash(&desc.node_id),
                    weight: weight_of(desc.capacity_bytes),
                },
                local: desc.node_id == local_id,
                desc,
            })
            .collect();
        let candidates = members.iter().map(|m| m.candidate).collect();
        View {
            members,
            candidates,
            revision,
        }
    }

    /// The member that owns placement key `key`.
    pub fn owner(&self, key: u64) -> Option<&Member> {
        super::placement::owner(key, &self.candidates).map(|i| &self.members[i])
    }

    /// The member with id `id`.
    pub fn get(&self, id: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.desc.node_id == id)
    }
}

/// The shared, swappable view.
pub type SharedView = Arc<parking_lot::RwLock<Arc<View>>>;

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn desc(id: &str, cap: u64) -> Descriptor {
        Descriptor {
            node_id: id.into(),
            endpoints: vec!["tcp://127.0.0.1:7000".into()],
            capacity_bytes: cap,
            used_bytes: 0,
            objects: 0,
            protocol_version: CLUSTER_PROTOCOL_VERSION,
            version: "0".into(),
            lmcache: false,
            started_unix_ms: 0,
            lease: 1,
        }
    }

    #[test]
    fn descriptors_round_trip_and_bad_ones_are_named() {
        let d = desc("n1", 1 << 30);
        let v = serde_json::to_vec(&d).unwrap();
        assert_eq!(Descriptor::parse("/p/members/n1", &v).unwrap(), d);
        let e = Descriptor::parse("/p/members/n2", &v).unwrap_err();
        assert!(e.to_string().contains("/p/members/n2"), "{e}");
        assert!(Descriptor::parse("/p/members/n1", b"{").is_err());
        assert!(Descriptor::parse("/p/members/n1", &vec![b' '; 5000]).is_err());
        let mut bad = d.clone();
        bad.endpoints = vec!["nonsense".into()];
        let v = serde_json::to_vec(&bad).unwrap();
        assert!(Descriptor::parse("/p/members/n1", &v).is_err());
    }

    proptest::proptest! {
        /// Whatever etcd holds under the prefix, parsing never panics; what it accepts names
        /// the key's node and has a parseable endpoint.
        #[test]
        fn any_bytes_parse_or_fail_cleanly(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)) {
            if let Ok(d) = Descriptor::parse("/p/members/n1", &bytes) {
                proptest::prop_assert_eq!(d.node_id, "n1");
                proptest::prop_assert!(!d.endpoints.is_empty());
            }
        }

        /// Mutated valid descriptors never panic either.
        #[test]
        fn mutated_descriptors_parse_or_fail_cleanly(at in 0usize..400, byte in proptest::prelude::any::<u8>()) {
            let mut v = serde_json::to_vec(&desc("n1", 1 << 30)).unwrap();
            let i = at % v.len();
            v[i] = byte;
            let _ = Descriptor::parse("/p/members/n1", &v);
        }
    }

    #[test]
    fn views_drop_other_versions_and_mark_the_local_node() {
        let mut old = desc("z", 1);
        old.protocol_version = 99;
        let v = View::build(vec![desc("b", 1), desc("a", 1), old], "b", 7);
        let ids: Vec<_> = v.members.iter().map(|m| m.desc.node_id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert!(v.members[1].local && !v.members[0].local);
        assert!(v.owner(42).is_some());
        assert!(View::default().owner(42).is_none());
    }
}
