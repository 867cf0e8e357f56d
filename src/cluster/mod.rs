//! A cluster of nodes on etcd: membership ([`etcd`]), placement ([`placement`]), peer fetch
//! ([`fetch`]) and pushes to owners ([`push`]), over authenticated connections to the peers
//! ([`peers`]).
//!
//! etcd holds only membership (each node's leased descriptor); it is never on the data path.
//! A node serves its own engines exactly as a lone node does; the cluster adds two things:
//! a LOOKUP or retrieve that misses locally brings the missing chunks in from their owners
//! first, and a store is pushed, after it was published here, to the member that owns it.
//! Calls between nodes are the remote-engine protocol over TCP with the same token mechanism,
//! so a peer gets no more trust than a remote engine of the same token, and every one of them
//! has a deadline: a dead or slow peer is a miss, never an error or a hang.

pub mod client;
pub mod etcd;
pub mod fetch;
pub mod handoff;
pub mod members;
pub mod peers;
pub mod placement;
pub mod push;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub use self::client::ClusterClient;
use self::etcd::{EtcdState, Membership};
use self::members::{Descriptor, View, CLUSTER_PROTOCOL_VERSION};
use self::peers::Peers;
use self::push::PushQueue;
use crate::config::ClusterConfig;
use crate::error::{Error, Result};
use crate::modules::cluster_link::ClusterLink;
use crate::modules::instances::Instance;
use crate::modules::NodeContext;
use crate::protocol::ChunkRange;
use crate::storage::StorageKey;
use crate::transport::tcp::auth::Token;

/// How long stopping waits for the cluster's threads (the lease revoke has its own deadline).
const STOP_PATIENCE: Duration = Duration::from_secs(5);

/// The cluster's counters (status `cluster`, metrics).
#[derive(Default)]
pub struct ClusterCounters {
    /// Requests that asked peers for chunks.
    pub fetch_requests: AtomicU64,
    /// Objects (chunk ranks) brought in and published here.
    pub fetched_objects: AtomicU64,
    /// Their bytes.
    pub fetched_bytes: AtomicU64,
    /// Lookups of a model no local engine registered a layout for (nothing fetched).
    pub fetch_no_layout: AtomicU64,
    /// Chunks missed: the owner did not hold them.
    pub miss_not_held: AtomicU64,
    /// Chunks missed: this node owns them and does not hold them.
    pub miss_owned_here: AtomicU64,
    /// Chunks missed: the owner could not be reached or its call failed.
    pub miss_unreachable: AtomicU64,
    /// Chunks missed: the owner did not answer within the peer deadline.
    pub miss_timeout: AtomicU64,
    /// Chunks missed: the owner's layout differs.
    pub miss_layout: AtomicU64,
    /// Chunks missed: no room in this pool.
    pub miss_local_full: AtomicU64,
    /// Chunks missed: beyond the fetch byte budget of one request.
    pub miss_budget: AtomicU64,
    /// Objects queued for a push to their owner.
    pub push_queued: AtomicU64,
    /// Objects not queued (queue at its byte limit).
    pub push_dropped: AtomicU64,
    /// Objects whose push failed.
    pub push_failed: AtomicU64,
    /// Push calls that completed.
    pub pushed_batches: AtomicU64,
    /// Bytes the owners received from pushes (the chunks they lacked).
    pub pushed_bytes: AtomicU64,
    /// Objects queued for a joining member that now owns them.
    pub handoff_queued: AtomicU64,
    /// Objects a joining member owns that could not be handed off (layout no longer known).
    pub handoff_skipped: AtomicU64,
}

impl ClusterCounters {
    fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "fetch_requests": g(&self.fetch_requests),
            "fetched_objects": g(&self.fetched_objects),
            "fetched_bytes": g(&self.fetched_bytes),
            "fetch_no_layout": g(&self.fetch_no_layout),
            "fetch_misses": {
                "not_held": g(&self.miss_not_held),
                "owned_here": g(&self.miss_owned_here),
                "unreachable": g(&self.miss_unreachable),
                "timeout": g(&self.miss_timeout),
                "layout": g(&self.miss_layout),
                "local_full": g(&self.miss_local_full),
                "budget": g(&self.miss_budget),
            },
            "push_queued": g(&self.push_queued),
            "push_dropped": g(&self.push_dropped),
            "push_failed": g(&self.push_failed),
            "pushed_batches": g(&self.pushed_batches),
            "pushed_bytes": g(&self.pushed_bytes),
            "handoff_queued": g(&self.handoff_queued),
            "handoff_skipped": g(&self.handoff_skipped),
        })
    }
}

/// This node as a member of its cluster. Invariant: `ctx` is the node it serves (weak: the
/// node holds this through its context); `view` is replaced whole, never edited.
pub struct ClusterNode {
    ctx: Weak<NodeContext>,
    cfg: ClusterConfig,
    local_id: String,
    endpoint: String,
    membership: Arc<Membership>,
    peers: Peers,
    pushes: PushQueue,
    layouts: handoff::LayoutCache,
    fetch_budget: fetch::FetchBudget,
    /// Counters.
    pub counters: ClusterCounters,
    stopping: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The view revision whose members the peer pools were last trimmed to.
    trimmed_at: std::sync::atomic::AtomicI64,
}

/// This node's id: the configured one, else `<hostname>-<port>` (characters outside
/// `[A-Za-z0-9._-]` replaced by `-`).
fn node_id(cfg: &ClusterConfig, listen: SocketAddr) -> String {
    if !cfg.node_id.is_empty() {
        return cfg.node_id.clone();
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(crate::config::MAX_NODE_ID_BYTES - 6)
        .collect();
    let host = if host.is_empty() { "node".into() } else { host };
    format!("{host}-{}", listen.port())
}

/// The endpoint peers reach this node at: the configured one, else the listener's address; an
/// unspecified address (0.0.0.0) becomes the address this host uses towards etcd.
fn advertise(cfg: &ClusterConfig, listen: SocketAddr) -> String {
    if !cfg.advertise.is_empty() {
        let a = cfg.advertise.trim();
        return if a.starts_with("tcp://") {
            a.to_owned()
        } else {
            format!("tcp://{a}")
        };
    }
    let mut ip = listen.ip();
    if ip.is_unspecified() {
        ip = cfg
            .etcd
            .first()
            .and_then(|e| crate::config::etcd_endpoint(e).ok())
            .and_then(|hp| {
                use std::net::ToSocketAddrs;
                let to = hp.to_socket_addrs().ok()?.next()?;
                let s = std::net::UdpSocket::bind(("0.0.0.0", 0)).ok()?;
                s.connect(to).ok()?;
                Some(s.local_addr().ok()?.ip())
            })
            .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
    }
    format!("tcp://{}", SocketAddr::new(ip, listen.port()))
}

impl ClusterNode {
    /// Joins the cluster `ctx.config.cluster` names: reads the peer token, starts the
    /// membership thread (which keeps trying while etcd is unreachable) and the pusher, and
    /// links the node's request path to the cluster. `listen` is the node's remote listener.
    pub fn start(ctx: &Arc<NodeContext>, listen: SocketAddr) -> Result<Arc<ClusterNode>> {
        let cfg = ctx.config.cluster.clone();
        let token_file = cfg
            .peer_token_file
            .clone()
            .or_else(|| ctx.config.remote.auth_token_file.clone());
        let token = match &token_file {
            Some(p) => {
                Some(Token::from_file(p).map_err(|e| e.context("the cluster's peer token"))?)
            }
            None => None,
        };
        let local_id = node_id(&cfg, listen);
        let endpoint = advertise(&cfg, listen);
        let membership = Arc::new(Membership {
            view: Arc::new(parking_lot::RwLock::new(Arc::new(View::default()))),
            state: Mutex::new(EtcdState::Connecting),
            registrations: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let node = Arc::new(ClusterNode {
            ctx: Arc::downgrade(ctx),
            peers: Peers::new(
                &local_id,
                token,
                cfg.connections_per_peer,
                cfg.peer_timeout(),
            ),
            pushes: PushQueue::new(cfg.max_push_queue_bytes),
            layouts: handoff::LayoutCache::default(),
            fetch_budget: fetch::FetchBudget::new(cfg.max_fetch_bytes),
            counters: ClusterCounters::default(),
            stopping: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            trimmed_at: std::sync::atomic::AtomicI64::new(0),
            membership: membership.clone(),
            local_id: local_id.clone(),
            endpoint: endpoint.clone(),
            cfg: cfg.clone(),
        });
        let describe = {
            let ctx = Arc::downgrade(ctx);
            let lmcache = !ctx
                .upgrade()
                .map(|c| c.config.shm_name.is_empty())
                .unwrap_or(true);
            let started = etcd::unix_ms();
            let id = local_id.clone();
            Box::new(move || {
                let (capacity, used, objects) = ctx.upgrade().map_or((0, 0, 0), |c| {
                    let n = c.storage.counts();
                    (
                        c.storage.capacity(),
                        c.storage.used_bytes(),
                        n.ready + n.read_locked + n.temporary,
                    )
                });
                Descriptor {
                    node_id: id.clone(),
                    endpoints: vec![endpoint.clone()],
                    capacity_bytes: capacity,
                    used_bytes: used,
                    objects,
                    protocol_version: CLUSTER_PROTOCOL_VERSION,
                    version: env!("CARGO_PKG_VERSION").into(),
                    lmcache,
                    started_unix_ms: started,
                    lease: 0,
                }
            })
        };
        let t1 = etcd::spawn(cfg.clone(), local_id.clone(), describe, membership.clone())?;
        let t2 = match push::spawn(Arc::downgrade(&node)) {
            Ok(t) => t,
            Err(e) => {
                // The membership thread must not keep advertising a node that did not start.
                membership.stop.store(true, Ordering::SeqCst);
                return Err(e.into());
            }
        };
        node.threads.lock().extend([t1, t2]);
        let link: Arc<dyn ClusterLink> = node.clone();
        if ctx.cluster.set(link).is_err() {
            node.stop();
            return Err(Error::internal("the node joined a cluster twice"));
        }
        {
            let n = Arc::downgrade(&node);
            ctx.add_status_part(
                "cluster",
                Box::new(move || n.upgrade().map_or(serde_json::Value::Null, |n| n.status())),
            );
        }
        tracing::info!(cluster = %cfg.name, node = %local_id, endpoint = %node.endpoint, etcd = ?cfg.etcd, "joining the cluster");
        Ok(node)
    }

    /// The current view of the live members; the first call after it changed closes the
    /// connections to members that left it.
    pub fn view(&self) -> Arc<View> {
        let view = self.membership.view.read().clone();
        if self.trimmed_at.swap(view.revision, Ordering::Relaxed) != view.revision {
            let ids: Vec<&str> = view
                .members
                .iter()
                .map(|m| m.desc.node_id.as_str())
                .collect();
            self.peers.retain(&ids);
        }
        view
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.local_id
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Leaves the cluster: the lease is revoked (peers stop asking this node at once) and the
    /// threads end (waited for at most a few seconds).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.membership.stop.store(true, Ordering::SeqCst);
        let threads = std::mem::take(&mut *self.threads.lock());
        let until = Instant::now() + STOP_PATIENCE;
        for t in threads {
            while !t.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }

    /// The status part `cluster`.
    pub fn status(&self) -> serde_json::Value {
        let view = self.view();
        let etcd = match &*self.membership.state.lock() {
            EtcdState::Connecting => serde_json::json!({"state": "connecting"}),
            EtcdState::Connected { lease } => {
                serde_json::json!({"state": "connected", "lease": lease})
            }
            EtcdState::Lost {
                reason,
                since_unix_ms,
            } => serde_json::json!({
                "state": "lost",
                "reason": reason,
                "since_unix_ms": since_unix_ms,
                "note": "serving this node's own cache and the last known members",
            }),
        };
        let members: Vec<_> = view
            .members
            .iter()
            .map(|m| {
                serde_json::json!({
                    "node_id": m.desc.node_id,
                    "endpoint": m.desc.endpoints.first(),
                    "capacity_bytes": m.desc.capacity_bytes,
                    "used_bytes": m.desc.used_bytes,
                    "objects": m.desc.objects,
                    "lmcache": m.desc.lmcache,
                    "local": m.local,
                })
            })
            .collect();
        let mut c = self.counters.json();
        c["name"] = self.cfg.name.clone().into();
        c["node_id"] = self.local_id.clone().into();
        c["endpoint"] = self.endpoint.clone().into();
        c["etcd"] = etcd;
        c["registrations"] = self.membership.registrations.load(Ordering::Relaxed).into();
        c["members"] = members.into();
        c["view_revision"] = view.revision.into();
        c["push_queue_bytes"] = self.pushes.bytes().into();
        c["push_in_flight"] = self.pushes.in_flight().into();
        c["push_delayed"] = self.pushes.delayed().into();
        c["fetch_bytes_in_flight"] = self.fetch_budget.used().into();
        c["peer_connections"] = self
            .peers
            .open()
            .into_iter()
            .map(|(id, n)| serde_json::json!({"node_id": id, "open": n}))
            .collect::<Vec<_>>()
            .into();
        c
    }
}

impl ClusterLink for ClusterNode {
    fn bring_in(&self, range: &ChunkRange) {
        if self.stopping() {
            return;
        }
        if let Some(ctx) = self.ctx.upgrade() {
            self.bring_in_range(&ctx, range);
        }
    }

    fn published(&self, inst: &Instance, keys: &[StorageKey]) {
        if self.stopping() {
            return;
        }
        if let Some(ctx) = self.ctx.upgrade() {
            self.queue_pushes(&ctx, inst, keys);
        }
    }
}
