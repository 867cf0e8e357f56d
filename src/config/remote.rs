//! `[remote]`: the TCP listener for remote engines, its authentication and its limits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};

/// Longest a handshake, a heartbeat gap or a transfer may be configured to take.
pub const MAX_REMOTE_TIMEOUT_MS: u64 = 600_000;
/// Shortest `dead_after_ms` accepted: four heartbeats ([`HEARTBEAT_MS`]), so a live client is
/// not taken for dead because one heartbeat was late.
pub const MIN_DEAD_AFTER_MS: u64 = 4 * HEARTBEAT_MS;
/// How often the client library sends a heartbeat on an otherwise idle connection.
pub const HEARTBEAT_MS: u64 = 150;
/// Most remote connections a node may be configured to hold (each: a thread, two descriptors,
/// up to a 4 MiB reply queue).
pub const MAX_REMOTE_CONNECTIONS: usize = 4096;
/// Largest `max_trailer_bytes` accepted (the frame codec's own bound).
pub const MAX_TRAILER_LIMIT: u64 = crate::protocol::frame::MAX_TRAILER_BYTES;

/// `rdma_device` value that turns RDMA off.
pub const RDMA_DEVICE_NONE: &str = "none";
/// Longest RDMA device name accepted (the kernel's `IB_DEVICE_NAME_MAX` is 64).
pub const MAX_RDMA_DEVICE_NAME_BYTES: usize = 64;

/// How the TCP fabric moves bytes (`tcp_engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpEngineChoice {
    /// io_uring: receive straight into slots, zero-copy send from the pool.
    Uring,
    /// poll(2) with plain recv/send into and out of the pool (the comparison path).
    Plain,
}

/// The remote listener's configuration. Invariant after [`RemoteConfig::validate`]: every limit
/// non-zero and within its bound; `listen` set means a token file is set or `insecure_no_auth`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// `tcp://ADDR:PORT` (or `ADDR:PORT`) to listen on for remote engines; empty: no listener.
    pub listen: String,
    /// File holding the token remote engines must prove (client role).
    pub auth_token_file: Option<PathBuf>,
    /// File holding the token that gives the admin role (CLEAR, MEMCHECK, full STATUS).
    pub admin_token_file: Option<PathBuf>,
    /// Listen without authentication (anyone who reaches the port may use the node).
    pub insecure_no_auth: bool,
    /// Remote connections open at once (handshaking or authenticated).
    pub max_connections: usize,
    /// Remote connections open at once from one IP address.
    pub max_connections_per_ip: usize,
    /// Connections still in their handshake at once (beyond: answered busy and closed).
    pub max_handshakes: usize,
    /// Longest a handshake may take from accept to authenticated.
    pub handshake_timeout_ms: u64,
    /// A remote connection that sends nothing (not even a heartbeat) for this long is dead: it
    /// is closed and its instances released.
    pub dead_after_ms: u64,
    /// Longest one store's or retrieve's bytes may take to move, whatever their size.
    pub transfer_timeout_ms: u64,
    /// The slowest rate (MB/s) a store's or retrieve's bytes may flow at: each 4 MiB piece must
    /// move within `dead_after_ms` plus its size at this rate, so an engine that stalls
    /// mid-transfer is released within about `dead_after_ms`.
    pub min_transfer_mbps: u64,
    /// Largest trailer (bytes of one remote store or retrieve on the TCP stream).
    pub max_trailer_bytes: u64,
    /// Regions a remote connection may register (RDMA descriptors).
    pub max_registered_regions: usize,
    /// `uring` or `plain`.
    pub tcp_engine: String,
    /// io_uring rings (each with one thread) of the TCP fabric.
    pub tcp_rings: usize,
    /// Fabric operations in flight at once, node-wide (one per remote connection at most).
    pub max_inflight_ops: usize,
    /// The RDMA device offered to remote engines: `"auto"` (the first device with an active
    /// port and a usable GID), a device name (`"mlx5_0"`), or `"none"` (TCP only). A device
    /// that cannot be opened is logged once and the node serves TCP only (status
    /// `transports.rdma` says why). Untested on hardware.
    pub rdma_device: String,
    /// The GID table index to use on the RDMA port; unset: chosen (RoCE v2 with an IPv4-mapped
    /// address, then a global IPv6 one; never link-local).
    pub rdma_gid_index: Option<u8>,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            listen: String::new(),
            auth_token_file: None,
            admin_token_file: None,
            insecure_no_auth: false,
            max_connections: 256,
            max_connections_per_ip: 64,
            max_handshakes: 32,
            handshake_timeout_ms: 2_000,
            dead_after_ms: 750,
            transfer_timeout_ms: 30_000,
            min_transfer_mbps: 50,
            max_trailer_bytes: 1 << 30,
            max_registered_regions: 64,
            tcp_engine: "uring".into(),
            tcp_rings: 2,
            max_inflight_ops: 1024,
            rdma_device: "auto".into(),
            rdma_gid_index: None,
        }
    }
}

impl RemoteConfig {
    /// Whether a listener is configured.
    pub fn enabled(&self) -> bool {
        !self.listen.is_empty()
    }

    /// The address to listen on, parsed from `listen` (`tcp://ADDR:PORT` or `ADDR:PORT`).
    pub fn listen_addr(&self) -> Result<SocketAddr> {
        parse_tcp_url(&self.listen)
    }

    /// The TCP fabric's engine.
    pub fn engine(&self) -> Result<TcpEngineChoice> {
        match self.tcp_engine.as_str() {
            "uring" => Ok(TcpEngineChoice::Uring),
            "plain" => Ok(TcpEngineChoice::Plain),
            other => Err(Error::invalid(format!(
                "remote.tcp_engine = {other:?}: expected \"uring\" or \"plain\""
            ))),
        }
    }

    /// The RDMA device to open, or `None` when `rdma_device` is `"none"`.
    pub fn rdma_device(&self) -> Option<&str> {
        (self.rdma_device != RDMA_DEVICE_NONE).then_some(self.rdma_device.as_str())
    }

    /// [`RemoteConfig::handshake_timeout_ms`] as a duration.
    pub fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.handshake_timeout_ms)
    }

    /// [`RemoteConfig::dead_after_ms`] as a duration.
    pub fn dead_after(&self) -> Duration {
        Duration::from_millis(self.dead_after_ms)
    }

    /// [`RemoteConfig::transfer_timeout_ms`] as a duration.
    pub fn transfer_timeout(&self) -> Duration {
        Duration::from_millis(self.transfer_timeout_ms)
    }

    /// Checks the invariants listed on the type.
    pub fn validate(&self) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        self.listen_addr()?;
        self.engine()?;
        if self.auth_token_file.is_none() && !self.insecure_no_auth {
            return Err(Error::invalid(format!(
                "refusing to listen on {} without authentication: give --auth-token-file FILE \
                 (create one with `kvnode token generate FILE`), or --insecure-no-auth to let \
                 anyone who reaches the port use the node",
                self.listen
            )));
        }
        if self.auth_token_file.is_some() && self.insecure_no_auth {
            return Err(Error::invalid(
                "--insecure-no-auth and --auth-token-file contradict each other",
            ));
        }
        if self.admin_token_file.is_some() && self.auth_token_file.is_none() {
            return Err(Error::invalid(
                "--admin-token-file needs --auth-token-file (the client token)",
            ));
        }
        for (name, v) in [
            ("remote.max_connections", self.max_connections),
            ("remote.max_connections_per_ip", self.max_connections_per_ip),
            ("remote.max_handshakes", self.max_handshakes),
            ("remote.max_registered_regions", self.max_registered_regions),
            ("remote.tcp_rings", self.tcp_rings),
            ("remote.min_transfer_mbps", self.min_transfer_mbps as usize),
            ("remote.max_inflight_ops", self.max_inflight_ops),
        ] {
            if v == 0 {
                return Err(Error::invalid(format!("{name} must be > 0")));
            }
        }
        if self.max_connections > MAX_REMOTE_CONNECTIONS {
            return Err(Error::invalid(format!(
                "remote.max_connections = {} is above {MAX_REMOTE_CONNECTIONS}",
                self.max_connections
            )));
        }
        if self.tcp_rings > 64 {
            return Err(Error::invalid(format!(
                "remote.tcp_rings = {} is above 64",
                self.tcp_rings
            )));
        }
        for (name, v) in [
            ("remote.handshake_timeout_ms", self.handshake_timeout_ms),
            ("remote.transfer_timeout_ms", self.transfer_timeout_ms),
        ] {
            if !(1..=MAX_REMOTE_TIMEOUT_MS).contains(&v) {
                return Err(Error::invalid(format!(
                    "{name} = {v} is outside 1..={MAX_REMOTE_TIMEOUT_MS}"
                )));
            }
        }
        if !(MIN_DEAD_AFTER_MS..=MAX_REMOTE_TIMEOUT_MS).contains(&self.dead_after_ms) {
            return Err(Error::invalid(format!(
                "remote.dead_after_ms = {} is outside {MIN_DEAD_AFTER_MS}..={MAX_REMOTE_TIMEOUT_MS} \
                 (clients heartbeat every {HEARTBEAT_MS} ms)",
                self.dead_after_ms
            )));
        }
        if self.rdma_device.is_empty()
            || self.rdma_device.len() > MAX_RDMA_DEVICE_NAME_BYTES
            || !self
                .rdma_device
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        {
            return Err(Error::invalid(format!(
                "remote.rdma_device = {:?}: expected \"auto\", \"none\" or a device name \
                 (letters, digits, '_', '-', '.'; at most {MAX_RDMA_DEVICE_NAME_BYTES} bytes)",
                self.rdma_device
            )));
        }
        if !(1..=MAX_TRAILER_LIMIT).contains(&self.max_trailer_bytes) {
            return Err(Error::invalid(format!(
                "remote.max_trailer_bytes = {} is outside 1..={MAX_TRAILER_LIMIT}",
                self.max_trailer_bytes
            )));
        }
        Ok(())
    }
}

/// Parses `tcp://HOST:PORT` or `HOST:PORT` (an IP address or a name that resolves; the first
/// address is taken). Errors name the text.
pub fn parse_tcp_url(url: &str) -> Result<SocketAddr> {
    let rest = url.strip_prefix("tcp://").unwrap_or(url);
    if rest.contains("://") {
        return Err(Error::invalid(format!(
            "{url:?}: only tcp:// addresses are supported"
        )));
    }
    use std::net::ToSocketAddrs;
    rest.to_socket_addrs()
        .map_err(|e| Error::invalid(format!("{url:?} is not HOST:PORT: {e}")))?
        .next()
        .ok_or_else(|| Error::invalid(format!("{url:?} resolves to no address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_needs_a_token_or_the_insecure_flag() {
        let mut c = RemoteConfig {
            listen: "tcp://127.0.0.1:0".into(),
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--auth-token-file"), "{e}");
        c.insecure_no_auth = true;
        c.validate().unwrap();
        c.auth_token_file = Some("/x".into());
        assert!(c.validate().is_err());
    }

    #[test]
    fn urls_parse_or_name_the_text() {
        assert_eq!(
            parse_tcp_url("tcp://127.0.0.1:7070").unwrap(),
            "127.0.0.1:7070".parse::<SocketAddr>().unwrap()
        );
        assert_eq!(
            parse_tcp_url("[::1]:9").unwrap(),
            "[::1]:9".parse::<SocketAddr>().unwrap()
        );
        let e = parse_tcp_url("rdma://x:1").unwrap_err().to_string();
        assert!(e.contains("rdma://x:1"), "{e}");
        assert!(parse_tcp_url("tcp://nohost").is_err());
    }

    #[test]
    fn limits_are_enforced() {
        let ok = RemoteConfig {
            listen: "127.0.0.1:1".into(),
            insecure_no_auth: true,
            ..Default::default()
        };
        ok.validate().unwrap();
        assert_eq!(ok.rdma_device(), Some("auto"));
        for name in ["none", "mlx5_0", "rxe-eth0"] {
            RemoteConfig {
                rdma_device: name.into(),
                ..ok.clone()
            }
            .validate()
            .unwrap();
        }
        let none = RemoteConfig {
            rdma_device: "none".into(),
            ..ok.clone()
        };
        assert_eq!(none.rdma_device(), None);
        for bad in [
            RemoteConfig {
                dead_after_ms: MIN_DEAD_AFTER_MS - 1,
                ..ok.clone()
            },
            RemoteConfig {
                max_handshakes: 0,
                ..ok.clone()
            },
            RemoteConfig {
                max_trailer_bytes: 0,
                ..ok.clone()
            },
            RemoteConfig {
                tcp_engine: "epoll".into(),
                ..ok.clone()
            },
            RemoteConfig {
                rdma_device: String::new(),
                ..ok.clone()
            },
            RemoteConfig {
                rdma_device: "mlx5_0/../x".into(),
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
