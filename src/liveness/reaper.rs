//! The reaper: drives the timer wheel in ticks of `liveness_tick_ms`.
//!
//! Windows (LMCache semantics): an instance that has pinged is reaped after `reap_timeout` of
//! silence; one that never pinged gets `registration_grace`. Any request refreshes last-seen,
//! only PING latches. Reaping releases the instance exactly like UNREGISTER (pending writes
//! deleted and freed, reads unlocked, layout reference dropped).
//!
//! The hot path never touches the wheel: a request only stores "last seen". Each instance
//! registration (an id and its generation) has exactly one timer, armed at registration and
//! cancelled at release, set no later than its deadline and no later than one reap timeout ahead
//! (so an instance that starts pinging, moving from the long grace to the short timeout, is seen
//! in time). When the timer fires, the reaper compares the deadline with last-seen and re-arms
//! or reaps.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::Duration;

use crossbeam_queue::SegQueue;

use super::timer_wheel::{TimerId, TimerWheel};
use crate::config::NodeConfig;

/// Timers the wheel holds beyond `max_instances` (a release and a new registration may briefly
/// overlap before the reaper sees the cancellation).
const WHEEL_CAPACITY_SLACK: usize = 64;
/// Longest the reaper sleeps between passes.
const MAX_SLEEP_MS: u64 = 1000;

/// One instance registration as the reaper sees it: an id, a generation unique to the
/// registration, and the stamps the request path keeps (last seen, whether it ever pinged).
pub trait Watched {
    /// The instance id.
    fn id(&self) -> u64;
    /// The registration's generation (never reused by another registration).
    fn generation(&self) -> u64;
    /// Node-clock ms of its last request.
    fn last_seen_ms(&self) -> u64;
    /// Whether it ever pinged (latched).
    fn pinged(&self) -> bool;
}

/// What the reaper needs from the node: the clock, the live registrations, and a way to release
/// one. The node's context implements it; the liveness layer imports nothing above it.
pub trait Registrations {
    /// A registration.
    type Registration: Watched;
    /// The liveness handle (windows, commands, stop flag).
    fn liveness(&self) -> &Liveness;
    /// The node clock in ms.
    fn now_ms(&self) -> u64;
    /// Most registrations the node holds at once (the wheel holds that many timers and slack).
    fn max_registrations(&self) -> usize;
    /// Registration `generation` of instance `id`, if it is still registered and not released.
    fn live(&self, id: u64, generation: u64) -> Option<Arc<Self::Registration>>;
    /// Releases a silent registration exactly like UNREGISTER (pending writes freed, never
    /// published; reads unlocked) and counts it as reaped.
    fn reap(&self, registration: &Arc<Self::Registration>);
}

/// A request to the reaper about one instance registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    /// Start watching (`id`, `generation`).
    Arm(u64, u64),
    /// Stop watching it (released).
    Disarm(u64, u64),
}

/// Handle to the reaper. Invariant: `arm`/`disarm` never block and never touch the wheel
/// directly; the reaper applies them in the order they were made.
pub struct Liveness {
    enabled: bool,
    tick_ms: u64,
    reap_timeout_ms: u64,
    grace_ms: u64,
    commands: SegQueue<Command>,
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
            commands: SegQueue::new(),
            tracked: AtomicUsize::new(0),
            thread: OnceLock::new(),
            stop: AtomicBool::new(false),
        }
    }

    /// Whether reaping is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Instance registrations with an armed timer.
    pub fn tracked(&self) -> usize {
        self.tracked.load(Ordering::Relaxed)
    }

    /// Asks the reaper to start watching a new registration.
    pub fn arm(&self, inst: &impl Watched) {
        self.command(Command::Arm(inst.id(), inst.generation()));
    }

    /// Asks the reaper to stop watching a released registration (its timer is cancelled).
    pub fn disarm(&self, inst: &impl Watched) {
        self.command(Command::Disarm(inst.id(), inst.generation()));
    }

    fn command(&self, c: Command) {
        if !self.enabled {
            return;
        }
        self.commands.push(c);
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
    pub fn wake_ms(&self, inst: &impl Watched, now_ms: u64) -> u64 {
        let d = self.deadline_ms(inst.last_seen_ms(), inst.pinged());
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
    pub fn spawn<R>(ctx: &Arc<R>) -> std::io::Result<Option<JoinHandle<()>>>
    where
        R: Registrations + Send + Sync + 'static,
    {
        if !ctx.liveness().enabled {
            return Ok(None);
        }
        let ctx = ctx.clone();
        thread::Builder::new()
            .name("kvnode-reaper".into())
            .spawn(move || run(&*ctx))
            .map(Some)
    }
}

fn run<R: Registrations>(ctx: &R) {
    let lv = ctx.liveness();
    let _ = lv.thread.set(thread::current());
    let mut reaper = Reaper::new(ctx);
    while !lv.stop.load(Ordering::Acquire) {
        let sleep_ms = reaper.step(ctx);
        thread::park_timeout(Duration::from_millis(sleep_ms));
    }
}

/// The reaper's state: the timer wheel and the timer of each watched registration. The thread
/// drives it in real time; the simulator calls [`Reaper::step`] after each advance of its manual
/// clock. Invariant: `timers` and the wheel hold the same timers, one per watched generation,
/// and after a step every live registration is watched (or waits in `unarmed` while the wheel is
/// full) and no released one is.
pub struct Reaper {
    wheel: TimerWheel<(u64, u64)>,
    /// generation -> (instance id, its timer).
    timers: BTreeMap<u64, (u64, TimerId)>,
    /// Registrations that could not be armed (wheel full): retried every pass.
    unarmed: BTreeMap<u64, u64>,
    fired: Vec<(TimerId, u64, (u64, u64))>,
}

impl Reaper {
    /// An empty reaper for `ctx`'s limits, starting at `ctx`'s current time.
    pub fn new(ctx: &impl Registrations) -> Reaper {
        let lv = ctx.liveness();
        let capacity = ctx.max_registrations() + WHEEL_CAPACITY_SLACK;
        Reaper {
            wheel: TimerWheel::new(lv.to_tick(ctx.now_ms()), capacity),
            timers: BTreeMap::new(),
            unarmed: BTreeMap::new(),
            fired: Vec::new(),
        }
    }

    /// Instance ids with a timer armed, sorted (the simulator checks them against the live
    /// instances).
    pub fn watched(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.timers.values().map(|(id, _)| *id).collect();
        v.sort_unstable();
        v
    }

    /// The registration of `id` if it is still `generation` and not released.
    fn schedule<W: Watched>(&mut self, lv: &Liveness, inst: &W, now: u64) {
        let tick = lv.to_tick(lv.wake_ms(inst, now));
        match self.wheel.insert(tick, (inst.id(), inst.generation())) {
            Ok(t) => {
                self.unarmed.remove(&inst.generation());
                self.timers.insert(inst.generation(), (inst.id(), t));
            }
            Err(_) => {
                if self.unarmed.insert(inst.generation(), inst.id()).is_none() {
                    tracing::error!(
                        instance = inst.id(),
                        capacity = self.wheel.capacity(),
                        "liveness wheel full: instance not watched yet (retried every pass)"
                    );
                }
            }
        }
    }

    fn apply_commands(&mut self, ctx: &impl Registrations, now: u64) {
        while let Some(c) = ctx.liveness().commands.pop() {
            match c {
                Command::Arm(id, generation) => {
                    if self.timers.contains_key(&generation) {
                        continue;
                    }
                    if let Some(inst) = ctx.live(id, generation) {
                        self.schedule(ctx.liveness(), &*inst, now);
                    }
                }
                Command::Disarm(_, generation) => {
                    self.unarmed.remove(&generation);
                    if let Some((_, t)) = self.timers.remove(&generation) {
                        self.wheel.cancel(t);
                    }
                }
            }
        }
    }

    /// One pass at the node's current time: applies the queued arm and disarm requests in
    /// order, fires the due timers, reaps the registrations past their deadline and re-arms the
    /// others. Returns how long to sleep before the next pass (1..=1000 ms).
    pub fn step(&mut self, ctx: &impl Registrations) -> u64 {
        let lv = ctx.liveness();
        let now = ctx.now_ms();
        self.apply_commands(ctx, now);
        let retry: Vec<(u64, u64)> = self.unarmed.iter().map(|(g, id)| (*id, *g)).collect();
        for (id, generation) in retry {
            match ctx.live(id, generation) {
                Some(inst) => self.schedule(lv, &*inst, now),
                None => {
                    self.unarmed.remove(&generation);
                }
            }
        }
        let mut fired = std::mem::take(&mut self.fired);
        fired.clear();
        self.wheel.advance(now / lv.tick_ms, &mut fired);
        for (_, _, (id, generation)) in fired.drain(..) {
            self.timers.remove(&generation);
            let Some(inst) = ctx.live(id, generation) else {
                continue;
            };
            let d = lv.deadline_ms(inst.last_seen_ms(), inst.pinged());
            if now >= d {
                tracing::warn!(
                    instance = id,
                    silent_ms = now.saturating_sub(inst.last_seen_ms()),
                    pinged = inst.pinged(),
                    "reaping silent instance"
                );
                ctx.reap(&inst);
            } else {
                self.schedule(lv, &*inst, now);
            }
        }
        self.fired = fired;
        // Releases during this pass queued their cancellations: apply them now, so the count
        // below is exact.
        self.apply_commands(ctx, now);
        lv.tracked.store(self.timers.len(), Ordering::Relaxed);
        self.wheel.next_deadline().map_or(MAX_SLEEP_MS, |t| {
            t.saturating_mul(lv.tick_ms)
                .saturating_sub(now)
                .clamp(1, MAX_SLEEP_MS)
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
        off.command(Command::Arm(1, 1)); // no thread, no queueing
        assert!(off.commands.is_empty());
    }
}
