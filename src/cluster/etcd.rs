//! Membership through etcd: this node's leased descriptor, kept alive, and a watch of the
//! cluster's prefix that keeps the view of the live members current.
//!
//! One thread (`kvnode-cluster`) runs a single-threaded tokio runtime for the etcd client
//! (etcd-client: gRPC over tonic). etcd is never on the data path: requests read the view, a
//! snapshot behind a lock held only to clone an `Arc`. Every etcd call has a deadline. When
//! etcd cannot be reached, the node keeps serving its own cache and its last view (peer calls
//! have their own deadlines: a dead peer is a miss), says so in status, and keeps trying to
//! reconnect; once back, it takes a new lease and publishes itself again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use parking_lot::Mutex;

use super::members::{Descriptor, SharedView, View};
use crate::config::ClusterConfig;

/// Shortest and longest wait between two reconnection attempts.
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// How often the descriptor's usage figures are refreshed in etcd (only when they changed).
const REFRESH_EVERY: Duration = Duration::from_secs(5);
/// How often the loop checks the stop flag.
const STOP_POLL: Duration = Duration::from_millis(100);

/// This node's link to etcd, as status reports it.
#[derive(Debug, Clone)]
pub enum EtcdState {
    /// Not connected yet.
    Connecting,
    /// Connected: the descriptor is published under `lease`.
    Connected {
        /// The lease id.
        lease: i64,
    },
    /// Lost: why, and since when (Unix ms). The node serves its own cache and its last view.
    Lost {
        /// The last error.
        reason: String,
        /// Unix milliseconds of the loss.
        since_unix_ms: u64,
    },
}

/// What the membership thread shares with the node.
pub struct Membership {
    /// The live members.
    pub view: SharedView,
    /// The etcd link's state.
    pub state: Mutex<EtcdState>,
    /// Times the node (re)published its descriptor.
    pub registrations: std::sync::atomic::AtomicU64,
    /// Set to stop the thread (it revokes the lease on its way out).
    pub stop: AtomicBool,
}

/// Unix milliseconds now.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The source of this node's descriptor (usage figures change over time).
pub type DescribeSelf = Box<dyn Fn() -> Descriptor + Send>;

/// Deadline-bound etcd call: the error names what timed out.
async fn within<T, E: std::fmt::Display>(
    what: &str,
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("etcd {what}: {e}")),
        Err(_) => Err(format!(
            "etcd {what}: no answer within {} ms",
            limit.as_millis()
        )),
    }
}

/// Connects to etcd with the configured deadlines.
pub async fn connect(cfg: &ClusterConfig) -> Result<Client, String> {
    let endpoints: Vec<String> = cfg
        .etcd
        .iter()
        .map(|e| crate::config::etcd_endpoint(e).map(|hp| format!("http://{hp}")))
        .collect::<crate::error::Result<_>>()
        .map_err(|e| e.to_string())?;
    let opts = ConnectOptions::new()
        .with_connect_timeout(cfg.etcd_timeout())
        .with_timeout(cfg.etcd_timeout())
        .with_keep_alive(Duration::from_secs(2), cfg.etcd_timeout());
    within(
        &format!("connect to {}", endpoints.join(",")),
        cfg.etcd_timeout(),
        Client::connect(endpoints.clone(), Some(opts)),
    )
    .await
}

/// Reads every member descriptor under `prefix`; bad ones are logged and left out. Returns
/// them with the revision read at.
pub async fn read_members(
    client: &mut Client,
    prefix: &str,
    limit: Duration,
) -> Result<(Vec<(String, Descriptor)>, i64), String> {
    let resp = within(
        "get members",
        limit,
        client.get(prefix, Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let mut out = Vec::new();
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        match Descriptor::parse(&key, kv.value()) {
            Ok(d) => out.push((key, d)),
            Err(e) => tracing::warn!(error = %e, "ignoring a member descriptor"),
        }
    }
    Ok((out, revision))
}

/// Starts the membership thread.
pub fn spawn(
    cfg: ClusterConfig,
    local_id: String,
    describe: DescribeSelf,
    membership: Arc<Membership>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kvnode-cluster".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the cluster thread's runtime");
                    return;
                }
            };
            rt.block_on(run(cfg, local_id, describe, membership));
        })
}

/// Reconnects until stopped; each session publishes the descriptor and follows the prefix.
async fn run(cfg: ClusterConfig, local_id: String, describe: DescribeSelf, m: Arc<Membership>) {
    let mut retry = RETRY_MIN;
    // The lease of the last session: reused when it is still alive, so a session that ended
    // on a watch or stream error (not a partition longer than the TTL) does not look like a
    // rejoin to the peers (which would hand this node its share again).
    let mut lease: Option<i64> = None;
    while !m.stop.load(Ordering::SeqCst) {
        let mut joined = false;
        match session(&cfg, &local_id, &describe, &m, &mut lease, &mut joined).await {
            Ok(()) => break,
            Err(reason) => {
                tracing::warn!(
                    cluster = %cfg.name,
                    error = %reason,
                    "etcd unreachable: serving this node's own cache and the last known members"
                );
                *m.state.lock() = EtcdState::Lost {
                    reason,
                    since_unix_ms: unix_ms(),
                };
            }
        }
        if joined {
            // It was up: try again soon (the lease may still be alive).
            retry = RETRY_MIN;
        }
        let until = tokio::time::Instant::now() + retry;
        while tokio::time::Instant::now() < until && !m.stop.load(Ordering::SeqCst) {
            tokio::time::sleep(STOP_POLL).await;
        }
        retry = (retry * 2).min(RETRY_MAX);
    }
}

/// One connected session: lease, descriptor, view, then keep-alives, watch events and usage
/// refreshes until an error (returned) or the stop flag (the lease is revoked: `Ok`).
async fn session(
    cfg: &ClusterConfig,
    local_id: &str,
    describe: &DescribeSelf,
    m: &Membership,
    last_lease: &mut Option<i64>,
    joined: &mut bool,
) -> Result<(), String> {
    let limit = cfg.etcd_timeout();
    let prefix = cfg.members_prefix();
    let key = format!("{prefix}{local_id}");
    let mut client = connect(cfg).await?;
    let ttl = i64::try_from(cfg.lease_ttl_secs).unwrap_or(i64::MAX);
    let alive = match *last_lease {
        Some(id) => within(
            "lease time-to-live",
            limit,
            client.lease_time_to_live(id, None),
        )
        .await
        .is_ok_and(|r| r.ttl() > 0)
        .then_some(id),
        None => None,
    };
    let lease = match alive {
        Some(id) => id,
        None => within("lease grant", limit, client.lease_grant(ttl, None))
            .await?
            .id(),
    };
    *last_lease = Some(lease);
    let describe_leased = || Descriptor {
        lease,
        ..describe()
    };
    let mut published = describe_leased();
    let value = serde_json::to_vec(&published).map_err(|e| e.to_string())?;
    within(
        "put descriptor",
        limit,
        client.put(
            key.as_str(),
            value,
            Some(PutOptions::new().with_lease(lease)),
        ),
    )
    .await?;
    let (found, revision) = read_members(&mut client, &prefix, limit).await?;
    let mut members: BTreeMap<String, Descriptor> = found.into_iter().collect();
    install(m, &members, local_id, revision);
    let mut watch = within(
        "watch",
        limit,
        client.watch(
            prefix.as_str(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        ),
    )
    .await?;
    let (mut keeper, mut alive) =
        within("lease keep-alive", limit, client.lease_keep_alive(lease)).await?;
    *m.state.lock() = EtcdState::Connected { lease };
    *joined = true;
    m.registrations.fetch_add(1, Ordering::Relaxed);
    tracing::info!(cluster = %cfg.name, node = local_id, lease, members = members.len(), "joined the cluster");
    // Keep-alives at a third of the TTL: two can be lost before the lease expires.
    let mut keep = tokio::time::interval(cfg.lease_ttl() / 3);
    let mut refresh = tokio::time::interval(REFRESH_EVERY);
    let mut poll = tokio::time::interval(STOP_POLL);
    let mut last_ack = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = keep.tick() => {
                if last_ack.elapsed() > cfg.lease_ttl() {
                    return Err(format!(
                        "no keep-alive answer for {} s: the lease expired",
                        cfg.lease_ttl_secs
                    ));
                }
                within("keep-alive", limit, keeper.keep_alive()).await?;
            }
            ack = alive.message() => {
                match ack {
                    Ok(Some(r)) if r.ttl() > 0 => last_ack = tokio::time::Instant::now(),
                    Ok(Some(_)) => return Err("the lease expired (etcd answered TTL 0)".into()),
                    Ok(None) => return Err("the keep-alive stream ended".into()),
                    Err(e) => return Err(format!("etcd keep-alive: {e}")),
                }
            }
            ev = watch.message() => {
                let resp = match ev {
                    Ok(Some(r)) => r,
                    Ok(None) => return Err("the watch ended".into()),
                    Err(e) => return Err(format!("etcd watch: {e}")),
                };
                if resp.canceled() {
                    return Err(format!("the watch was cancelled: {}", resp.cancel_reason()));
                }
                if resp.events().is_empty() {
                    continue; // the watch's creation, or a progress notice
                }
                let mut rev = 0;
                for e in resp.events() {
                    let Some(kv) = e.kv() else { continue };
                    rev = rev.max(kv.mod_revision());
                    let k = String::from_utf8_lossy(kv.key()).into_owned();
                    match e.event_type() {
                        EventType::Put => match Descriptor::parse(&k, kv.value()) {
                            Ok(d) => {
                                members.insert(k, d);
                            }
                            Err(err) => tracing::warn!(error = %err, "ignoring a member descriptor"),
                        },
                        EventType::Delete => {
                            members.remove(&k);
                        }
                    }
                }
                install(m, &members, local_id, rev);
                if !members.contains_key(&key) {
                    // Our key went away (lease revoked by someone, or expired meanwhile).
                    return Err("this node's descriptor was deleted from etcd".into());
                }
            }
            _ = refresh.tick() => {
                let now = describe_leased();
                if now != published {
                    let value = serde_json::to_vec(&now).map_err(|e| e.to_string())?;
                    within(
                        "refresh descriptor",
                        limit,
                        client.put(key.as_str(), value, Some(PutOptions::new().with_lease(lease))),
                    )
                    .await?;
                    published = now;
                }
            }
            _ = poll.tick() => {
                if m.stop.load(Ordering::SeqCst) {
                    // Leave at once rather than after the TTL: peers stop asking this node.
                    let _ = within("lease revoke", limit, client.lease_revoke(lease)).await;
                    tracing::info!(cluster = %cfg.name, node = local_id, "left the cluster");
                    return Ok(());
                }
            }
        }
    }
}

/// Installs the view of `members` (by key).
fn install(m: &Membership, members: &BTreeMap<String, Descriptor>, local_id: &str, revision: i64) {
    let view = View::build(members.values().cloned().collect(), local_id, revision);
    let ids: Vec<&str> = view
        .members
        .iter()
        .map(|x| x.desc.node_id.as_str())
        .collect();
    tracing::debug!(?ids, revision, "cluster view");
    *m.view.write() = Arc::new(view);
}
