//! `kvnode-bench --gpu`: engines that store from and retrieve into device memory through the
//! node (one client, one stream per instance), next to the raw copies between device memory
//! and registered or pageable host memory of the same request size, measured in the same run.
//!
//! Each request moves `--gpu-batch` chunks. Stores use fresh keys (the node evicts the oldest
//! objects as it would in service) from four source buffers with different bodies in turn;
//! retrieves cycle over the most recent requests that fit in the pool. Rates are bytes over each
//! phase's wall time (the longest instance's), so the harness's small work between requests
//! counts against the node. Verification: every retrieved chunk's 32-byte header must be its key
//! (the right object); after the timed phase the 8 most recent requests are retrieved into a
//! poisoned buffer and compared whole; `corrupt_chunks` counts failures.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use kvnode::client::{ChunkRangeBuilder, Client, RemoteClient};
use kvnode::hashing::ChunkHash;
use kvnode::protocol::{ChunkRange, RegisterRequest};
use kvnode_hw::gpu::{DeviceSpan, Gpu};
use serde_json::json;

use crate::conn::RemoteTarget;
use crate::payload::{splitmix64, Payload, HEADER_BYTES};
use crate::workload::LayoutSpec;

/// Requests verified whole (into a poisoned buffer) after the timed retrieve phase.
const FULL_CHECKS: u64 = 8;

/// Source buffers with different chunk bodies, used in turn by the stores.
const VARIANTS: u64 = 4;

/// What the GPU run needs from the command line.
pub struct GpuRun<'a> {
    pub device: u32,
    pub socket: String,
    pub remote: Option<RemoteTarget>,
    pub layout: &'a LayoutSpec,
    pub instances: u32,
    pub batch: u32,
    pub ops: Option<u64>,
    pub duration: Duration,
    pub warmup: u64,
    pub pool_bytes: u64,
    pub baseline: Duration,
    pub run_nonce: u64,
    pub verify: bool,
}

/// A reusable start line for the instances' phases that a failing instance can break, so the
/// others return instead of waiting for it forever.
struct StartLine {
    n: usize,
    state: Mutex<(usize, u64, bool)>, // (arrived, generation, broken)
    cv: Condvar,
}

impl StartLine {
    fn new(n: usize) -> StartLine {
        StartLine {
            n,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    /// Waits until every instance arrived; `Err` once any instance broke the line.
    fn wait(&self) -> Result<(), String> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.2 {
            return Err("another instance failed".into());
        }
        st.0 += 1;
        if st.0 == self.n {
            st.0 = 0;
            st.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let gen = st.1;
        while st.1 == gen && !st.2 {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        if st.2 {
            Err("another instance failed".into())
        } else {
            Ok(())
        }
    }

    fn break_line(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).2 = true;
        self.cv.notify_all();
    }
}

/// One engine's device paths, local or remote.
trait DeviceEngine {
    fn store(&mut self, id: u64, r: &ChunkRange, spans: &[DeviceSpan<'_>])
        -> kvnode::Result<usize>;
    fn retrieve(
        &mut self,
        id: u64,
        r: &ChunkRange,
        spans: &[DeviceSpan<'_>],
    ) -> kvnode::Result<bool>;
}

impl DeviceEngine for Client {
    fn store(&mut self, id: u64, r: &ChunkRange, s: &[DeviceSpan<'_>]) -> kvnode::Result<usize> {
        self.store_from_device(id, r, s)
    }
    fn retrieve(&mut self, id: u64, r: &ChunkRange, s: &[DeviceSpan<'_>]) -> kvnode::Result<bool> {
        self.retrieve_to_device(id, r, None, s)
    }
}

impl DeviceEngine for RemoteClient {
    fn store(&mut self, id: u64, r: &ChunkRange, s: &[DeviceSpan<'_>]) -> kvnode::Result<usize> {
        self.store_from_device(id, r, s)
    }
    fn retrieve(&mut self, id: u64, r: &ChunkRange, s: &[DeviceSpan<'_>]) -> kvnode::Result<bool> {
        self.retrieve_to_device(id, r, None, s)
    }
}

/// One instance's figures.
#[derive(Default)]
struct Phase {
    bytes: u64,
    elapsed: Duration,
    lat_us: Vec<f64>,
}

#[derive(Default)]
struct InstanceResult {
    store: Phase,
    retrieve: Phase,
    misses: u64,
    corrupt: u64,
    checked_headers: u64,
    checked_full: u64,
}

fn key(nonce: u64, inst: u32, op: u64, chunk: u32) -> ChunkHash {
    let mut h = [0u8; 32];
    let mut x = splitmix64(nonce ^ (u64::from(inst) << 48) ^ op.rotate_left(20) ^ u64::from(chunk));
    for w in h.chunks_mut(8) {
        x = splitmix64(x);
        w.copy_from_slice(&x.to_le_bytes());
    }
    h
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs the GPU workload and the raw baselines; returns the report (JSON) and whether every
/// check passed.
pub fn run(g: &GpuRun<'_>) -> Result<(serde_json::Value, bool), String> {
    let gpu = Gpu::open(g.device).map_err(|e| format!("--gpu: {e}"))?;
    let chunk = g.layout.chunk_bytes();
    let req_bytes = chunk * u64::from(g.batch);
    let resident =
        (g.pool_bytes as f64 * 0.7 / (req_bytes * u64::from(g.instances)) as f64).floor() as u64;
    if resident == 0 {
        return Err(format!(
            "the pool ({} MiB) cannot hold {} instances x {} chunks of {} MiB: give a larger \
             --pool-size or a smaller --gpu-batch",
            g.pool_bytes >> 20,
            g.instances,
            g.batch,
            chunk >> 20
        ));
    }
    eprintln!(
        "kvnode-bench --gpu: {} ({}), {} instance(s) x {} chunks of {} bytes per request, {} \
         requests resident per instance",
        gpu.info().name,
        gpu.info().backend,
        g.instances,
        g.batch,
        chunk,
        resident
    );
    let barrier = StartLine::new(g.instances as usize);
    let results: Vec<Result<InstanceResult, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..g.instances)
            .map(|i| {
                let (gpu, barrier) = (&gpu, &barrier);
                s.spawn(move || {
                    let r = instance(g, gpu, i, resident, barrier);
                    if r.is_err() {
                        barrier.break_line();
                    }
                    r
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a GPU instance panicked".into()))
            })
            .collect()
    });
    // Report the failure that broke the start line, not the instances it stopped.
    let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    if let Some(e) = errors
        .iter()
        .find(|e| !e.contains("another instance failed"))
        .or(errors.first())
    {
        return Err((*e).clone());
    }
    let results: Vec<InstanceResult> = results.into_iter().collect::<Result<_, _>>()?;
    let raw = crate::gpu_raw::measure(
        &gpu,
        g.instances as usize,
        chunk,
        g.batch as usize,
        g.baseline,
    )?;
    let rate = |f: &dyn Fn(&InstanceResult) -> &Phase| {
        let bytes: u64 = results.iter().map(|r| f(r).bytes).sum();
        let t = results
            .iter()
            .map(|r| f(r).elapsed)
            .max()
            .unwrap_or_default();
        bytes as f64 / t.as_secs_f64().max(1e-9) / 1e9
    };
    let store = rate(&|r| &r.store);
    let retrieve = rate(&|r| &r.retrieve);
    let mut store_lat: Vec<f64> = results
        .iter()
        .flat_map(|r| r.store.lat_us.clone())
        .collect();
    let mut retr_lat: Vec<f64> = results
        .iter()
        .flat_map(|r| r.retrieve.lat_us.clone())
        .collect();
    let corrupt: u64 = results.iter().map(|r| r.corrupt).sum();
    let misses: u64 = results.iter().map(|r| r.misses).sum();
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let info = gpu.info();
    let verified = corrupt == 0 && misses == 0;
    let rep = json!({
        "gpu": info.name,
        "gpu_backend": info.backend,
        "gpu_driver": kvnode_hw::gpu::driver_version_string(info.driver_version),
        "gpu_dma_buf": info.dma_buf,
        "gpu_device": g.device,
        "gpu_transport": if g.remote.is_some() { "tcp" } else { "local" },
        "layout": g.layout.name,
        "chunk_bytes": chunk,
        "gpu_batch_chunks": g.batch,
        "instances": g.instances,
        "gpu_store_gbps": store,
        "gpu_retrieve_gbps": retrieve,
        "gpu_store_p50_us": percentile(&mut store_lat, 0.5),
        "gpu_store_p99_us": percentile(&mut store_lat, 0.99),
        "gpu_retrieve_p50_us": percentile(&mut retr_lat, 0.5),
        "gpu_retrieve_p99_us": percentile(&mut retr_lat, 0.99),
        "gpu_store_requests": store_lat.len(),
        "gpu_retrieve_requests": retr_lat.len(),
        "raw_registered_d2h_gbps": raw.registered_d2h,
        "raw_registered_h2d_gbps": raw.registered_h2d,
        "raw_pageable_d2h_gbps": raw.pageable_d2h,
        "raw_pageable_h2d_gbps": raw.pageable_h2d,
        "gpu_store_vs_raw": ratio(store, raw.registered_d2h),
        "gpu_retrieve_vs_raw": ratio(retrieve, raw.registered_h2d),
        "registered_vs_pageable_h2d": ratio(raw.registered_h2d, raw.pageable_h2d),
        "verify": g.verify,
        "verified": verified,
        "misses": misses,
        "corrupt_chunks": corrupt,
        "checked_headers": results.iter().map(|r| r.checked_headers).sum::<u64>(),
        "checked_full_chunks": results.iter().map(|r| r.checked_full).sum::<u64>(),
    });
    Ok((rep, verified || !g.verify))
}

/// Connects instance `i` (local or remote), registered and attached to `gpu`.
fn connect(
    g: &GpuRun<'_>,
    gpu: &Gpu,
    req: &RegisterRequest,
) -> Result<Box<dyn DeviceEngine>, String> {
    let e = |e: kvnode::error::Error| e.to_string();
    Ok(match &g.remote {
        Some(t) => {
            let mut c = t.connect("kvnode-bench gpu")?;
            c.register(req).map_err(e)?;
            c.attach_gpu(gpu).map_err(e)?;
            Box::new(c)
        }
        None => {
            let mut c = Client::connect(&g.socket).map_err(e)?;
            c.register(req).map_err(e)?;
            c.attach_gpu(gpu).map_err(e)?;
            Box::new(c)
        }
    })
}

fn instance(
    g: &GpuRun<'_>,
    gpu: &Gpu,
    i: u32,
    resident: u64,
    barrier: &StartLine,
) -> Result<InstanceResult, String> {
    let id = (u64::from(std::process::id()) << 20) | (1 << 19) | u64::from(i);
    let model = format!("bench-gpu-{}", g.layout.name);
    let req = RegisterRequest {
        instance_id: id,
        model: model.clone(),
        world_size: 1,
        block_size: 16,
        num_layers: g.layout.layers,
        hidden_dim: g.layout.hidden,
        dtype: g.layout.dtype.clone(),
        use_mla: false,
        physical_slots: None,
    };
    let mut c = connect(g, gpu, &req)?;
    let chunk = g.layout.chunk_bytes();
    let batch = g.batch as usize;
    let e = |e: kvnode_hw::HwError| e.to_string();
    // VARIANTS source buffers with different bodies, used in turn: a store that leaves bytes
    // out leaves another variant's (or an evicted object's) bytes in the slot.
    let payload = Payload::new(chunk as usize);
    let mut srcs = Vec::new();
    let mut bodies: Vec<Vec<Vec<u8>>> = Vec::new();
    for v in 0..VARIANTS {
        let buf = gpu.alloc(chunk * batch as u64).map_err(e)?;
        let bs: Vec<Vec<u8>> = (0..g.batch)
            .map(|j| {
                let mut b = vec![0u8; chunk as usize];
                payload.fill(&key(g.run_nonce, i, u64::MAX - v, j), &mut b);
                b
            })
            .collect();
        for (j, b) in bs.iter().enumerate() {
            buf.write(j as u64 * chunk, b).map_err(e)?;
        }
        srcs.push(buf);
        bodies.push(bs);
    }
    let dst = gpu.alloc(chunk * batch as u64).map_err(e)?;
    let range_of = |op: u64| -> (ChunkRange, Vec<ChunkHash>) {
        let keys: Vec<ChunkHash> = (0..g.batch).map(|j| key(g.run_nonce, i, op, j)).collect();
        (
            ChunkRangeBuilder::worker(&model, 1, 0).hashes(0, keys.clone()),
            keys,
        )
    };
    let src_spans: Vec<Vec<DeviceSpan>> = srcs
        .iter()
        .map(|b| b.chunks(chunk, batch))
        .collect::<Result<_, _>>()
        .map_err(e)?;
    let dst_spans = dst.chunks(chunk, batch).map_err(e)?;
    let mut r = InstanceResult::default();
    let mut stored = 0u64;
    let mut store_one =
        |c: &mut Box<dyn DeviceEngine>, timed: Option<&mut Phase>| -> Result<(), String> {
            let (rg, keys) = range_of(stored);
            let v = (stored % VARIANTS) as usize;
            for (j, k) in keys.iter().enumerate() {
                srcs[v]
                    .write(j as u64 * chunk, &k[..HEADER_BYTES])
                    .map_err(e)?;
            }
            let t = Instant::now();
            let n = c
                .store(id, &rg, &src_spans[v])
                .map_err(|e| format!("store: {e}"))?;
            let d = t.elapsed();
            if n != batch {
                return Err(format!(
                    "store {stored}: the node had {} of {batch} fresh chunks already",
                    batch - n
                ));
            }
            if let Some(p) = timed {
                p.bytes += chunk * batch as u64;
                p.lat_us.push(d.as_secs_f64() * 1e6);
            }
            stored += 1;
            Ok(())
        };
    for _ in 0..g.warmup {
        store_one(&mut c, None)?;
    }
    barrier.wait()?;
    // A phase's time is its wall time: the harness's small work between requests (writing the
    // key headers, reading them back) counts against the node, never for it.
    let t = Instant::now();
    let mut phase = Phase::default();
    while g.ops.map_or(t.elapsed() < g.duration, |n| {
        (phase.lat_us.len() as u64) < n
    }) {
        store_one(&mut c, Some(&mut phase))?;
    }
    phase.elapsed = t.elapsed();
    r.store = phase;
    if stored == 0 {
        return Err(
            "no request was stored: give --ops of at least 1 or a longer --duration".into(),
        );
    }
    // Retrieves over the most recent requests that are still resident.
    let window = resident.min(stored).max(1);
    let first = stored - window;
    let mut header = vec![0u8; HEADER_BYTES];
    // One untimed retrieve first, as the raw copies have (first touches, lazy driver setup).
    let (rg, _) = range_of(stored - 1);
    c.retrieve(id, &rg, &dst_spans)
        .map_err(|e| format!("retrieve: {e}"))?;
    barrier.wait()?;
    let mut phase = Phase::default();
    let t = Instant::now();
    let mut k = 0u64;
    while g.ops.map_or(t.elapsed() < g.duration, |n| k < n) {
        let op = first + k % window;
        let (rg, keys) = range_of(op);
        let t0 = Instant::now();
        let hit = c
            .retrieve(id, &rg, &dst_spans)
            .map_err(|e| format!("retrieve: {e}"))?;
        let d = t0.elapsed();
        k += 1;
        if !hit {
            r.misses += 1;
            continue;
        }
        phase.bytes += chunk * batch as u64;
        phase.lat_us.push(d.as_secs_f64() * 1e6);
        if g.verify {
            // The right object: each chunk's header is its key (a retrieve that moved nothing
            // leaves the previous request's keys).
            for (j, key) in keys.iter().enumerate() {
                dst.read(j as u64 * chunk, &mut header).map_err(e)?;
                r.checked_headers += 1;
                r.corrupt += u64::from(header[..] != key[..HEADER_BYTES]);
            }
        }
    }
    phase.elapsed = t.elapsed();
    r.retrieve = phase;
    if g.verify {
        // Whole chunks, after the timed phase: the most recent requests, each retrieved into a
        // poisoned buffer (bytes a retrieve leaves out keep the poison).
        let poison = vec![0xEE_u8; chunk as usize * batch];
        let mut whole = vec![0u8; chunk as usize];
        for op in stored - window.min(FULL_CHECKS)..stored {
            dst.write(0, &poison).map_err(e)?;
            let (rg, keys) = range_of(op);
            if !c
                .retrieve(id, &rg, &dst_spans)
                .map_err(|e| format!("retrieve: {e}"))?
            {
                r.misses += 1;
                continue;
            }
            for (j, key) in keys.iter().enumerate() {
                dst.read(j as u64 * chunk, &mut whole).map_err(e)?;
                r.checked_full += 1;
                let body = &bodies[(op % VARIANTS) as usize][j];
                let ok = whole[..HEADER_BYTES] == key[..HEADER_BYTES]
                    && whole[HEADER_BYTES..] == body[HEADER_BYTES..];
                r.corrupt += u64::from(!ok);
            }
        }
    }
    Ok(r)
}

/// Prints the figures people read first.
pub fn print_table(rep: &serde_json::Value) {
    let f = |k: &str| rep[k].as_f64().unwrap_or(0.0);
    println!(
        "GPU {} ({}), {} instance(s), {} x {} bytes per request",
        rep["gpu"].as_str().unwrap_or("?"),
        rep["gpu_backend"].as_str().unwrap_or("?"),
        rep["instances"],
        rep["gpu_batch_chunks"],
        rep["chunk_bytes"]
    );
    println!(
        "  store from device    {:8.2} GB/s   raw registered D2H {:8.2}   ratio {:.3}   (pageable {:.2})",
        f("gpu_store_gbps"),
        f("raw_registered_d2h_gbps"),
        f("gpu_store_vs_raw"),
        f("raw_pageable_d2h_gbps")
    );
    println!(
        "  retrieve to device   {:8.2} GB/s   raw registered H2D {:8.2}   ratio {:.3}   (pageable {:.2})",
        f("gpu_retrieve_gbps"),
        f("raw_registered_h2d_gbps"),
        f("gpu_retrieve_vs_raw"),
        f("raw_pageable_h2d_gbps")
    );
    println!(
        "  latency p50/p99 us: store {:.0}/{:.0}, retrieve {:.0}/{:.0}; verified {} (corrupt {}, misses {})",
        f("gpu_store_p50_us"),
        f("gpu_store_p99_us"),
        f("gpu_retrieve_p50_us"),
        f("gpu_retrieve_p99_us"),
        rep["verified"],
        rep["corrupt_chunks"],
        rep["misses"]
    );
}
