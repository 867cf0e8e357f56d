//! A deterministic simulator of the L2 disk tier's state machine (issue 10), in the manner of
//! the request-level simulator next door: the real [`crate::l2::L2Tier`] and L1
//! [`crate::storage::StorageCore`] run random interleavings of every tier operation over a
//! simulated, fault-injecting device, and a reference model is checked after every step. A run
//! is a pure function of its seed; a failure prints the seed, and the seed reproduces it
//! (`scripts/simulate.sh --l2 --seed S`).
//!
//! # What is modelled
//!
//! * **The device** ([`disk`], [`engine`]): the tier runs its real pread engine on a real data
//!   file (in `/dev/shm` when possible), wrapped so that every I/O is checked and faulted, and
//!   every write recorded. Seeded faults: reads failing with EIO or returning a flipped byte,
//!   writes failing with EIO (after a random prefix of their blocks landed) or ENOSPC (nothing
//!   landed), `fdatasync` failing. Durability: a write is durable once a later `fdatasync`
//!   succeeded; one issued before a *failed* `fdatasync` is in limbo and a later success does
//!   not cover it (the assumption `L2Tier::sync` itself makes); a process restart settles
//!   limbo writes (kept or undone); a power loss undoes a random subset of the writes that are
//!   not durable, some torn at 4 KiB granularity.
//! * **Stuck I/O** ([`worker`]): a write-behind batch (parked before its payload writes or
//!   before its slot header writes) or a load (parked before its payload reads) waits on a
//!   worker thread across later steps, while the simulator syncs, writes other batches, loads,
//!   evicts, stores and changes faults; it is then completed or failed with EIO. A CLEAR or a
//!   restart first releases it (the gate would make a CLEAR wait for it anyway).
//! * **Operations** ([`ops`]): store a new version of a key (each version under a layout of its
//!   own, four object sizes so strides mix; an L1 copy is evicted first, so an L2 copy of an
//!   older version is really replaced), store the latest version again, write-behind of a few
//!   L1 objects (`persist`, at most one batch), `sync`, evict some or all L1 copies, `load`
//!   (under the newest layout, an older one, or none), CLEAR (`clear_with`),
//!   `requeue_deferred`, a clean restart (sync, drop, reopen), a process crash (drop, reopen),
//!   a power loss, TTL expiry on the simulator's clock, fault rate changes.
//! * **Checks** ([`check`]), after every step: (a) a load publishes exactly the bytes of a
//!   version of that key, under the layout asked for, never one stored before an acknowledged
//!   CLEAR (nor, before the next restart, one stored before a CLEAR that failed); the tier's
//!   index never holds a key under a layout none of its versions has; (b) every object the
//!   tier held when a sync succeeded (and still held at the restart) is held and loads with
//!   its exact bytes after a clean restart, a crash or a power loss (unless a read of its slot
//!   or extent header was faulted at start-up); (c) see (a); (d) every write lies in
//!   `[0, l2.bytes)`, on a superblock copy, an extent header, or the header or payload of a
//!   slot of the stride and epoch its extent was last given, and the data file equals what the
//!   engine wrote; (e) `L2Tier::check` and `StorageCore::memcheck`, and when nothing is stuck:
//!   every staging block free, no L1 lock, reservation or doomed object left; a TTL sweep
//!   long after never expires the tier's own I/O holds.
//!
//! "Acknowledged durable" is precise: a copy this run wrote, held by the index when a later
//! `L2Tier::sync` returned `Ok`, and still held when the tier stopped. A copy found at
//! start-up that was not durable before the stop is the device's leftover: it must load
//! correctly or not at all, but nothing is promised about it.
//!
//! Known tier bugs the simulator found have ignored reproductions in `repro.rs`;
//! [`L2SimOptions::skip`] steers random runs around them so that they can look for others.
//!
//! # What is not
//!
//! * The write-behind thread and its queue (`l2::writer`): the simulator calls `persist` and
//!   `sync` itself, one batch at a time; keys `requeue_deferred` pushes stay in the queue (they
//!   are written when a later step persists them again). Pipelined multi-batch `persist` calls
//!   run two threads at once and are left out to keep runs deterministic.
//! * `L2Set` (several devices), the io_uring engine, block devices, `l2.max_index_bytes` caps
//!   (recovery at the cap keeps the newest records, which the durability check does not
//!   model), `on-evict` demotion, geometry changes between runs.
//! * Sub-4 KiB tearing, misdirected writes, and slow (rather than stuck) I/O: there are no
//!   deadlines to hit, since time in the tier is real time.
//! * Real `fdatasync`: the device model decides durability, so the engine's own sync is not
//!   called (it would only slow runs down).

pub mod check;
pub mod disk;
pub mod engine;
pub mod model;
pub mod node;
pub mod ops;
pub mod payload;
pub mod worker;

#[cfg(test)]
mod repro;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::path::PathBuf;

use self::disk::FaultRates;
use self::model::Model;
use self::node::Node;
use crate::config::L2Config;
use crate::sim::rng::Rng;

/// What to simulate. Invariant: plain data; the geometry of the device and the number of keys
/// are drawn from the seed.
#[derive(Debug, Clone)]
pub struct L2SimOptions {
    /// The seed; everything else follows from it.
    pub seed: u64,
    /// Steps (one operation each).
    pub steps: u64,
    /// Steps of history printed with a failure.
    pub trace: usize,
    /// Where the run's data file goes (default: `/dev/shm` if usable, else the temp dir).
    pub dir: Option<PathBuf>,
    /// Known tier bugs to steer around (to look past them for others): `internal-sync` (only
    /// the `fdatasync` of `L2Tier::sync` fails, not those after extent headers and superblock
    /// copies), `superblock` (a failed superblock write lands nothing), `in-flight-sync` (no
    /// fdatasync fails while a batch is parked between its payload and header writes).
    pub skip: Vec<String>,
}

impl L2SimOptions {
    /// The default shape of a run for `seed`.
    pub fn new(seed: u64) -> L2SimOptions {
        L2SimOptions {
            seed,
            steps: 2_000,
            trace: 40,
            dir: None,
            skip: Vec::new(),
        }
    }

    /// These options for another seed.
    pub fn with_seed(self, seed: u64) -> L2SimOptions {
        L2SimOptions { seed, ..self }
    }
}

/// Counters of one finished run. Invariant: `trace_digest` is equal for two runs of a seed.
#[derive(Debug, Clone, Default)]
pub struct L2SimStats {
    /// Steps run.
    pub steps: u64,
    /// Versions stored into L1.
    pub stores: u64,
    /// Objects `persist` reported written.
    pub persisted: u64,
    /// Objects loaded from L2 and verified.
    pub loaded: u64,
    /// Successful syncs.
    pub syncs: u64,
    /// Failed syncs.
    pub failed_syncs: u64,
    /// CLEARs (acknowledged or not).
    pub clears: u64,
    /// Clean restarts.
    pub restarts: u64,
    /// Clean restarts whose checkpoint (extent tables) succeeded.
    pub checkpoints: u64,
    /// Process crashes.
    pub crashes: u64,
    /// Power losses.
    pub power_losses: u64,
    /// I/Os parked by the stuck-I/O worker.
    pub stalls: u64,
    /// Keys `requeue_deferred` queued again (stores that met an older, busy L2 entry).
    pub requeued: u64,
    /// Durable objects verified (held and loaded byte-exact) after a reopen.
    pub durable_verified: u64,
    /// Durable objects not required after a reopen (a read of their headers was faulted).
    pub durable_forgiven: u64,
    /// Blocks a power loss or limbo settlement undid.
    pub reverted_blocks: u64,
    /// Faults injected (read EIO, flips, write EIO, ENOSPC, sync EIO).
    pub faults: u64,
    /// xxh3 of every trace line and per-step tier counters.
    pub trace_digest: u64,
}

/// A failed run of the tier simulator (the request-level simulator's type, flagged `l2`).
pub type L2SimFailure = super::SimFailure;

/// The result of one check or step.
pub type Check = Result<(), String>;

/// The running simulation. Invariant: at most one stuck worker; the tier is open between
/// steps.
pub struct L2Sim {
    opts: L2SimOptions,
    rng: Rng,
    node: Node,
    model: Model,
    stuck: Option<worker::Stuck>,
    /// The fault rates of the current period (restored after quiet checks).
    rates: FaultRates,
    trace: VecDeque<String>,
    digest: xxhash_rust::xxh3::Xxh3,
    step: u64,
    stats: L2SimStats,
    /// Device counters at the end of the previous step (faults are traced per step).
    seen: disk::DiskStats,
}

/// Runs one seed to the end (then a clean restart that checks every durable object) or to
/// its first broken invariant. A panic in the tier is reported as a failure of its step.
pub fn run(opts: &L2SimOptions) -> Result<L2SimStats, L2SimFailure> {
    let mut sim = L2Sim::new(opts.clone()).map_err(|message| L2SimFailure {
        seed: opts.seed,
        step: 0,
        message,
        trace: Vec::new(),
        l2: true,
        reproduce_steps: 1,
    })?;
    for _ in 0..opts.steps {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.step()));
        let r = r.unwrap_or_else(|p| Err(format!("panic: {}", panic_text(&*p))));
        if let Err(message) = r {
            return Err(sim.failure(message));
        }
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.finish()));
    let r = r.unwrap_or_else(|p| Err(format!("panic: {}", panic_text(&*p))));
    if let Err(message) = r {
        return Err(sim.failure(message));
    }
    Ok(sim.stats())
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

impl L2Sim {
    /// A simulation of `opts` with its tier opened on a new, empty device.
    pub fn new(opts: L2SimOptions) -> Result<L2Sim, String> {
        let mut rng = Rng::new(opts.seed);
        let extents = rng.range(3, 5);
        let cfg = L2Config {
            bytes: (2 << 20) + extents * (2 << 20),
            extent_bytes: 2 << 20,
            engine: "pread".into(),
            batch_objects: rng.range(2, 8) as usize,
            max_prefetch_objects: rng.range(4, 16) as usize,
            write_queue: 64,
            lock_wait_ms: 1_000,
            ..L2Config::default()
        };
        let keys = rng.range(16, 40) as usize;
        let base = opts.dir.clone().unwrap_or_else(node::default_base_dir);
        let mut node = Node::new(&base, opts.seed, cfg, rng.next_u64());
        let skip = |what: &str| opts.skip.iter().any(|s| s == what);
        node.disk
            .set_explicit_sync_faults_only(skip("internal-sync"));
        node.disk.set_clean_superblock_failures(skip("superblock"));
        node.open()
            .map_err(|e| format!("opening a new tier: {e}"))?;
        let mut sim = L2Sim {
            rng,
            node,
            model: Model::new(keys),
            stuck: None,
            rates: FaultRates::default(),
            trace: VecDeque::new(),
            digest: xxhash_rust::xxh3::Xxh3::new(),
            step: 0,
            stats: L2SimStats::default(),
            seen: disk::DiskStats::default(),
            opts,
        };
        let c = &sim.node.cfg;
        let line = format!(
            "device of {} extents, batches of {}, prefetch {}, {keys} keys",
            extents, c.batch_objects, c.max_prefetch_objects
        );
        sim.log(line);
        Ok(sim)
    }

    fn log(&mut self, what: String) {
        if self.trace.len() >= self.opts.trace.max(1) {
            self.trace.pop_front();
        }
        let line = format!("#{} {what}", self.step);
        self.digest.update(line.as_bytes());
        self.trace.push_back(line);
    }

    fn failure(&self, message: String) -> L2SimFailure {
        L2SimFailure {
            seed: self.opts.seed,
            step: self.step,
            message,
            trace: self.trace.iter().cloned().collect(),
            l2: true,
            reproduce_steps: self.step.max(1),
        }
    }

    /// One step: a random operation, then every check.
    pub fn step(&mut self) -> Check {
        self.step += 1;
        let stuck = self.stuck.is_some();
        let weights = [
            18,                        // 0 store a new version
            6,                         // 1 store the latest version again
            16,                        // 2 persist
            8,                         // 3 sync
            6,                         // 4 evict some L1 copies
            2,                         // 5 drop all of L1
            16,                        // 6 load
            1,                         // 7 CLEAR
            2,                         // 8 requeue deferred
            1,                         // 9 clean restart
            1,                         // 10 process crash
            2,                         // 11 power loss
            3,                         // 12 fault rates
            if stuck { 0 } else { 3 }, // 13 start a stuck I/O
            if stuck { 6 } else { 0 }, // 14 release it
            1,                         // 15 expire L1 locks much later
        ];
        match self.rng.weighted(&weights) {
            0 => self.store_new()?,
            1 => self.store_again()?,
            2 => self.persist()?,
            3 => self.sync()?,
            4 => self.evict_some(),
            5 => self.drop_l1(),
            6 => self.load()?,
            7 => self.clear()?,
            8 => self.requeue(),
            9 => self.restart(ops::Stop::Clean)?,
            10 => self.restart(ops::Stop::Crash)?,
            11 => self.restart(ops::Stop::PowerLoss)?,
            12 => self.change_faults(),
            13 => self.start_stuck()?,
            14 => self.release_stuck()?,
            _ => self.expire()?,
        }
        self.check_step()
    }

    /// The end of a run: whatever is stuck is released, then a clean restart checks every
    /// durable object once more.
    pub fn finish(&mut self) -> Check {
        self.step += 1;
        self.restart(ops::Stop::Clean)?;
        self.check_step()
    }

    /// Counters so far (the digest covers the steps run).
    pub fn stats(&self) -> L2SimStats {
        let d = self.node.disk.stats();
        L2SimStats {
            steps: self.step,
            reverted_blocks: d.reverted,
            faults: d.read_eio + d.flips + d.write_eio + d.enospc + d.sync_eio,
            trace_digest: self.digest.digest(),
            ..self.stats.clone()
        }
    }
}

impl Drop for L2Sim {
    /// A run abandoned with a stuck worker: it is released (failed) and joined before the
    /// node goes.
    fn drop(&mut self) {
        if let Some(s) = self.stuck.take() {
            let _ = s.release(engine::Release::Fail);
        }
    }
}
