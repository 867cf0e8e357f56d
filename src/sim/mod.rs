//! A deterministic simulator of the node's request-level semantics, in the manner of
//! TigerBeetle's VOPR: simulated engine workers (native clients and LMCache clients through the
//! real frontend) and schedulers issue random interleavings of every request type against the
//! real `modules`, `storage`, `liveness` and `lmcache` code, on a manual clock, with faults
//! (disconnects, silent deaths, CLEAR, eviction pressure, clock jumps across every TTL and reap
//! deadline). After every step a reference model of what each client was promised is checked
//! against the node (see [`model::Model::check`] and [`Sim::check`]). A run is a pure function of
//! its seed: a failure prints the seed, and the seed reproduces it.
//!
//! This file holds the run's options, results and step loop; `native` and `lm` drive the
//! clients, `releases` follows instance releases, and `check` holds the per-step checks.

mod check;
pub mod l2;
mod lm;
mod lm_disconnect;
pub mod model;
mod native;
mod releases;
mod remote;
pub mod rng;
pub mod world;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use self::model::Model;
use self::rng::Rng;
use self::world::{Prompts, GRACE_MS, REAP_TIMEOUT_MS};
use crate::clock::Clock;
use crate::liveness::reaper::Reaper;
use crate::lmcache::frontend::LmFrontend;
use crate::modules::instances::Instance;
use crate::modules::NodeContext;

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// The seed; everything else follows from it.
    pub seed: u64,
    /// Steps (one request or one fault each).
    pub steps: u64,
    /// Native engine workers.
    pub native_instances: usize,
    /// LMCache engine workers (through the real frontend).
    pub lmcache_instances: usize,
    /// Remote engine workers (WRITE_SLOTS / READ_SLOTS over a fake fabric with faults).
    pub remote_instances: usize,
    /// Whether remote workers also start data ops on transfers so close to their TTL that the
    /// op may still be in flight when the TTL passes (off: they give such transfers up). On,
    /// it reproduces the storage lock TTL freeing slots under a fabric op (see
    /// `remote::repro`).
    pub remote_late: bool,
    /// Distinct prompts.
    pub prompts: usize,
    /// Steps of history printed with a failure.
    pub trace: usize,
    /// Checks not to run (to look past a known failure): `memcheck`, `slots`, `bytes`,
    /// `locks`, `reaper`, `wheel`, `namespaces`, `owners`, `sessions`, `quotas`, `inflight`
    /// (remote ops' pool ranges), `settle` (a remote op's outcome when it settles).
    pub skip: Vec<String>,
}

impl SimOptions {
    /// The default shape of a run for `seed`.
    pub fn new(seed: u64) -> SimOptions {
        SimOptions {
            seed,
            steps: 4_000,
            native_instances: 5,
            lmcache_instances: 3,
            remote_instances: 3,
            remote_late: false,
            prompts: 12,
            trace: 40,
            skip: Vec::new(),
        }
    }
}

/// Counters of one finished run.
#[derive(Debug, Clone, Default)]
pub struct SimStats {
    /// Steps run.
    pub steps: u64,
    /// Requests sent to the node.
    pub requests: u64,
    /// Stores committed with at least one object.
    pub stores_committed: u64,
    /// Retrieves that hit (bytes verified at prepare and commit).
    pub retrieves_hit: u64,
    /// Retrieve locks adopted from a lookup session (the path of defects 1 and 3).
    pub adopted: u64,
    /// Lookups run.
    pub lookups: u64,
    /// Instances reaped by the liveness wheel.
    pub reaped: u64,
    /// Instances released by disconnect.
    pub disconnected: u64,
    /// CLEARs.
    pub clears: u64,
    /// Requests naming what another client created (all refused or finding nothing).
    pub intrusions: u64,
    /// Transfers whose TTL passed while the client held them.
    pub expired: u64,
    /// Silent workers replaced by a new process after their instance was reaped.
    pub revived: u64,
    /// LMCache workers that crashed and restarted under the same id before being reaped.
    pub lm_restarts: u64,
    /// LMCache connections closed (workers and schedulers).
    pub lm_disconnects: u64,
    /// LMCache instances the frontend released after their connection closed.
    pub lm_disconnect_releases: u64,
    /// LMCache instances taken over by a new connection after their owner's closed.
    pub lm_adoptions: u64,
    /// LMCache workers that reconnected with their own routing id and kept their instance
    /// (the frontend's `reconnects`, checked against the simulator's count).
    pub lm_reconnects: u64,
    /// xxh3 of every trace line: equal for two runs of one seed, or the run is not deterministic.
    pub trace_digest: u64,
    /// Simulated milliseconds.
    pub sim_ms: u64,
    /// Lookup sessions evicted to keep within the session count and byte limits.
    pub sessions_evicted: u64,
    /// Remote data ops posted to the fabric.
    pub remote_ops: u64,
    /// Remote stores committed (by WRITE_SLOTS or a later COMMIT_STORE).
    pub remote_stores_committed: u64,
    /// Remote retrieves whose delivered bytes were verified.
    pub remote_reads_verified: u64,
    /// Remote data ops that failed (error, peer death, deadline, teardown).
    pub remote_ops_failed: u64,
    /// Remote data ops settled after their instance was released.
    pub remote_settled_released: u64,
    /// Remote data ops that missed their deadline.
    pub remote_deadline_misses: u64,
    /// Remote data ops refused for their descriptors.
    pub remote_refused: u64,
}

/// A failed run: the first broken invariant, where, and the steps leading to it.
#[derive(Debug, Clone)]
pub struct SimFailure {
    /// The seed that reproduces it.
    pub seed: u64,
    /// The step at which a check failed.
    pub step: u64,
    /// What broke.
    pub message: String,
    /// The last steps before it, oldest first.
    pub trace: Vec<String>,
    /// A failure of the L2 tier simulator ([`l2`]), not the request-level one.
    pub l2: bool,
    /// Steps that reproduce it.
    pub reproduce_steps: u64,
}

impl std::fmt::Display for SimFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let l2 = if self.l2 { "L2 " } else { "" };
        writeln!(
            f,
            "{l2}seed {} failed at step {}: {}",
            self.seed, self.step, self.message
        )?;
        writeln!(f, "last steps:")?;
        for t in &self.trace {
            writeln!(f, "  {t}")?;
        }
        let flag = if self.l2 { "--l2 " } else { "" };
        write!(
            f,
            "reproduce: scripts/simulate.sh {flag}--seed {} --steps {}",
            self.seed, self.reproduce_steps
        )
    }
}

/// Liveness stamps the model keeps for a registered instance.
pub(crate) struct Registration {
    /// The node's instance object (a release is seen as the table no longer holding it).
    pub inst: Arc<Instance>,
    /// Last request naming the instance.
    pub last_seen_ms: u64,
    /// Whether it ever pinged.
    pub pinged: bool,
    /// The hidden size it registered with.
    pub hidden: u32,
    /// Connections that registered this instance object and are still open (native only).
    pub conns: Vec<u64>,
    /// When the connection owning it (LMCache) closed with nobody taking it over, and whether
    /// it had pinged then: the frontend must release it within its disconnect countdown.
    pub closed_ms: Option<(u64, bool)>,
}

impl Registration {
    fn deadline_ms(&self) -> u64 {
        self.last_seen_ms
            + if self.pinged {
                REAP_TIMEOUT_MS
            } else {
                GRACE_MS
            }
    }
}

/// The running simulation.
pub struct Sim {
    opts: SimOptions,
    rng: Rng,
    clock: Clock,
    ctx: Arc<NodeContext>,
    reaper: Reaper,
    frontend: LmFrontend,
    prompts: Prompts,
    model: Model,
    natives: Vec<native::NativeActor>,
    lms: Vec<lm::LmActor>,
    remote: remote::RemoteWorld,
    schedulers: Vec<native::Conn>,
    /// A scheduler of another user (an allowed client, not an admin).
    foreign: native::Conn,
    trace: VecDeque<String>,
    digest: xxhash_rust::xxh3::Xxh3,
    step: u64,
    next_conn: u64,
    next_request: u64,
    /// (model, salt) -> last time a request named it.
    named: HashMap<(String, String), u64>,
    /// Recent lookups: (session id, model, salt, prompt, hit chunks), newest last (retrieves
    /// mostly follow one, as engines do).
    lookups: VecDeque<(String, &'static str, &'static str, usize, u32)>,
    /// The scheduler connection whose LOOKUP created each live session `s*` (the node's own
    /// user's name space); a session of another connection refuses FREE, END and LOOKUP.
    session_creators: std::collections::BTreeMap<String, u64>,
    /// Incarnation of the LMCache scheduler's connection (a closed one reconnects anew).
    lm_scheduler: u32,
    /// Connections of LMCache schedulers that closed: none of their sessions may hold a lock.
    closed_schedulers: Vec<crate::lmcache::frontend::ClientId>,
    stats: SimStats,
}

type Check = Result<(), String>;

/// Runs one seed to the end or to its first broken invariant.
pub fn run(opts: &SimOptions) -> Result<SimStats, SimFailure> {
    let mut sim = Sim::new(opts.clone());
    let fail = |sim: &Sim, message: String| SimFailure {
        seed: opts.seed,
        step: sim.step,
        message,
        trace: sim.trace.iter().cloned().collect(),
        l2: false,
        reproduce_steps: sim.step + 1,
    };
    for _ in 0..opts.steps {
        if let Err(message) = sim.step() {
            return Err(fail(&sim, message));
        }
    }
    // Every remote connection is torn down: every data op must drain.
    if let Err(message) = sim.remote_drain() {
        return Err(fail(&sim, format!("[drain] {message}")));
    }
    sim.stats.steps = sim.step;
    sim.stats.sim_ms = sim.clock.now_ms();
    sim.stats.trace_digest = sim.digest.digest();
    sim.stats.adopted = sim
        .ctx
        .counters
        .adopted_locks
        .load(std::sync::atomic::Ordering::Relaxed);
    sim.stats.sessions_evicted = sim.ctx.sessions.evicted();
    let d = sim.frontend.disconnect_counters();
    sim.stats.lm_disconnect_releases = d.releases.load(std::sync::atomic::Ordering::Relaxed);
    sim.stats.lm_adoptions = d.adoptions.load(std::sync::atomic::Ordering::Relaxed);
    sim.stats.lm_reconnects = d.reconnects.load(std::sync::atomic::Ordering::Relaxed);
    Ok(sim.stats)
}

impl Sim {
    fn new(opts: SimOptions) -> Sim {
        let clock = Clock::manual(1_000);
        let ctx = world::build_node(&clock);
        let reaper = Reaper::new(&*ctx);
        let frontend = LmFrontend::new(ctx.clone());
        let mut rng = Rng::new(opts.seed);
        let prompts = Prompts::new(opts.prompts, rng.next_u64());
        let natives = (0..opts.native_instances)
            .map(|i| native::NativeActor::new(1 + i as u64, world::MODELS[i % 2]))
            .collect();
        let lms = (0..opts.lmcache_instances)
            .map(|i| lm::LmActor::new(1001 + i as u64))
            .collect();
        let remote = remote::RemoteWorld::new(opts.remote_instances, opts.seed, &ctx);
        let mut sim = Sim {
            rng,
            clock,
            ctx,
            reaper,
            frontend,
            prompts,
            model: Model::default(),
            natives,
            lms,
            remote,
            schedulers: Vec::new(),
            foreign: native::foreign_conn(u64::MAX - 7),
            trace: VecDeque::new(),
            digest: xxhash_rust::xxh3::Xxh3::new(),
            step: 0,
            next_conn: 1,
            next_request: 1,
            named: HashMap::new(),
            lookups: VecDeque::new(),
            session_creators: Default::default(),
            lm_scheduler: 0,
            closed_schedulers: Vec::new(),
            stats: SimStats::default(),
            opts,
        };
        sim.schedulers = (0..2).map(|_| sim.new_conn()).collect();
        if !sim.remote.actors.is_empty() {
            let faults = sim.remote.faults.clone();
            sim.log(format!("remote fabric faults: {faults}"));
        }
        sim
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Whether check `name` runs.
    fn on(&self, name: &str) -> bool {
        !self.opts.skip.iter().any(|s| s == name)
    }

    fn log(&mut self, what: String) {
        if self.trace.len() >= self.opts.trace {
            self.trace.pop_front();
        }
        let line = format!("#{} t={} {what}", self.step, self.now());
        self.digest.update(line.as_bytes());
        self.trace.push_back(line);
    }

    fn new_conn(&mut self) -> native::Conn {
        self.next_conn += 1;
        native::Conn::new(self.next_conn)
    }

    fn request_id(&mut self) -> u64 {
        self.next_request += 1;
        self.next_request
    }

    fn remember_lookup(
        &mut self,
        session: String,
        model: &'static str,
        salt: &'static str,
        p: usize,
        hits: u32,
    ) {
        if self.lookups.len() >= 16 {
            self.lookups.pop_front();
        }
        self.lookups.push_back((session, model, salt, p, hits));
    }

    fn named(&mut self, model: &str, salt: &str) {
        let now = self.now();
        self.named.insert((model.to_owned(), salt.to_owned()), now);
    }

    /// One step: a request from a random client, or a fault, then the node's timers, then every
    /// check.
    fn step(&mut self) -> Check {
        self.step += 1;
        self.stats.expired += self.model.expire(self.now()) as u64;
        let natives = if self.natives.is_empty() { 0 } else { 55 };
        let lms = if self.lms.is_empty() { 0 } else { 25 };
        let remotes = if self.remote.actors.is_empty() { 0 } else { 40 };
        match self
            .rng
            .weighted(&[natives * 4, lms * 4, 32, 24, 16, 1, remotes * 4])
        {
            0 => {
                let i = self.rng.index(self.natives.len());
                self.native_step(i)?;
            }
            1 => {
                let i = self.rng.index(self.lms.len());
                self.lm_step(i)?;
            }
            2 if self.rng.chance(10) => self.foreign_step()?,
            2 => self.scheduler_step()?,
            3 => self.advance_clock(),
            4 => self.maintenance()?,
            5 => self.clear()?,
            _ => {
                let i = self.rng.index(self.remote.actors.len());
                self.remote_step(i)?;
            }
        }
        // The fabric's completions: data ops settle (the mover's part); deadlines and peer
        // deaths close connections.
        self.remote_progress()?;
        // The frontend's sweeper: closes seen, countdowns ended.
        let released = self.frontend.sweep_disconnects();
        if released > 0 {
            self.log(format!(
                "{released} LMCache instance(s) released after their connection closed"
            ));
        }
        self.reaper.step(&*self.ctx);
        self.observe_releases()?;
        self.check()
    }

    fn advance_clock(&mut self) {
        let ms = match self.rng.weighted(&[60, 30, 10]) {
            0 => self.rng.range(1, 300),
            1 => self.rng.range(500, 4_000),
            _ => self.rng.range(5_000, 25_000),
        };
        self.clock.advance(ms);
        self.log(format!("advance clock by {ms} ms"));
    }

    fn maintenance(&mut self) -> Check {
        crate::server::maintenance::ttl_sweep(&self.ctx);
        self.ctx.reclaim_namespaces();
        let evicted = self.ctx.storage.evict_to_watermark();
        self.log(format!("maintenance (TTL sweep, {evicted} evicted)"));
        self.check_namespaces_reclaimed()
    }

    fn clear(&mut self) -> Check {
        self.model.clear_epoch += 1;
        self.stats.clears += 1;
        let conn = self.schedulers[0].clone();
        let resp = self.native_call(&conn, crate::protocol::Request::Clear);
        self.log(format!("CLEAR -> {resp:?}"));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds the CI test runs.
    const SMOKE_SEEDS: u64 = 16;

    /// The bounded CI run: a few seeds of the local client kinds (the remote workers' run is
    /// `remote::tests`, with native and LMCache workers beside them); `scripts/simulate.sh`
    /// runs many seeds of every kind at once.
    #[test]
    fn simulator_seeds_hold_every_invariant() {
        let mut total = SimStats::default();
        for seed in 1..=SMOKE_SEEDS {
            let opts = SimOptions {
                steps: 1_500,
                remote_instances: 0,
                ..SimOptions::new(seed)
            };
            match run(&opts) {
                Ok(s) => {
                    assert!(
                        s.stores_committed > 0 && s.retrieves_hit > 0,
                        "seed {seed} exercised too little: {s:?}"
                    );
                    total.retrieves_hit += s.retrieves_hit;
                    total.adopted += s.adopted;
                    total.reaped += s.reaped;
                    total.lm_restarts += s.lm_restarts;
                    total.sessions_evicted += s.sessions_evicted;
                    total.lm_disconnects += s.lm_disconnects;
                    total.lm_disconnect_releases += s.lm_disconnect_releases;
                    total.lm_adoptions += s.lm_adoptions;
                    total.lm_reconnects += s.lm_reconnects;
                }
                Err(f) => panic!("{f}"),
            }
        }
        // Coverage floor: the paths the defects lived on are exercised every run.
        assert!(total.retrieves_hit >= 40 * SMOKE_SEEDS, "{total:?}");
        assert!(total.adopted >= 5 * SMOKE_SEEDS, "{total:?}");
        assert!(total.reaped > 0 && total.lm_restarts > 0, "{total:?}");
        assert!(total.sessions_evicted > 0, "{total:?}");
        assert!(
            total.lm_disconnect_releases > 0 && total.lm_adoptions > 0 && total.lm_reconnects > 0,
            "connection closes exercised: {total:?}"
        );
    }

    /// A seed reproduces exactly (same steps, requests and simulated time).
    #[test]
    fn a_seed_reproduces_exactly() {
        let opts = SimOptions {
            steps: 600,
            ..SimOptions::new(77)
        };
        let a = run(&opts).expect("seed 77 passes");
        let b = run(&opts).expect("seed 77 passes");
        assert_eq!(a.trace_digest, b.trace_digest, "the traces differ");
        assert_eq!(
            (a.requests, a.sim_ms, a.stores_committed, a.retrieves_hit),
            (b.requests, b.sim_ms, b.stores_committed, b.retrieves_hit)
        );
        assert!(a.stores_committed > 0 && a.retrieves_hit > 0, "{a:?}");
    }

    /// The checks can fail: a node that publishes a store without its COMMIT is caught.
    #[test]
    fn the_model_catches_an_object_published_without_commit() {
        let mut sim = Sim::new(SimOptions::new(3));
        let mut found = false;
        for _ in 0..2_000 {
            sim.step().expect("clean run");
            // Sabotage: publish the first prepared, uncommitted store behind the client's back.
            let pending = sim.ctx.instances.all().into_iter().find_map(|i| {
                let p = i.pending.lock();
                p.writes.values().next().cloned()
            });
            if let Some(w) = pending {
                sim.ctx.storage.finish_write(&w.items);
                found = sim.check().is_err();
                break;
            }
        }
        assert!(found, "publishing an uncommitted store went unnoticed");
    }

    /// The checks can fail: a transfer the node holds for an LMCache worker that no COMMIT will
    /// ever be paired with (an orphan, what a frontend bug would leave) is caught.
    #[test]
    fn the_model_catches_an_orphaned_transfer() {
        let mut sim = Sim::new(SimOptions::new(5));
        for _ in 0..4_000 {
            sim.step().expect("clean run");
            let Some(reg) = sim.lms.iter().find_map(|a| a.reg.as_ref()) else {
                continue;
            };
            let id = reg.inst.id;
            let Some((key, _)) = sim.ctx.storage.snapshot().into_iter().find(|(k, e)| {
                k.namespace == reg.inst.namespace
                    && e.state == crate::storage::index::ObjectState::Ready
                    && !e.doomed
                    && e.slot.len == reg.inst.layout.object_bytes()
            }) else {
                continue;
            };
            // Sabotage: a retrieve prepared for the worker behind the frontend's back (over the
            // frontend's own connection: any other connection is refused).
            let conn = native::Conn::new(crate::lmcache::frontend::FRONTEND_CONNECTION_ID);
            let r = sim.native_call(
                &conn,
                crate::protocol::Request::PrepareRetrieve {
                    instance_id: id,
                    range: crate::protocol::ChunkRange {
                        model: reg.inst.model.clone(),
                        world_size: 1,
                        worker_id: Some(0),
                        cache_salt: String::new(),
                        first_chunk: 0,
                        chunk_hashes: vec![key.chunk_hash],
                    },
                    lookup_session: None,
                },
            );
            assert!(matches!(
                r,
                crate::protocol::Response::RetrievePrepared { hit: true, .. }
            ));
            let e = sim
                .check()
                .expect_err("an orphaned transfer went unnoticed");
            assert!(e.contains("does not queue"), "{e}");
            return;
        }
        panic!("no LMCache object to sabotage with");
    }
}
