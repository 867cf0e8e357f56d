//! The loop's figures: those of one iteration (its JSON and its stderr line) and the run's
//! totals and summary line.

use serde_json::{json, Value};

use super::disk::Scan;
use super::Loop;

/// Figures of one iteration.
#[derive(Default, Clone)]
pub(super) struct Iter {
    pub(super) kill_target_writes: u64,
    pub(super) writes_at_kill: u64,
    pub(super) queued_at_kill: u64,
    pub(super) unwritten_at_kill: u64,
    /// The node's STATUS at the last poll before the kill: its `l2` object and eviction counters.
    pub(super) status_at_kill: Value,
    pub(super) busy: bool,
    pub(super) kill_delay_us: u64,
    pub(super) committed: u64,
    pub(super) present: u64,
    pub(super) refused: u64,
    pub(super) clear: Option<ClearOutcome>,
    pub(super) sabotaged_slots: Option<u64>,
    pub(super) scan: Scan,
    pub(super) recovered: u64,
    pub(super) served: u64,
    pub(super) served_committed: u64,
    /// Committed in this iteration, not served, and not dropped by a CLEAR that returned.
    pub(super) missing: u64,
    /// Committed in this iteration and dropped by a CLEAR that returned (never served).
    pub(super) cleared: u64,
    pub(super) wrong: u64,
    pub(super) resurrected: u64,
    /// STATUS `l2.corrupt`: checksum failures the node blames on the medium.
    pub(super) corrupt: u64,
    /// STATUS `l2.torn`: checksum failures the node puts down to the kill before the restart.
    pub(super) torn_counted: u64,
    pub(super) errors: u64,
    pub(super) stalled: u64,
    pub(super) hits: u64,
    pub(super) objects_after: u64,
    pub(super) memcheck_ok: bool,
    pub(super) memcheck_problems: Vec<String>,
}

#[derive(Clone)]
pub(super) struct ClearOutcome {
    /// The kill was aimed at the CLEAR itself (else at the write-behind after it returned).
    pub(super) during: bool,
    /// CLEAR returned OK (whether before or after the SIGKILL was sent, it was acknowledged).
    pub(super) returned: bool,
    /// Its error, if it answered one (an error naming a CLEAR not durable yet, say).
    pub(super) error: Option<String>,
    pub(super) latency_us: Option<u64>,
    /// Every epoch below this must never be served again.
    pub(super) forbidden_below: u32,
}

impl Iter {
    pub(super) fn json(&self, n: u32) -> Value {
        json!({
            "iteration": n,
            "kill_target_writes": self.kill_target_writes,
            "writes_at_kill": self.writes_at_kill,
            "queued_at_kill": self.queued_at_kill,
            "unwritten_at_kill": self.unwritten_at_kill,
            "status_at_kill": self.status_at_kill,
            "busy": self.busy,
            "kill_delay_us": self.kill_delay_us,
            "committed": self.committed,
            "present": self.present,
            "refused": self.refused,
            "clear": self.clear.as_ref().map(|c| json!({
                "kill": if c.during { "during" } else { "after" },
                "returned": c.returned,
                "error": c.error,
                "latency_us": c.latency_us,
                "forbidden_below_epoch": c.forbidden_below,
            })),
            "sabotaged_slots": self.sabotaged_slots,
            "scan": {
                "live": self.scan.live,
                "torn": self.scan.torn,
                "torn_other_key": self.scan.torn_other_key,
                "torn_same_key": self.scan.torn_same_key,
            },
            "recovered": self.recovered,
            "served": self.served,
            "served_committed": self.served_committed,
            "missing": self.missing,
            "cleared": self.cleared,
            "wrong": self.wrong,
            "resurrected": self.resurrected,
            "corrupt": self.corrupt,
            "torn_counted": self.torn_counted,
            "errors": self.errors,
            "stalled": self.stalled,
            "hits": self.hits,
            "objects_after": self.objects_after,
            "memcheck_ok": self.memcheck_ok,
            "memcheck_problems": self.memcheck_problems,
        })
    }

    pub(super) fn line(&self, n: u32, of: u32) -> String {
        let clear = match &self.clear {
            None => String::new(),
            Some(c) => {
                let kill = if c.during { "during" } else { "after" };
                match (&c.error, c.returned) {
                    (_, true) => format!(
                        " | kill {kill} a CLEAR that returned ({} us)",
                        c.latency_us.unwrap_or(0)
                    ),
                    (Some(e), _) => format!(" | kill {kill} a CLEAR that failed: {e}"),
                    (None, false) => format!(" | kill {kill} a CLEAR that did not return"),
                }
            }
        };
        format!(
            "iteration {n}/{of}: kill at writes={} queued={} unwritten={}{}{clear} | committed {} \
             present {} refused {} | torn on disk {} (slot reused {}) | recovered {} served {} \
             (committed this iteration {}) missing {}{} wrong {} resurrected {} | corrupt {} torn {} \
             errors {} stalled {} | memcheck {}",
            self.writes_at_kill,
            self.queued_at_kill,
            self.unwritten_at_kill,
            if self.busy { "" } else { " (idle)" },
            self.committed,
            self.present,
            self.refused,
            self.scan.torn,
            self.scan.torn_other_key,
            self.recovered,
            self.served,
            self.served_committed,
            self.missing,
            if self.clear.is_some() {
                format!(" cleared {}", self.cleared)
            } else {
                String::new()
            },
            self.wrong,
            self.resurrected,
            self.corrupt,
            self.torn_counted,
            self.errors,
            self.stalled,
            if self.memcheck_ok { "ok" } else { "FAILED" },
        )
    }
}

impl Loop<'_> {
    pub(super) fn totals(&self) -> Value {
        let sum = |f: fn(&Iter) -> u64| self.iters.iter().map(f).sum::<u64>();
        let clears = self.iters.iter().filter_map(|i| i.clear.as_ref());
        json!({
            "kills": self.iters.len(),
            "busy_kills": sum(|i| u64::from(i.busy)),
            "committed": sum(|i| i.committed),
            "present": sum(|i| i.present),
            "refused": sum(|i| i.refused),
            "recovered": sum(|i| i.recovered),
            "served": sum(|i| i.served),
            "served_committed": sum(|i| i.served_committed),
            "missing": sum(|i| i.missing),
            "cleared": sum(|i| i.cleared),
            "wrong": sum(|i| i.wrong),
            "resurrected": sum(|i| i.resurrected),
            "corrupt": sum(|i| i.corrupt),
            "torn_counted": sum(|i| i.torn_counted),
            "torn": sum(|i| i.scan.torn),
            "torn_other_key": sum(|i| i.scan.torn_other_key),
            "torn_same_key": sum(|i| i.scan.torn_same_key),
            "errors": sum(|i| i.errors),
            "stalled": sum(|i| i.stalled),
            "memcheck_failures": sum(|i| u64::from(!i.memcheck_ok)),
            "clears": clears.clone().count(),
            "clears_returned": clears.clone().filter(|c| c.returned).count(),
            "clears_killed_during": clears.clone().filter(|c| c.during).count(),
            "clears_killed_during_returned": clears.clone().filter(|c| c.during && c.returned).count(),
            "clears_failed": clears.filter(|c| c.error.is_some()).count(),
        })
    }

    pub(super) fn summary(&self, t: &Value) -> String {
        let n = |k: &str| t[k].as_u64().unwrap_or(0);
        let clear = if self.a.clear {
            format!(
                ", {} CLEARs ({} killed during the CLEAR, {} of those returned; {} returned in all, \
                 {} errors), {} resurrected",
                n("clears"),
                n("clears_killed_during"),
                n("clears_killed_during_returned"),
                n("clears_returned"),
                n("clears_failed"),
                n("resurrected")
            )
        } else {
            String::new()
        };
        let cleared = if self.a.clear {
            format!(", {} dropped by CLEARs", n("cleared"))
        } else {
            String::new()
        };
        format!(
            "L2-KILLLOOP: {} iterations, {} kills, {} served, {} wrong, {} recovered, {} missing \
             (of {} committed{cleared}), {} corrupt, {} torn counted ({} torn on disk after the \
             kills, {} of them in reused slots), {} errors, memcheck {}{clear}; {} kills with the write-behind \
             busy, variant {}, engine {}, seed {}: {}",
            self.iters.len(),
            n("kills"),
            n("served"),
            n("wrong"),
            n("recovered"),
            n("missing"),
            n("committed"),
            n("corrupt"),
            n("torn_counted"),
            n("torn"),
            n("torn_other_key"),
            n("errors"),
            if n("memcheck_failures") == 0 {
                "ok"
            } else {
                "FAILED"
            },
            n("busy_kills"),
            if self.a.clear { "clear" } else { "store" },
            self.engine_used,
            self.seed,
            if self.failures.is_empty() {
                "PASS"
            } else {
                "FAIL"
            },
        )
    }
}
