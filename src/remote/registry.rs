//! The node's record of its remote connections and handshakes (status and metrics).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use serde_json::json;

/// Connections listed by name in the status report at most (the total is given beside).
pub const STATUS_CONNECTIONS_MAX: usize = 256;

/// One authenticated remote connection. Invariant: registered from the end of its handshake to
/// the end of its frame loop.
#[derive(Debug)]
pub struct RemoteConnInfo {
    /// The connection's id (the same as its instances' connection).
    pub id: u64,
    /// The engine's address.
    pub peer: SocketAddr,
    /// The name the engine gave in its handshake (logs only).
    pub name: String,
    /// `tcp` or `rdma`.
    pub fabric: &'static str,
    /// `client` or `admin`.
    pub role: &'static str,
    /// When the handshake ended.
    pub since: Instant,
    /// Bytes of stores received into slots.
    pub bytes_in: AtomicU64,
    /// Bytes of retrieves sent from slots.
    pub bytes_out: AtomicU64,
    /// Data ops (WRITE_SLOTS, READ_SLOTS) served.
    pub data_ops: AtomicU64,
}

/// Outcomes of handshakes since start.
#[derive(Debug, Default)]
pub struct HandshakeCounts {
    /// Authenticated.
    pub ok: AtomicU64,
    /// A wrong token (or none where one is required).
    pub auth_failed: AtomicU64,
    /// Refused: too many connections or handshakes.
    pub busy: AtomicU64,
    /// Not finished within `remote.handshake_timeout_ms`.
    pub timed_out: AtomicU64,
    /// No common protocol version or fabric, or malformed.
    pub refused: AtomicU64,
}

/// Every remote connection of the node, its per-IP counts and handshake outcomes. Invariant:
/// `per_ip[ip]` is the number of accepted, not yet closed connections from `ip` (handshaking
/// or authenticated); `open` is their sum.
#[derive(Debug, Default)]
pub struct RemoteRegistry {
    conns: Mutex<BTreeMap<u64, Arc<RemoteConnInfo>>>,
    per_ip: Mutex<BTreeMap<IpAddr, usize>>,
    handshaking: AtomicU64,
    /// Handshake outcomes.
    pub handshakes: HandshakeCounts,
    /// Data ops whose bytes failed to move (the transfer was freed or its locks released).
    pub failed_moves: AtomicU64,
    /// Bytes received into slots, all connections.
    pub bytes_in: AtomicU64,
    /// Bytes sent from slots, all connections.
    pub bytes_out: AtomicU64,
}

/// A connection's place in the per-IP and handshake counts; dropping it gives the place back.
pub struct Admitted {
    registry: Arc<RemoteRegistry>,
    ip: IpAddr,
    handshaking: bool,
}

impl Admitted {
    /// The handshake ended (either way): the connection no longer counts as handshaking.
    pub fn handshake_over(&mut self) {
        if std::mem::take(&mut self.handshaking) {
            self.registry.handshaking.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.handshake_over();
        let mut per_ip = self.registry.per_ip.lock();
        if let Some(n) = per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                per_ip.remove(&self.ip);
            }
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `remote.max_connections` open.
    Connections(usize),
    /// `remote.max_connections_per_ip` open from this address.
    PerIp(usize),
    /// `remote.max_handshakes` in progress.
    Handshakes(usize),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Connections(n) => {
                write!(f, "{n} remote connections open (remote.max_connections)")
            }
            Refusal::PerIp(n) => write!(
                f,
                "{n} connections open from this address (remote.max_connections_per_ip)"
            ),
            Refusal::Handshakes(n) => {
                write!(f, "{n} handshakes in progress (remote.max_handshakes)")
            }
        }
    }
}

impl RemoteRegistry {
    /// Admits a new connection from `ip` within the three limits, counting it as handshaking.
    pub fn admit(
        self: &Arc<Self>,
        ip: IpAddr,
        max_connections: usize,
        max_per_ip: usize,
        max_handshakes: usize,
    ) -> Result<Admitted, Refusal> {
        let mut per_ip = self.per_ip.lock();
        let open: usize = per_ip.values().sum();
        if open >= max_connections {
            return Err(Refusal::Connections(open));
        }
        let from_ip = per_ip.get(&ip).copied().unwrap_or(0);
        if from_ip >= max_per_ip {
            return Err(Refusal::PerIp(from_ip));
        }
        let hs = self.handshaking.load(Ordering::Acquire) as usize;
        if hs >= max_handshakes {
            return Err(Refusal::Handshakes(hs));
        }
        self.handshaking.fetch_add(1, Ordering::AcqRel);
        *per_ip.entry(ip).or_default() += 1;
        Ok(Admitted {
            registry: self.clone(),
            ip,
            handshaking: true,
        })
    }

    /// Records an authenticated connection.
    pub fn add(&self, info: Arc<RemoteConnInfo>) {
        self.conns.lock().insert(info.id, info);
    }

    /// Forgets a closed connection.
    pub fn remove(&self, id: u64) {
        self.conns.lock().remove(&id);
    }

    /// Authenticated connections open now.
    pub fn open(&self) -> usize {
        self.conns.lock().len()
    }

    /// The `remote` part of the status report.
    pub fn status(&self) -> serde_json::Value {
        let conns = self.conns.lock();
        let listed: Vec<serde_json::Value> = conns
            .values()
            .take(STATUS_CONNECTIONS_MAX)
            .map(|c| {
                json!({
                    "id": c.id,
                    "peer": c.peer.to_string(),
                    "name": c.name,
                    "fabric": c.fabric,
                    "role": c.role,
                    "bytes_in": c.bytes_in.load(Ordering::Relaxed),
                    "bytes_out": c.bytes_out.load(Ordering::Relaxed),
                    "data_ops": c.data_ops.load(Ordering::Relaxed),
                    "connected_ms": c.since.elapsed().as_millis() as u64,
                })
            })
            .collect();
        let h = &self.handshakes;
        json!({
            "connections_total": conns.len(),
            "connections": listed,
            "handshaking": self.handshaking.load(Ordering::Relaxed),
            "handshakes": {
                "ok": h.ok.load(Ordering::Relaxed),
                "auth_failed": h.auth_failed.load(Ordering::Relaxed),
                "busy": h.busy.load(Ordering::Relaxed),
                "timed_out": h.timed_out.load(Ordering::Relaxed),
                "refused": h.refused.load(Ordering::Relaxed),
            },
            "failed_moves": self.failed_moves.load(Ordering::Relaxed),
            "bytes_in": self.bytes_in.load(Ordering::Relaxed),
            "bytes_out": self.bytes_out.load(Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_keeps_every_limit_and_gives_places_back() {
        let r = Arc::new(RemoteRegistry::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let mut x = r.admit(a, 3, 2, 2).unwrap();
        let y = r.admit(a, 3, 2, 2).unwrap();
        assert_eq!(r.admit(b, 3, 2, 2).err(), Some(Refusal::Handshakes(2)));
        x.handshake_over();
        assert_eq!(r.admit(a, 3, 2, 2).err(), Some(Refusal::PerIp(2)));
        let z = r.admit(b, 3, 2, 2).unwrap();
        assert_eq!(r.admit(b, 3, 5, 5).err(), Some(Refusal::Connections(3)));
        drop((x, y, z));
        assert!(r.per_ip.lock().is_empty());
        assert_eq!(r.handshaking.load(Ordering::Relaxed), 0);
        r.admit(a, 1, 1, 1).unwrap();
    }
}
