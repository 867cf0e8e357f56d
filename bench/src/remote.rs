//! `--remote tcp://HOST:PORT`: the workloads against a node over TCP, and in the same run the
//! network's limits between the same two endpoints (raw TCP stream, TCP ping-pong: see
//! [`crate::rawtcp`]), the node's CPU per GB moved, and the ratios between them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::conn::{Conn, RemoteTarget};
use crate::node::SpawnedNode;
use crate::rawtcp::{self, RawTcp, SpawnedPeer};

/// The control probe alternates blocks of TCP ping-pong and NOOP round trips (so that both see
/// the same machine load); the first block of each is untimed warm-up.
const CONTROL_BLOCKS: usize = 11;
/// Round trips per block.
const CONTROL_BLOCK_ROUNDS: usize = 200;

/// The fabrics `--fabric` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FabricArg {
    /// TCP (the only one this build's client speaks).
    Tcp,
    /// RDMA verbs (refused: see [`Setup::new`]).
    Rdma,
}

/// What `--remote` sets up before the node is reached. Invariant: a generated token lives in
/// `_dir`, removed on drop.
pub struct Setup {
    listen: String,
    token_file: Option<PathBuf>,
    _dir: Option<TokenDir>,
}

/// A private directory for a generated token, removed on drop.
struct TokenDir(PathBuf);

impl Drop for TokenDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Setup {
    /// `None` without `--remote`. `--fabric rdma` is an error (this client speaks TCP only,
    /// and nodes offer TCP to remote engines for now). With `--spawn` and no `--token-file`, a
    /// fresh token is generated for the spawned node.
    pub fn new(args: &crate::Args) -> Result<Option<Setup>, String> {
        let Some(url) = &args.remote else {
            return Ok(None);
        };
        if args.fabric == FabricArg::Rdma {
            return Err(format!(
                "--fabric rdma: RDMA is not offered by this build/node to the bench (its \
                 workloads move bytes inline over TCP; the RDMA path, untested on hardware, has \
                 no bench workload yet); use --fabric tcp against {url}"
            ));
        }
        let mut token_file = args.token_file.clone();
        let mut dir = None;
        if args.spawn && token_file.is_none() {
            let d = std::env::temp_dir().join(format!(
                "kvnode-bench-token-{}-{}",
                std::process::id(),
                crate::random_nonce()
            ));
            std::fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
            let d = TokenDir(d);
            let f = d.0.join("client.token");
            kvnode::transport::tcp::auth::generate_token_file(&f).map_err(|e| e.to_string())?;
            token_file = Some(f);
            dir = Some(d);
        }
        Ok(Some(Setup {
            listen: url.clone(),
            token_file,
            _dir: dir,
        }))
    }

    /// Flags for a spawned node: listen on the `--remote` address with the token.
    pub fn node_args(&self) -> Vec<String> {
        let mut a = vec!["--listen".to_string(), self.listen.clone()];
        if let Some(f) = &self.token_file {
            a.push("--auth-token-file".into());
            a.push(f.display().to_string());
        }
        a
    }

    /// The address to connect to: the spawned node's (`transports.tcp` of its status, since
    /// port 0 picks one), else `--remote` as given.
    pub fn target(&self, spawned: Option<&SpawnedNode>) -> Result<RemoteTarget, String> {
        let url = match spawned {
            Some(n) => {
                let mut c =
                    kvnode::client::Client::connect(&n.socket).map_err(|e| e.to_string())?;
                let st = c.status().map_err(|e| e.to_string())?;
                let addr = st["transports"]["tcp"].as_str().ok_or_else(|| {
                    format!(
                        "the spawned node listens on no TCP address (transports: {})",
                        st["transports"]
                    )
                })?;
                format!("tcp://{addr}")
            }
            None => self.listen.clone(),
        };
        Ok(RemoteTarget {
            url,
            token_file: self.token_file.as_ref().map(|f| f.display().to_string()),
        })
    }
}

/// The raw peer of this run: given (`--raw-peer-addr`), or started here when the node is on
/// this host's loopback.
pub enum Peer {
    /// Somebody else's.
    Given(SocketAddr),
    /// Started by this run (stopped on drop).
    Spawned(SpawnedPeer),
}

impl Peer {
    /// `--raw-peer-addr`, else a local peer when `url`'s host is a loopback address.
    pub fn find(given: Option<&str>, url: &str) -> Result<Peer, String> {
        if let Some(a) = given {
            return Ok(Peer::Given(rawtcp::resolve(a)?));
        }
        let node = kvnode::config::parse_tcp_url(url).map_err(|e| e.to_string())?;
        if node.ip().is_loopback() {
            return Ok(Peer::Spawned(SpawnedPeer::start(&format!(
                "{}:0",
                node.ip()
            ))?));
        }
        Err(format!(
            "the node at {url} is not on this host: start `kvnode-bench --raw-peer ADDR:PORT` \
             beside it and pass --raw-peer-addr ADDR:PORT (the raw TCP baselines need the same \
             two endpoints)"
        ))
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        match self {
            Peer::Given(a) => *a,
            Peer::Spawned(p) => p.addr,
        }
    }
}

/// CPU time of the node process (when its pid is known) and of this process, sampled around
/// the load.
pub struct CpuSample {
    node: Option<Duration>,
    bench: Option<Duration>,
}

impl CpuSample {
    /// Samples now.
    pub fn take(node_pid: Option<u32>) -> CpuSample {
        CpuSample {
            node: node_pid.and_then(rawtcp::process_cpu),
            bench: rawtcp::process_cpu(std::process::id()),
        }
    }
}

/// Control round trips against their floor, measured interleaved.
#[derive(Debug, Clone, Copy)]
pub struct Control {
    /// NOOP on an idle authenticated connection, p50 and p99 (microseconds).
    pub noop: (f64, f64),
    /// TCP ping-pong of small messages to the raw peer, p50 and p99 (microseconds).
    pub pingpong: (f64, f64),
    /// Timed round trips of each.
    pub rounds: usize,
}

/// NOOPs on `probe` and ping-pongs with the raw peer at `peer`, in alternating blocks.
pub fn control_probe(probe: &mut Conn, peer: SocketAddr) -> Result<Control, String> {
    let mut echo = rawtcp::Echo::connect(peer)?;
    let timed = (CONTROL_BLOCKS - 1) * CONTROL_BLOCK_ROUNDS;
    let (mut noop, mut pp) = (Vec::with_capacity(timed), Vec::with_capacity(timed));
    for block in 0..CONTROL_BLOCKS {
        for _ in 0..CONTROL_BLOCK_ROUNDS {
            let rtt = echo.round_trip()?;
            if block > 0 {
                pp.push(rtt.as_secs_f64() * 1e6);
            }
        }
        for _ in 0..CONTROL_BLOCK_ROUNDS {
            let t = Instant::now();
            probe.noop().map_err(|e| format!("noop: {e}"))?;
            if block > 0 {
                noop.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    let p = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (rawtcp::percentile(&v, 50.0), rawtcp::percentile(&v, 99.0))
    };
    Ok(Control {
        noop: p(noop),
        pingpong: p(pp),
        rounds: timed,
    })
}

/// Everything a remote run adds to the report.
pub struct Figures {
    /// Where the node was.
    pub url: String,
    /// `transports.tcp_engine` of the node's status.
    pub tcp_engine: String,
    /// Raw TCP between the same endpoints.
    pub raw: RawTcp,
    /// Control round trips and their floor.
    pub control: Control,
    /// CPU before and after the load.
    pub cpu: (CpuSample, CpuSample),
    /// Bytes the node moved for the instances (every phase).
    pub moved_bytes: u64,
}

fn per_gb(cpu: Option<Duration>, bytes: u64) -> Value {
    match cpu {
        Some(c) if bytes > 0 => json!(c.as_secs_f64() / (bytes as f64 / 1e9)),
        _ => Value::Null,
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Adds the remote figures to the report's JSON (documented in bench/README.md).
pub fn extend_report(j: &mut Value, f: &Figures) {
    let get = |k: &str| j[k].as_f64().unwrap_or(0.0);
    let (store, retrieve) = (get("store_gbps"), get("retrieve_gbps"));
    let ping_p50 = j["latency_us"]["ping"]["p50"].as_f64().unwrap_or(0.0);
    let delta = |a: Option<Duration>, b: Option<Duration>| match (a, b) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    let node_cpu = delta(f.cpu.0.node, f.cpu.1.node);
    let bench_cpu = delta(f.cpu.0.bench, f.cpu.1.bench);
    let pp = f.control.pingpong.0;
    let add = json!({
        "fabric": "tcp",
        "remote_url": f.url,
        "tcp_engine": f.tcp_engine,
        "raw_tcp_gbps": f.raw.send.gbps,
        "raw_tcp_recv_gbps": f.raw.recv.gbps,
        "tcp_pingpong_p50_us": pp,
        "tcp_pingpong_p99_us": f.control.pingpong.1,
        "control_rounds": f.control.rounds,
        "store_vs_raw": ratio(store, f.raw.send.gbps),
        "retrieve_vs_raw": ratio(retrieve, f.raw.recv.gbps),
        "control_noop_p50_us": f.control.noop.0,
        "control_noop_p99_us": f.control.noop.1,
        "control_p50_vs_pingpong": ratio(f.control.noop.0, pp),
        "ping_vs_tcp_floor": ratio(ping_p50, pp),
        "moved_bytes": f.moved_bytes,
        "node_cpu_s": node_cpu.map(|c| c.as_secs_f64()),
        "node_cpu_s_per_gb": per_gb(node_cpu, f.moved_bytes),
        "bench_cpu_s_per_gb": per_gb(bench_cpu, f.moved_bytes),
        "raw_tcp": f.raw,
    });
    if let (Value::Object(m), Value::Object(a)) = (j, add) {
        m.extend(a);
    }
}

/// Prints the remote lines of the human table.
pub fn print_table(j: &Value) {
    let f = |k: &str| j[k].as_f64().unwrap_or(0.0);
    println!(
        "remote      {} ({} engine)  raw tcp {:.2} GB/s send, {:.2} recv  store {:.2}x raw  retrieve {:.2}x raw",
        j["remote_url"].as_str().unwrap_or("?"),
        j["tcp_engine"].as_str().unwrap_or("?"),
        f("raw_tcp_gbps"),
        f("raw_tcp_recv_gbps"),
        f("store_vs_raw"),
        f("retrieve_vs_raw"),
    );
    println!(
        "control     noop p50 {:.1} us = {:.2}x tcp ping-pong p50 {:.1} us  node cpu {} s/GB  bench cpu {} s/GB",
        f("control_noop_p50_us"),
        f("control_p50_vs_pingpong"),
        f("tcp_pingpong_p50_us"),
        j["node_cpu_s_per_gb"]
            .as_f64()
            .map_or("?".into(), |v| format!("{v:.3}")),
        j["bench_cpu_s_per_gb"]
            .as_f64()
            .map_or("?".into(), |v| format!("{v:.3}")),
    );
}
