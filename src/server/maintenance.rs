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
/// (an intern was refused at the limit, or [`near_limit`] namespaces are held, so the first new
/// namespace is not refused)...
const RECLAIM_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// ...and at least this often regardless.
const RECLAIM_EVERY: Duration = Duration::from_secs(600);
/// After a reclaim that freed nothing, the near-the-limit rule asks again only once more
/// namespaces are held than after it, or when this much time has passed: namespaces that are
/// really in use would otherwise be scanned for every second.
const RECLAIM_BACKOFF: Duration = Duration::from_secs(60);

/// The held count from which the maintenance thread reclaims before any intern is refused:
/// 90 % of `limit`, and at least one below it (so the first new namespace finds room), but at
/// least 1 (a limit of 1 reclaims once its one namespace is held).
fn near_limit(limit: usize) -> usize {
    limit.saturating_sub((limit / 10).max(1)).max(1)
}

/// When the maintenance thread reclaims namespaces. Invariant: `backoff` is `Some(held)` exactly
/// when the last reclaim freed nothing, `held` being the count it left.
#[derive(Debug)]
struct ReclaimSchedule {
    last: Instant,
    backoff: Option<usize>,
}

impl ReclaimSchedule {
    fn new(now: Instant) -> ReclaimSchedule {
        ReclaimSchedule {
            last: now,
            backoff: None,
        }
    }

    /// Whether to reclaim at `now`, with `held` of `limit` namespaces held. `refused` (whether an
    /// intern was refused at the limit since it was last asked) is asked only once
    /// [`RECLAIM_MIN_INTERVAL`] has passed, so a refusal is never lost.
    fn due(&self, now: Instant, refused: impl FnOnce() -> bool, held: usize, limit: usize) -> bool {
        let since = now.saturating_duration_since(self.last);
        if since >= RECLAIM_EVERY {
            return true;
        }
        if since < RECLAIM_MIN_INTERVAL {
            return false;
        }
        if refused() {
            return true;
        }
        if held < near_limit(limit) {
            return false;
        }
        match self.backoff {
            Some(held_then) => held > held_then || since >= RECLAIM_BACKOFF,
            None => true,
        }
    }

    /// Records a reclaim at `now` that freed `freed` namespaces and left `held`.
    fn ran(&mut self, now: Instant, freed: usize, held: usize) {
        self.last = now;
        self.backoff = (freed == 0).then_some(held);
    }
}

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
    let mut reclaims = ReclaimSchedule::new(Instant::now());
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
        let ns = &ctx.namespaces;
        if reclaims.due(
            Instant::now(),
            || ns.take_reclaim_wanted(),
            ns.len(),
            ns.limit(),
        ) {
            let freed = ctx.reclaim_namespaces();
            reclaims.ran(Instant::now(), freed, ns.len());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_limit_leaves_room_for_one_more_namespace_even_for_small_limits() {
        assert_eq!(near_limit(1000), 900);
        assert_eq!(near_limit(100), 90);
        assert_eq!(near_limit(10), 9);
        // `limit / 10 * 9` was 0 here: every tick wanted a reclaim.
        assert_eq!(near_limit(9), 8);
        assert_eq!(near_limit(5), 4);
        assert_eq!(near_limit(2), 1);
        assert_eq!(near_limit(1), 1);
        for limit in 1..100 {
            assert!(near_limit(limit) >= 1 && near_limit(limit) <= limit);
        }
    }

    /// Near the limit with every namespace really in use: one reclaim, then none until more
    /// are held or the back-off has passed (it used to run every second); a refused intern
    /// still gets one at once.
    #[test]
    fn a_reclaim_that_freed_nothing_backs_off() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut r = ReclaimSchedule::new(t0);
        let no = || false;
        assert!(
            !r.due(at(0), no, 95, 100),
            "not before the minimum interval"
        );
        assert!(!r.due(at(2), no, 50, 100), "far from the limit");
        assert!(r.due(at(2), no, 95, 100), "near the limit");
        r.ran(at(2), 0, 95);
        for s in 4..60 {
            assert!(!r.due(at(s), no, 95, 100), "backed off at {s} s");
        }
        assert!(r.due(at(10), no, 96, 100), "one more namespace held");
        assert!(r.due(at(10), || true, 95, 100), "an intern was refused");
        assert!(r.due(at(62), no, 95, 100), "the back-off passed");
        r.ran(at(62), 3, 92);
        assert!(r.due(at(64), no, 92, 100), "it freed some: no back-off");
        r.ran(at(64), 0, 92);
        assert!(!r.due(at(70), no, 92, 100));
        assert!(r.due(at(64 + 600), no, 0, 100), "the periodic reclaim");
        // A small limit: below it nothing is wanted (the old threshold, 0, wanted it always).
        let r = ReclaimSchedule::new(t0);
        assert!(!r.due(at(5), no, 0, 5));
        assert!(!r.due(at(5), no, 3, 5));
        assert!(r.due(at(5), no, 4, 5));
    }

    /// `refused` is asked only once the minimum interval passed: a refusal seen early is not
    /// consumed and lost.
    #[test]
    fn a_refusal_is_not_consumed_before_the_minimum_interval() {
        let t0 = Instant::now();
        let r = ReclaimSchedule::new(t0);
        let asked = std::cell::Cell::new(false);
        assert!(!r.due(
            t0,
            || {
                asked.set(true);
                true
            },
            0,
            100
        ));
        assert!(!asked.get());
    }
}
