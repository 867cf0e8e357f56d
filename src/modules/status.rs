//! The STATUS report: a JSON-serialisable snapshot of the node.

use std::sync::atomic::Ordering;

use serde::Serialize;

use super::context::NodeContext;
use super::events::EventBusStats;
use crate::storage::core::{EvictionCounters, MemcheckStatus};
use crate::storage::ObjectCounts;

/// One instance in the report.
#[derive(Debug, Serialize)]
pub struct InstanceStatus {
    /// Instance id.
    pub id: u64,
    /// Model name.
    pub model: String,
    /// KV world size.
    pub world_size: u32,
    /// Object shape.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: &'static str,
    /// Milliseconds since its last request.
    pub last_seen_ms_ago: u64,
    /// Whether it has pinged.
    pub pinged: bool,
    /// Prepared, uncommitted stores.
    pub pending_writes: usize,
    /// Prepared, uncommitted retrieves.
    pub pending_reads: usize,
    /// Requests queued in its mailbox.
    pub queued: usize,
    /// Worker shard it runs on.
    pub shard: usize,
}

/// Liveness configuration and counters.
#[derive(Debug, Serialize)]
pub struct LivenessStatus {
    /// Whether reaping is on.
    pub enabled: bool,
    /// Reap timeout for instances that pinged.
    pub reap_timeout_secs: f64,
    /// Reap timeout for instances that never pinged.
    pub registration_grace_secs: f64,
    /// Instances with an armed timer.
    pub tracked_instances: usize,
    /// Instances reaped so far.
    pub reaped: u64,
    /// Instances released because their connection closed.
    pub disconnected: u64,
}

/// `(model, cache_salt)` namespaces.
#[derive(Debug, Serialize)]
pub struct NamespaceStatus {
    /// Held now.
    pub held: usize,
    /// Most held at once (`limits.max_namespaces`).
    pub limit: usize,
    /// Dropped since start-up because nothing used them.
    pub reclaimed: u64,
}

/// The whole report. Field names are a public contract (`kvnode status --json`).
#[derive(Debug, Serialize)]
pub struct StatusReport {
    /// kvnode version.
    pub version: &'static str,
    /// `hugetlb-2m`, `hugetlb-1g`, `thp` or `4k`: what the node's own mapping of the pool was
    /// backed by right after pre-faulting (THP that the kernel did not deliver reports `4k`).
    pub pool_backing: &'static str,
    /// One line for people: where the pool's memory comes from (memfd, tmpfs `/dev/shm`, or
    /// the private hugetlbfs/tmpfs file bind-mounted at the segment's `/dev/shm` path) and how
    /// much of it is in huge pages, or why it is on 4 KiB pages.
    pub pool_backing_detail: String,
    /// Pool size in bytes.
    pub pool_bytes: u64,
    /// Bytes usable for objects.
    pub capacity_bytes: u64,
    /// Bytes in slots (reserved or committed).
    pub used_bytes: u64,
    /// Tokens per chunk.
    pub chunk_tokens: u32,
    /// Object counts by state.
    pub objects: ObjectCounts,
    /// Registered instances.
    pub instances: Vec<InstanceStatus>,
    /// Prepared stores across instances.
    pub pending_writes: usize,
    /// Prepared retrieves across instances.
    pub pending_reads: usize,
    /// Total objects evicted (sync + background).
    pub evictions: u64,
    /// Eviction and TTL-expiry details.
    pub eviction_counters: EvictionCounters,
    /// Whether the last MEMCHECK found nothing wrong (true when none has run since start-up).
    /// STATUS never runs a check itself (it must not slow the hot path): see `memcheck`.
    pub memcheck_ok: bool,
    /// Violations the last MEMCHECK found.
    pub memcheck_problems: Vec<String>,
    /// The memcheck record: whether one runs now, how many finished, the last one's age.
    pub memcheck: MemcheckStatus,
    /// Liveness.
    pub liveness: LivenessStatus,
    /// Open lookup sessions.
    pub sessions: usize,
    /// Read locks retrieves took over from lookup sessions so far.
    pub adopted_lookup_locks: u64,
    /// Interned namespaces.
    pub namespaces: NamespaceStatus,
    /// Distinct registered layouts.
    pub layouts: usize,
    /// Event bus counters.
    pub event_bus: EventBusStats,
    /// Open client connections.
    pub connections: usize,
    /// Requests answered.
    pub requests: u64,
    /// Error responses sent.
    pub errors: u64,
    /// Requests executed per worker shard.
    pub shard_executed: Vec<u64>,
    /// Allocator size classes: (class bytes, live slots, slabs).
    pub size_classes: Vec<(u64, usize, usize)>,
    /// The L2 disk tier (`null` when not configured).
    pub l2: Option<crate::l2::L2SetStatus>,
    /// Bytes the lookup sessions hold (an upper bound; at most `limits.max_session_bytes`).
    pub session_bytes: usize,
    /// Parts added by components above the core, each under its own key (`lmcache`: the
    /// LMCache frontend's budgets, state and refusals); absent when none is running.
    #[serde(flatten)]
    pub parts: std::collections::BTreeMap<String, serde_json::Value>,
}

/// Builds the report from counters: it takes no storage gate and no index shard lock (object
/// counts come from the shards' counters, memcheck figures from the last check), so a client
/// polling STATUS never holds up another's requests. Cost: O(instances + size classes).
pub fn report(ctx: &NodeContext) -> StatusReport {
    let now = ctx.now_ms();
    let mut pending_writes = 0;
    let mut pending_reads = 0;
    let instances = ctx
        .instances
        .all()
        .into_iter()
        .map(|i| {
            let p = i.pending.lock();
            pending_writes += p.writes.len();
            pending_reads += p.reads.len();
            InstanceStatus {
                id: i.id,
                model: i.model.clone(),
                world_size: i.world_size,
                shape: i.layout.shape.clone(),
                dtype: i.layout.dtype.name(),
                last_seen_ms_ago: now.saturating_sub(i.last_seen_ms.load(Ordering::Relaxed)),
                pinged: i.pinged.load(Ordering::Relaxed),
                pending_writes: p.writes.len(),
                pending_reads: p.reads.len(),
                queued: i.mailbox.len(),
                shard: i.shard,
            }
        })
        .collect();
    let mem = ctx.storage.memcheck_status();
    let ev = ctx.storage.eviction_counters();
    StatusReport {
        version: env!("CARGO_PKG_VERSION"),
        pool_backing: ctx.pool.backing().as_str(),
        pool_backing_detail: ctx.pool.backing_detail().to_owned(),
        pool_bytes: ctx.pool.len(),
        capacity_bytes: ctx.storage.capacity(),
        used_bytes: ctx.storage.used_bytes(),
        chunk_tokens: ctx.config.chunk_tokens,
        objects: ctx.storage.counts(),
        instances,
        pending_writes,
        pending_reads,
        evictions: ev.sync_evictions + ev.background_evictions,
        eviction_counters: ev,
        memcheck_ok: mem.last_ok,
        memcheck_problems: mem.last_problems.clone(),
        memcheck: mem,
        liveness: LivenessStatus {
            enabled: ctx.liveness.enabled(),
            reap_timeout_secs: ctx.config.reap_timeout_secs,
            registration_grace_secs: ctx.config.registration_grace_secs,
            tracked_instances: ctx.liveness.tracked(),
            reaped: ctx.counters.reaped.load(Ordering::Relaxed),
            disconnected: ctx.counters.disconnected.load(Ordering::Relaxed),
        },
        sessions: ctx.sessions.len(),
        adopted_lookup_locks: ctx.counters.adopted_locks.load(Ordering::Relaxed),
        namespaces: NamespaceStatus {
            held: ctx.namespaces.len(),
            limit: ctx.namespaces.limit(),
            reclaimed: ctx.namespaces.reclaimed(),
        },
        layouts: ctx.layouts.len(),
        event_bus: ctx.events.stats(),
        connections: ctx.counters.connections.load(Ordering::Relaxed),
        requests: ctx.counters.requests.load(Ordering::Relaxed),
        errors: ctx.counters.errors.load(Ordering::Relaxed),
        shard_executed: ctx.shards.executed(),
        size_classes: ctx.storage.class_stats(),
        l2: ctx.l2.as_ref().map(|l2| l2.status()),
        session_bytes: ctx.sessions.bytes(),
        parts: ctx.status_parts(),
    }
}
