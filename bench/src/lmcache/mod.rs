//! `kvnode-bench lmcache`: an LMCache-wire load generator. One DEALER speaks the real 0.5.6
//! client's frames to any LMCache multiprocess server (kvnode's `lmcache-server` or LMCache's
//! own): REGISTER with the real payload, then per op a STORE (PREPARE_STORE, copy into the shm
//! segment the server named, COMMIT_STORE, END_SESSION), a RETRIEVE (LOOKUP, WAIT_PREFETCH_STATUS,
//! PREPARE_RETRIEVE, copy out, COMMIT_RETRIEVE, END_SESSION), a PING and a NOOP. Every call's
//! wire time (just after the send to the reply's arrival) goes into an HDR histogram; a call's
//! server cost is its wire time minus the NOOP's (the floor of the transport both sides pay),
//! so Python's overhead no longer hides the server-to-server comparison.

mod dealer;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvnode::lmcache::wire::{self, Op};
use kvnode_hw::PoolMapping;
use serde_json::json;

use crate::workload::LayoutSpec;
use dealer::{field, slots, uint, Dealer};

/// Command line of `kvnode-bench lmcache`.
#[derive(clap::Args, Debug)]
pub struct LmArgs {
    /// The server, e.g. tcp://127.0.0.1:5555.
    #[arg(long)]
    url: String,
    /// Layout preset: tiny, qwen2.5-0.5b, llama3-8b (the chunk's token count is the server's).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Timed ops (each one store, one retrieve, one PING and one NOOP).
    #[arg(long, default_value_t = 500)]
    ops: u64,
    /// Untimed warm-up ops.
    #[arg(long, default_value_t = 10)]
    warmup: u64,
    /// Chunks per store/retrieve call (the Python driver: 4).
    #[arg(long, default_value_t = 4)]
    chunks: u32,
    /// NOOP round trips timed before the ops (the floor; every op adds one more).
    #[arg(long, default_value_t = 1000)]
    pings: u64,
    /// Write every figure as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The calls timed, in report order. `lookup_wait` is LOOKUP + WAIT_PREFETCH_STATUS (what a
/// scheduler pays before a retrieve); `store`/`retrieve` are end to end, copies included.
const CALLS: [&str; 12] = [
    "noop",
    "ping",
    "register",
    "prepare_store",
    "commit_store",
    "lookup",
    "wait_prefetch",
    "lookup_wait",
    "prepare_retrieve",
    "commit_retrieve",
    "end_session",
    "store",
];
const MODEL: &str = "kvnode-bench-lm";

struct Run {
    d: Dealer,
    hist: BTreeMap<&'static str, Histogram<u64>>,
    pool: PoolMapping,
    instance: u64,
    chunk_bytes: usize,
    chunk_tokens: u32,
    data: Vec<u8>,
    store_time: Duration,
    retrieve_time: Duration,
    stored_bytes: u64,
    retrieved_bytes: u64,
    mismatches: u64,
    misses: u64,
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid bounds")
}

impl Run {
    fn call(
        &mut self,
        name: &'static str,
        op: Op,
        p: Vec<Vec<u8>>,
        timed: bool,
    ) -> Result<Option<rmpv::Value>, String> {
        let a = self.d.call(op, p)?;
        if timed {
            self.record(name, a.wire);
        }
        Ok(a.value)
    }

    fn record(&mut self, name: &'static str, d: Duration) {
        let h = self.hist.entry(name).or_insert_with(hist);
        let _ = h.record((d.as_nanos() as u64).max(1));
    }

    fn inst(&self) -> Vec<u8> {
        wire::encode_uint(self.instance)
    }

    /// The chunk-`c` contents of op `i`: the shared random bytes stamped with (i, c).
    fn stamp(&self, i: u64, c: u32, buf: &mut [u8]) {
        buf.copy_from_slice(&self.data);
        buf[..8].copy_from_slice(&i.to_le_bytes());
        buf[8..12].copy_from_slice(&c.to_le_bytes());
    }

    fn one(&mut self, i: u64, nonce: u64, chunks: u32, timed: bool) -> Result<(), String> {
        let ntok = (chunks * self.chunk_tokens) as usize;
        // Unique per run and op; below a 128k vocabulary like real token ids.
        let tokens: Vec<u32> = (0..ntok as u64)
            .map(|j| (crate::payload::splitmix64(nonce ^ (i << 32) ^ j) % 128_000) as u32)
            .collect();
        let (srid, rrid) = (format!("s{nonce:x}-{i}"), format!("r{nonce:x}-{i}"));
        let mut buf = vec![0u8; self.chunk_bytes];

        // STORE.
        let t = Instant::now();
        let inst = self.inst();
        let r = self
            .call(
                "prepare_store",
                Op::PrepareStore,
                vec![dealer::key(MODEL, &tokens, Some(0), &srid), inst.clone()],
                timed,
            )?
            .ok_or("PREPARE_STORE without a reply")?;
        let ctx = field(&r, "context")?;
        let sl = slots(ctx)?;
        let idx: Vec<u64> = field(ctx, "chunk_indices")?
            .as_array()
            .ok_or("chunk_indices is not an array")?
            .iter()
            .map(|v| uint(v, "chunk index"))
            .collect::<Result<_, _>>()?;
        if sl.len() != chunks as usize || idx.len() != sl.len() {
            return Err(format!(
                "PREPARE_STORE gave {} slots for {chunks} new chunks (pool full?)",
                sl.len()
            ));
        }
        for (&(off, len), &c) in sl.iter().zip(&idx) {
            self.stamp(i, c as u32, &mut buf);
            let n = (len as usize).min(buf.len());
            self.pool
                .region()
                .write_at(off, &buf[..n])
                .map_err(|e| e.to_string())?;
        }
        let ok = self.call(
            "commit_store",
            Op::CommitStore,
            vec![
                dealer::key(MODEL, &tokens, Some(0), &srid),
                inst.clone(),
                vec![0xc4, 0x00],
            ],
            timed,
        )?;
        if ok.as_ref().and_then(rmpv::Value::as_bool) != Some(true) {
            return Err(format!("COMMIT_STORE answered {ok:?}"));
        }
        let took = t.elapsed();
        self.call(
            "end_session",
            Op::EndSession,
            vec![wire::encode_str(&srid)],
            timed,
        )?;
        if timed {
            self.record("store", took);
            self.store_time += took;
            self.stored_bytes += (chunks as usize * self.chunk_bytes) as u64;
        }

        // RETRIEVE.
        let t = Instant::now();
        let a = self.d.call(
            Op::Lookup,
            vec![
                dealer::key(MODEL, &tokens, None, &rrid),
                wire::encode_uint(1),
            ],
        )?;
        let b = self.d.call(
            Op::WaitPrefetchStatus,
            vec![wire::encode_str(&rrid), dealer::float(30.0)],
        )?;
        if timed {
            self.record("lookup", a.wire);
            self.record("wait_prefetch", b.wire);
            self.record("lookup_wait", a.wire + b.wire);
        }
        let hits = b.value.as_ref().and_then(rmpv::Value::as_u64).unwrap_or(0);
        if hits < u64::from(chunks) {
            self.misses += 1;
        }
        let r = self
            .call(
                "prepare_retrieve",
                Op::PrepareRetrieve,
                vec![dealer::key(MODEL, &tokens, Some(0), &rrid), inst.clone()],
                timed,
            )?
            .ok_or("PREPARE_RETRIEVE without a reply")?;
        let mut got = Vec::new();
        if field(&r, "success")?.as_bool() == Some(true) {
            for (c, &(off, len)) in slots(field(&r, "context")?)?.iter().enumerate() {
                let mut out = vec![0u8; (len as usize).min(self.chunk_bytes)];
                self.pool
                    .region()
                    .read_at(off, &mut out)
                    .map_err(|e| e.to_string())?;
                got.push((c as u32, out));
            }
        } else {
            self.misses += 1;
        }
        self.call(
            "commit_retrieve",
            Op::CommitRetrieve,
            vec![dealer::key(MODEL, &tokens, Some(0), &rrid), inst],
            timed,
        )?;
        let took = t.elapsed();
        self.call(
            "end_session",
            Op::EndSession,
            vec![wire::encode_str(&rrid)],
            timed,
        )?;
        if timed {
            self.record("retrieve", took);
            self.retrieve_time += took;
            self.retrieved_bytes += got.iter().map(|g| g.1.len() as u64).sum::<u64>();
        }
        // PING and NOOP right after the retrieve, before the client's own verification, so
        // neither finds the server idle longer than the calls before them.
        let inst = self.inst();
        self.call("ping", Op::Ping, vec![inst], timed)?;
        self.call("noop", Op::Noop, vec![], timed)?;
        for (c, out) in got {
            self.stamp(i, c, &mut buf);
            if out[..] != buf[..out.len()] {
                self.mismatches += 1;
            }
        }
        Ok(())
    }
}

/// Runs the load generator; returns whether every retrieved byte verified and every retrieve hit.
pub fn run(a: &LmArgs) -> Result<bool, String> {
    let layout = LayoutSpec::preset(&a.preset).ok_or_else(|| {
        format!(
            "unknown preset {:?} (tiny, qwen2.5-0.5b, llama3-8b)",
            a.preset
        )
    })?;
    if a.chunks == 0 || a.ops == 0 {
        return Err("--chunks and --ops must be at least 1".into());
    }
    let mut d = Dealer::connect(&a.url)?;
    let chunk = d.call(Op::GetChunkSize, vec![])?.value;
    let chunk_tokens = chunk
        .as_ref()
        .and_then(rmpv::Value::as_u64)
        .ok_or("GET_CHUNK_SIZE did not answer an integer")? as u32;
    let layout = LayoutSpec {
        chunk_tokens,
        ..layout
    };
    let chunk_bytes = layout.chunk_bytes() as usize;
    let nonce = crate::random_nonce();
    let instance = nonce >> 2;
    let reg = d.call(
        Op::RegisterEngineDriven,
        vec![dealer::register_payload(
            instance,
            MODEL,
            layout.layers,
            layout.hidden,
            &layout.dtype,
            chunk_tokens,
        )],
    )?;
    let r = reg.value.ok_or("REGISTER without a reply")?;
    let shm = field(&r, "shm_name")?
        .as_str()
        .ok_or("shm_name is not a string")?
        .to_owned();
    let size = uint(field(&r, "pool_size")?, "pool_size")?;
    if shm.is_empty() || size == 0 {
        return Err(
            "the server advertised no shm segment (LMCache needs --shm-name and --no-l1-use-lazy)"
                .into(),
        );
    }
    let pool =
        PoolMapping::open_posix_shm(&shm, size).map_err(|e| format!("mapping {shm}: {e}"))?;
    let need = (a.ops + a.warmup) * u64::from(a.chunks) * chunk_bytes as u64;
    if need > size / 10 * 7 {
        eprintln!(
            "note: {} MiB stored in all is over 70 % of the {} MiB pool: expect evictions",
            need >> 20,
            size >> 20
        );
    }
    let mut data = vec![0u8; chunk_bytes];
    for (k, b) in data.chunks_mut(8).enumerate() {
        let v = crate::payload::splitmix64(nonce.wrapping_add(k as u64)).to_le_bytes();
        b.copy_from_slice(&v[..b.len()]);
    }
    let mut run = Run {
        d,
        hist: BTreeMap::new(),
        pool,
        instance,
        chunk_bytes,
        chunk_tokens,
        data,
        store_time: Duration::ZERO,
        retrieve_time: Duration::ZERO,
        stored_bytes: 0,
        retrieved_bytes: 0,
        mismatches: 0,
        misses: 0,
    };
    run.record("register", reg.wire);
    for _ in 0..a.pings {
        run.call("noop", Op::Noop, vec![], true)?;
    }
    for i in 0..a.warmup {
        run.one(i, nonce, a.chunks, false)?;
    }
    let (misses0, mism0) = (run.misses, run.mismatches);
    for i in a.warmup..a.warmup + a.ops {
        run.one(i, nonce, a.chunks, true)?;
    }
    let inst = run.inst();
    let _ = run.d.call(Op::UnregisterEngineDriven, vec![inst]);
    let (misses, mismatches) = (run.misses - misses0, run.mismatches - mism0);
    let report = report(a, &layout, &run, misses, mismatches);
    print(&report);
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report).expect("json"))
            .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    Ok(misses == 0 && mismatches == 0)
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        bytes as f64 / t.as_secs_f64() / 1e9
    }
}

fn report(a: &LmArgs, l: &LayoutSpec, r: &Run, misses: u64, mismatches: u64) -> serde_json::Value {
    let mut lat = serde_json::Map::new();
    let mut cost = serde_json::Map::new();
    let noop = r.hist.get("noop");
    let (f50, f99) = noop.map_or((0.0, 0.0), |h| (us(h, 0.5), us(h, 0.99)));
    for name in CALLS.iter().chain(["retrieve"].iter()) {
        let Some(h) = r.hist.get(name) else { continue };
        lat.insert(
            name.to_string(),
            json!({
                "p50": us(h, 0.5), "p90": us(h, 0.9), "p99": us(h, 0.99),
                "max": h.max() as f64 / 1000.0, "count": h.len(),
            }),
        );
        if !matches!(*name, "noop" | "store" | "retrieve" | "register") {
            // LOOKUP + WAIT is two round trips: two floors.
            let k = if *name == "lookup_wait" { 2.0 } else { 1.0 };
            cost.insert(
                name.to_string(),
                json!({"p50": us(h, 0.5) - k * f50, "p99": us(h, 0.99) - k * f99}),
            );
        }
    }
    json!({
        "url": a.url, "preset": l.name, "layers": l.layers, "hidden": l.hidden, "dtype": l.dtype,
        "chunk_tokens": l.chunk_tokens, "chunk_bytes": r.chunk_bytes, "chunks_per_op": a.chunks,
        "ops": a.ops, "warmup": a.warmup,
        "latency_us": lat,
        "noop_floor_us": {"p50": f50, "p99": f99},
        "server_cost_us": cost,
        "store_GBps": gbps(r.stored_bytes, r.store_time),
        "retrieve_GBps": gbps(r.retrieved_bytes, r.retrieve_time),
        "retrieve_misses": misses, "byte_mismatches": mismatches,
        "verified": misses == 0 && mismatches == 0,
    })
}

fn print(r: &serde_json::Value) {
    println!(
        "{} ({}: {} KiB chunks x {} per op, {} ops); NOOP floor p50 {:.1} us, p99 {:.1} us",
        r["url"].as_str().unwrap_or(""),
        r["preset"].as_str().unwrap_or(""),
        r["chunk_bytes"].as_u64().unwrap_or(0) >> 10,
        r["chunks_per_op"],
        r["ops"],
        r["noop_floor_us"]["p50"].as_f64().unwrap_or(0.0),
        r["noop_floor_us"]["p99"].as_f64().unwrap_or(0.0)
    );
    println!(
        "{:18} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "call", "p50 us", "p99 us", "max us", "cost p50", "cost p99"
    );
    if let Some(m) = r["latency_us"].as_object() {
        for (k, v) in m {
            let c = &r["server_cost_us"][k];
            let f = |x: &serde_json::Value| x.as_f64().map_or(String::new(), |x| format!("{x:.1}"));
            println!(
                "{:18} {:>10} {:>10} {:>10} {:>12} {:>12}",
                k,
                f(&v["p50"]),
                f(&v["p99"]),
                f(&v["max"]),
                f(&c["p50"]),
                f(&c["p99"])
            );
        }
    }
    println!(
        "store {:.2} GB/s, retrieve {:.2} GB/s; retrieve misses {}, byte mismatches {}",
        r["store_GBps"].as_f64().unwrap_or(0.0),
        r["retrieve_GBps"].as_f64().unwrap_or(0.0),
        r["retrieve_misses"],
        r["byte_mismatches"]
    );
}
