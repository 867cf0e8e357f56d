//! Connections to the other nodes: a small pool per peer of authenticated TCP connections
//! (the remote-engine protocol, so a peer applies to this node every check, lock and liveness
//! rule it applies to remote engines), each with the instances it registered there, one per
//! layout.
//!
//! Invariant: a connection is used by one call at a time (taken out of its pool, put back only
//! after a call that left it in step); a connection whose call failed is dropped, which closes
//! it, and the peer then releases its instances, locks and reservations (its liveness rules).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::client::{FabricChoice, RemoteClient, RemoteOptions};
use crate::error::{Error, ErrorKind, Result};
use crate::modules::caller::PEER_NODE_NAME_PREFIX;
use crate::protocol::RegisterRequest;
use crate::storage::Layout;
use crate::transport::tcp::auth::Token;

/// One connection to a peer and what it registered there.
pub struct PeerConn {
    /// The connection.
    pub client: RemoteClient,
    /// Instance registered per (model, world size, layout fingerprint).
    instances: HashMap<(String, u32, u64), u64>,
    /// The lookup session this connection's fetches use: one name per connection (it serves
    /// one call at a time), so each LOOKUP replaces, and releases, the previous one's session
    /// on the peer instead of leaving one per fetch until its idle expiry.
    pub session: String,
}

/// Distinct layouts one connection registers at most, below the peer's
/// `max_instances_per_connection` (64 by default); a connection that needs more is closed (the
/// peer releases its instances) and a new one made.
const MAX_LAYOUTS_PER_CONN: usize = 16;

/// Whether `layout` can be registered on a peer (an engine-driven shape).
pub fn shareable(layout: &Layout) -> bool {
    register_request("m", 1, layout, 1).is_ok()
}

impl PeerConn {
    /// The instance this connection registered for `(model, world_size)` with `layout`,
    /// registering one now if there is none.
    pub fn instance(
        &mut self,
        model: &str,
        world_size: u32,
        layout: &Layout,
        ids: &AtomicU64,
    ) -> Result<u64> {
        let key = (model.to_owned(), world_size, layout.fingerprint());
        if let Some(&id) = self.instances.get(&key) {
            return Ok(id);
        }
        if self.instances.len() >= MAX_LAYOUTS_PER_CONN {
            return Err(Error::new(
                ErrorKind::LimitExceeded,
                format!(
                    "this peer connection registered {MAX_LAYOUTS_PER_CONN} layouts: it is \
                     closed and a new one made"
                ),
            ));
        }
        let req = register_request(
            model,
            world_size,
            layout,
            ids.fetch_add(1, Ordering::Relaxed),
        )?;
        let reply = self.client.register(&req)?;
        if reply.object_bytes != layout.object_bytes() {
            return Err(Error::invalid(format!(
                "the peer's layout for {model} (world {world_size}) holds {} bytes per object, \
                 this node's {}",
                reply.object_bytes,
                layout.object_bytes()
            )));
        }
        self.instances.insert(key, req.instance_id);
        Ok(req.instance_id)
    }
}

/// The registration that gives a peer `layout` for `(model, world_size)`: LMCache's
/// engine-driven shape `[2, layers, slots, hidden]` (or `[layers, slots, hidden]` for MLA).
fn register_request(
    model: &str,
    world_size: u32,
    layout: &Layout,
    instance_id: u64,
) -> Result<RegisterRequest> {
    let dims: Vec<u32> = layout
        .shape
        .iter()
        .map(|&d| u32::try_from(d))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::invalid("a layout dimension beyond u32"))?;
    let (use_mla, rest) = match dims.as_slice() {
        [2, rest @ ..] if rest.len() == 3 => (false, rest),
        rest if rest.len() == 3 => (true, rest),
        _ => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "layout {:?} is not an engine-driven one: not shared with peers",
                    layout.shape
                ),
            ))
        }
    };
    Ok(RegisterRequest {
        instance_id,
        model: model.to_owned(),
        world_size,
        block_size: 16,
        num_layers: rest[0],
        hidden_dim: rest[2],
        dtype: layout.dtype.name().to_owned(),
        use_mla,
        physical_slots: Some(rest[1]),
    })
}

/// How long a peer that could not be connected to is skipped (its calls are misses at once,
/// not one connect timeout each, until etcd drops it from the view or it answers again).
pub const PEER_DOWN_BACKOFF: Duration = Duration::from_secs(1);

/// The pool of one peer. Invariant: `open` counts the connections of generation `gen` idle
/// here or taken out; a taken connection of an older generation (its pool was dropped and made
/// again meanwhile) is never counted nor given back.
struct PeerPool {
    endpoint: String,
    idle: Vec<PeerConn>,
    open: usize,
    gen: u64,
    /// Set when a connect failed: no new connection is tried before this instant.
    down_until: Option<Instant>,
}

/// Connections to every peer, created on demand.
pub struct Peers {
    local_id: String,
    token: Option<Token>,
    per_peer: usize,
    timeout: Duration,
    pools: Mutex<HashMap<String, PeerPool>>,
    /// Woken (all waiters) whenever a connection is given back or closed.
    freed: Condvar,
    next_gen: AtomicU64,
    /// Instance ids this node registers on its peers (random start: two nodes never pick the
    /// same ids on a third; engine-chosen ids are small in practice).
    ids: AtomicU64,
}

/// A connection taken from its pool; dropped (closed) unless given back with [`Peers::put`].
pub struct Taken {
    /// The peer's id.
    pub peer: String,
    /// The connection.
    pub conn: PeerConn,
    gen: u64,
}

impl Peers {
    /// Connections for node `local_id`, proving `token`, at most `per_peer` to each peer, each
    /// call bounded by `timeout`.
    pub fn new(local_id: &str, token: Option<Token>, per_peer: usize, timeout: Duration) -> Peers {
        let mut seed = [0u8; 8];
        let _ = crate::transport::tcp::auth::os_random(&mut seed);
        Peers {
            local_id: local_id.to_owned(),
            token,
            per_peer,
            timeout,
            pools: Mutex::new(HashMap::new()),
            freed: Condvar::new(),
            next_gen: AtomicU64::new(1),
            ids: AtomicU64::new(u64::from_le_bytes(seed) | (1 << 63)),
        }
    }

    /// The instance-id source for registrations on peers.
    pub fn ids(&self) -> &AtomicU64 {
        &self.ids
    }

    /// A connection to `peer` at `endpoint`: an idle one, a new one when fewer than the limit
    /// are open, else the first one given back before `deadline`.
    pub fn take(&self, peer: &str, endpoint: &str, deadline: Instant) -> Result<Taken> {
        let mut pools = self.pools.lock();
        loop {
            let pool = pools.entry(peer.to_owned()).or_insert_with(|| PeerPool {
                endpoint: endpoint.to_owned(),
                idle: Vec::new(),
                open: 0,
                gen: self.next_gen.fetch_add(1, Ordering::Relaxed),
                down_until: None,
            });
            if pool.endpoint != endpoint {
                // The peer restarted elsewhere: every old connection is stale (a new
                // generation: those taken out are not given back).
                pool.endpoint = endpoint.to_owned();
                pool.idle.clear();
                pool.open = 0;
                pool.gen = self.next_gen.fetch_add(1, Ordering::Relaxed);
                pool.down_until = None;
            }
            let gen = pool.gen;
            if let Some(conn) = pool.idle.pop() {
                return Ok(Taken {
                    peer: peer.to_owned(),
                    conn,
                    gen,
                });
            }
            if let Some(until) = pool.down_until {
                if Instant::now() < until {
                    return Err(Error::new(
                        ErrorKind::Io,
                        format!("peer {peer} at {endpoint} could not be reached a moment ago"),
                    ));
                }
            }
            if pool.open < self.per_peer {
                pool.open += 1;
                drop(pools);
                return match self.connect(endpoint, deadline) {
                    Ok(conn) => Ok(Taken {
                        peer: peer.to_owned(),
                        conn,
                        gen,
                    }),
                    Err(e) => {
                        let mut pools = self.pools.lock();
                        if let Some(p) = pools.get_mut(peer).filter(|p| p.gen == gen) {
                            p.open = p.open.saturating_sub(1);
                            p.down_until = Some(Instant::now() + PEER_DOWN_BACKOFF);
                        }
                        drop(pools);
                        self.freed.notify_all();
                        Err(e)
                    }
                };
            }
            if self.freed.wait_until(&mut pools, deadline).timed_out() {
                return Err(Error::new(
                    ErrorKind::Io,
                    format!(
                        "timed out: all {} connections to peer {peer} stayed busy",
                        self.per_peer
                    ),
                ));
            }
        }
    }

    fn connect(&self, endpoint: &str, deadline: Instant) -> Result<PeerConn> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(
                ErrorKind::Io,
                "timed out: no time left to connect",
            ));
        }
        let opts = RemoteOptions {
            name: format!("{PEER_NODE_NAME_PREFIX}{}", self.local_id),
            connect_timeout: left,
            reply_timeout: Some(self.timeout),
            fabric: FabricChoice::Tcp,
            rdma_device: "none".into(),
        };
        let client = RemoteClient::connect_remote(endpoint, self.token.as_ref(), &opts)?;
        Ok(PeerConn {
            client,
            instances: HashMap::new(),
            session: format!(
                "kvnode-peer:{}:{}",
                self.local_id,
                self.ids.fetch_add(1, Ordering::Relaxed)
            ),
        })
    }

    /// Gives a connection back after a call that left it in step (dropped instead when its
    /// pool was replaced meanwhile).
    pub fn put(&self, t: Taken) {
        let mut pools = self.pools.lock();
        match pools.get_mut(&t.peer).filter(|p| p.gen == t.gen) {
            Some(p) => p.idle.push(t.conn),
            None => return,
        }
        drop(pools);
        self.freed.notify_all();
    }

    /// Closes a connection after a failed call (the peer then releases what it held for it).
    pub fn close(&self, t: Taken) {
        let Taken { peer, conn, gen } = t;
        drop(conn);
        let mut pools = self.pools.lock();
        if let Some(p) = pools.get_mut(&peer).filter(|p| p.gen == gen) {
            p.open = p.open.saturating_sub(1);
        }
        drop(pools);
        self.freed.notify_all();
    }

    /// Drops the pools of peers no longer in `live` (their connections close).
    pub fn retain(&self, live: &[&str]) {
        self.pools
            .lock()
            .retain(|id, _| live.contains(&id.as_str()));
        self.freed.notify_all();
    }

    /// Open connections per peer (status).
    pub fn open(&self) -> Vec<(String, usize)> {
        let mut v: Vec<_> = self
            .pools
            .lock()
            .iter()
            .map(|(k, p)| (k.clone(), p.open))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::layout::Dtype;

    #[test]
    fn registrations_reproduce_the_layout() {
        for mla in [false, true] {
            let l = Layout::engine_driven(4, 256, 128, Dtype::Bfloat16, mla).unwrap();
            let r = register_request("m", 2, &l, 9).unwrap();
            assert_eq!(r.use_mla, mla);
            let back = Layout::engine_driven(
                r.num_layers,
                r.physical_slots.unwrap(),
                r.hidden_dim,
                Dtype::Bfloat16,
                r.use_mla,
            )
            .unwrap();
            assert_eq!(back.fingerprint(), l.fingerprint());
        }
        let odd = Layout::new(vec![3, 4, 5, 6, 7], Dtype::Float32).unwrap();
        assert!(register_request("m", 1, &odd, 1).is_err());
    }
}
