//! The maintenance thread: drains the event bus, runs the watermark eviction pass, and the TTL
//! safety nets (lock expiry, idle lookup sessions). None of this is on the request path.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::config::WritePolicy;
use crate::modules::events::Event;
use crate::modules::NodeContext;

const TICK: Duration = Duration::from_millis(100);
const EVICTION_EVERY: Duration = Duration::from_secs(1);
const EVENTS_PER_TICK: usize = 4096;
/// Namespace reclaims (a scan of every index, O(objects)) run at most this often when wanted
/// (an intern was refused at the limit, or 90 % of the limit is held, so the first new
/// namespace is not refused)...
const RECLAIM_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// ...and at least this often regardless.
const RECLAIM_EVERY: Duration = Duration::from_secs(600);

/// Starts the thread; it exits when the node shuts down.
pub fn spawn(ctx: &Arc<NodeContext>) -> std::io::Result<JoinHandle<()>> {
    let ctx = ctx.clone();
    thread::Builder::new()
        .name("kvnode-maintenance".into())
        .spawn(move || run(&ctx))
}

fn ttl_sweep_interval(ctx: &NodeContext) -> Duration {
    let shortest = ctx
        .config
        .read_ttl_secs
        .min(ctx.config.write_ttl_secs)
        .min(ctx.config.session_ttl_secs);
    Duration::from_secs((shortest / 8).clamp(1, 60))
}

fn run(ctx: &NodeContext) {
    let mut last_evict = Instant::now();
    let mut last_ttl = Instant::now();
    let mut last_reclaim = Instant::now();
    let ttl_every = ttl_sweep_interval(ctx);
    while !ctx.shutting_down.load(Ordering::Acquire) {
        thread::sleep(TICK);
        ctx.events.drain(EVENTS_PER_TICK, |e| match e {
            Event::BlockAllocation {
                instance_id,
                model,
                records,
                new_blocks,
            } => tracing::debug!(instance_id, %model, records, new_blocks, "block allocation"),
            Event::InstanceReleased {
                instance_id,
                reason,
            } => {
                tracing::debug!(instance_id, reason, "instance released")
            }
        });
        // With L2 on-evict, the L2 writer thread evicts (each object after writing it).
        let demoting = ctx
            .l2
            .as_ref()
            .is_some_and(|l2| l2.policy() == WritePolicy::OnEvict);
        if !demoting && last_evict.elapsed() >= EVICTION_EVERY {
            last_evict = Instant::now();
            let n = ctx.storage.evict_to_watermark();
            if n > 0 {
                tracing::debug!(evicted = n, "watermark eviction");
            }
        }
        if last_ttl.elapsed() >= ttl_every {
            last_ttl = Instant::now();
            ttl_sweep(ctx);
        }
        let since = last_reclaim.elapsed();
        let ns = &ctx.namespaces;
        let wanted = since >= RECLAIM_MIN_INTERVAL
            && (ns.take_reclaim_wanted() || ns.len() >= ns.limit() / 10 * 9);
        if wanted || since >= RECLAIM_EVERY {
            last_reclaim = Instant::now();
            ctx.reclaim_namespaces();
        }
    }
}

/// The TTL safety nets, in order: prepared transfers never committed (released and freed),
/// expired object locks, idle lookup sessions (their locks released). The maintenance thread
/// runs it every few seconds; the simulator runs it on its own schedule.
pub fn ttl_sweep(ctx: &NodeContext) {
    let (pw, pr) = ctx.expire_pending();
    if pw + pr > 0 {
        tracing::warn!(
            expired_prepared_stores = pw,
            expired_prepared_retrieves = pr,
            "prepared transfers never committed: released by the TTL safety net"
        );
    }
    let (w, r) = ctx.storage.expire_locks(ctx.storage.now_ms());
    if w + r > 0 {
        tracing::warn!(
            expired_writes = w,
            expired_reads = r,
            "lock TTL expired (a client forgot to commit)"
        );
    }
    let cutoff = ctx
        .now_ms()
        .saturating_sub(ctx.config.session_ttl_secs.saturating_mul(1000));
    let expired = ctx.sessions.expire(cutoff);
    for s in &expired {
        crate::modules::lookup::release_session(ctx, s);
    }
    if !expired.is_empty() {
        tracing::debug!(sessions = expired.len(), "idle lookup sessions dropped");
    }
}
