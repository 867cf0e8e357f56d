//! `kvnode serve`: the node's flags (over the optional TOML configuration) and its start-up.

use super::*;

// Flags that the config file can also set have no clap default (it would override the file);
// their help states the default instead.
#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// TOML configuration file (keys as in `NodeConfig`); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Unix socket path; its directory must exist [default: $XDG_RUNTIME_DIR/kvnode.sock, else
    /// /tmp/kvnode.sock, unless the config file sets socket].
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Permission bits of the socket file, in octal: 0660 lets the socket's group connect, 0666
    /// everyone [default: 0600, unless the config file sets socket_mode].
    #[arg(long, value_parser = mode_arg, value_name = "OCTAL")]
    socket_mode: Option<u32>,
    /// Pool size, e.g. 256MiB, 4GiB, or bytes; must fit in the memory available [default: 1GiB,
    /// unless the config file sets pool_bytes].
    #[arg(long, value_parser = size_arg)]
    pool_size: Option<u64>,
    /// Tokens per chunk [default: 256, unless the config file sets chunk_tokens].
    #[arg(long)]
    chunk_size: Option<u32>,
    /// Seconds of silence before a pinging instance is reaped, 0 disables reaping [default: 120,
    /// unless the config file sets reap_timeout_secs].
    #[arg(long)]
    reap_timeout: Option<f64>,
    /// Seconds before an instance that never pinged is reaped [default: 3600, raised to the reap
    /// timeout if that is longer, unless the config file sets registration_grace_secs].
    #[arg(long)]
    registration_grace: Option<f64>,
    /// Preferred page size: 1g, 2m, thp or 4k (falls back downwards) [default: 2m, unless the
    /// config file sets pages].
    #[arg(long)]
    pages: Option<String>,
    /// Worker threads [default: 0 = one per core, unless the config file sets workers].
    #[arg(long)]
    workers: Option<usize>,
    /// Log filter (tracing EnvFilter syntax), e.g. info or kvnode=debug; RUST_LOG wins.
    #[arg(long, default_value = "info")]
    log: String,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 127.0.0.1:9091; port 0 picks
    /// a free port, logged) [default: off]. A port that cannot be bound stops the node.
    #[arg(long, value_parser = socket_addr_arg, value_name = "HOST:PORT")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Listen for remote engines at tcp://ADDR:PORT (port 0 picks a free port, logged)
    /// [default: off, unless the config file sets remote.listen].
    #[arg(long, value_name = "URL")]
    listen: Option<String>,
    /// File with the token remote engines must prove (create one with `kvnode token generate`;
    /// owned by the node's user, mode 0600 or stricter).
    #[arg(long, value_name = "FILE")]
    auth_token_file: Option<PathBuf>,
    /// File with the token that gives remote callers the admin role (CLEAR, MEMCHECK).
    #[arg(long, value_name = "FILE")]
    admin_token_file: Option<PathBuf>,
    /// Listen on --listen without authentication: anyone who reaches the port may use the
    /// node. Only for a network that is yours alone.
    #[arg(long)]
    insecure_no_auth: bool,
    /// How the TCP fabric moves bytes: uring (io_uring, zero-copy send) or plain (poll + recv
    /// and send) [default: uring, unless the config file sets remote.tcp_engine].
    #[arg(long, value_name = "ENGINE")]
    tcp_engine: Option<String>,
    /// RDMA device offered to remote engines on --listen: auto (the first usable one), a device
    /// name (e.g. mlx5_0), or none (TCP only). A device that cannot be opened is logged and the
    /// node serves TCP only; status `transports.rdma` says why. Untested on hardware
    /// [default: auto, unless the config file sets remote.rdma_device].
    #[arg(long, value_name = "DEVICE")]
    rdma_device: Option<String>,
    #[command(flatten)]
    l2: L2Args,
    #[command(flatten)]
    access: AccessArgs,
    #[command(flatten)]
    cluster: super::cluster::ClusterArgs,
}

pub(crate) fn serve(args: ServeArgs) -> Result<(), String> {
    init_logs(&args.log)?;
    let mut cfg = match &args.config {
        Some(p) => NodeConfig::from_toml_file(p).map_err(|e| e.to_string())?,
        None => NodeConfig::default(),
    };
    if let Some(v) = args.socket {
        cfg.socket = v;
    }
    if let Some(v) = args.socket_mode {
        cfg.socket_mode = v;
    }
    if cfg.socket.as_os_str().is_empty() {
        return Err(
            "the socket path is empty: `kvnode serve` needs --socket PATH (or `socket` in \
                    the config file) for engines to connect"
                .into(),
        );
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
    if let Some(v) = args.listen {
        cfg.remote.listen = v;
    }
    if let Some(v) = args.auth_token_file {
        cfg.remote.auth_token_file = Some(v);
    }
    if let Some(v) = args.admin_token_file {
        cfg.remote.admin_token_file = Some(v);
    }
    if args.insecure_no_auth {
        cfg.remote.insecure_no_auth = true;
    }
    if let Some(v) = args.tcp_engine {
        cfg.remote.tcp_engine = v;
    }
    if let Some(v) = args.rdma_device {
        cfg.remote.rdma_device = v;
    }
    args.l2.apply(&mut cfg.l2)?;
    args.access.apply(&mut cfg.access);
    args.cluster.apply(&mut cfg.cluster)?;
    if cfg.reap_timeout_secs > 0.0 && cfg.reap_timeout_secs < 30.0 {
        tracing::warn!(
            reap_timeout_secs = cfg.reap_timeout_secs,
            "reap timeout under 30 s: engines heartbeat every 10 s and may be reaped while healthy"
        );
    }
    let (signals, stop) = install_signals()?;
    let metrics_listener = match args.metrics_addr {
        Some(addr) => kvnode::metrics::bind(
            addr,
            kvnode::metrics::AddrChoice::Explicit,
            "--metrics-addr",
        )?,
        None => None,
    };
    let node = Node::start_cancellable(cfg, Some(stop)).map_err(|e| e.to_string())?;
    let metrics = match metrics_listener.map(|l| {
        kvnode::metrics::serve(
            l,
            kvnode::metrics::NodeCollector::new(node.context().clone(), None),
        )
    }) {
        Some(Err(e)) => {
            node.shutdown();
            return Err(format!("cannot start the metrics endpoint: {e}"));
        }
        Some(Ok(m)) => Some(m),
        None => None,
    };
    wait_for_signal(signals);
    if let Some(m) = metrics {
        m.shutdown();
    }
    node.shutdown();
    Ok(())
}
