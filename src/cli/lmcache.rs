//! `kvnode lmcache-server`: the LMCache drop-in's flags (LMCache's own, plus kvnode's) and its
//! start-up: bind checks, the metrics listener, the node and the ZMQ frontend.

use super::*;

/// The LMCache server flags that matter (same names as LMCache's), plus kvnode's own.
#[derive(clap::Args)]
pub(crate) struct LmcacheArgs {
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
    /// As root, put the segment on huge pages by bind-mounting a private hugetlbfs (or huge
    /// tmpfs) file over /dev/shm/<name> (TOML: segment_bind_mount). Off by default: the mount is
    /// seen only in the node's mount namespace, so EVERY client must run in it (or in one the
    /// mount propagates to); a client elsewhere (e.g. a container bind-mounting /dev/shm) would
    /// open an empty file. Refused when the node is not in PID 1's mount namespace. Without it,
    /// remount /dev/shm huge=within_size (scripts/setup.sh --shm-huge) for huge pages.
    #[arg(long)]
    segment_bind_mount: bool,
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
    #[command(flatten)]
    listen: super::cluster::ListenArgs,
    #[command(flatten)]
    cluster: super::cluster::ClusterArgs,
}

pub(crate) fn lmcache_server(a: LmcacheArgs) -> Result<(), String> {
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
    a.listen.apply(&mut cfg);
    a.cluster.apply(&mut cfg.cluster)?;
    cfg.segment_bind_mount |= a.segment_bind_mount;
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
