//! Turns instance results and baselines into the human table, the JSON report and the plot.
//! The JSON schema is documented in the README ("Benchmark JSON").

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::baseline::{MemcpyBaseline, PingPong};
use crate::stats::{Op, OpHistograms};
use crate::workload::{InstanceResult, LayoutSpec, WorkloadKind};

/// Serialises one instance's result (child process -> parent).
pub fn instance_to_json(r: &InstanceResult) -> String {
    json!({
        "ops": r.ops,
        "hist": r.hist.to_hex(),
        "stored_bytes": r.stored_bytes,
        "retrieved_bytes": r.retrieved_bytes,
        "hits": r.hits,
        "misses": r.misses,
        "verified_chunks": r.verified_chunks,
        "moved_bytes": r.moved_bytes,
        "corrupt_chunks": r.corrupt_chunks,
        "store_skipped_chunks": r.store_skipped_chunks,
        "elapsed_ns": r.elapsed.as_nanos() as u64,
        "verify_ns": r.verify_time.as_nanos() as u64,
        "payload_ns": r.payload_time.as_nanos() as u64,
    })
    .to_string()
}

/// Parses [`instance_to_json`] output (the last JSON line of a child's stdout).
pub fn instance_from_json(text: &str) -> Result<InstanceResult, String> {
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("instance process printed no result")?;
    let v: Value = serde_json::from_str(line).map_err(|e| format!("instance result: {e}"))?;
    let n = |k: &str| {
        v[k].as_u64()
            .ok_or_else(|| format!("instance result lacks {k}"))
    };
    let hist: Vec<String> = serde_json::from_value(v["hist"].clone()).map_err(|e| e.to_string())?;
    Ok(InstanceResult {
        ops: n("ops")?,
        hist: OpHistograms::from_hex(&hist)?,
        stored_bytes: n("stored_bytes")?,
        retrieved_bytes: n("retrieved_bytes")?,
        hits: n("hits")?,
        misses: n("misses")?,
        verified_chunks: n("verified_chunks")?,
        moved_bytes: n("moved_bytes")?,
        corrupt_chunks: n("corrupt_chunks")?,
        store_skipped_chunks: n("store_skipped_chunks")?,
        elapsed: Duration::from_nanos(n("elapsed_ns")?),
        verify_time: Duration::from_nanos(n("verify_ns")?),
        payload_time: Duration::from_nanos(n("payload_ns")?),
    })
}

/// What the report is built from.
pub struct Inputs<'a> {
    /// Layout.
    pub layout: &'a LayoutSpec,
    /// Workload.
    pub workload: WorkloadKind,
    /// Mixed read probability.
    pub hit_ratio: f64,
    /// Instances.
    pub instances: u32,
    /// Whether instances were processes.
    pub processes: bool,
    /// Whether bytes were verified.
    pub verify: bool,
    /// The nonce hashed into every key of the run.
    pub run_nonce: u64,
    /// Pool backing reported by the node.
    pub backing: String,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    /// Per-instance results.
    pub results: &'a [InstanceResult],
    /// Wall time of the whole load phase.
    pub wall: Duration,
    /// memcpy with one thread.
    pub memcpy_1: MemcpyBaseline,
    /// memcpy with one thread per instance.
    pub memcpy_n: MemcpyBaseline,
    /// Unix-socket ping-pong floor.
    pub pingpong: PingPong,
    /// Node status after the run.
    pub node_status: Option<Value>,
}

/// The finished report.
pub struct Report {
    /// Every figure (the `--json` document).
    pub json: Value,
    /// Merged histograms.
    pub hist: OpHistograms,
    /// Whether verification ran and found no corrupt chunk.
    pub verified: bool,
    /// Chunks read back with wrong bytes.
    pub corrupt_chunks: u64,
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        bytes as f64 / d.as_secs_f64() / 1e9
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

impl Report {
    /// Merges results and computes every figure.
    pub fn build(i: Inputs<'_>) -> Report {
        let mut hist = OpHistograms::default();
        for r in i.results {
            hist.merge(&r.hist);
        }
        let sum = |f: fn(&InstanceResult) -> u64| i.results.iter().map(f).sum::<u64>();
        let ops = sum(|r| r.ops);
        // Throughput over the measured time of the timed phase: all instances start together
        // (barrier), so this is the longest instance's timed phase, each one's minus the
        // harness's own work in it (verifying retrieved bytes, generating payloads to store).
        let elapsed = i
            .results
            .iter()
            .map(|r| r.elapsed)
            .max()
            .unwrap_or_default();
        let verify_s: f64 = i.results.iter().map(|r| r.verify_time.as_secs_f64()).sum();
        let payload_s: f64 = i.results.iter().map(|r| r.payload_time.as_secs_f64()).sum();
        // Wall time of every instance's timed phase, harness work included.
        let timed_wall_s: f64 = i
            .results
            .iter()
            .map(|r| (r.elapsed + r.verify_time + r.payload_time).as_secs_f64())
            .sum();
        let store_gbps = gbps(sum(|r| r.stored_bytes), elapsed);
        let retrieve_gbps = gbps(sum(|r| r.retrieved_bytes), elapsed);
        let corrupt = sum(|r| r.corrupt_chunks);
        let verified_chunks = sum(|r| r.verified_chunks);
        // Every instance must have checked something, and nothing may differ.
        let verified = i.verify && corrupt == 0 && i.results.iter().all(|r| r.verified_chunks > 0);
        let per_instance: Vec<f64> = i
            .results
            .iter()
            .map(|r| r.ops as f64 / r.elapsed.as_secs_f64().max(1e-9))
            .collect();
        let mean = per_instance.iter().sum::<f64>() / per_instance.len().max(1) as f64;
        let min = per_instance.iter().copied().fold(f64::INFINITY, f64::min);
        let mut lat = Map::new();
        for op in Op::ALL {
            lat.insert(
                op.name().into(),
                serde_json::to_value(hist.percentiles(op)).expect("plain numbers"),
            );
        }
        let control_p50 =
            hist.percentiles(Op::PrepareStore).p50 + hist.percentiles(Op::CommitStore).p50;
        let json = json!({
            "verified": verified,
            "ops": ops,
            "ops_per_sec": ratio(ops as f64, elapsed.as_secs_f64()),
            "elapsed_s": elapsed.as_secs_f64(),
            "wall_s": i.wall.as_secs_f64(),
            "latency_us": lat,
            "store_gbps": store_gbps,
            "retrieve_gbps": retrieve_gbps,
            "memcpy_gbps": i.memcpy_n.write_gbps,
            "memcpy_read_gbps": i.memcpy_n.read_gbps,
            "store_vs_memcpy": ratio(store_gbps, i.memcpy_n.write_gbps),
            "retrieve_vs_memcpy": ratio(retrieve_gbps, i.memcpy_n.read_gbps),
            "uds_pingpong_p50_us": i.pingpong.p50_us,
            "uds_pingpong_p99_us": i.pingpong.p99_us,
            "ping_vs_uds_floor": ratio(hist.percentiles(Op::Ping).p50, i.pingpong.p50_us),
            "store_control_p50_us": control_p50,
            "pool_backing": i.backing,
            "instances": i.instances,
            "processes": i.processes,
            "chunk_bytes": i.chunk_bytes,
            "preset": i.layout.name,
            "layout": {"layers": i.layout.layers, "hidden": i.layout.hidden, "dtype": i.layout.dtype, "chunk_tokens": i.layout.chunk_tokens},
            "workload": i.workload,
            "hit_ratio": i.hit_ratio,
            "hits": sum(|r| r.hits),
            "misses": sum(|r| r.misses),
            "verified_chunks": verified_chunks,
            "verify_share": ratio(verify_s, timed_wall_s),
            "verify_s": verify_s,
            "payload_s": payload_s,
            "corrupt_chunks": corrupt,
            "store_skipped_chunks": sum(|r| r.store_skipped_chunks),
            "run_nonce": i.run_nonce,
            "per_instance_ops_per_sec": per_instance,
            "fairness_min_over_mean": ratio(min, mean),
            "memcpy": {"single_thread": i.memcpy_1, "per_instance_threads": i.memcpy_n},
            "uds_pingpong": i.pingpong,
            "node_status": i.node_status.unwrap_or(Value::Null),
        });
        Report {
            json,
            hist,
            verified,
            corrupt_chunks: corrupt,
        }
    }

    /// Prints the human-readable table on stdout.
    pub fn print_table(&self) {
        let j = &self.json;
        println!(
            "kvnode-bench  preset {}  workload {}  instances {}  chunk {} KiB  pool {}",
            j["preset"].as_str().unwrap_or("?"),
            j["workload"].as_str().unwrap_or("?"),
            j["instances"],
            j["chunk_bytes"].as_u64().unwrap_or(0) / 1024,
            j["pool_backing"].as_str().unwrap_or("?")
        );
        println!(
            "{:<18}{:>9}{:>10}{:>10}{:>10}{:>10}{:>10}",
            "op (us)", "count", "p50", "p90", "p99", "p99.9", "max"
        );
        for op in Op::ALL {
            let p = self.hist.percentiles(op);
            if p.count == 0 {
                continue;
            }
            println!(
                "{:<18}{:>9}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}",
                op.name(),
                p.count,
                p.p50,
                p.p90,
                p.p99,
                p.p999,
                p.max
            );
        }
        let f = |k: &str| j[k].as_f64().unwrap_or(0.0);
        println!(
            "throughput  {:.0} ops/s  store {:.2} GB/s ({:.0}% of memcpy {:.2})  retrieve {:.2} GB/s ({:.0}% of memcpy {:.2})",
            f("ops_per_sec"),
            f("store_gbps"),
            100.0 * f("store_vs_memcpy"),
            f("memcpy_gbps"),
            f("retrieve_gbps"),
            100.0 * f("retrieve_vs_memcpy"),
            f("memcpy_read_gbps"),
        );
        println!(
            "floor       uds ping-pong p50 {:.1} us (ping p50 = {:.2}x)  fairness min/mean {:.2}  hits {} misses {}",
            f("uds_pingpong_p50_us"),
            f("ping_vs_uds_floor"),
            f("fairness_min_over_mean"),
            j["hits"],
            j["misses"]
        );
        println!(
            "verified    {} ({} chunks checked, {} corrupt)",
            j["verified"], j["verified_chunks"], j["corrupt_chunks"]
        );
    }

    /// Writes the PNG plot.
    pub fn plot(&self, path: &Path) -> Result<(), String> {
        let curves: Vec<crate::plot::LatencyCurve> = Op::ALL
            .iter()
            .filter(|op| !self.hist.get(**op).is_empty())
            .map(|op| crate::plot::LatencyCurve {
                name: op.name().into(),
                points: self.hist.curve(*op),
            })
            .collect();
        let f = |k: &str| self.json[k].as_f64().unwrap_or(0.0);
        let bars = vec![
            ("store".to_string(), f("store_gbps")),
            ("retrieve".to_string(), f("retrieve_gbps")),
            ("memcpy write".to_string(), f("memcpy_gbps")),
            ("memcpy read".to_string(), f("memcpy_read_gbps")),
        ];
        let title = format!(
            "kvnode {} {} x{}",
            self.json["preset"].as_str().unwrap_or("?"),
            self.json["workload"].as_str().unwrap_or("?"),
            self.json["instances"]
        );
        crate::plot::write_png(path, &title, &curves, &bars)
    }
}
