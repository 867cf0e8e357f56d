//! `kvnode-bench`: load-tests a kvnode through the public client library, as real engines would,
//! and reports latency percentiles and goodput next to the machine's limits measured in the same
//! run (memcpy bandwidth over the same page backing, a bare Unix-socket ping-pong).
//! `kvnode-bench l2` measures the L2 disk tier against raw `O_DIRECT` I/O on the same disk;
//! `kvnode-bench l2-killloop` kills and restarts a node with a disk tier and checks every object
//! it serves; `kvnode-bench soak` is the kill soak (clients SIGKILLed mid-transfer, the node must
//! stay clean). `--remote tcp://HOST:PORT` runs the workloads against a node over TCP and
//! measures the network's limits between the same endpoints (`--raw-peer` is the far end of
//! those measurements).

mod baseline;
mod cluster;
mod conn;
mod disk;
mod gpu;
mod gpu_raw;
mod l2;
mod l2kill;
mod lmcache;
mod node;
mod opcount;
mod payload;
mod peerbuf;
mod plot;
mod rawtcp;
mod remote;
mod report;
mod runner;
mod soak;
mod soak_engine;
mod soak_lmcache;
mod soak_node;
mod soak_report;
mod soak_worker;
mod stats;
mod workload;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use workload::{Instance, InstanceSpec, LayoutSpec, WorkloadKind};

/// Command line. Scripts rely on these exact flag names.
#[derive(Parser, Debug)]
#[command(
    name = "kvnode-bench",
    version,
    about = "Load harness for kvnode",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Args {
    /// Another mode instead of the load test.
    #[command(subcommand)]
    mode: Option<Mode>,
    /// Start a private `kvnode serve` on a temporary socket and stop it afterwards.
    #[arg(long, conflicts_with = "socket")]
    spawn: bool,
    /// Pool size of the spawned node (e.g. 1GiB).
    #[arg(long, default_value = "1GiB", requires = "spawn")]
    pool_size: String,
    /// Extra argument for the spawned node (repeatable), e.g. --node-arg=--workers --node-arg=2.
    #[arg(long = "node-arg", allow_hyphen_values = true, requires = "spawn")]
    node_args: Vec<String>,
    /// The `kvnode` binary to spawn (default: next to this binary, else on PATH).
    #[arg(long, requires = "spawn")]
    node_bin: Option<PathBuf>,
    /// Socket of a running node.
    #[arg(long, required_unless_present_any = ["spawn", "remote", "raw_peer", "etcd"])]
    socket: Option<PathBuf>,
    /// A node over TCP (`tcp://HOST:PORT`) instead of its socket: every workload goes through
    /// the remote client (the node moves the bytes). With --spawn, the spawned node listens on
    /// this address (port 0: any free one) with --token-file or a generated token.
    #[arg(long, value_name = "URL", conflicts_with = "socket")]
    remote: Option<String>,
    /// The client token's file for --remote (none: the node must run --insecure-no-auth).
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Fabric of --remote: tcp, or rdma (refused: RDMA is not offered by this build/node yet).
    #[arg(long, value_enum, default_value = "tcp", requires = "remote")]
    fabric: remote::FabricArg,
    /// The raw peer (`kvnode-bench --raw-peer`) beside the --remote node, for the raw TCP
    /// baselines (default: one started here when the node is on loopback).
    #[arg(long, value_name = "HOST:PORT", required = false)]
    raw_peer_addr: Option<String>,
    /// Seconds per direction of the raw TCP stream baseline (half before the load, half after).
    #[arg(long, default_value_t = 2.0)]
    raw_secs: f64,
    /// Process id of the --remote node on this host (same pid namespace), for its CPU per GB
    /// moved (known without this flag when --spawn started it).
    #[arg(long, requires = "remote")]
    node_pid: Option<u32>,
    /// Run the workloads through a cluster of nodes whose members etcd at URL lists (with
    /// --cluster and --token-file): per-member and total store, cross-node and local retrieve
    /// GB/s, peer vs local hits, against the raw TCP stream measured in the same run.
    #[arg(long, value_delimiter = ',', value_name = "URL", conflicts_with_all = ["socket", "remote", "spawn"])]
    etcd: Vec<String>,
    /// The cluster's name (with --etcd).
    #[arg(long, value_name = "NAME", requires = "etcd")]
    cluster: Option<String>,
    /// An admin token of the members (with --etcd): their `cluster` status counters (peer
    /// fetches, pushes) are read with it; without it, peer vs local hits are not reported.
    #[arg(long, value_name = "FILE", requires = "etcd")]
    admin_token_file: Option<PathBuf>,
    /// Serve as the raw peer on ADDR:PORT (port 0: any; prints `LISTENING ADDR:PORT`) until
    /// killed: a sink, source and echo for another kvnode-bench's --remote baselines.
    #[arg(long, value_name = "ADDR:PORT", exclusive = true)]
    raw_peer: Option<String>,
    /// Layout preset: tiny, qwen2.5-0.5b, llama3-8b (explicit flags override its fields).
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Layers (overrides the preset).
    #[arg(long)]
    layers: Option<u32>,
    /// Hidden size = kv heads x head dim (overrides the preset).
    #[arg(long)]
    hidden: Option<u32>,
    /// PyTorch dtype name (overrides the preset).
    #[arg(long)]
    dtype: Option<String>,
    /// Tokens per chunk (overrides the preset; a spawned node uses it as --chunk-size).
    #[arg(long)]
    chunk_tokens: Option<u32>,
    /// Workload shape.
    #[arg(long, value_enum, default_value = "store")]
    workload: WorkloadKind,
    /// Read probability of the mixed workload.
    #[arg(long, default_value_t = 0.5)]
    hit_ratio: f64,
    /// Simulated engine instances.
    #[arg(long, default_value_t = 1)]
    instances: u32,
    /// Run each instance in its own process instead of a thread.
    #[arg(long)]
    processes: bool,
    /// Timed operations per instance.
    #[arg(long, conflicts_with = "duration")]
    ops: Option<u64>,
    /// Timed seconds (default 5 when --ops is not given).
    #[arg(long)]
    duration: Option<f64>,
    /// Untimed warm-up operations per instance.
    #[arg(long, default_value_t = 10)]
    warmup: u64,
    /// Working set as a fraction of the pool (above 1 exercises eviction).
    #[arg(long, default_value_t = 0.5)]
    working_set: f64,
    /// Chunks a multiturn turn appends.
    #[arg(long, default_value_t = 2)]
    turn_chunks: u32,
    /// Turns per multiturn conversation.
    #[arg(long, default_value_t = 4)]
    turns: u32,
    /// Seconds per direction for the memcpy baseline.
    #[arg(long, default_value_t = 1.0)]
    baseline_secs: f64,
    /// Write every figure as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw latency curves and throughput as PNG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Do not verify retrieved bytes.
    #[arg(long)]
    no_verify: bool,
    /// Fix the run nonce hashed into every key (default: random per run). Two runs given the same
    /// nonce (and preset) use the same keys, so the second finds the first's chunks already
    /// stored; for tests of deduplicated stores.
    #[arg(long)]
    run_nonce: Option<u64>,
    /// Store from and retrieve into GPU memory through the node (one stream per instance),
    /// next to raw copies between device memory and registered / pageable host memory of the
    /// same size (needs the CUDA driver; see scripts/gpu-check.sh).
    #[arg(long)]
    gpu: bool,
    /// CUDA device ordinal for --gpu.
    #[arg(long, default_value_t = 0, requires = "gpu")]
    device: u32,
    /// Chunks per request for --gpu.
    #[arg(long, default_value_t = 4, requires = "gpu")]
    gpu_batch: u32,
}

/// A fresh random run nonce: std's `RandomState` (randomly keyed per process) over the pid and
/// the time, so two runs, even started at the same instant, get different keys.
pub(crate) fn random_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}

/// Modes other than the default load test.
#[derive(clap::Subcommand, Debug)]
enum Mode {
    /// L2 disk tier: raw O_DIRECT baseline, node write-behind and cold read per block engine.
    L2(l2::L2Args),
    /// Kill loop over the L2 disk tier: the node SIGKILLed while its write-behind is busy (or
    /// around a CLEAR), restarted, every object served checked byte for byte (see
    /// bench/README.md).
    #[command(name = "l2-killloop")]
    L2Killloop(l2kill::KillLoopArgs),
    /// Kill soak: native and LMCache clients SIGKILLed at random points while survivors store
    /// and verify; then the node must be clean (see bench/README.md).
    Soak(soak::SoakArgs),
    /// LMCache-wire load generator: a DEALER speaking the real client's frames to any LMCache
    /// server (kvnode's or LMCache's own); per-call HDR latencies, server cost over the NOOP
    /// floor, store/retrieve GB/s.
    Lmcache(lmcache::LmArgs),
    /// One client process of the kill soak (started by `soak`, never by hand).
    #[command(hide = true)]
    SoakWorker(soak_worker::WorkerArgs),
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    // Hidden roles used by the harness itself (child processes).
    match argv.get(1).map(String::as_str) {
        Some("__uds-echo") => {
            let path = argv.get(2).map(PathBuf::from).unwrap_or_default();
            if let Err(e) = baseline::uds_echo(&path) {
                eprintln!("uds echo: {e}");
                std::process::exit(1);
            }
            return;
        }
        Some("__instance") => {
            std::process::exit(child_instance(argv.get(2).map_or("", String::as_str)))
        }
        Some("__opcount") => {
            let n = argv.get(4).and_then(|s| s.parse().ok()).unwrap_or(0);
            let r = opcount::run(
                argv.get(2).map_or("", String::as_str),
                argv.get(3).map_or("", String::as_str),
                n,
            );
            if let Err(e) = r {
                eprintln!("opcount: {e}");
                std::process::exit(1);
            }
            return;
        }
        _ => {}
    }
    let args = Args::parse();
    if let Some(addr) = &args.raw_peer {
        if let Err(e) = rawtcp::serve(addr) {
            eprintln!("kvnode-bench: {e}");
            std::process::exit(2);
        }
        return;
    }
    let outcome = match &args.mode {
        Some(Mode::L2(a)) => l2::run(a),
        Some(Mode::L2Killloop(a)) => l2kill::run(a),
        Some(Mode::Soak(a)) => soak::run(a),
        Some(Mode::Lmcache(a)) => lmcache::run(a),
        Some(Mode::SoakWorker(a)) => std::process::exit(soak_worker::run(a)),
        None if !args.etcd.is_empty() => cluster::run(&args),
        None => run(&args),
    };
    match outcome {
        Ok(ok) => std::process::exit(if ok { 0 } else { 1 }),
        Err(e) => {
            eprintln!("kvnode-bench: {e}");
            std::process::exit(2);
        }
    }
}

fn child_instance(spec_json: &str) -> i32 {
    let spec: InstanceSpec = match serde_json::from_str(spec_json) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bad instance spec: {e}");
            return 2;
        }
    };
    // Start barrier across processes: say READY on stdout, wait for GO on stdin.
    let ready = || {
        println!("READY");
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    };
    match Instance::connect(spec).and_then(|i| i.run(ready, |_| {})) {
        Ok(r) => {
            println!("{}", report::instance_to_json(&r));
            0
        }
        Err(e) => {
            eprintln!("instance failed: {e}");
            1
        }
    }
}

fn layout(args: &Args) -> Result<LayoutSpec, String> {
    let mut l = LayoutSpec::preset(&args.preset).ok_or_else(|| {
        format!(
            "unknown preset {:?} (tiny, qwen2.5-0.5b, llama3-8b)",
            args.preset
        )
    })?;
    let custom = args.layers.is_some()
        || args.hidden.is_some()
        || args.dtype.is_some()
        || args.chunk_tokens.is_some();
    if let Some(v) = args.layers {
        l.layers = v;
    }
    if let Some(v) = args.hidden {
        l.hidden = v;
    }
    if let Some(v) = &args.dtype {
        l.dtype = v.clone();
    }
    if let Some(v) = args.chunk_tokens {
        l.chunk_tokens = v;
    }
    if custom {
        l.name = format!("{}-custom", l.name);
    }
    l.item_bytes()
        .ok_or_else(|| format!("unknown dtype {:?}", l.dtype))?;
    Ok(l)
}

/// The `--gpu` run: the GPU workload and its raw baselines (see `gpu`).
fn run_gpu(
    args: &Args,
    layout: &LayoutSpec,
    socket: PathBuf,
    target: Option<conn::RemoteTarget>,
    pool_bytes: u64,
    duration_ms: u64,
    spawned: Option<node::SpawnedNode>,
) -> Result<bool, String> {
    if args.gpu_batch == 0 {
        return Err("--gpu-batch must be at least 1".into());
    }
    if args.ops == Some(0) {
        return Err("--ops must be at least 1 with --gpu".into());
    }
    let (mut rep, ok) = gpu::run(&gpu::GpuRun {
        device: args.device,
        socket: socket.display().to_string(),
        remote: target,
        layout,
        instances: args.instances,
        batch: args.gpu_batch,
        ops: args.ops,
        duration: Duration::from_millis(duration_ms),
        warmup: args.warmup,
        pool_bytes,
        baseline: Duration::from_secs_f64(args.baseline_secs.max(0.05)),
        run_nonce: args.run_nonce.unwrap_or_else(random_nonce),
        verify: !args.no_verify,
    })?;
    drop(spawned);
    rep["pool_bytes"] = pool_bytes.into();
    gpu::print_table(&rep);
    if let Some(p) = &args.json {
        std::fs::write(
            p,
            serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    Ok(ok)
}

/// Runs the whole benchmark; returns whether every retrieved byte verified.
fn run(args: &Args) -> Result<bool, String> {
    if args.instances == 0 {
        return Err("--instances must be at least 1".into());
    }
    if !(0.0..=1.0).contains(&args.hit_ratio) {
        return Err("--hit-ratio must be within 0..=1".into());
    }
    let mut layout = layout(args)?;
    let setup = remote::Setup::new(args)?;
    let spawned = if args.spawn {
        let mut node_args = args.node_args.clone();
        node_args.extend(setup.iter().flat_map(remote::Setup::node_args));
        Some(node::SpawnedNode::start(
            args.node_bin.as_deref(),
            &args.pool_size,
            layout.chunk_tokens,
            &node_args,
        )?)
    } else {
        None
    };
    let socket = match (&spawned, &args.socket) {
        (Some(n), _) => n.socket.clone(),
        (None, Some(s)) => s.clone(),
        (None, None) if setup.is_some() => PathBuf::new(),
        (None, None) => return Err("give --spawn, --socket PATH or --remote URL".into()),
    };
    let target = match &setup {
        Some(s) => Some(s.target(spawned.as_ref())?),
        None => None,
    };
    let mut probe = conn::Conn::connect(
        &socket.display().to_string(),
        target.as_ref(),
        "kvnode-bench probe",
    )?;
    let node_chunk = probe.chunk_tokens()?;
    if node_chunk != layout.chunk_tokens {
        eprintln!(
            "note: the node uses {node_chunk}-token chunks; the layout follows it (preset said {})",
            layout.chunk_tokens
        );
        layout.chunk_tokens = node_chunk;
    }
    let status = probe.status()?;
    let pool_bytes = status["capacity_bytes"].as_u64().unwrap_or(0);
    let backing = status["pool_backing"].as_str().unwrap_or("4k").to_owned();
    let chunk_bytes = layout.chunk_bytes();
    let per_instance_ws =
        ((pool_bytes as f64 * args.working_set) / chunk_bytes as f64 / f64::from(args.instances))
            .floor()
            .max(1.0) as u64;
    let duration_ms = (args.duration.unwrap_or(5.0) * 1000.0) as u64;
    if args.gpu {
        drop(probe);
        return run_gpu(
            args,
            &layout,
            socket,
            target,
            pool_bytes,
            duration_ms,
            spawned,
        );
    }
    // Registrations are named by pid (unique among live processes); keys by the run nonce.
    let run_id = u64::from(std::process::id());
    let run_nonce = args.run_nonce.unwrap_or_else(random_nonce);
    let specs: Vec<InstanceSpec> = (0..args.instances)
        .map(|i| InstanceSpec {
            socket: socket.display().to_string(),
            remote: target.clone(),
            instance_id: (run_id << 16) | u64::from(i),
            index: i,
            run_nonce,
            layout: layout.clone(),
            workload: args.workload,
            hit_ratio: args.hit_ratio,
            ops: args.ops,
            duration_ms,
            warmup: args.warmup,
            working_set_chunks: match args.workload {
                WorkloadKind::Multiturn => {
                    (per_instance_ws / u64::from(args.turns * args.turn_chunks).max(1)).max(1)
                }
                _ => per_instance_ws,
            },
            turn_chunks: args.turn_chunks,
            turns: args.turns,
            verify: !args.no_verify,
            seed: payload::splitmix64(run_nonce ^ 0x5EED ^ (u64::from(i) << 32)),
        })
        .collect();
    eprintln!(
        "kvnode-bench: {} x {} ({} bytes/chunk), workload {:?}, pool {} MiB ({backing}), working set {} chunks/instance, run nonce {run_nonce}",
        args.instances,
        layout.name,
        chunk_bytes,
        args.workload,
        pool_bytes >> 20,
        specs[0].working_set_chunks
    );
    let node_pid = spawned
        .as_ref()
        .map(node::SpawnedNode::pid)
        .or(args.node_pid);
    // Remote: the raw TCP stream is sampled before and after the load (half its time each).
    let raw_secs = Duration::from_secs_f64(args.raw_secs.max(0.03) / 2.0);
    let mut streams = rawtcp::Streams::default();
    // The peer's buffers on the node pool's page size (the node receives into / sends from it).
    let peer_pages = peerbuf::Pages::for_pool_backing(&backing);
    let peer = match &target {
        Some(t) => {
            let peer = remote::Peer::find(args.raw_peer_addr.as_deref(), &t.url)?;
            streams.sample(peer.addr(), chunk_bytes, raw_secs, peer_pages)?;
            Some(peer)
        }
        None => None,
    };
    let cpu_before = remote::CpuSample::take(node_pid);
    let wall = Instant::now();
    let results = if args.processes {
        runner::run_processes(&specs)?
    } else {
        runner::run_threads(&specs, args)?
    };
    let wall = wall.elapsed();
    let cpu_after = remote::CpuSample::take(node_pid);
    let node_status = probe.status().ok();
    let remote_figures = match (&target, &peer) {
        (Some(t), Some(peer)) => {
            streams.sample(peer.addr(), chunk_bytes, raw_secs, peer_pages)?;
            let raw = streams.finish(peer.addr(), chunk_bytes);
            let control = remote::control_probe(&mut probe, peer.addr())?;
            Some(remote::Figures {
                url: t.url.clone(),
                tcp_engine: status["transports"]["tcp_engine"]
                    .as_str()
                    .unwrap_or("unknown")
                    .to_owned(),
                raw,
                control,
                cpu: (cpu_before, cpu_after),
                moved_bytes: results.iter().map(|r| r.moved_bytes).sum(),
            })
        }
        _ => None,
    };
    drop(probe);
    drop(peer);
    // Baselines after the load so they do not compete with it.
    let prefer = match backing.as_str() {
        "hugetlb-1g" => kvnode_hw::PagePreference::Huge1G,
        "hugetlb-2m" => kvnode_hw::PagePreference::Huge2M,
        "thp" => kvnode_hw::PagePreference::Thp,
        _ => kvnode_hw::PagePreference::Pages4K,
    };
    let bsecs = Duration::from_secs_f64(args.baseline_secs.max(0.05));
    let cap = 512 << 20;
    let memcpy_1 = baseline::memcpy_baseline(chunk_bytes, 1, prefer, bsecs, cap)?;
    let memcpy_n = if args.instances > 1 {
        baseline::memcpy_baseline(chunk_bytes, args.instances as usize, prefer, bsecs, cap)?
    } else {
        memcpy_1.clone()
    };
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut echo = Command::new(exe);
    echo.arg("__uds-echo");
    let pingpong = baseline::uds_pingpong(echo, 20_000, 2_000)?;
    drop(spawned);
    let rep = report::Report::build(report::Inputs {
        layout: &layout,
        workload: args.workload,
        hit_ratio: args.hit_ratio,
        instances: args.instances,
        processes: args.processes,
        verify: !args.no_verify,
        run_nonce,
        backing,
        chunk_bytes,
        results: &results,
        wall,
        memcpy_1,
        memcpy_n,
        pingpong,
        node_status,
    });
    let mut rep = rep;
    if let Some(f) = &remote_figures {
        remote::extend_report(&mut rep.json, f);
    }
    rep.print_table();
    if remote_figures.is_some() {
        remote::print_table(&rep.json);
    }
    if let Some(p) = &args.json {
        std::fs::write(
            p,
            serde_json::to_string_pretty(&rep.json).map_err(|e| e.to_string())?,
        )
        .map_err(|e| format!("writing {}: {e}", p.display()))?;
    }
    if let Some(p) = &args.plot {
        rep.plot(p)?;
    }
    if rep.corrupt_chunks > 0 {
        eprintln!(
            "kvnode-bench: {} chunks read back with wrong bytes",
            rep.corrupt_chunks
        );
    }
    Ok(rep.verified || args.no_verify)
}
