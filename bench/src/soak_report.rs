//! Bookkeeping of the kill soak: what each worker process reported on stdout (read by one thread
//! per worker until EOF, so the last phase a killed worker announced is known exactly), kills by
//! kind and phase, the node's end-state checks, and the summary line.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::ChildStdout;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;

use crate::soak_engine::object_bytes;
use crate::soak_worker::{ClientKind, WorkerStats};

/// Corrupt / anomaly / error lines kept per worker (the counters count them all).
const MAX_NOTES: usize = 20;

/// What one worker process has said so far.
#[derive(Debug, Default, Clone)]
pub struct WorkerState {
    /// The last `phase` it announced (`start` before its first line).
    pub phase: String,
    /// Its last cumulative counters.
    pub stats: WorkerStats,
    /// It registered (`ready`).
    pub ready: bool,
    /// A survivor finished its final verification (`final`).
    pub final_done: bool,
    /// It exited cleanly (`exit`).
    pub exited: bool,
    /// `corrupt ...`, `anomaly ...` and `error ...` lines (at most [`MAX_NOTES`]).
    pub notes: Vec<String>,
    /// `error ...` lines seen.
    pub errors: u64,
    /// `corrupt ...` lines seen (counted here too: a kill may land before the next `stats`).
    pub corrupt_lines: u64,
    /// `anomaly lookup_then_miss ...` lines seen.
    pub lookup_then_miss_lines: u64,
    /// `anomaly stale_commit ...` lines seen.
    pub stale_commit_lines: u64,
}

/// A worker's shared state plus the thread that fills it.
pub struct Reader {
    /// Shared with the reader thread.
    pub state: Arc<Mutex<WorkerState>>,
    thread: JoinHandle<()>,
}

impl Reader {
    /// Starts reading `out` (a worker's stdout) until EOF.
    pub fn start(out: ChildStdout, name: String) -> Reader {
        let state = Arc::new(Mutex::new(WorkerState {
            phase: "start".into(),
            ..WorkerState::default()
        }));
        let s = state.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    let mut st = s.lock().unwrap_or_else(|p| p.into_inner());
                    apply(&mut st, &line);
                }
            })
            .expect("spawn a reader thread");
        Reader { state, thread }
    }

    /// Waits for EOF (the process has exited) and returns the final state.
    pub fn finish(self) -> WorkerState {
        let _ = self.thread.join();
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.clone()
    }

    /// A copy of the state now.
    pub fn snapshot(&self) -> WorkerState {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

fn apply(st: &mut WorkerState, line: &str) {
    let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
    match word {
        "phase" => rest.clone_into(&mut st.phase),
        "stats" => {
            if let Ok(s) = serde_json::from_str(rest) {
                st.stats = s;
            }
        }
        "ready" => st.ready = true,
        "final" => st.final_done = true,
        "exit" => st.exited = true,
        "corrupt" | "anomaly" | "error" => {
            match (word, rest.split(' ').next()) {
                ("error", _) => st.errors += 1,
                ("corrupt", _) => st.corrupt_lines += 1,
                (_, Some("lookup_then_miss")) => st.lookup_then_miss_lines += 1,
                (_, Some("stale_commit")) => st.stale_commit_lines += 1,
                _ => {}
            }
            if st.notes.len() < MAX_NOTES {
                st.notes.push(line.to_owned());
            }
        }
        _ => {
            if st.notes.len() < MAX_NOTES {
                st.notes.push(format!("unexpected line: {line}"));
            }
        }
    }
}

/// The window a phase belongs to, for the summary: `store` (PREPARE_STORE sent .. COMMIT_STORE
/// answered), `retrieve` (PREPARE_RETRIEVE sent .. COMMIT_RETRIEVE answered), `session` (a
/// lookup session open: LOOKUP, its locks held, FREE_LOOKUP_LOCKS, END_SESSION), `other`.
pub fn phase_group(phase: &str) -> &'static str {
    match phase {
        "prepare_store" | "store_prepared" | "copy_in" | "store_copied" | "commit_store"
        | "abort_store" => "store",
        "prepare_retrieve" | "retrieve_prepared" | "copy_out" | "retrieve_copied"
        | "commit_retrieve" => "retrieve",
        "lookup" | "lookup_locked" | "free_locks" | "end_session" => "session",
        _ => "other",
    }
}

/// Kills and totals over every worker process of the soak.
#[derive(Debug, Default, Serialize)]
pub struct Tally {
    /// Kills per kind.
    pub kills: BTreeMap<String, u64>,
    /// Kills per kind and exact phase.
    pub kill_phases: BTreeMap<String, BTreeMap<String, u64>>,
    /// Kills per phase window (store, retrieve, session, other), all kinds.
    pub kill_windows: BTreeMap<String, u64>,
    /// Killed before they had registered.
    pub kills_before_ready: u64,
    /// Worker processes started per kind.
    pub started: BTreeMap<String, u64>,
    /// Sum of every worker's final counters.
    pub totals: WorkerStats,
    /// Notes (corrupt, anomaly, error lines) of every worker, at most 50.
    pub notes: Vec<String>,
}

fn kind_name(k: ClientKind) -> String {
    match k {
        ClientKind::Native => "native".into(),
        ClientKind::Lmcache => "lmcache".into(),
    }
}

impl Tally {
    /// Counts a started worker.
    pub fn started(&mut self, kind: ClientKind) {
        *self.started.entry(kind_name(kind)).or_default() += 1;
    }

    /// Counts a kill of a worker whose last announced state was `st`.
    pub fn killed(&mut self, kind: ClientKind, st: &WorkerState) {
        let k = kind_name(kind);
        *self.kills.entry(k.clone()).or_default() += 1;
        *self
            .kill_phases
            .entry(k)
            .or_default()
            .entry(st.phase.clone())
            .or_default() += 1;
        *self
            .kill_windows
            .entry(phase_group(&st.phase).to_owned())
            .or_default() += 1;
        if !st.ready {
            self.kills_before_ready += 1;
        }
    }

    /// Adds a finished worker's counters and notes.
    pub fn absorb(&mut self, who: &str, st: &WorkerState) {
        let t = &mut self.totals;
        let s = &st.stats;
        t.stores += s.stores;
        t.chunks_stored += s.chunks_stored;
        t.chunks_skipped += s.chunks_skipped;
        t.stores_aborted += s.stores_aborted;
        t.stores_refused += s.stores_refused;
        t.lookups += s.lookups;
        t.lookup_hit_chunks += s.lookup_hit_chunks;
        t.retrieves += s.retrieves;
        t.retrieve_misses += s.retrieve_misses;
        t.chunks_verified += s.chunks_verified;
        t.corrupt += s.corrupt.max(st.corrupt_lines);
        t.lookup_then_miss += s.lookup_then_miss.max(st.lookup_then_miss_lines);
        t.stale_commits += s.stale_commits.max(st.stale_commit_lines);
        t.stale_reads += s.stale_reads;
        t.pings += s.pings;
        t.final_convs += s.final_convs;
        t.final_chunks_verified += s.final_chunks_verified;
        t.final_chunks_missing += s.final_chunks_missing;
        for n in &st.notes {
            if self.notes.len() < 50 {
                self.notes.push(format!("{who}: {n}"));
            }
        }
    }

    /// Kills of `kind`.
    pub fn kills_of(&self, kind: ClientKind) -> u64 {
        self.kills.get(&kind_name(kind)).copied().unwrap_or(0)
    }
}

fn num(st: &serde_json::Value, path: &[&str]) -> Option<u64> {
    path.iter().try_fold(st, |v, p| v.get(*p))?.as_u64()
}

/// The end-state conditions `st` does not meet yet: no instances, nothing pending, nothing
/// reserved or locked, no sessions, memcheck clean, and used bytes exactly the committed objects
/// (`ready x object_bytes`: every soak object has the same size). Empty when all hold.
pub fn end_unmet(st: &serde_json::Value, object_bytes: u64) -> Vec<String> {
    let mut unmet = Vec::new();
    let instances = st["instances"].as_array().map_or(usize::MAX, Vec::len);
    if instances != 0 {
        unmet.push(format!("instances={instances}"));
    }
    for path in [
        &["pending_writes"][..],
        &["pending_reads"],
        &["objects", "write_reserved"],
        &["objects", "read_locked"],
        &["objects", "temporary"],
        &["objects", "doomed"],
        &["sessions"],
    ] {
        match num(st, path) {
            Some(0) => {}
            v => unmet.push(format!("{}={v:?}", path.join("."))),
        }
    }
    if st["memcheck_ok"] != true {
        unmet.push(format!("memcheck_ok=false {}", st["memcheck_problems"]));
    }
    let ready = num(st, &["objects", "ready"]).unwrap_or(u64::MAX);
    let used = num(st, &["used_bytes"]).unwrap_or(u64::MAX);
    if ready.checked_mul(object_bytes) != Some(used) {
        unmet.push(format!(
            "used_bytes={used} but {ready} committed objects x {object_bytes} B"
        ));
    }
    unmet
}

/// A process's resident set from `/proc/<pid>/status`: (VmRSS, RssAnon, RssShmem) in bytes.
pub fn rss(pid: u32) -> Option<(u64, u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("VmRSS:")?, field("RssAnon:")?, field("RssShmem:")?))
}

/// Bytes as MiB with one decimal.
pub fn mib(b: u64) -> String {
    format!("{:.1}MiB", b as f64 / f64::from(1u32 << 20))
}

/// What the soak measured besides the workers' counters.
#[derive(Default)]
pub struct Outcome {
    /// Time spent killing (the `--duration` part).
    pub killing: Duration,
    /// Node (VmRSS, RssAnon, RssShmem) after the warm-up, and at the end.
    pub rss_start: (u64, u64, u64),
    /// The same at the end (all clients gone, end state settled).
    pub rss_end: (u64, u64, u64),
    /// Largest VmRSS sampled during the run.
    pub rss_max: u64,
    /// Seconds from the survivors' exit until the end state was clean (or the deadline).
    pub settle_s: f64,
    /// The last STATUS of the end checks.
    pub end_status: serde_json::Value,
    /// The MEMCHECK request's answer.
    pub memcheck: Option<Result<(bool, Vec<String>), String>>,
    /// The node's exit status after SIGTERM.
    pub node_exit: Option<ExitStatus>,
}

impl Outcome {
    /// VmRSS growth from the warm-up sample to the end (negative: it shrank).
    pub fn growth(&self) -> i64 {
        self.rss_end.0 as i64 - self.rss_start.0 as i64
    }

    /// MEMCHECK and the last STATUS both clean.
    pub fn memcheck_ok(&self) -> bool {
        matches!(&self.memcheck, Some(Ok((true, _)))) && self.end_status["memcheck_ok"] == true
    }

    /// A number of the last STATUS (0 when absent).
    pub fn end(&self, path: &[&str]) -> u64 {
        path.iter()
            .try_fold(&self.end_status, |v, k| v.get(*k))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
    }
}

/// What the verdict is made of besides the [`Outcome`].
pub struct Verdict<'a> {
    /// Kills and the workers' totals.
    pub tally: &'a Tally,
    /// Every failure found (PASS when empty).
    pub failures: &'a [String],
    /// The soak's seed.
    pub seed: u64,
    /// Shared conversations.
    pub conversations: u64,
    /// The RSS growth bound.
    pub rss_bound_mib: u64,
}

impl Verdict<'_> {
    /// The one summary line.
    pub fn summary(&self, out: &Outcome) -> String {
        let t = &self.tally.totals;
        let win = |k: &str| self.tally.kill_windows.get(k).copied().unwrap_or(0);
        let g = out.growth();
        format!(
            "SOAK: {} duration={:.0}s kills={} (native {}, lmcache {}) \
             kill_windows(store/retrieve/session/other)={}/{}/{}/{} stores={} chunks_stored={} \
             retrieves_verified={} final_verified={} corrupt={} stale_reads={} rss_start={} \
             rss_end={} rss_growth={}{} pending={} locked={} sessions={} memcheck={} \
             node_errors={} seed={}",
            if self.failures.is_empty() {
                "PASS"
            } else {
                "FAIL"
            },
            out.killing.as_secs_f64(),
            self.tally.kills.values().sum::<u64>(),
            self.tally.kills_of(ClientKind::Native),
            self.tally.kills_of(ClientKind::Lmcache),
            win("store"),
            win("retrieve"),
            win("session"),
            win("other"),
            t.stores,
            t.chunks_stored,
            t.chunks_verified,
            t.final_chunks_verified,
            t.corrupt,
            t.stale_reads,
            mib(out.rss_start.0),
            mib(out.rss_end.0),
            if g < 0 { "-" } else { "" },
            mib(g.unsigned_abs()),
            out.end(&["pending_writes"]) + out.end(&["pending_reads"]),
            out.end(&["objects", "read_locked"]) + out.end(&["objects", "write_reserved"]),
            out.end(&["sessions"]),
            if out.memcheck_ok() { "ok" } else { "FAILED" },
            out.end(&["errors"]),
            self.seed,
        )
    }

    /// Everything, as the `--json` document.
    pub fn json(&self, out: &Outcome, line: &str) -> serde_json::Value {
        let memcheck = match &out.memcheck {
            Some(Ok((ok, problems))) => serde_json::json!({"ok": ok, "problems": problems}),
            Some(Err(e)) => serde_json::json!({"ok": false, "error": e}),
            None => serde_json::Value::Null,
        };
        serde_json::json!({
            "pass": self.failures.is_empty(),
            "summary": line,
            "failures": self.failures,
            "seed": self.seed,
            "duration_s": out.killing.as_secs_f64(),
            "settle_s": out.settle_s,
            "kills": self.tally.kills,
            "kill_phases": self.tally.kill_phases,
            "kill_windows": self.tally.kill_windows,
            "kills_before_ready": self.tally.kills_before_ready,
            "workers_started": self.tally.started,
            "totals": self.tally.totals,
            "notes": self.tally.notes,
            "conversations": self.conversations,
            "object_bytes": object_bytes(16),
            "rss": {
                "start_bytes": out.rss_start.0, "end_bytes": out.rss_end.0,
                "max_bytes": out.rss_max, "growth_bytes": out.growth(),
                "bound_bytes": self.rss_bound_mib << 20,
                "anon_start_bytes": out.rss_start.1, "anon_end_bytes": out.rss_end.1,
                "shmem_start_bytes": out.rss_start.2, "shmem_end_bytes": out.rss_end.2,
            },
            "memcheck": memcheck,
            "node_exit_code": out.node_exit.and_then(|s| s.code()),
            "end_status": out.end_status,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_update_the_state() {
        let mut st = WorkerState::default();
        apply(&mut st, "phase copy_in");
        apply(&mut st, "ready 7");
        apply(&mut st, r#"stats {"stores":3,"chunks_verified":9}"#);
        apply(&mut st, "corrupt conv=1 chunk=0");
        apply(&mut st, "error Io: gone");
        apply(&mut st, "anomaly lookup_then_miss conv=1 hits=2");
        assert_eq!(st.phase, "copy_in");
        assert!(st.ready);
        assert_eq!(st.stats.stores, 3);
        assert_eq!(st.stats.chunks_verified, 9);
        assert_eq!(st.errors, 1);
        assert_eq!(st.corrupt_lines, 1);
        assert_eq!(st.lookup_then_miss_lines, 1);
        assert_eq!(st.notes.len(), 3);
        assert_eq!(phase_group(&st.phase), "store");
    }

    #[test]
    fn end_state_conditions() {
        let clean = serde_json::json!({
            "instances": [], "pending_writes": 0, "pending_reads": 0, "sessions": 0,
            "objects": {"ready": 2, "write_reserved": 0, "read_locked": 0, "temporary": 0, "doomed": 0},
            "memcheck_ok": true, "memcheck_problems": [], "used_bytes": 32768
        });
        assert!(end_unmet(&clean, 16384).is_empty());
        let mut dirty = clean.clone();
        dirty["objects"]["read_locked"] = 1.into();
        dirty["used_bytes"] = 49152.into();
        assert_eq!(end_unmet(&dirty, 16384).len(), 2);
    }
}
