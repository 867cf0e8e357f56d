//! The node's metrics, read at scrape time from the counters the node already keeps (the
//! storage core's shard tallies, the node and frontend counters, the per-operation tables): a
//! scrape adds no work to the request path and takes no lock a request holds for longer than a
//! counter read (the LMCache handler queues' and pending table's, each for a length read; the
//! L2 tier's status, as STATUS takes it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;

use super::names::{lm_op_name, LM_OPS, NATIVE_OPS};
use crate::lmcache::server::LmProbe;
use crate::modules::NodeContext;
use crate::op_stats::{LatencyHistogram, OpTable};

type Fmt = Result<(), std::fmt::Error>;

/// Key of the LMCache frontend's status part that counts instances released because every
/// connection that used them closed (`disconnect_releases`, issue 12 §1). The metric
/// `kvnode_lmcache_disconnect_releases_total` reports it whenever the part carries it.
pub const LM_DISCONNECT_RELEASES_KEY: &str = "disconnect_releases";

/// What a scrape reads: the node and, under `lmcache-server`, the LMCache frontend.
/// Invariant: holds only shared handles; encoding never writes to them.
pub struct NodeCollector {
    ctx: Arc<NodeContext>,
    lm: Option<LmProbe>,
    capacity: u64,
}

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCollector")
            .field("lmcache", &self.lm.is_some())
            .finish()
    }
}

impl NodeCollector {
    /// A collector over `ctx` and, when given, a running LMCache frontend.
    pub fn new(ctx: Arc<NodeContext>, lm: Option<LmProbe>) -> NodeCollector {
        // Fixed for the node's life; read once (it takes the allocator's lock).
        let capacity = ctx.storage.capacity();
        NodeCollector { ctx, lm, capacity }
    }
}

/// Writes one metric family of a single sample (or one per label set).
struct Out<'a, 'b> {
    enc: &'a mut DescriptorEncoder<'b>,
}

impl Out<'_, '_> {
    fn gauge(&mut self, name: &str, help: &str, v: u64) -> Fmt {
        let mut m = self
            .enc
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        m.encode_gauge(&v)
    }

    fn counter(&mut self, name: &str, help: &str, v: u64) -> Fmt {
        let mut m = self
            .enc
            .encode_descriptor(name, help, None, MetricType::Counter)?;
        m.encode_counter::<NoLabelSet, _, u64>(&v, None)
    }

    fn gauges<L: EncodeLabelSet>(&mut self, name: &str, help: &str, rows: &[(L, u64)]) -> Fmt {
        let mut m = self
            .enc
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (labels, v) in rows {
            m.encode_family(labels)?.encode_gauge(v)?;
        }
        Ok(())
    }

    fn counters<L: EncodeLabelSet>(&mut self, name: &str, help: &str, rows: &[(L, u64)]) -> Fmt {
        let mut m = self
            .enc
            .encode_descriptor(name, help, None, MetricType::Counter)?;
        for (labels, v) in rows {
            m.encode_family(labels)?
                .encode_counter::<NoLabelSet, _, u64>(v, None)?;
        }
        Ok(())
    }

    fn histograms<L: EncodeLabelSet>(
        &mut self,
        name: &str,
        help: &str,
        rows: &[(L, &LatencyHistogram)],
    ) -> Fmt {
        let mut m = self
            .enc
            .encode_descriptor(name, help, None, MetricType::Histogram)?;
        for (labels, h) in rows {
            let s = h.snapshot();
            // The encoder takes per-bucket counts and sums them itself.
            let mut prev = 0;
            let buckets: Vec<(f64, u64)> = s
                .cumulative
                .iter()
                .map(|&(le, c)| {
                    let b = (le, c - prev);
                    prev = c;
                    b
                })
                .collect();
            m.encode_family(labels)?
                .encode_histogram::<NoLabelSet>(s.sum_secs, s.count, &buckets, None)?;
        }
        Ok(())
    }

    /// Requests, errors and latency per operation, as three families named `prefix` +
    /// `_requests`, `_request_errors`, `_request_duration_seconds`.
    fn op_table<const N: usize>(
        &mut self,
        prefix: &str,
        what: &str,
        table: &OpTable<N>,
        ops: &[(usize, &'static str)],
    ) -> Fmt {
        let rows =
            |f: &dyn Fn(&crate::op_stats::OpCounters) -> u64| -> Vec<([(&str, &str); 1], u64)> {
                ops.iter()
                    .filter_map(|&(i, name)| table.get(i).map(|c| ([("op", name)], f(c))))
                    .collect()
            };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        self.counters(
            &format!("{prefix}_requests"),
            &format!("{what} requests answered, by operation"),
            &rows(&|c| load(&c.requests)),
        )?;
        self.counters(
            &format!("{prefix}_request_errors"),
            &format!("{what} requests answered with an error, by operation"),
            &rows(&|c| load(&c.errors)),
        )?;
        let hist: Vec<([(&str, &str); 1], &LatencyHistogram)> = ops
            .iter()
            .filter_map(|&(i, name)| table.get(i).map(|c| ([("op", name)], &c.latency)))
            .collect();
        self.histograms(
            &format!("{prefix}_request_duration_seconds"),
            &format!("{what} request latency from receipt to answer, by operation"),
            &hist,
        )
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Fmt {
        let mut out = Out { enc: &mut enc };
        self.encode_node(&mut out)?;
        if let Some(l2) = &self.ctx.l2 {
            encode_l2(&mut out, &l2.status())?;
        }
        if let Some(lm) = &self.lm {
            self.encode_lmcache(&mut out, lm)?;
        }
        let mut parts = self.ctx.status_parts();
        if let Some(remote) = parts.remove("remote") {
            encode_remote(&mut out, &remote)?;
        }
        if let Some(cluster) = parts.remove("cluster") {
            encode_cluster(&mut out, &cluster)?;
        }
        Ok(())
    }
}

/// The cluster's counters, from its status part (present when the node is a member).
fn encode_cluster(out: &mut Out, c: &serde_json::Value) -> Fmt {
    let n = |path: &[&str]| path.iter().fold(c, |v, k| &v[*k]).as_u64().unwrap_or(0);
    out.gauge(
        "kvnode_cluster_members",
        "Live members of the cluster in this node's view (itself included)",
        c["members"].as_array().map_or(0, |m| m.len() as u64),
    )?;
    out.gauge(
        "kvnode_cluster_etcd_connected",
        "1 while the node's etcd session is up (0: serving its own cache and the last view)",
        u64::from(c["etcd"]["state"] == "connected"),
    )?;
    out.counter(
        "kvnode_cluster_fetch_requests",
        "Lookups and retrieves that asked peers for chunks",
        n(&["fetch_requests"]),
    )?;
    out.counter(
        "kvnode_cluster_fetched_objects",
        "Objects brought in from peers and published in this pool",
        n(&["fetched_objects"]),
    )?;
    out.counter(
        "kvnode_cluster_fetched_bytes",
        "Bytes brought in from peers",
        n(&["fetched_bytes"]),
    )?;
    let causes = [
        "not_held",
        "owned_here",
        "unreachable",
        "timeout",
        "layout",
        "local_full",
        "budget",
    ];
    let rows: Vec<_> = causes
        .iter()
        .map(|&k| ([("cause", k)], n(&["fetch_misses", k])))
        .collect();
    out.counters(
        "kvnode_cluster_fetch_misses",
        "Chunks a peer fetch did not bring in, by cause",
        &rows,
    )?;
    out.counters(
        "kvnode_cluster_pushes",
        "Objects pushed to their owners: queued, dropped (queue full), failed",
        &[
            ([("outcome", "queued")], n(&["push_queued"])),
            ([("outcome", "dropped")], n(&["push_dropped"])),
            ([("outcome", "failed")], n(&["push_failed"])),
        ],
    )?;
    out.counter(
        "kvnode_cluster_pushed_bytes",
        "Bytes owners received from this node's pushes",
        n(&["pushed_bytes"]),
    )?;
    out.gauge(
        "kvnode_cluster_push_queue_bytes",
        "Bytes waiting to be pushed",
        n(&["push_queue_bytes"]),
    )
}

/// The remote listener's counters, from its status part (present when it listens).
fn encode_remote(out: &mut Out, r: &serde_json::Value) -> Fmt {
    let n = |path: &[&str]| path.iter().fold(r, |v, k| &v[*k]).as_u64().unwrap_or(0);
    out.gauge(
        "kvnode_remote_connections",
        "Authenticated remote connections open",
        n(&["connections_total"]),
    )?;
    out.counters(
        "kvnode_remote_bytes",
        "Bytes of remote stores received into slots (in) and retrieves sent from them (out)",
        &[
            ([("dir", "in")], n(&["bytes_in"])),
            ([("dir", "out")], n(&["bytes_out"])),
        ],
    )?;
    out.counters(
        "kvnode_remote_handshakes",
        "Remote handshakes by outcome",
        &[
            ([("outcome", "ok")], n(&["handshakes", "ok"])),
            (
                [("outcome", "auth_failed")],
                n(&["handshakes", "auth_failed"]),
            ),
            ([("outcome", "busy")], n(&["handshakes", "busy"])),
            ([("outcome", "timed_out")], n(&["handshakes", "timed_out"])),
            ([("outcome", "refused")], n(&["handshakes", "refused"])),
        ],
    )?;
    out.counter(
        "kvnode_remote_failed_moves",
        "Remote data ops whose bytes did not move (the store freed, never published)",
        n(&["failed_moves"]),
    )?;
    out.gauge(
        "kvnode_remote_stuck_ops",
        "Fabric ops past their deadline without completion (their slots stay reserved)",
        n(&["mover", "stuck_ops"]) + n(&["rdma_mover", "stuck_ops"]),
    )
}

impl NodeCollector {
    fn encode_node(&self, out: &mut Out) -> Fmt {
        let ctx = &self.ctx;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.gauges(
            "kvnode_info",
            "Constant 1, labelled with the version and what backs the pool",
            &[(
                [
                    ("version", env!("CARGO_PKG_VERSION")),
                    ("pool_backing", ctx.pool.backing().as_str()),
                ],
                1,
            )],
        )?;
        out.gauge(
            "kvnode_pool_bytes",
            "Size of the shared pool",
            ctx.pool.len(),
        )?;
        out.gauge(
            "kvnode_pool_capacity_bytes",
            "Pool bytes usable for objects",
            self.capacity,
        )?;
        out.gauge(
            "kvnode_pool_used_bytes",
            "Pool bytes in the slots of objects (reserved or committed)",
            ctx.storage.slot_bytes(),
        )?;
        let c = ctx.storage.counts();
        out.gauges(
            "kvnode_objects",
            "Objects by state: ready, read_locked and write_reserved partition them; temporary, \
             doomed and unwritten are flags counted on top",
            &[
                ([("state", "ready")], c.ready),
                ([("state", "read_locked")], c.read_locked),
                ([("state", "write_reserved")], c.write_reserved),
                ([("state", "temporary")], c.temporary),
                ([("state", "doomed")], c.doomed),
                ([("state", "unwritten")], c.unwritten),
            ],
        )?;
        let ev = ctx.storage.eviction_counters();
        out.counters(
            "kvnode_evictions",
            "Objects evicted from the pool, by cause: allocation (an allocation needed room) or \
             watermark (the background pass)",
            &[
                ([("cause", "allocation")], ev.sync_evictions),
                ([("cause", "watermark")], ev.background_evictions),
            ],
        )?;
        out.counter(
            "kvnode_evictions_unwritten",
            "Evicted objects whose L2 write-behind had not run (lost to both tiers)",
            ev.unwritten_evictions,
        )?;
        out.counters(
            "kvnode_ttl_expirations",
            "Transfers ended by their TTL: write reservations deleted, read locks dropped",
            &[
                ([("kind", "write")], ev.expired_writes),
                ([("kind", "read")], ev.expired_reads),
            ],
        )?;
        out.counter(
            "kvnode_oom_keys",
            "Keys that could not be reserved for lack of memory",
            ev.oom_keys,
        )?;
        out.gauge(
            "kvnode_instances",
            "Registered instances",
            ctx.instances.len() as u64,
        )?;
        out.counter(
            "kvnode_instances_reaped",
            "Instances released by the liveness reaper (silent past their timeout)",
            n(&ctx.counters.reaped),
        )?;
        out.counter(
            "kvnode_instances_disconnected",
            "Instances released because the native connection that registered them closed",
            n(&ctx.counters.disconnected),
        )?;
        out.gauge(
            "kvnode_lookup_sessions",
            "Open lookup sessions",
            ctx.sessions.len() as u64,
        )?;
        out.gauge(
            "kvnode_connections",
            "Open native client connections",
            ctx.counters.connections.load(Ordering::Relaxed) as u64,
        )?;
        let native: Vec<(usize, &'static str)> = NATIVE_OPS
            .iter()
            .map(|&(code, name)| (usize::from(code), name))
            .collect();
        out.op_table(
            "kvnode",
            "Node (native protocol and the LMCache frontend's native calls)",
            &ctx.counters.ops,
            &native,
        )
    }

    fn encode_lmcache(&self, out: &mut Out, lm: &LmProbe) -> Fmt {
        let st = lm.stats();
        let fc = lm.frontend().counters();
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let ops: Vec<(usize, &'static str)> = LM_OPS
            .iter()
            .map(|&op| (op as usize, lm_op_name(op)))
            .collect();
        out.op_table("kvnode_lmcache", "LMCache", &st.ops, &ops)?;
        out.counter(
            "kvnode_lmcache_malformed",
            "LMCache requests that could not be decoded (answered negatively, or dropped \
             without uid and type frames)",
            n(&st.malformed),
        )?;
        out.counters(
            "kvnode_lmcache_refusals",
            "LMCache requests answered negatively because of a rule or budget, by reason",
            &[
                ([("reason", "access")], n(&st.refused)),
                ([("reason", "queue_budget")], n(&fc.queue_refused)),
                ([("reason", "max_tokens_per_request")], n(&fc.over_limit)),
                (
                    [("reason", "max_request_id_bytes")],
                    n(&fc.long_request_ids),
                ),
                ([("reason", "not_owner")], n(&fc.not_owner)),
                ([("reason", "register_other_user")], n(&fc.register_refused)),
                ([("reason", "pending_budget")], n(&fc.pending_refused)),
            ],
        )?;
        out.counter(
            "kvnode_lmcache_takeovers",
            "REGISTERs that took an instance over from another connection of the same user",
            n(&fc.takeovers),
        )?;
        out.counter(
            "kvnode_lmcache_sessions_dropped",
            "Lookup sessions ended for a client's session budget or the state TTL",
            n(&fc.sessions_dropped),
        )?;
        out.gauge(
            "kvnode_lmcache_queued_bytes",
            "Bytes of LMCache requests waiting for a handler thread",
            fc.queued_bytes.load(Ordering::Relaxed) as u64,
        )?;
        out.gauge(
            "kvnode_lmcache_queued_requests",
            "LMCache requests waiting for a handler thread",
            lm.queued_requests() as u64,
        )?;
        out.gauge(
            "kvnode_lmcache_pending_transfers",
            "Transfers handed to LMCache workers and not yet committed",
            lm.frontend().pending_transfers() as u64,
        )?;
        // The disconnect hook: present once the frontend's status part counts the releases.
        let part = self.ctx.status_parts().remove("lmcache");
        if let Some(v) = part
            .as_ref()
            .and_then(|p| p.get(LM_DISCONNECT_RELEASES_KEY))
            .and_then(|v| v.as_u64())
        {
            out.counter(
                "kvnode_lmcache_disconnect_releases",
                "Instances released because every LMCache connection that used them closed",
                v,
            )?;
        }
        Ok(())
    }
}

fn encode_l2(out: &mut Out, s: &crate::l2::L2SetStatus) -> Fmt {
    let t = &s.total;
    out.gauge(
        "kvnode_l2_bytes",
        "Size of the L2 tier (all devices)",
        t.bytes,
    )?;
    out.gauge(
        "kvnode_l2_used_bytes",
        "L2 bytes in slots holding or receiving objects",
        t.used_bytes,
    )?;
    out.gauge("kvnode_l2_objects", "Objects readable from L2", t.objects)?;
    out.gauge(
        "kvnode_l2_queued",
        "Objects waiting in the L2 write-behind queue",
        t.queued as u64,
    )?;
    out.gauge(
        "kvnode_l2_stuck",
        "1 while a device call has run past l2.io_timeout_ms (loads miss, writes wait)",
        u64::from(t.stuck),
    )?;
    for (name, help, v) in [
        (
            "kvnode_l2_hits",
            "Objects loaded from L2 into the pool",
            t.hits,
        ),
        ("kvnode_l2_writes", "Objects written to L2", t.writes),
        (
            "kvnode_l2_errors",
            "L2 device errors (each dropped its object from L2)",
            t.errors,
        ),
        (
            "kvnode_l2_evictions",
            "Objects evicted from L2 to make room",
            t.evictions,
        ),
        (
            "kvnode_l2_skipped",
            "Objects not written to L2 (queue full, too large, no space)",
            t.skipped,
        ),
        (
            "kvnode_l2_stalled",
            "Objects not loaded because the device had not answered in time",
            t.stalled,
        ),
        (
            "kvnode_l2_written_bytes",
            "Payload bytes written to L2",
            t.bytes_written,
        ),
        (
            "kvnode_l2_read_bytes",
            "Payload bytes loaded from L2",
            t.bytes_read,
        ),
    ] {
        out.counter(name, help, v)?;
    }
    out.counters(
        "kvnode_l2_checksum_failures",
        "L2 objects that failed their checksum when loaded (dropped, never served), by cause: \
         corrupt (the medium changed them) or torn (written before an unclean stop)",
        &[
            ([("cause", "corrupt")], t.corrupt),
            ([("cause", "torn")], t.torn),
        ],
    )
}
