//! The `kvnode` command: `serve`, `status`, `ping`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use kvnode::client::Client;
use kvnode::config::{default_socket_path, parse_size, NodeConfig};
use kvnode::server::Node;

#[derive(Parser)]
#[command(
    name = "kvnode",
    version,
    about = "KV-cache storage node for LLM inference engines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node (embedded defaults; flags override the optional TOML config).
    Serve(ServeArgs),
    /// Print the node's status report.
    Status {
        /// Node socket.
        #[arg(long, default_value_os_t = default_socket_path())]
        socket: PathBuf,
        /// Print the raw JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Check that the node answers.
    Ping {
        /// Node socket.
        #[arg(long, default_value_os_t = default_socket_path())]
        socket: PathBuf,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML configuration file (keys as in `NodeConfig`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Unix socket path.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Pool size, e.g. 256MiB, 4GiB, or bytes.
    #[arg(long, value_parser = size_arg)]
    pool_size: Option<u64>,
    /// Tokens per chunk.
    #[arg(long)]
    chunk_size: Option<u32>,
    /// Seconds of silence before a pinging instance is reaped (0 disables reaping).
    #[arg(long)]
    reap_timeout: Option<f64>,
    /// Seconds before an instance that never pinged is reaped.
    #[arg(long)]
    registration_grace: Option<f64>,
    /// Preferred page size: 1g, 2m, thp or 4k (falls back downwards).
    #[arg(long)]
    pages: Option<String>,
    /// Worker threads (0 = one per core).
    #[arg(long)]
    workers: Option<usize>,
    /// Log filter (tracing EnvFilter syntax), e.g. info or kvnode=debug.
    #[arg(long, default_value = "info")]
    log: String,
}

fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.context)
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&args.log))
        .map_err(|e| format!("bad --log filter: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let mut cfg = match &args.config {
        Some(p) => NodeConfig::from_toml_file(p).map_err(|e| e.to_string())?,
        None => NodeConfig::default(),
    };
    if let Some(v) = args.socket {
        cfg.socket = v;
    }
    if let Some(v) = args.pool_size {
        cfg.pool_bytes = v;
    }
    if let Some(v) = args.chunk_size {
        cfg.chunk_tokens = v;
    }
    if let Some(v) = args.reap_timeout {
        cfg.reap_timeout_secs = v;
    }
    if let Some(v) = args.registration_grace {
        cfg.registration_grace_secs = v;
    } else if cfg.reap_timeout_secs > cfg.registration_grace_secs {
        cfg.registration_grace_secs = cfg.reap_timeout_secs;
    }
    if let Some(v) = args.pages {
        cfg.pages = v;
    }
    if let Some(v) = args.workers {
        cfg.workers = v;
    }
    if cfg.reap_timeout_secs > 0.0 && cfg.reap_timeout_secs < 30.0 {
        tracing::warn!(
            reap_timeout_secs = cfg.reap_timeout_secs,
            "reap timeout under 30 s: engines heartbeat every 10 s and may be reaped while healthy"
        );
    }
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .map_err(|e| format!("installing signal handlers: {e}"))?;
    let node = Node::start(cfg).map_err(|e| e.to_string())?;
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "shutting down");
    }
    node.shutdown();
    Ok(())
}

fn status(socket: PathBuf, json: bool) -> Result<(), String> {
    let mut c = Client::connect(&socket).map_err(|e| e.to_string())?;
    let text = c.status_json().map_err(|e| e.to_string())?;
    if json {
        println!("{text}");
        return Ok(());
    }
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let mib = |k: &str| v[k].as_u64().unwrap_or(0) as f64 / (1 << 20) as f64;
    println!(
        "kvnode {} at {}",
        v["version"].as_str().unwrap_or("?"),
        socket.display()
    );
    println!(
        "pool      {:.1} MiB ({}), used {:.1} MiB",
        mib("pool_bytes"),
        v["pool_backing"].as_str().unwrap_or("?"),
        mib("used_bytes")
    );
    let o = &v["objects"];
    println!(
        "objects   ready {}  read-locked {}  write-reserved {}  temporary {}",
        o["ready"], o["read_locked"], o["write_reserved"], o["temporary"]
    );
    println!(
        "transfers pending writes {}  pending reads {}  evictions {}",
        v["pending_writes"], v["pending_reads"], v["evictions"]
    );
    println!(
        "memcheck  {}",
        if v["memcheck_ok"].as_bool() == Some(true) {
            "ok"
        } else {
            "FAILED"
        }
    );
    let empty = vec![];
    let instances = v["instances"].as_array().unwrap_or(&empty);
    println!("instances {}", instances.len());
    for i in instances {
        println!(
            "  {:>20}  {}  world {}  last seen {} ms ago  pinged {}  pending w/r {}/{}",
            i["id"],
            i["model"].as_str().unwrap_or("?"),
            i["world_size"],
            i["last_seen_ms_ago"],
            i["pinged"],
            i["pending_writes"],
            i["pending_reads"]
        );
    }
    Ok(())
}

fn ping(socket: PathBuf) -> Result<(), String> {
    let t = Instant::now();
    let mut c = Client::connect(&socket).map_err(|e| e.to_string())?;
    c.ping(None).map_err(|e| e.to_string())?;
    println!(
        "pong from {} in {} us",
        socket.display(),
        t.elapsed().as_micros()
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Serve(a) => serve(a),
        Command::Status { socket, json } => status(socket, json),
        Command::Ping { socket } => ping(socket),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvnode: {e}");
            ExitCode::FAILURE
        }
    }
}
