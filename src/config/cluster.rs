//! `[cluster]`: membership in a cluster of nodes kept in etcd, and the limits of the calls
//! between nodes.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};

/// Longest cluster name accepted (it is part of every etcd key of the cluster).
pub const MAX_CLUSTER_NAME_BYTES: usize = 64;
/// Longest node id accepted (it is part of its etcd key and of the handshake's client name).
pub const MAX_NODE_ID_BYTES: usize = 48;
/// etcd endpoints accepted at most.
pub const MAX_ETCD_ENDPOINTS: usize = 16;
/// Longest lease a node may be configured with: a dead node stays a member this long.
pub const MAX_LEASE_TTL_SECS: u64 = 60;
/// Longest deadline of one call to a peer node that may be configured.
pub const MAX_PEER_TIMEOUT_MS: u64 = 60_000;

/// The cluster configuration. Invariant after [`ClusterConfig::validate`]: when `etcd` is set,
/// `name` and `node_id` are valid key parts and every limit is non-zero and within its bound.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// etcd endpoints (`http://HOST:PORT` or `HOST:PORT`); empty: no cluster.
    pub etcd: Vec<String>,
    /// The cluster's name: nodes of one name see each other (key prefix
    /// `/kvnode/clusters/<name>/`).
    pub name: String,
    /// This node's id, unique in the cluster; empty: `<hostname>-<listen port>`.
    pub node_id: String,
    /// The fabric endpoint other nodes reach this one at (`tcp://HOST:PORT`); empty: the
    /// listener's address, with the host's first non-loopback IPv4 address when it listens on
    /// 0.0.0.0 (or 127.0.0.1 when it has none).
    pub advertise: String,
    /// Token file this node proves to its peers (their `--auth-token-file`); empty: the node's
    /// own `remote.auth_token_file` (one token per cluster, like per engine fleet).
    pub peer_token_file: Option<PathBuf>,
    /// The lease of this node's descriptor: a node that dies disappears within it.
    pub lease_ttl_secs: u64,
    /// Deadline of one call to a peer (connect + handshake, or one request and its bytes); a
    /// peer that misses it is a miss, never an error.
    pub peer_timeout_ms: u64,
    /// Deadline of one call to etcd.
    pub etcd_timeout_ms: u64,
    /// Push stored chunks to their owner (placement) in the background.
    pub push: bool,
    /// Bytes of stored chunks waiting to be pushed at most (beyond: the push is dropped and
    /// counted; the chunk stays in this node's cache).
    pub max_push_queue_bytes: u64,
    /// Bytes all peer fetches in flight may hold in reservations at once, node-wide (a request
    /// gets what is left; beyond it the rest of its prefix is a miss).
    pub max_fetch_bytes: u64,
    /// Connections kept open to each peer (one fetch or push uses one at a time).
    pub connections_per_peer: usize,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            etcd: Vec::new(),
            name: String::new(),
            node_id: String::new(),
            advertise: String::new(),
            peer_token_file: None,
            lease_ttl_secs: 5,
            peer_timeout_ms: 2_000,
            etcd_timeout_ms: 2_000,
            push: true,
            max_push_queue_bytes: 256 << 20,
            max_fetch_bytes: 1 << 30,
            connections_per_peer: 4,
        }
    }
}

/// Whether `s` is a valid cluster name or node id: `[A-Za-z0-9._-]`, 1 to `max` bytes.
fn valid_part(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl ClusterConfig {
    /// Whether the node joins a cluster.
    pub fn enabled(&self) -> bool {
        !self.etcd.is_empty()
    }

    /// The etcd key prefix of the cluster's member descriptors.
    pub fn members_prefix(&self) -> String {
        members_prefix(&self.name)
    }

    /// The lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    /// The deadline of one call to a peer.
    pub fn peer_timeout(&self) -> Duration {
        Duration::from_millis(self.peer_timeout_ms)
    }

    /// The deadline of one call to etcd.
    pub fn etcd_timeout(&self) -> Duration {
        Duration::from_millis(self.etcd_timeout_ms)
    }

    /// Checks the configuration (see the invariant).
    pub fn validate(&self, listening: bool) -> Result<()> {
        if !self.enabled() {
            if !self.name.is_empty() {
                return Err(Error::invalid(
                    "cluster.name is set but cluster.etcd is not: a cluster needs --etcd URL",
                ));
            }
            return Ok(());
        }
        if self.etcd.len() > MAX_ETCD_ENDPOINTS {
            return Err(Error::invalid(format!(
                "{} etcd endpoints: at most {MAX_ETCD_ENDPOINTS}",
                self.etcd.len()
            )));
        }
        for e in &self.etcd {
            etcd_endpoint(e)?;
        }
        if !valid_part(&self.name, MAX_CLUSTER_NAME_BYTES) {
            return Err(Error::invalid(format!(
                "cluster name {:?}: expected 1 to {MAX_CLUSTER_NAME_BYTES} characters of \
                 A-Z a-z 0-9 . _ - (--cluster NAME)",
                self.name
            )));
        }
        if !self.node_id.is_empty() && !valid_part(&self.node_id, MAX_NODE_ID_BYTES) {
            return Err(Error::invalid(format!(
                "node id {:?}: expected 1 to {MAX_NODE_ID_BYTES} characters of A-Z a-z 0-9 . _ -",
                self.node_id
            )));
        }
        if !listening {
            return Err(Error::invalid(
                "a cluster node must listen for its peers: give --listen tcp://ADDR:PORT (and \
                 --auth-token-file) with --etcd",
            ));
        }
        if !self.advertise.is_empty() {
            crate::config::parse_tcp_url(&self.advertise)
                .map_err(|e| e.context("cluster.advertise"))?;
        }
        if !(1..=MAX_LEASE_TTL_SECS).contains(&self.lease_ttl_secs) {
            return Err(Error::invalid(format!(
                "cluster.lease_ttl_secs = {} is outside 1..={MAX_LEASE_TTL_SECS}",
                self.lease_ttl_secs
            )));
        }
        for (name, v) in [
            ("cluster.peer_timeout_ms", self.peer_timeout_ms),
            ("cluster.etcd_timeout_ms", self.etcd_timeout_ms),
        ] {
            if !(1..=MAX_PEER_TIMEOUT_MS).contains(&v) {
                return Err(Error::invalid(format!(
                    "{name} = {v} is outside 1..={MAX_PEER_TIMEOUT_MS}"
                )));
            }
        }
        // An etcd call that takes its whole deadline must still leave room for a keep-alive
        // before the lease runs out.
        if self.etcd_timeout_ms.saturating_mul(2) > self.lease_ttl_secs * 1000 {
            return Err(Error::invalid(format!(
                "cluster.etcd_timeout_ms = {} is more than half of cluster.lease_ttl_secs = {} \
                 (a slow etcd call would let the lease expire)",
                self.etcd_timeout_ms, self.lease_ttl_secs
            )));
        }
        if self.max_fetch_bytes == 0 || self.max_push_queue_bytes == 0 {
            return Err(Error::invalid(
                "cluster.max_fetch_bytes and cluster.max_push_queue_bytes must be > 0",
            ));
        }
        if !(1..=64).contains(&self.connections_per_peer) {
            return Err(Error::invalid(format!(
                "cluster.connections_per_peer = {} is outside 1..=64",
                self.connections_per_peer
            )));
        }
        Ok(())
    }
}

/// The etcd key prefix of cluster `name`'s member descriptors.
pub fn members_prefix(name: &str) -> String {
    format!("/kvnode/clusters/{name}/members/")
}

/// `HOST:PORT` of an etcd endpoint given as `http://HOST:PORT` or `HOST:PORT` (etcd's client
/// URLs; TLS endpoints are refused with a clear error: not supported yet).
pub fn etcd_endpoint(url: &str) -> Result<String> {
    if url.starts_with("https://") {
        return Err(Error::invalid(format!(
            "etcd endpoint {url:?}: TLS to etcd is not supported yet (use http:// on a trusted \
             network)"
        )));
    }
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let rest = rest.trim_end_matches('/');
    let ok = rest
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    if !ok || rest.contains('/') {
        return Err(Error::invalid(format!(
            "etcd endpoint {url:?}: expected http://HOST:PORT"
        )));
    }
    Ok(rest.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> ClusterConfig {
        ClusterConfig {
            etcd: vec!["http://127.0.0.1:2379".into()],
            name: "c1".into(),
            ..ClusterConfig::default()
        }
    }

    #[test]
    fn validation_names_the_bad_value() {
        assert!(ClusterConfig::default().validate(false).is_ok());
        assert!(on().validate(true).is_ok());
        let e = on().validate(false).unwrap_err();
        assert!(e.to_string().contains("--listen"), "{e}");
        let mut c = on();
        c.name = "a/b".into();
        assert!(c.validate(true).unwrap_err().to_string().contains("a/b"));
        let mut c = on();
        c.node_id = "x y".into();
        assert!(c.validate(true).unwrap_err().to_string().contains("x y"));
        let mut c = on();
        c.lease_ttl_secs = 0;
        assert!(c.validate(true).is_err());
        let mut c = on();
        c.etcd = vec!["https://e:2379".into()];
        assert!(c.validate(true).unwrap_err().to_string().contains("TLS"));
        let c = ClusterConfig {
            name: "x".into(),
            ..ClusterConfig::default()
        };
        assert!(c.validate(true).is_err());
    }

    #[test]
    fn etcd_endpoints_parse() {
        assert_eq!(etcd_endpoint("http://h:2379").unwrap(), "h:2379");
        assert_eq!(etcd_endpoint("h:2379/").unwrap(), "h:2379");
        assert!(etcd_endpoint("h").is_err());
        assert!(etcd_endpoint("http://h:0").is_err());
        assert!(etcd_endpoint("http://h:1/x").is_err());
    }
}
