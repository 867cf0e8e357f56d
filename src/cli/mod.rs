//! The `kvnode` binary's command line (not part of the library): one module per command, and
//! here what several commands share (access and L2 flags, logging, signals, argument parsers).

pub(crate) mod cluster;
pub(crate) mod gpu;
pub(crate) mod inspect;
pub(crate) mod lmcache;
pub(crate) mod remote;
pub(crate) mod serve;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use kvnode::client::Client;
use kvnode::config::{parse_size, NodeConfig};
use kvnode::server::Node;

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

/// Connects for a one-shot CLI request: the connection and then each reply are bounded by
/// `timeout`.
fn cli_client(socket: &std::path::Path, timeout: std::time::Duration) -> Result<Client, String> {
    let mut c = Client::connect_timeout(socket, timeout).map_err(|e| e.to_string())?;
    c.set_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    Ok(c)
}

/// A `--timeout` in seconds: more than 0, at most a day.
/// A command's failure: the message printed and the process's exit status (1, or
/// [`EXIT_AUTH_FAILED`]).
pub(crate) struct CliError {
    pub(crate) message: String,
    pub(crate) code: u8,
}

/// Exit status of a remote command whose authentication failed (either direction).
pub(crate) const EXIT_AUTH_FAILED: u8 = 3;

/// Exit status of `kvnode gpu probe` when no GPU can be used.
pub(crate) const EXIT_NO_GPU: u8 = 4;

impl From<String> for CliError {
    fn from(message: String) -> CliError {
        CliError { message, code: 1 }
    }
}

pub(crate) fn timeout_arg(s: &str) -> Result<std::time::Duration, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 86_400.0 => Ok(std::time::Duration::from_secs_f64(v)),
        _ => Err(format!(
            "timeout {s:?}: must be a number of seconds above 0 and at most 86400"
        )),
    }
}
