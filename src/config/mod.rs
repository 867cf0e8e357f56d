//! Node configuration: embedded defaults, an optional TOML file, command-line overrides.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};

/// Longest reap timeout or registration grace accepted (30 days): keeps every deadline far
/// from overflowing the millisecond clock arithmetic.
pub const MAX_LIVENESS_SECS: f64 = 30.0 * 24.0 * 3600.0;
/// Longest write, read or session TTL accepted (30 days).
pub const MAX_TTL_SECS: u64 = 30 * 24 * 3600;
/// Longest liveness tick accepted.
pub const MAX_LIVENESS_TICK_MS: u64 = 10_000;

mod cluster;
mod limits;
mod remote;
mod socket_dir;

pub use cluster::{etcd_endpoint, members_prefix, ClusterConfig, MAX_NODE_ID_BYTES};
pub use limits::Limits;
pub use remote::{parse_tcp_url, RemoteConfig, TcpEngineChoice, HEARTBEAT_MS};
pub use socket_dir::{
    check_private_dir, default_socket_dir, default_socket_path, ensure_private_dir,
};

/// Longest frame deadline accepted (one hour).
pub const MAX_FRAME_TIMEOUT_MS: u64 = 3_600_000;

impl Limits {
    /// Checks the native protocol's byte budgets and deadlines (see the fields).
    fn validate_native_budgets(&self) -> Result<()> {
        if self.max_session_bytes == 0 {
            return Err(Error::invalid("limit max_session_bytes must be > 0"));
        }
        if !(1..=MAX_FRAME_TIMEOUT_MS).contains(&self.frame_timeout_ms) {
            return Err(Error::invalid(format!(
                "limit frame_timeout_ms = {} is outside 1..={MAX_FRAME_TIMEOUT_MS}",
                self.frame_timeout_ms
            )));
        }
        if self.idle_timeout_secs > MAX_TTL_SECS {
            return Err(Error::invalid(format!(
                "limit idle_timeout_secs = {} is beyond {MAX_TTL_SECS} s (0 turns it off)",
                self.idle_timeout_secs
            )));
        }
        let max_frame = u64::from(crate::protocol::MAX_PAYLOAD_BYTES);
        if self.max_inflight_payload_bytes < max_frame {
            return Err(Error::invalid(format!(
                "limit max_inflight_payload_bytes = {} is below the largest frame payload \
                 ({max_frame} bytes): such a frame could never be received",
                self.max_inflight_payload_bytes
            )));
        }
        Ok(())
    }

    /// The frame deadline.
    pub fn frame_timeout(&self) -> Duration {
        Duration::from_millis(self.frame_timeout_ms)
    }

    /// The idle deadline (`None`: off).
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_secs > 0).then(|| Duration::from_secs(self.idle_timeout_secs))
    }
}

/// When committed objects are written to the L2 disk tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WritePolicy {
    /// Every committed object is written behind (asynchronously) as soon as it is committed.
    Always,
    /// Objects are written when the background eviction pass is about to drop them from L1.
    OnEvict,
}

impl WritePolicy {
    /// Stable name: `"always"` or `"on-evict"`.
    pub fn as_str(self) -> &'static str {
        match self {
            WritePolicy::Always => "always",
            WritePolicy::OnEvict => "on-evict",
        }
    }

    /// Parses `always` or `on-evict`.
    pub fn parse(s: &str) -> Result<WritePolicy> {
        match s.to_ascii_lowercase().as_str() {
            "always" | "all" => Ok(WritePolicy::Always),
            "on-evict" | "on_evict" | "evict" => Ok(WritePolicy::OnEvict),
            other => Err(Error::invalid(format!(
                "L2 write policy must be always or on-evict (got {other:?})"
            ))),
        }
    }
}

/// Which L2 devices the node may format. Invariant: the node never formats a device that holds
/// data it cannot prove to be its own or empty unless told `overwrite`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum L2Format {
    /// Only a new or empty file or device (every byte zero, proven by reading its allocated
    /// ranges, at most [`crate::l2::device::MAX_EMPTY_SCAN_BYTES`]) or one already holding a kvnode
    /// L2 tier.
    #[default]
    IfEmpty,
    /// Also a device or file holding other data (destroyed): for a disk handed to kvnode
    /// explicitly.
    Overwrite,
}

impl L2Format {
    /// Stable name: `"if-empty"` or `"overwrite"`.
    pub fn as_str(self) -> &'static str {
        match self {
            L2Format::IfEmpty => "if-empty",
            L2Format::Overwrite => "overwrite",
        }
    }

    /// Parses `if-empty` or `overwrite`.
    pub fn parse(s: &str) -> Result<L2Format> {
        match s.to_ascii_lowercase().as_str() {
            "if-empty" | "if_empty" => Ok(L2Format::IfEmpty),
            "overwrite" => Ok(L2Format::Overwrite),
            other => Err(Error::invalid(format!(
                "L2 format must be if-empty or overwrite (got {other:?})"
            ))),
        }
    }
}

/// `paths = ["/a", "/b"]`, or a single `path = "/a"` (the form before several devices).
fn one_or_many_paths<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<PathBuf>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(PathBuf),
        Many(Vec<PathBuf>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(p) => vec![p],
        OneOrMany::Many(v) => v,
    })
}

/// Most L2 devices (paths) one node spreads its objects over.
pub const MAX_L2_DEVICES: usize = 16;

/// The L2 disk tier. Invariant after [`NodeConfig::validate`]: disabled (`paths` empty) or
/// `bytes`, `queue_depth`, `max_prefetch_objects`, `write_queue`, `batch_objects` and
/// `max_index_bytes` are > 0 and `engine` names an engine.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct L2Config {
    /// One entry per device: a directory (the data file `kvnode-l2.dat` is created in it), an
    /// existing data file, or a block device. Objects are spread over them by key, in
    /// proportion to their sizes. Empty: no L2 tier.
    #[serde(alias = "path", deserialize_with = "one_or_many_paths")]
    pub paths: Vec<PathBuf>,
    /// Bytes of each data file (a block device uses at most this much of itself).
    pub bytes: u64,
    /// `auto` (io_uring, else pread), `uring` or `pread`.
    pub engine: String,
    /// When objects are written to L2.
    pub write_policy: WritePolicy,
    /// io_uring queue depth of the write-behind ring (I/Os in flight).
    pub queue_depth: u32,
    /// io_uring queue depth of each load ring. A smaller depth makes the reads of one lookup
    /// complete one after another (checksums verified while the rest are on the disk) at the
    /// price of fewer reads in flight; on the development VM's disk 8 and 64 measured within
    /// its noise of each other, so the default stays 64.
    pub read_queue_depth: u32,
    /// Kernel-side submission polling for the io_uring rings.
    pub sqpoll: bool,
    /// Extent size on disk (a multiple of 2 MiB); 0 = chosen from the file size.
    pub extent_bytes: u64,
    /// Objects being loaded from L2 into L1 at once, node-wide (prefetch bound).
    pub max_prefetch_objects: usize,
    /// Committed objects waiting for write-behind (beyond it they are skipped and counted).
    pub write_queue: usize,
    /// Objects per write-behind batch.
    pub batch_objects: usize,
    /// How long start-up waits for another process's lock on a device to go away (a node
    /// killed a moment ago keeps its files open until the kernel has finished its in-flight
    /// I/O); after that the node refuses to start.
    pub lock_wait_ms: u64,
    /// Which devices the node may format (`if-empty` or `overwrite`).
    pub format: L2Format,
    /// How long a device may take to answer one I/O before the tier counts it as stuck: loads
    /// then miss at once, writes wait, a CLEAR stops waiting for its superblock, and the
    /// shutdown stops waiting for the write-behind (1 ms ..= 1 h).
    pub io_timeout_ms: u64,
    /// Memory of each device's in-memory index, in bytes. Its geometry is charged up front:
    /// one bit per 8 KiB of device and about 1.6 KiB per extent (16 MiB and 6.4 MiB per TiB
    /// with 256 MiB extents); a device needing more than the limit for that plus one object is
    /// refused at start-up. Each object is charged
    /// [`crate::l2::space::INDEX_BYTES_PER_OBJECT`] (991 bytes, a worst case; typical use is
    /// about half), and the rest of the limit divided by that is the most objects the device
    /// indexes: beyond it, storing an object evicts the least recently used, and recovery
    /// indexes the most recently written. The default, 1 GiB, indexes about a million objects
    /// per device (all of a default 8 GiB device; 64 GiB of 64 KiB objects).
    pub max_index_bytes: u64,
}

impl Default for L2Config {
    fn default() -> Self {
        L2Config {
            paths: Vec::new(),
            bytes: 8 << 30,
            engine: "auto".into(),
            write_policy: WritePolicy::Always,
            queue_depth: 64,
            read_queue_depth: 64,
            sqpoll: false,
            extent_bytes: 0,
            max_prefetch_objects: 1024,
            write_queue: 65_536,
            batch_objects: 64,
            lock_wait_ms: 5_000,
            format: L2Format::IfEmpty,
            io_timeout_ms: 10_000,
            max_index_bytes: 1 << 30,
        }
    }
}

impl L2Config {
    /// Whether the tier is configured.
    pub fn enabled(&self) -> bool {
        !self.paths.is_empty()
    }

    /// The engine named by `engine` (`None` = auto).
    pub fn engine_kind(&self) -> Result<Option<kvnode_hw::EngineKind>> {
        match self.engine.to_ascii_lowercase().as_str() {
            "auto" => Ok(None),
            "uring" | "io_uring" | "io-uring" => Ok(Some(kvnode_hw::EngineKind::Uring)),
            "pread" => Ok(Some(kvnode_hw::EngineKind::Pread)),
            other => Err(Error::invalid(format!(
                "L2 engine must be one of uring, pread, auto (got {other:?})"
            ))),
        }
    }

    fn validate(&self) -> Result<()> {
        if !self.enabled() {
            return Ok(());
        }
        self.engine_kind()?;
        for (i, p) in self.paths.iter().enumerate() {
            if p.as_os_str().is_empty() {
                return Err(Error::invalid("an L2 path is empty"));
            }
            if self.paths[..i].contains(p) {
                return Err(Error::invalid(format!(
                    "L2 path {} given twice",
                    p.display()
                )));
            }
        }
        if self.paths.len() > MAX_L2_DEVICES {
            return Err(Error::invalid(format!(
                "{} L2 paths (at most {MAX_L2_DEVICES})",
                self.paths.len()
            )));
        }
        for (name, v) in [
            ("l2.bytes", self.bytes),
            ("l2.queue_depth", u64::from(self.queue_depth)),
            ("l2.read_queue_depth", u64::from(self.read_queue_depth)),
            ("l2.max_prefetch_objects", self.max_prefetch_objects as u64),
            ("l2.write_queue", self.write_queue as u64),
            ("l2.batch_objects", self.batch_objects as u64),
            ("l2.max_index_bytes", self.max_index_bytes),
        ] {
            if v == 0 {
                return Err(Error::invalid(format!("{name} must be > 0")));
            }
        }
        if self.queue_depth > 4096 || self.read_queue_depth > 4096 {
            return Err(Error::invalid(
                "l2.queue_depth and l2.read_queue_depth must be <= 4096",
            ));
        }
        if !self.extent_bytes.is_multiple_of(2 << 20) {
            return Err(Error::invalid(
                "l2.extent_bytes must be a multiple of 2 MiB",
            ));
        }
        if !(1..=3_600_000).contains(&self.io_timeout_ms) {
            return Err(Error::invalid(format!(
                "l2.io_timeout_ms must be between 1 and 3600000 (got {})",
                self.io_timeout_ms
            )));
        }
        Ok(())
    }
}

/// Everything `kvnode serve` needs. Invariant after [`NodeConfig::validate`]: sizes non-zero,
/// `registration_grace >= reap_timeout` when reaping is on.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Unix socket path of the native protocol (empty: no native socket, e.g. an LMCache-only
    /// frontend).
    pub socket: PathBuf,
    /// Back the pool with the named POSIX shm segment `/dev/shm/<shm_name>` (what LMCache
    /// clients open by name) instead of an anonymous memfd; empty = memfd.
    pub shm_name: String,
    /// Opt-in (default false; `--segment-bind-mount`): a root node puts the `shm_name` segment
    /// on huge pages by bind-mounting a private hugetlbfs / huge tmpfs file over its name. Seen
    /// only in the node's mount namespace: every client must run there (or in one the mount
    /// propagates to). Refused, with a warning, when the node is not in PID 1's mount namespace.
    pub segment_bind_mount: bool,
    /// Permission bits of the socket file.
    pub socket_mode: u32,
    /// Requested pool size in bytes (rounded up to 2 MiB).
    pub pool_bytes: u64,
    /// Preferred page size: "1g", "2m", "thp" or "4k" (falls back downwards).
    pub pages: String,
    /// Tokens per chunk.
    pub chunk_tokens: u32,
    /// Reap instances that pinged and then went silent this long (seconds; 0 disables reaping).
    pub reap_timeout_secs: f64,
    /// Reap instances that never pinged after this long (seconds).
    pub registration_grace_secs: f64,
    /// Liveness timer-wheel tick in milliseconds.
    pub liveness_tick_ms: u64,
    /// Worker (instance shard) threads; 0 = one per core.
    pub workers: usize,
    /// Write-reservation TTL safety net (seconds).
    pub write_ttl_secs: u64,
    /// Read-lock TTL safety net (seconds).
    pub read_ttl_secs: u64,
    /// Lookup sessions idle this long are dropped (seconds).
    pub session_ttl_secs: u64,
    /// Background eviction trigger (fraction of the pool).
    pub high_watermark: f64,
    /// Background eviction target (fraction of the pool).
    pub low_watermark: f64,
    /// Limits.
    pub limits: Limits,
    /// The L2 disk tier (`[l2]` in TOML).
    pub l2: L2Config,
    /// Who may connect and who may run admin operations (`[access]` in TOML).
    pub access: crate::access::AccessConfig,
    /// Budgets of the LMCache frontend (`[lmcache]` in TOML).
    pub lmcache: crate::lmcache::frontend::LmLimits,
    /// The TCP listener for remote engines (`[remote]` in TOML).
    pub remote: RemoteConfig,
    /// Membership in a cluster of nodes on etcd (`[cluster]` in TOML).
    pub cluster: ClusterConfig,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            socket: default_socket_path(),
            shm_name: String::new(),
            segment_bind_mount: false,
            socket_mode: 0o600,
            pool_bytes: 1 << 30,
            pages: "2m".into(),
            chunk_tokens: 256,
            reap_timeout_secs: 120.0,
            registration_grace_secs: 3600.0,
            liveness_tick_ms: 100,
            workers: 0,
            write_ttl_secs: 600,
            read_ttl_secs: 300,
            session_ttl_secs: 600,
            high_watermark: 0.95,
            low_watermark: 0.85,
            limits: Limits::default(),
            l2: L2Config::default(),
            access: Default::default(),
            lmcache: Default::default(),
            remote: RemoteConfig::default(),
            cluster: ClusterConfig::default(),
        }
    }
}

impl NodeConfig {
    /// Reads a TOML file; missing keys keep their defaults, unknown keys are an error.
    pub fn from_toml_file(path: &Path) -> Result<NodeConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::invalid(format!("reading config {}: {e}", path.display())))?;
        toml::from_str(&text).map_err(|e| Error::invalid(format!("config {}: {e}", path.display())))
    }

    /// Checks the invariants listed on the type.
    pub fn validate(&self) -> Result<()> {
        if self.pool_bytes == 0 {
            return Err(Error::invalid("pool size must be > 0"));
        }
        if self.chunk_tokens == 0 {
            return Err(Error::invalid("chunk size must be > 0 tokens"));
        }
        if !(self.reap_timeout_secs >= 0.0 && self.reap_timeout_secs.is_finite()) {
            return Err(Error::invalid("reap timeout must be a finite number >= 0"));
        }
        if self.reap_timeout_secs > 0.0 && self.registration_grace_secs < self.reap_timeout_secs {
            return Err(Error::invalid(format!(
                "registration grace ({} s) must be >= reap timeout ({} s)",
                self.registration_grace_secs, self.reap_timeout_secs
            )));
        }
        if self.socket_mode > 0o777 || self.socket_mode & 0o600 != 0o600 {
            return Err(Error::invalid(format!(
                "socket_mode {:#o}: permission bits only (at most 0777), and the owner needs read \
                 and write, or not even the node's own user could connect",
                self.socket_mode
            )));
        }
        if self.liveness_tick_ms == 0 || self.liveness_tick_ms > MAX_LIVENESS_TICK_MS {
            return Err(Error::invalid(format!(
                "liveness tick {} ms outside 1..={MAX_LIVENESS_TICK_MS} ms",
                self.liveness_tick_ms
            )));
        }
        for (name, v) in [
            ("write_ttl_secs", self.write_ttl_secs),
            ("read_ttl_secs", self.read_ttl_secs),
            ("session_ttl_secs", self.session_ttl_secs),
        ] {
            if !(1..=MAX_TTL_SECS).contains(&v) {
                return Err(Error::invalid(format!(
                    "{name} = {v} is outside 1..={MAX_TTL_SECS} s: a TTL of 0 would free memory \
                     a client is still copying, and the safety nets need a finite deadline"
                )));
            }
        }
        for (name, v) in [
            ("reap timeout", self.reap_timeout_secs),
            ("registration grace", self.registration_grace_secs),
        ] {
            if !(v.is_finite() && v <= MAX_LIVENESS_SECS) {
                return Err(Error::invalid(format!(
                    "{name} {v} s is beyond the limit of {MAX_LIVENESS_SECS} s (30 days)"
                )));
            }
        }
        if !(0.0 < self.low_watermark
            && self.low_watermark <= self.high_watermark
            && self.high_watermark <= 1.0)
        {
            return Err(Error::invalid(
                "watermarks must satisfy 0 < low <= high <= 1",
            ));
        }
        self.page_preference()?;
        self.l2.validate()?;
        self.access.validate()?;
        self.lmcache.validate()?;
        self.remote.validate()?;
        self.cluster.validate(self.remote.enabled())?;
        let l = &self.limits;
        for (name, v) in [
            ("max_instances", l.max_instances),
            ("max_connections", l.max_connections),
            ("max_queued_per_instance", l.max_queued_per_instance),
            ("max_pending_transfers", l.max_pending_transfers),
            ("max_chunks_per_request", l.max_chunks_per_request),
            ("max_sessions", l.max_sessions),
            ("max_objects", l.max_objects),
            ("max_namespaces", l.max_namespaces),
            ("event_bus_capacity", l.event_bus_capacity),
            ("max_instances_per_user", l.max_instances_per_user),
            (
                "max_instances_per_connection",
                l.max_instances_per_connection,
            ),
            (
                "max_connections_per_client_user",
                l.max_connections_per_client_user,
            ),
        ] {
            if v == 0 {
                return Err(Error::invalid(format!("limit {name} must be > 0")));
            }
        }
        l.validate_native_budgets()?;
        for (name, v) in [
            (
                "max_reserved_fraction_per_instance",
                l.max_reserved_fraction_per_instance,
            ),
            (
                "max_reserved_fraction_per_user",
                l.max_reserved_fraction_per_user,
            ),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(Error::invalid(format!(
                    "limit {name} = {v} must be a share of the pool in (0, 1]"
                )));
            }
        }
        Ok(())
    }

    /// The page preference named by `pages`.
    pub fn page_preference(&self) -> Result<kvnode_hw::PagePreference> {
        use kvnode_hw::PagePreference as P;
        Ok(match self.pages.to_ascii_lowercase().as_str() {
            "1g" | "hugetlb-1g" => P::Huge1G,
            "2m" | "hugetlb-2m" => P::Huge2M,
            "thp" => P::Thp,
            "4k" => P::Pages4K,
            other => {
                return Err(Error::invalid(format!(
                    "pages must be one of 1g, 2m, thp, 4k (got {other:?})"
                )))
            }
        })
    }

    /// Number of worker threads to start.
    pub fn worker_threads(&self) -> usize {
        if self.workers > 0 {
            return self.workers.min(64);
        }
        std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 16))
    }

    /// The reap timeout as a duration (zero = disabled).
    pub fn reap_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.reap_timeout_secs)
    }

    /// The registration grace as a duration.
    pub fn registration_grace(&self) -> Duration {
        Duration::from_secs_f64(self.registration_grace_secs.max(0.0))
    }
}

/// Parses sizes like `256MiB`, `4GiB`, `1G`, `512k`, or plain bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| {
        Error::invalid(format!(
            "size {s:?}: expected a number with an optional unit"
        ))
    })?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(Error::invalid(format!(
                "size {s:?}: unknown unit {other:?}"
            )))
        }
    };
    let bytes = value * mult as f64;
    if !(0.0..1.8e19).contains(&bytes) {
        return Err(Error::invalid(format!("size {s:?} out of range")));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("4GiB").unwrap(), 4 << 30);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn validation() {
        assert!(NodeConfig::default().validate().is_ok());
        let c = NodeConfig {
            reap_timeout_secs: 100.0,
            registration_grace_secs: 50.0,
            ..NodeConfig::default()
        };
        assert!(c.validate().is_err());
        let c = NodeConfig {
            pages: "huge".into(),
            ..NodeConfig::default()
        };
        assert!(c.validate().is_err());
        // Liveness windows and tick are bounded (no overflow, no busy loop).
        for (timeout, grace, tick) in [
            (1e12, 1e12, 100),
            (120.0, 1e300, 100),
            (120.0, f64::INFINITY, 100),
            (120.0, 3600.0, u64::MAX),
        ] {
            let c = NodeConfig {
                reap_timeout_secs: timeout,
                registration_grace_secs: grace,
                liveness_tick_ms: tick,
                ..NodeConfig::default()
            };
            let e = c.validate().unwrap_err();
            assert!(
                e.context.contains("limit") || e.context.contains("outside"),
                "{e}"
            );
        }
        let mut c = NodeConfig::default();
        c.limits.max_instances = 0;
        assert!(c.validate().is_err());
        // TTLs: 0 would free what a client is still copying; "forever" would overflow.
        for (w, r, s) in [
            (0, 300, 600),
            (600, 0, 600),
            (600, 300, 0),
            (u64::MAX, 300, 600),
        ] {
            let c = NodeConfig {
                write_ttl_secs: w,
                read_ttl_secs: r,
                session_ttl_secs: s,
                ..NodeConfig::default()
            };
            let e = c.validate().unwrap_err();
            assert!(e.context.contains("ttl_secs"), "{e}");
        }
        // Native budgets and deadlines: named in the error.
        let mut c = NodeConfig::default();
        c.limits.max_inflight_payload_bytes = (16 << 20) - 1;
        assert!(c
            .validate()
            .unwrap_err()
            .context
            .contains("max_inflight_payload_bytes"));
        let mut c = NodeConfig::default();
        c.limits.frame_timeout_ms = 0;
        assert!(c
            .validate()
            .unwrap_err()
            .context
            .contains("frame_timeout_ms"));
        let mut c = NodeConfig::default();
        c.limits.max_session_bytes = 0;
        assert!(c
            .validate()
            .unwrap_err()
            .context
            .contains("max_session_bytes"));
        let mut c = NodeConfig::default();
        c.limits.idle_timeout_secs = 0;
        assert!(c.validate().is_ok(), "0 turns the idle deadline off");
        // The socket mode from a config file follows the flag's rules.
        for mode in [0, 0o400, 0o1777] {
            let c = NodeConfig {
                socket_mode: mode,
                ..NodeConfig::default()
            };
            assert!(c.validate().unwrap_err().context.contains("socket_mode"));
        }
    }

    #[test]
    fn toml_overrides_defaults_and_rejects_unknown_keys() {
        let dir = std::env::temp_dir().join(format!("kvnode-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.toml");
        std::fs::write(&p, "pool_bytes = 1048576\n[limits]\nmax_instances = 3\n").unwrap();
        let c = NodeConfig::from_toml_file(&p).unwrap();
        assert_eq!(
            (c.pool_bytes, c.limits.max_instances, c.chunk_tokens),
            (1 << 20, 3, 256)
        );
        std::fs::write(&p, "pool_size = 1\n").unwrap();
        assert!(NodeConfig::from_toml_file(&p).is_err());
        // L2 devices: a list, or the single-path form.
        std::fs::write(&p, "[l2]\npaths = [\"/a\", \"/b\"]\n").unwrap();
        let c = NodeConfig::from_toml_file(&p).unwrap();
        assert_eq!(c.l2.paths, [PathBuf::from("/a"), PathBuf::from("/b")]);
        std::fs::write(&p, "[l2]\npath = \"/a\"\n").unwrap();
        let c = NodeConfig::from_toml_file(&p).unwrap();
        assert_eq!(c.l2.paths, [PathBuf::from("/a")]);
        // The index limit: 1 GiB by default, set in bytes, never 0.
        assert_eq!(c.l2.max_index_bytes, 1 << 30);
        std::fs::write(&p, "[l2]\npath = \"/a\"\nmax_index_bytes = 4194304\n").unwrap();
        let c = NodeConfig::from_toml_file(&p).unwrap();
        assert_eq!(c.l2.max_index_bytes, 4 << 20);
        assert!(c.validate().is_ok());
        std::fs::write(&p, "[l2]\npath = \"/a\"\nmax_index_bytes = 0\n").unwrap();
        let e = NodeConfig::from_toml_file(&p)
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(e.context.contains("l2.max_index_bytes"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
