//! The reaper thread: drives the timer wheel in ticks of `liveness_tick_ms`.
//!
//! Windows (LMCache semantics): an instance that has pinged is reaped after `reap_timeout` of
//! silence; one that never pinged gets `registration_grace`. Any request refreshes last-seen,
//! only PING latches. Reaping releases the instance exactly like UNREGISTER (pending writes
//! deleted and freed, reads unlocked, layout reference dropped).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::Duration;

use crossbeam_queue::SegQueue;

use super::timer_wheel::{TimerId, TimerWheel};
use crate::config::NodeConfig;
use crate::modules::NodeContext;

/// Most timers the wheel holds (one per instance, plus slack for re-registrations).
const WHEEL_CAPACITY_SLACK: usize = 64;

/// Handle to the reaper. Invariant: `arm` never blocks and never touches the wheel directly.
pub struct Liveness {
    enabled: bool,
    tick_ms: u64,
    reap_timeout_ms: u64,
    grace_ms: u64,
    arm_requests: SegQueue<u64>,
    tracked: AtomicUsize,
    thread: OnceLock<Thread>,
    stop: AtomicBool,
}

impl Liveness {
    /// Builds the handle from the configuration (reaping disabled when the timeout is 0).
    pub fn new(cfg: &NodeConfig) -> Liveness {
        Liveness {
            enabled: cfg.reap_timeout_secs > 0.0,
            tick_ms: cfg.liveness_tick_ms.max(1),
            reap_timeout_ms: cfg.reap_timeout().as_millis() as u64,
            grace_ms: cfg.registration_grace().as_millis() as u64,
            arm_requests: SegQueue::new(),
            tracked: AtomicUsize::new(0),
            thread: OnceLock::new(),
            stop: AtomicBool::new(false),
        }
    }

    /// Whether reaping is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Instances with an armed timer.
    pub fn tracked(&self) -> usize {
        self.tracked.load(Ordering::Relaxed)
    }

    /// Asks the reaper to start watching an instance (idempotent).
    pub fn arm(&self, instance_id: u64) {
        if !self.enabled {
            return;
        }
        self.arm_requests.push(instance_id);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// The deadline (node-clock ms) of an instance given its stamps.
    pub fn deadline_ms(&self, last_seen_ms: u64, pinged: bool) -> u64 {
        last_seen_ms.saturating_add(if pinged {
            self.reap_timeout_ms
        } else {
            self.grace_ms
        })
    }

    /// When the reaper should next look at an instance: its deadline, but no later than one reap
    /// timeout from now, so an instance that starts pinging (switching from the long grace window
    /// to the short reap timeout) is re-examined in time without touching the wheel on PING.
    pub fn wake_ms(&self, inst: &crate::modules::instances::Instance, now_ms: u64) -> u64 {
        let d = self.deadline_ms(
            inst.last_seen_ms.load(Ordering::Relaxed),
            inst.pinged.load(Ordering::Relaxed),
        );
        d.min(now_ms.saturating_add(self.reap_timeout_ms.max(self.tick_ms)))
    }

    fn to_tick(&self, ms: u64) -> u64 {
        ms.div_ceil(self.tick_ms)
    }

    /// Stops the reaper thread.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Starts the reaper thread (none when reaping is disabled).
    pub fn spawn(ctx: &Arc<NodeContext>) -> std::io::Result<Option<JoinHandle<()>>> {
        if !ctx.liveness.enabled {
            return Ok(None);
        }
        let ctx = ctx.clone();
        thread::Builder::new()
            .name("kvnode-reaper".into())
            .spawn(move || run(&ctx))
            .map(Some)
    }
}

fn run(ctx: &NodeContext) {
    let lv = &ctx.liveness;
    let _ = lv.thread.set(thread::current());
    let mut reaper = Reaper::new(ctx);
    while !lv.stop.load(Ordering::Acquire) {
        let sleep_ms = reaper.step(ctx);
        thread::park_timeout(Duration::from_millis(sleep_ms));
    }
}

/// The reaper's state: the timer wheel and the timer of each watched instance. The thread drives
/// it in real time; the simulator calls [`Reaper::step`] after each advance of its manual clock.
/// Invariant: `timers` and the wheel hold the same set of timers.
pub struct Reaper {
    wheel: TimerWheel<u64>,
    timers: HashMap<u64, TimerId>,
    fired: Vec<(TimerId, u64, u64)>,
}

impl Reaper {
    /// An empty reaper for `ctx`'s limits, starting at `ctx`'s current time.
    pub fn new(ctx: &NodeContext) -> Reaper {
        let lv = &ctx.liveness;
        let capacity = ctx.config.limits.max_instances + WHEEL_CAPACITY_SLACK;
        Reaper {
            wheel: TimerWheel::new(lv.to_tick(ctx.now_ms()), capacity),
            timers: HashMap::new(),
            fired: Vec::new(),
        }
    }

    /// Instance ids with a timer armed (the simulator checks them against the live instances).
    pub fn watched(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.timers.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// One pass at the node's current time: takes the queued arm requests, fires the due
    /// timers, reaps the instances past their deadline and re-arms the others. Returns how long
    /// to sleep before the next pass (1..=1000 ms).
    pub fn step(&mut self, ctx: &NodeContext) -> u64 {
        let lv = &ctx.liveness;
        while let Some(id) = lv.arm_requests.pop() {
            if self.timers.contains_key(&id) {
                continue;
            }
            let Some(inst) = ctx.instances.get(id) else {
                continue;
            };
            let d = lv.deadline_ms(
                inst.last_seen_ms.load(Ordering::Relaxed),
                inst.pinged.load(Ordering::Relaxed),
            );
            match self.wheel.insert(lv.to_tick(d), id) {
                Ok(t) => {
                    self.timers.insert(id, t);
                }
                Err(_) => {
                    tracing::error!(instance = id, "liveness wheel full: instance not watched")
                }
            }
        }
        let now = ctx.now_ms();
        self.fired.clear();
        self.wheel.advance(now / lv.tick_ms, &mut self.fired);
        for (_, _, id) in std::mem::take(&mut self.fired) {
            self.timers.remove(&id);
            let Some(inst) = ctx.instances.get(id) else {
                continue;
            };
            let d = lv.deadline_ms(
                inst.last_seen_ms.load(Ordering::Relaxed),
                inst.pinged.load(Ordering::Relaxed),
            );
            if now >= d {
                tracing::warn!(
                    instance = id,
                    silent_ms = now.saturating_sub(inst.last_seen_ms.load(Ordering::Relaxed)),
                    pinged = inst.pinged.load(Ordering::Relaxed),
                    "reaping silent instance"
                );
                ctx.release(&inst, "reaped");
                ctx.counters.reaped.fetch_add(1, Ordering::Relaxed);
            } else if let Ok(t) = self.wheel.insert(lv.to_tick(lv.wake_ms(&inst, now)), id) {
                self.timers.insert(id, t);
            }
        }
        lv.tracked.store(self.timers.len(), Ordering::Relaxed);
        self.wheel.next_deadline().map_or(1000, |t| {
            (t * lv.tick_ms).saturating_sub(now).clamp(1, 1000)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_follow_ping_latch() {
        let cfg = NodeConfig {
            reap_timeout_secs: 120.0,
            registration_grace_secs: 3600.0,
            ..NodeConfig::default()
        };
        let lv = Liveness::new(&cfg);
        assert!(lv.enabled());
        assert_eq!(lv.deadline_ms(1_000, true), 121_000, "pinged: reap timeout");
        assert_eq!(
            lv.deadline_ms(1_000, false),
            3_601_000,
            "never pinged: grace"
        );
        assert_eq!(lv.deadline_ms(u64::MAX - 5, true), u64::MAX, "no overflow");
        assert_eq!(lv.to_tick(1), 1, "deadlines round up to the next tick");
        assert_eq!(lv.to_tick(100), 1);
        assert_eq!(lv.to_tick(101), 2);
        let off = Liveness::new(&NodeConfig {
            reap_timeout_secs: 0.0,
            ..NodeConfig::default()
        });
        assert!(!off.enabled());
        off.arm(1); // no thread, no queueing
        assert!(off.arm_requests.is_empty());
    }
}
