//! `kvnode-bench soak`: the kill soak. One `kvnode lmcache-server` serves both protocols (native
//! socket and LMCache ZMQ port); killable worker processes of both kinds (`soak-worker`) are
//! SIGKILLed at random moments and replaced, while one survivor per kind stores and verifies for
//! the whole run. At the end the survivors re-verify what they stored and unregister, and the
//! node must come back to a clean state: no instance, nothing pending, reserved or locked, no
//! session, memcheck clean, used bytes = committed objects, flat RSS, and on SIGTERM exit 0 with
//! its shm segment removed. One summary line on stdout (`SOAK: PASS ...` / `SOAK: FAIL ...`).

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::soak_engine::object_bytes;
use crate::soak_node::LmNode;
use crate::soak_report::{end_unmet, mib, rss, Outcome, Reader, Tally, Verdict, WorkerState};
use crate::soak_worker::{ClientKind, Role, SoakRng};

/// `kvnode-bench soak` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct SoakArgs {
    /// Seconds of killing (the end checks come after).
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// The `kvnode` binary (default: next to this binary, else on PATH).
    #[arg(long)]
    pub node_bin: Option<PathBuf>,
    /// Pool size in GiB (`--l1-size-gb` of the node).
    #[arg(long, default_value_t = 0.25)]
    pub pool_gb: f64,
    /// Killable native workers kept running.
    #[arg(long, default_value_t = 3)]
    pub native: u32,
    /// Killable LMCache workers kept running.
    #[arg(long, default_value_t = 3)]
    pub lmcache: u32,
    /// Shortest interval between two kills, in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub kill_min_ms: u64,
    /// Longest interval between two kills, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub kill_max_ms: u64,
    /// Longest random pause of a worker between PREPARE, copy and COMMIT, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub max_pause_ms: u64,
    /// Seed of every random choice (default: random; printed, and in the JSON).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Shared conversations (default: a third of the pool's objects, so eviction runs).
    #[arg(long)]
    pub conversations: Option<u64>,
    /// Chunks of the longest conversation.
    #[arg(long, default_value_t = 8)]
    pub max_chunks: u32,
    /// Conversations each survivor re-verifies at the end (its most recent ones).
    #[arg(long, default_value_t = 4096)]
    pub final_verify_limit: usize,
    /// Largest allowed growth of the node's VmRSS from the warm-up sample to the end, in MiB.
    #[arg(long, default_value_t = 64)]
    pub rss_bound_mib: u64,
    /// Fraction of the duration after which the RSS baseline is sampled.
    #[arg(long, default_value_t = 0.25)]
    pub warmup_fraction: f64,
    /// Node reap timeout and registration grace, in seconds.
    #[arg(long, default_value_t = 2.0)]
    pub reap_secs: f64,
    /// Node `session_ttl_secs`.
    #[arg(long, default_value_t = 3)]
    pub session_ttl_secs: u64,
    /// Node `read_ttl_secs`.
    #[arg(long, default_value_t = 5)]
    pub read_ttl_secs: u64,
    /// Node `write_ttl_secs`.
    #[arg(long, default_value_t = 5)]
    pub write_ttl_secs: u64,
    /// Deadline for the end state to become clean after the survivors exit, in seconds
    /// (default: the longest TTL + the reap timeout + 10 s).
    #[arg(long)]
    pub settle_secs: Option<f64>,
    /// Keep the working directory (node log, worker log) even when the soak passes.
    #[arg(long)]
    pub keep_dir: bool,
    /// Test of the harness itself: the survivors store every 8th chunk with one wrong byte, so
    /// the soak must FAIL with corrupt chunks.
    #[arg(long, hide = true)]
    pub sabotage: bool,
}

/// One worker process.
struct Proc {
    kind: ClientKind,
    role: Role,
    id: u64,
    child: Child,
    stdin: Option<ChildStdin>,
    reader: Reader,
}

impl Proc {
    fn name(&self) -> String {
        format!("{:?} {:?} {}", self.role, self.kind, self.id).to_lowercase()
    }
}

struct Soak<'a> {
    a: &'a SoakArgs,
    node: LmNode,
    exe: PathBuf,
    worker_log: File,
    rng: SoakRng,
    nonce: u64,
    conversations: u64,
    next_id: u64,
    survivors: Vec<Proc>,
    killable: Vec<Proc>,
    tally: Tally,
    failures: Vec<String>,
    memcheck_failed: bool,
    node_died: Option<ExitStatus>,
}

impl Soak<'_> {
    fn spawn(&mut self, kind: ClientKind, role: Role) -> Result<Proc, String> {
        self.next_id += 1;
        let id = (u64::from(std::process::id()) << 20) | self.next_id;
        let lower = |d: &dyn std::fmt::Debug| format!("{d:?}").to_lowercase();
        let mut cmd = Command::new(&self.exe);
        cmd.arg("soak-worker")
            .args(["--kind", &lower(&kind), "--role", &lower(&role)])
            .args(["--instance-id", &id.to_string()])
            .args(["--seed", &self.rng.next_u64().to_string()])
            .args(["--run-nonce", &self.nonce.to_string()])
            .args(["--conversations", &self.conversations.to_string()])
            .args(["--max-chunks", &self.a.max_chunks.to_string()])
            .args(["--max-pause-ms", &self.a.max_pause_ms.to_string()])
            .args([
                "--final-verify-limit",
                &self.a.final_verify_limit.to_string(),
            ]);
        if self.a.sabotage && role == Role::Survivor {
            cmd.arg("--sabotage");
        }
        match kind {
            ClientKind::Native => cmd.arg("--socket").arg(&self.node.socket),
            ClientKind::Lmcache => cmd.args(["--port", &self.node.port.to_string()]),
        };
        let log = self.worker_log.try_clone().map_err(|e| e.to_string())?;
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawning a soak worker: {e}"))?;
        let out = child.stdout.take().ok_or("no worker stdout")?;
        let stdin = child.stdin.take();
        self.tally.started(kind);
        Ok(Proc {
            kind,
            role,
            id,
            child,
            stdin,
            reader: Reader::start(out, format!("soak-reader-{id}")),
        })
    }

    /// SIGKILLs `p`, then reads what it said up to its death (the phase it was killed in).
    fn kill(&mut self, mut p: Proc) {
        let _ = p.child.kill();
        let _ = p.child.wait();
        drop(p.stdin.take());
        let name = p.name();
        let st = p.reader.finish();
        self.tally.killed(p.kind, &st);
        self.tally.absorb(&name, &st);
    }

    /// Collects a worker that exited by itself: a failure unless it was told to stop and
    /// exited cleanly.
    fn collect(&mut self, mut p: Proc, expected: bool) -> WorkerState {
        let status = p.child.wait().ok();
        drop(p.stdin.take());
        let name = p.name();
        let st = p.reader.finish();
        self.tally.absorb(&name, &st);
        let clean = status.is_some_and(|s| s.success()) && st.exited;
        if !expected || !clean {
            self.failures.push(format!(
                "{name} exited ({status:?}{}) in phase {}: {:?}",
                if expected { "" } else { ", unasked" },
                st.phase,
                st.notes
            ));
        }
        st
    }

    /// Collects workers that exited by themselves (failures); killable ones are replaced.
    fn collect_exited(&mut self) -> Result<(), String> {
        let mut i = 0;
        while i < self.killable.len() {
            if matches!(self.killable[i].child.try_wait(), Ok(Some(_))) {
                let p = self.killable.swap_remove(i);
                let kind = p.kind;
                self.collect(p, false);
                let q = self.spawn(kind, Role::Killable)?;
                self.killable.push(q);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.survivors.len() {
            if matches!(self.survivors[i].child.try_wait(), Ok(Some(_))) {
                let p = self.survivors.swap_remove(i);
                self.collect(p, false);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Mid-run STATUS: memcheck clean, and every registered survivor still registered.
    fn poll_status(&mut self) {
        let st = match self.node.status() {
            Ok(st) => st,
            Err(e) => return self.fail_once(format!("node status failed: {e}")),
        };
        if st["memcheck_ok"] != true && !self.memcheck_failed {
            self.memcheck_failed = true;
            self.failures.push(format!(
                "memcheck failed during the run: {}",
                st["memcheck_problems"]
            ));
        }
        let ids: Vec<u64> = st["instances"]
            .as_array()
            .map(|v| v.iter().filter_map(|i| i["id"].as_u64()).collect())
            .unwrap_or_default();
        let mut lost = Vec::new();
        for s in &self.survivors {
            if s.reader.snapshot().ready && !ids.contains(&s.id) {
                lost.push(format!("{} is alive but no longer registered", s.name()));
            }
        }
        for msg in lost {
            self.fail_once(msg);
        }
    }

    /// Records a failure unless the same one was recorded already (repeated polls).
    fn fail_once(&mut self, msg: String) {
        if !self.failures.contains(&msg) {
            self.failures.push(msg);
        }
    }

    fn gap(&mut self) -> Duration {
        let (lo, hi) = (self.a.kill_min_ms, self.a.kill_max_ms);
        Duration::from_millis(lo + self.rng.below(hi - lo + 1))
    }

    /// Kills a random killable worker every `--kill-min-ms..=--kill-max-ms` and starts a
    /// replacement, for `--duration` seconds; samples the node's RSS and STATUS meanwhile.
    fn kill_loop(&mut self, out: &mut Outcome) -> Result<(), String> {
        let a = self.a;
        let start = Instant::now();
        let end = start + Duration::from_secs_f64(a.duration);
        let warm = start + Duration::from_secs_f64(a.duration * a.warmup_fraction.clamp(0.0, 1.0));
        let mut next_kill = start + self.gap();
        let mut next_poll = start + Duration::from_secs(1);
        let mut next_progress = start + Duration::from_secs(10);
        let mut warmed = false;
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
            let now = Instant::now();
            if let Some(st) = self.node.exited() {
                self.node_died = Some(st);
                break;
            }
            self.collect_exited()?;
            if now >= next_kill {
                let i = self.rng.below(self.killable.len() as u64) as usize;
                let victim = self.killable.swap_remove(i);
                let kind = victim.kind;
                self.kill(victim);
                let q = self.spawn(kind, Role::Killable)?;
                self.killable.push(q);
                next_kill = now + self.gap();
            }
            if let Some(r) = rss(self.node.pid()) {
                out.rss_max = out.rss_max.max(r.0);
                if !warmed && now >= warm {
                    out.rss_start = r;
                    warmed = true;
                }
            }
            if now >= next_poll {
                self.poll_status();
                next_poll = now + Duration::from_secs(1);
            }
            if now >= next_progress {
                eprintln!(
                    "soak: {:.0} s, kills {} native / {} lmcache, failures so far {}",
                    start.elapsed().as_secs_f64(),
                    self.tally.kills_of(ClientKind::Native),
                    self.tally.kills_of(ClientKind::Lmcache),
                    self.failures.len()
                );
                next_progress = now + Duration::from_secs(10);
            }
        }
        out.killing = start.elapsed();
        // The remaining killable workers die too, wherever they are.
        for p in std::mem::take(&mut self.killable) {
            self.kill(p);
        }
        if let Some(st) = self.node_died {
            let log = self.node.log_tail(40);
            self.failures
                .push(format!("the node died during the run ({st}):\n{log}"));
            for p in std::mem::take(&mut self.survivors) {
                self.kill(p);
            }
        }
        Ok(())
    }

    /// Tells the survivors to stop: each re-verifies what it stored, unregisters and exits 0.
    fn finish_survivors(&mut self) {
        for p in &mut self.survivors {
            if let Some(mut w) = p.stdin.take() {
                let _ = w.write_all(b"stop\n");
            }
        }
        let deadline = Instant::now() + Duration::from_secs(300);
        for mut p in std::mem::take(&mut self.survivors) {
            while Instant::now() < deadline && matches!(p.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(p.child.try_wait(), Ok(None)) {
                self.failures
                    .push(format!("{} did not finish within 300 s of stop", p.name()));
                self.kill(p);
                continue;
            }
            let name = p.name();
            if !self.collect(p, true).final_done {
                self.failures
                    .push(format!("{name} exited without its final verification"));
            }
        }
    }

    /// Polls STATUS until the end state is clean, within TTLs + reap timeout + 10 s; then
    /// MEMCHECK and the RSS sample.
    fn settle(&mut self, out: &mut Outcome) {
        let a = self.a;
        let ttl = a
            .session_ttl_secs
            .max(a.read_ttl_secs)
            .max(a.write_ttl_secs) as f64;
        let limit = Duration::from_secs_f64(a.settle_secs.unwrap_or(ttl + a.reap_secs + 10.0));
        let t = Instant::now();
        let mut unmet = vec!["no status".to_string()];
        while self.node_died.is_none() {
            match self.node.status() {
                Ok(st) => {
                    unmet = end_unmet(&st, object_bytes(16));
                    out.end_status = st;
                }
                Err(e) => unmet = vec![e],
            }
            if unmet.is_empty() || t.elapsed() > limit {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        out.settle_s = t.elapsed().as_secs_f64();
        if !unmet.is_empty() {
            self.failures.push(format!(
                "end state not clean after {:.1} s: {}",
                out.settle_s,
                unmet.join(", ")
            ));
        }
        let mc = self.node.memcheck();
        if !matches!(&mc, Ok((true, _))) {
            self.failures.push(format!("MEMCHECK: {mc:?}"));
        }
        out.memcheck = Some(mc);
        out.rss_end = rss(self.node.pid()).unwrap_or_default();
        if out.growth() > (a.rss_bound_mib << 20) as i64 {
            self.failures.push(format!(
                "node RSS grew by {} from {} (bound {} MiB)",
                mib(out.growth() as u64),
                mib(out.rss_start.0),
                a.rss_bound_mib
            ));
        }
    }

    /// SIGTERM: the node must exit 0 and remove its segment.
    fn stop_node(&mut self, out: &mut Outcome) -> Result<(), String> {
        if self.node_died.is_some() {
            return Ok(());
        }
        out.node_exit = self.node.terminate(Duration::from_secs(30))?;
        if !out.node_exit.is_some_and(|s| s.success()) {
            let log = self.node.log_tail(40);
            self.failures
                .push(format!("node after SIGTERM: {:?}\n{log}", out.node_exit));
        }
        if self.node.segment().exists() {
            let seg = self.node.segment();
            self.failures
                .push(format!("{} still exists after SIGTERM", seg.display()));
        }
        Ok(())
    }

    /// Failures read from the workers' totals.
    fn judge(&mut self) {
        let t = &self.tally.totals;
        let mut f = Vec::new();
        if t.corrupt > 0 {
            f.push(format!("{} chunks read back with wrong bytes", t.corrupt));
        }
        if t.lookup_then_miss > 0 {
            f.push(format!(
                "{} retrieves missed right after their LOOKUP's hits",
                t.lookup_then_miss
            ));
        }
        if t.stale_commits > 0 {
            f.push(format!(
                "{} COMMIT_STOREs of live workers found their reservation gone",
                t.stale_commits
            ));
        }
        if t.stores == 0 || t.chunks_verified == 0 {
            f.push("no store or no verified chunk at all".into());
        }
        for kind in [ClientKind::Native, ClientKind::Lmcache] {
            if self.tally.kills_of(kind) == 0 {
                f.push(format!("no {kind:?} worker was killed"));
            }
        }
        self.failures.extend(f);
    }
}

pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

/// Runs the soak; `Ok(true)` on PASS. Prints the summary line on stdout, details on stderr.
pub fn run(a: &SoakArgs) -> Result<bool, String> {
    if a.native == 0 || a.lmcache == 0 || a.kill_min_ms > a.kill_max_ms || a.duration <= 0.0 {
        return Err("the soak needs --native >= 1, --lmcache >= 1, \
                    --kill-min-ms <= --kill-max-ms and a positive --duration"
            .into());
    }
    let seed = a.seed.unwrap_or_else(random_seed);
    let dir = std::env::temp_dir().join(format!("kvnode-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let node = LmNode::start(a, &dir)?;
    let first = node.status()?;
    let capacity = first["capacity_bytes"].as_u64().unwrap_or(0);
    let conversations = a
        .conversations
        .unwrap_or((capacity / object_bytes(16) / 3).max(16));
    eprintln!(
        "soak: seed {seed}, {} s, pool {} ({}), {conversations} shared conversations, \
         {} native + {} LMCache killable workers, 1 + 1 survivors, logs in {}",
        a.duration,
        mib(capacity),
        first["pool_backing"].as_str().unwrap_or("?"),
        a.native,
        a.lmcache,
        dir.display()
    );
    let mut s = Soak {
        a,
        node,
        exe: std::env::current_exe().map_err(|e| e.to_string())?,
        worker_log: File::create(dir.join("workers.log")).map_err(|e| e.to_string())?,
        rng: SoakRng::new(seed),
        nonce: crate::payload::splitmix64(seed ^ 0x50A6),
        conversations,
        next_id: 0,
        survivors: Vec::new(),
        killable: Vec::new(),
        tally: Tally::default(),
        failures: Vec::new(),
        memcheck_failed: false,
        node_died: None,
    };
    for kind in [ClientKind::Native, ClientKind::Lmcache] {
        let p = s.spawn(kind, Role::Survivor)?;
        s.survivors.push(p);
    }
    let kinds = (0..a.native)
        .map(|_| ClientKind::Native)
        .chain((0..a.lmcache).map(|_| ClientKind::Lmcache));
    for kind in kinds {
        let p = s.spawn(kind, Role::Killable)?;
        s.killable.push(p);
    }
    let mut out = Outcome::default();
    s.kill_loop(&mut out)?;
    s.finish_survivors();
    s.settle(&mut out);
    s.stop_node(&mut out)?;
    s.judge();
    let verdict = Verdict {
        tally: &s.tally,
        failures: &s.failures,
        seed,
        conversations,
        rss_bound_mib: a.rss_bound_mib,
    };
    let line = verdict.summary(&out);
    for f in &s.failures {
        eprintln!("soak failure: {f}");
    }
    for note in &s.tally.notes {
        eprintln!("soak note: {note}");
    }
    println!("{line}");
    if let Some(path) = &a.json {
        let text =
            serde_json::to_string_pretty(&verdict.json(&out, &line)).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let pass = s.failures.is_empty();
    drop(s);
    // A sabotaged soak is meant to fail: its logs are of no interest either.
    if (pass || a.sabotage) && !a.keep_dir {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("soak: node and worker logs kept in {}", dir.display());
    }
    Ok(pass)
}
