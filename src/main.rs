//! The `kvnode` command: `serve`, `status`, `ping`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
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
    /// Print the node's status report (counters only: cheap at any size; `memcheck` shows the
    /// outcome of the last MEMCHECK). `status` waits up to 60 s by default (`--timeout`), then
    /// gives up.
    Status {
        /// Node socket.
        #[arg(long, default_value_os_t = default_socket_path())]
        socket: PathBuf,
        /// Print the raw JSON object.
        #[arg(long)]
        json: bool,
        /// Seconds to wait for the node to take the connection, and then for its report.
        #[arg(long, value_parser = timeout_arg, value_name = "SECS", default_value = "60")]
        timeout: std::time::Duration,
    },
    /// Serve LMCache clients (drop-in for `python -m lmcache.v1.multiprocess.server`).
    LmcacheServer(LmcacheArgs),
    /// Check that the node answers (gives up after 10 s by default, `--timeout`).
    Ping {
        /// Node socket.
        #[arg(long, default_value_os_t = default_socket_path())]
        socket: PathBuf,
        /// Seconds to wait for the node to take the connection, and then for its answer.
        #[arg(long, value_parser = timeout_arg, value_name = "SECS", default_value = "10")]
        timeout: std::time::Duration,
    },
}

// Flags that the config file can also set have no clap default (it would override the file);
// their help states the default instead.
#[derive(clap::Args)]
struct ServeArgs {
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
    #[command(flatten)]
    l2: L2Args,
    #[command(flatten)]
    access: AccessArgs,
}

/// Who may use the node: the `[access]` table's lists as flags, shared by `serve` and
/// `lmcache-server`. A list given here replaces the config file's.
#[derive(clap::Args)]
struct AccessArgs {
    /// A user (numeric uid) that may use the node as a client, besides the node's own user and
    /// root; repeat it or separate with commas [default: none, unless the config file sets
    /// access.allow_uids].
    #[arg(long, value_delimiter = ',', value_name = "UID")]
    allow_uid: Vec<u32>,
    /// A group (numeric gid) whose members may use the node as clients; repeat it or separate
    /// with commas [default: none, unless the config file sets access.allow_gids].
    #[arg(long, value_delimiter = ',', value_name = "GID")]
    allow_gid: Vec<u32>,
    /// A user (numeric uid) that may also run node-wide operations (CLEAR, MEMCHECK, the full
    /// STATUS), like the node's own user and root; repeat it or separate with commas [default:
    /// none, unless the config file sets access.admin_uids].
    #[arg(long, value_delimiter = ',', value_name = "UID")]
    admin_uid: Vec<u32>,
    /// A group (numeric gid) whose members may also run node-wide operations; repeat it or
    /// separate with commas [default: none, unless the config file sets access.admin_gids].
    #[arg(long, value_delimiter = ',', value_name = "GID")]
    admin_gid: Vec<u32>,
}

impl AccessArgs {
    /// Applies the lists given on top of `cfg`.
    fn apply(&self, cfg: &mut kvnode::access::AccessConfig) {
        for (flag, list) in [
            (&self.allow_uid, &mut cfg.allow_uids),
            (&self.allow_gid, &mut cfg.allow_gids),
            (&self.admin_uid, &mut cfg.admin_uids),
            (&self.admin_gid, &mut cfg.admin_gids),
        ] {
            if !flag.is_empty() {
                list.clone_from(flag);
            }
        }
    }
}

/// The L2 disk tier flags, shared by `serve` and `lmcache-server`.
#[derive(clap::Args)]
struct L2Args {
    /// L2 disk tier: a directory (data file kvnode-l2.dat inside), a data file or a block
    /// device; repeat it (or separate with commas) to spread objects over several devices.
    #[arg(long, value_delimiter = ',')]
    l2_path: Vec<PathBuf>,
    /// L2 size per device, e.g. 64GiB [default: 8GiB, unless the config file sets l2.bytes].
    #[arg(long, value_parser = size_arg)]
    l2_size: Option<u64>,
    /// L2 block engine: uring, pread or auto (io_uring, falling back to pread) [default: auto,
    /// unless the config file sets l2.engine].
    #[arg(long, value_parser = ["uring", "pread", "auto"])]
    l2_engine: Option<String>,
    /// When objects go to L2: always (write-behind on commit) or on-evict [default: always,
    /// unless the config file sets l2.write_policy].
    #[arg(long, value_parser = ["always", "on-evict"])]
    l2_write_policy: Option<String>,
    /// Which L2 devices the node may format: if-empty (only a new or all-zero file or device,
    /// or one that already holds a kvnode L2 tier) or overwrite (also one holding other data,
    /// which is destroyed) [default: if-empty, unless the config file sets l2.format].
    #[arg(long, value_parser = ["if-empty", "overwrite"])]
    l2_format: Option<String>,
}

impl L2Args {
    /// Applies the flags given on top of `cfg`.
    fn apply(&self, cfg: &mut kvnode::config::L2Config) -> Result<(), String> {
        if !self.l2_path.is_empty() {
            cfg.paths = self.l2_path.clone();
        }
        if let Some(v) = self.l2_size {
            cfg.bytes = v;
        }
        if let Some(v) = &self.l2_engine {
            cfg.engine = v.clone();
        }
        if let Some(v) = &self.l2_write_policy {
            cfg.write_policy = kvnode::config::WritePolicy::parse(v).map_err(|e| e.to_string())?;
        }
        if let Some(v) = &self.l2_format {
            cfg.format = kvnode::config::L2Format::parse(v).map_err(|e| e.to_string())?;
        }
        if !cfg.enabled()
            && (self.l2_size.is_some() || self.l2_engine.is_some() || self.l2_format.is_some())
        {
            return Err("--l2-size/--l2-engine/--l2-format need --l2-path".into());
        }
        Ok(())
    }
}

/// The LMCache server flags that matter (same names as LMCache's), plus kvnode's own.
#[derive(clap::Args)]
struct LmcacheArgs {
    /// kvnode TOML configuration (keys as in `NodeConfig`) for what the LMCache flags do not
    /// set: TTLs, limits, watermarks, L2 tuning. The LMCache flags below always win.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Where to bind the ZMQ ROUTER: an IP address, `*` (every interface), a network interface
    /// name (`eth0`) or a host name.
    #[arg(long, default_value = "localhost")]
    host: String,
    /// TCP port of the ZMQ ROUTER.
    #[arg(long, default_value_t = 5555)]
    port: u16,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 256)]
    chunk_size: u32,
    /// L1 (shared pool) size in GiB.
    #[arg(long, default_value_t = 1.0)]
    l1_size_gb: f64,
    /// Name of the POSIX shm pool (`lmcache_l1_pool_` is prefixed) [default: kvnode_<port>].
    #[arg(long)]
    shm_name: Option<String>,
    /// lmcache_driven, engine_driven or auto (kvnode serves the engine-driven path).
    #[arg(long, default_value = "auto")]
    supported_transfer_mode: String,
    /// Seconds of silence before a pinging worker is reaped (0 disables).
    #[arg(long, default_value_t = 120.0)]
    worker_reap_timeout_seconds: f64,
    /// Seconds before a worker that never pinged is reaped.
    #[arg(long, default_value_t = 3600.0)]
    worker_registration_grace_seconds: f64,
    /// Seconds a worker's instance is kept after its connection closed (a crash, a kill), for
    /// it to come back over a new connection; then it is released (uncommitted stores freed,
    /// read locks released). A worker that never pinged gets max(this, min(registration grace,
    /// 10 s)). 0 disables: only the reaper releases. LMCache's values (30 s up to the reap
    /// timeout) work as there [default: 1, or the config file's lmcache.worker_disconnect_grace_ms].
    #[arg(long)]
    worker_disconnect_grace_seconds: Option<f64>,
    /// Eviction policy (kvnode evicts LRU, later chunks first).
    #[arg(long, default_value = "LRU")]
    eviction_policy: String,
    /// Handler threads for LMCache requests [default: one per core].
    #[arg(long)]
    max_workers: Option<usize>,
    /// Accepted for compatibility (kvnode sizes its handler pool with --max-workers).
    #[arg(long)]
    max_gpu_workers: Option<usize>,
    /// Accepted for compatibility (kvnode sizes its handler pool with --max-workers).
    #[arg(long)]
    max_cpu_workers: Option<usize>,
    /// Accepted for compatibility: kvnode's pool is always allocated and pre-faulted up front.
    #[arg(long)]
    no_l1_use_lazy: bool,
    /// Accepted for compatibility (see --no-l1-use-lazy).
    #[arg(long)]
    l1_use_lazy: bool,
    /// Only blake3 (LMCache's default) is supported.
    #[arg(long, default_value = "blake3")]
    hash_algorithm: String,
    /// Accepted for compatibility (kvnode aligns slots to 4 KiB or more).
    #[arg(long)]
    l1_align_bytes: Option<u64>,
    /// Serve Prometheus metrics at http://HOST:P/metrics, HOST being the --host address
    /// [default: 9090, as LMCache; if 9090 is taken the node warns and runs without metrics,
    /// while a port given here that is taken stops the node].
    #[arg(long, value_name = "P")]
    prometheus_port: Option<u16>,
    /// Serve Prometheus metrics on this address instead of --host:--prometheus-port (e.g.
    /// 0.0.0.0:9090 to let a Prometheus on another machine scrape a loopback-only node).
    #[arg(long, value_parser = socket_addr_arg, value_name = "HOST:PORT", conflicts_with = "prometheus_port")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Serve no metrics (nothing listens; wins over --prometheus-port, as in LMCache).
    #[arg(long)]
    disable_metrics: bool,
    /// As LMCache: turns metrics off (like --disable-metrics); kvnode's logs are unaffected.
    #[arg(long)]
    disable_observability: bool,
    /// Also serve the native protocol on this Unix socket (then `kvnode status --socket` works);
    /// its directory must exist.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Permission bits of the --socket file, in octal: 0660 lets the socket's group connect.
    #[arg(long, value_parser = mode_arg, value_name = "OCTAL", default_value = "0600")]
    socket_mode: u32,
    /// Preferred page size for the pool (POSIX shm gets THP or 4k pages).
    #[arg(long, default_value = "2m")]
    pages: String,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, default_value = "info")]
    log: String,
    /// Allow --host to be an address other machines can reach (not 127.0.0.0/8, ::1 or
    /// localhost). kvnode identifies local peers by the owner of their socket, but cannot tell
    /// who a peer on another machine is: such peers are served as clients (data path, never
    /// CLEAR). Protect the port at the network level (firewall, private network) first.
    #[arg(long)]
    allow_remote: bool,
    #[command(flatten)]
    l2: L2Args,
    #[command(flatten)]
    access: AccessArgs,
}

fn init_logs(filter: &str) -> Result<(), String> {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(filter))
        .map_err(|e| format!("bad --log filter {filter:?}: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    Ok(())
}

/// Installs the SIGTERM/SIGINT handlers; call before starting anything, so a signal that
/// arrives during start-up is not fatal.
/// The stop signals, and a flag they raise: a first SIGTERM/SIGINT during start-up stops the
/// pool's pre-fault (the node then exits cleanly); a second one ends the process at once.
/// After start-up, `Signals` delivers them to [`wait_for_signal`].
fn install_signals() -> Result<(signal_hook::iterator::Signals, Arc<AtomicBool>), String> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    let err = |e: std::io::Error| format!("installing signal handlers: {e}");
    for sig in [SIGTERM, SIGINT] {
        // Order matters: the conditional exit sees the flag as it was before this signal.
        signal_hook::flag::register_conditional_shutdown(sig, 1, stop.clone()).map_err(err)?;
        signal_hook::flag::register(sig, stop.clone()).map_err(err)?;
    }
    let signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).map_err(err)?;
    Ok((signals, stop))
}

fn wait_for_signal(mut signals: signal_hook::iterator::Signals) {
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "shutting down");
    }
}

fn lmcache_server(a: LmcacheArgs) -> Result<(), String> {
    init_logs(&a.log)?;
    if a.hash_algorithm != "blake3" {
        return Err(format!(
            "--hash-algorithm {:?}: kvnode implements blake3 only",
            a.hash_algorithm
        ));
    }
    match a.supported_transfer_mode.as_str() {
        "engine_driven" | "auto" => {}
        "lmcache_driven" => tracing::warn!(
            "--supported-transfer-mode lmcache_driven: kvnode serves the engine-driven path only; \
             run workers with LMCACHE_MP_TRANSFER_MODE=engine_driven (GPU-path requests get negative answers)"
        ),
        other => return Err(format!("--supported-transfer-mode {other:?}: expected lmcache_driven, engine_driven or auto")),
    }
    if !a.eviction_policy.eq_ignore_ascii_case("lru") {
        tracing::warn!(policy = %a.eviction_policy, "kvnode evicts LRU (later chunks first); the policy flag is ignored");
    }
    if !(a.l1_size_gb > 0.0 && a.l1_size_gb.is_finite()) {
        return Err(format!(
            "--l1-size-gb {}: the pool size must be a number of GiB > 0",
            a.l1_size_gb
        ));
    }
    if a.socket.is_none() && a.socket_mode != 0o600 {
        return Err("--socket-mode applies to the --socket file; give --socket too".into());
    }
    let shm = kvnode::lmcache::shm_segment_name(
        &a.shm_name
            .clone()
            .unwrap_or_else(|| format!("kvnode_{}", a.port)),
    );
    let mut cfg = NodeConfig {
        socket: a.socket.clone().unwrap_or_default(),
        socket_mode: a.socket_mode,
        shm_name: shm,
        pool_bytes: (a.l1_size_gb * (1u64 << 30) as f64) as u64,
        pages: a.pages.clone(),
        chunk_tokens: a.chunk_size,
        reap_timeout_secs: a.worker_reap_timeout_seconds,
        registration_grace_secs: a
            .worker_registration_grace_seconds
            .max(a.worker_reap_timeout_seconds),
        workers: a.max_workers.unwrap_or(0),
        ..match &a.config {
            Some(p) => NodeConfig::from_toml_file(p).map_err(|e| e.to_string())?,
            None => NodeConfig::default(),
        }
    };
    a.l2.apply(&mut cfg.l2)?;
    a.access.apply(&mut cfg.access);
    if let Some(g) = a.worker_disconnect_grace_seconds {
        cfg.lmcache.worker_disconnect_grace_ms = disconnect_grace_ms(g)?;
    }
    let handlers = cfg.worker_threads();
    let (signals, stop) = install_signals()?;
    // The port is checked before the pool is built: a second server on a busy port fails at once,
    // without pre-faulting memory or touching anything.
    let host = lmcache_bind_host(&a.host, a.port)?;
    kvnode::lmcache::access::check_bind_host(&host, a.allow_remote)
        .map_err(|e| format!("--host {}: {}", a.host, e.context))?;
    // Bound before the pool is built, like the ROUTER's port: a taken explicit port fails fast.
    let metrics_listener = lmcache_metrics_listener(&a, &host)?;
    let node = Node::start_cancellable(cfg, Some(stop)).map_err(|e| e.to_string())?;
    let frontend = kvnode::lmcache::frontend::LmFrontend::new(node.context().clone());
    let access = kvnode::lmcache::access::LmAccessOptions {
        policy: node.context().access.clone(),
        allow_remote: a.allow_remote,
    };
    let server =
        match kvnode::lmcache::server::LmServer::start(frontend, &host, a.port, handlers, access) {
            Ok(s) => s,
            Err(e) => {
                node.shutdown();
                return Err(format!(
                    "cannot serve LMCache clients on {}:{}: {e}",
                    a.host, a.port
                ));
            }
        };
    let metrics = match metrics_listener.map(|l| {
        let c = kvnode::metrics::NodeCollector::new(node.context().clone(), Some(server.probe()));
        kvnode::metrics::serve(l, c)
    }) {
        Some(Err(e)) => {
            server.shutdown();
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
    server.shutdown();
    node.shutdown();
    Ok(())
}

/// The metrics listener of `lmcache-server`, bound: `None` when metrics are off
/// (`--disable-metrics`, `--disable-observability`) or the default port is taken. The address
/// is `--metrics-addr`, else `--host` (as resolved into `bind_host`) with `--prometheus-port`
/// (default 9090).
fn lmcache_metrics_listener(
    a: &LmcacheArgs,
    bind_host: &str,
) -> Result<Option<std::net::TcpListener>, String> {
    use kvnode::metrics::{bind, AddrChoice, LMCACHE_DEFAULT_PROMETHEUS_PORT};
    if a.disable_metrics || a.disable_observability {
        if a.prometheus_port.is_some() || a.metrics_addr.is_some() {
            tracing::info!("metrics disabled: --prometheus-port/--metrics-addr ignored");
        }
        return Ok(None);
    }
    if let Some(addr) = a.metrics_addr {
        return bind(addr, AddrChoice::Explicit, "--metrics-addr");
    }
    let ip: std::net::IpAddr = match bind_host {
        "*" => std::net::Ipv4Addr::UNSPECIFIED.into(),
        h => h
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| format!("--host {}: no address to serve metrics on", a.host))?,
    };
    let (port, choice) = match a.prometheus_port {
        Some(p) => (p, AddrChoice::Explicit),
        None => (LMCACHE_DEFAULT_PROMETHEUS_PORT, AddrChoice::Default),
    };
    bind((ip, port).into(), choice, "--prometheus-port")
}

/// A `HOST:PORT` address: an IP address (`[v6]:port` for IPv6) or a host name resolved to its
/// first address.
fn socket_addr_arg(s: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let mut addrs = s
        .to_socket_addrs()
        .map_err(|e| format!("address {s:?}: expected HOST:PORT such as 127.0.0.1:9091 ({e})"))?;
    addrs
        .next()
        .ok_or_else(|| format!("address {s:?}: resolves to no address"))
}

/// `--worker-disconnect-grace-seconds` in milliseconds: a finite number of seconds >= 0 (a
/// nonzero value rounds up to at least 1 ms).
fn disconnect_grace_ms(secs: f64) -> Result<u64, String> {
    let max = kvnode::lmcache::frontend::MAX_WORKER_DISCONNECT_GRACE_MS;
    if !(secs >= 0.0 && secs.is_finite()) || secs * 1000.0 > max as f64 {
        return Err(format!(
            "--worker-disconnect-grace-seconds {secs}: expected seconds from 0 (off) to {}",
            max / 1000
        ));
    }
    Ok((secs * 1000.0).ceil() as u64)
}

/// The address to bind the LMCache ROUTER on: an IP address as given, `*` for every
/// interface, the address of a network interface of this machine given by name (`eth0`; its
/// first IPv4 address, else its first IPv6 one), or a host name resolved to its first IPv4
/// address. The libzmq kvnode links binds addresses only: it resolves neither host names nor
/// interface names (built without `getifaddrs`, it answers "No such device"), so both are
/// resolved here. Interface names come first, as in libzmq. Fails, naming the port, when it is
/// taken, and naming the host when it is none of these.
fn lmcache_bind_host(host: &str, port: u16) -> Result<String, String> {
    use std::net::{IpAddr, ToSocketAddrs};
    let ip: IpAddr = if host == "*" {
        IpAddr::from([0, 0, 0, 0])
    } else if let Ok(ip) = host.parse() {
        ip
    } else if let Some(&ip) = kvnode_hw::interface_addresses(host).first() {
        ip
    } else {
        let addrs: Vec<_> = (host, port)
            .to_socket_addrs()
            .map_err(|e| {
                format!(
                    "--host {host:?} is neither an IP address, nor a network interface of this \
                     machine with an address, nor a host name that resolves ({e})"
                )
            })?
            .collect();
        addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or(addrs.first())
            .map(|a| a.ip())
            .ok_or_else(|| format!("--host {host:?}: resolves to no address"))?
    };
    match port_free(ip, port) {
        Ok(()) => {}
        Err(e) => {
            return Err(format!(
                "cannot serve LMCache clients on {host}:{port} ({ip}): {e}; is another server \
                 running on that port?"
            ))
        }
    }
    Ok(match (host, ip) {
        ("*", _) => "*".to_owned(),
        (_, IpAddr::V6(v6)) => format!("[{v6}]"),
        (_, IpAddr::V4(v4)) => v4.to_string(),
    })
}

/// Whether `ip:port` can be bound, checked with a socket that is bound but never listens, so
/// no client can connect to the probe (and take it for the server).
fn port_free(ip: std::net::IpAddr, port: u16) -> std::io::Result<()> {
    use rustix::net::{AddressFamily, SocketType};
    let family = if ip.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = rustix::net::socket(family, SocketType::STREAM, None)?;
    // As a listener would: a port left in TIME_WAIT by a previous server is free.
    rustix::net::sockopt::set_socket_reuseaddr(&fd, true)?;
    rustix::net::bind(&fd, &std::net::SocketAddr::new(ip, port))?;
    Ok(())
}

fn size_arg(s: &str) -> Result<u64, String> {
    match parse_size(s) {
        Ok(0) => Err(format!("size {s:?}: must be more than 0 bytes")),
        Ok(n) => Ok(n),
        Err(e) => Err(e.context),
    }
}

/// Parses a socket mode in octal (`0660`, `660` or `0o660`): permission bits only (at most
/// 0777), and the owner must keep read and write (else not even the node's user could connect).
fn mode_arg(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    let bad =
        || format!("socket mode {s:?}: expected octal permission bits such as 0600, 0660 or 0666");
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| (b'0'..=b'7').contains(&b))
    {
        return Err(bad());
    }
    let mode = u32::from_str_radix(digits, 8).map_err(|_| bad())?;
    if mode > 0o777 {
        return Err(format!(
            "socket mode {s:?}: only permission bits (at most 0777), no setuid, setgid or sticky bit"
        ));
    }
    if mode & 0o600 != 0o600 {
        return Err(format!(
            "socket mode {s:?}: the owner needs read and write (6 in the first digit), or not even \
             the node's own user could connect"
        ));
    }
    Ok(mode)
}

fn serve(args: ServeArgs) -> Result<(), String> {
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
    args.l2.apply(&mut cfg.l2)?;
    args.access.apply(&mut cfg.access);
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

/// Connects for a one-shot CLI request: the connection and then each reply are bounded by
/// `timeout`.
fn cli_client(socket: &std::path::Path, timeout: std::time::Duration) -> Result<Client, String> {
    let mut c = Client::connect_timeout(socket, timeout).map_err(|e| e.to_string())?;
    c.set_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    Ok(c)
}

/// A `--timeout` in seconds: more than 0, at most a day.
fn timeout_arg(s: &str) -> Result<std::time::Duration, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86_400.0 => Ok(std::time::Duration::from_secs_f64(v)),
        _ => Err(format!(
            "timeout {s:?}: must be a number of seconds above 0 and at most 86400"
        )),
    }
}

fn status(socket: PathBuf, json: bool, timeout: std::time::Duration) -> Result<(), String> {
    let mut c = cli_client(&socket, timeout)?;
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
    println!(
        "backing   {}",
        v["pool_backing_detail"].as_str().unwrap_or("?")
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

fn ping(socket: PathBuf, timeout: std::time::Duration) -> Result<(), String> {
    let t = Instant::now();
    let mut c = cli_client(&socket, timeout)?;
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
        Command::LmcacheServer(a) => lmcache_server(a),
        Command::Status {
            socket,
            json,
            timeout,
        } => status(socket, json, timeout),
        Command::Ping { socket, timeout } => ping(socket, timeout),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvnode: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn disconnect_grace_takes_lmcache_values_shorter_ones_and_zero() {
        assert_eq!(disconnect_grace_ms(0.0), Ok(0));
        assert_eq!(disconnect_grace_ms(0.0001), Ok(1));
        assert_eq!(disconnect_grace_ms(1.0), Ok(1000));
        assert_eq!(disconnect_grace_ms(120.0), Ok(120_000));
        for bad in [-1.0, f64::NAN, f64::INFINITY, 1e9] {
            let e = disconnect_grace_ms(bad).unwrap_err();
            assert!(e.contains("--worker-disconnect-grace-seconds"), "{e}");
        }
    }

    use super::*;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn the_port_probe_finds_a_busy_port_and_never_accepts() {
        let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let busy = std::net::TcpListener::bind((ip, 0)).unwrap();
        let port = busy.local_addr().unwrap().port();
        assert!(port_free(ip, port).is_err(), "a listening port is busy");
        drop(busy);
        port_free(ip, port).unwrap();
        // The probe never listened: nothing accepts on the port afterwards.
        assert!(std::net::TcpStream::connect((ip, port)).is_err());
        let e = lmcache_bind_host("127.0.0.1", {
            let l = std::net::TcpListener::bind((ip, 0)).unwrap();
            let p = l.local_addr().unwrap().port();
            std::mem::forget(l);
            p
        })
        .unwrap_err();
        assert!(e.contains("another server"), "{e}");
    }

    #[test]
    fn bind_hosts_are_addresses_interfaces_or_resolved_names() {
        let port = free_port();
        assert_eq!(lmcache_bind_host("127.0.0.1", port).unwrap(), "127.0.0.1");
        assert_eq!(lmcache_bind_host("localhost", port).unwrap(), "127.0.0.1");
        assert_eq!(lmcache_bind_host("*", port).unwrap(), "*");
        // An interface name (it used to be refused: it is no host name).
        assert_eq!(lmcache_bind_host("lo", port).unwrap(), "127.0.0.1");
        // None of these: refused naming it, before anything is built.
        let e = lmcache_bind_host("kvnode-no-such-interface.invalid", port).unwrap_err();
        assert!(
            e.contains("\"kvnode-no-such-interface.invalid\" is neither"),
            "{e}"
        );
    }

    #[test]
    fn a_taken_port_on_an_address_is_refused_naming_it() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = lmcache_bind_host("127.0.0.1", port).unwrap_err();
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
    }
}
