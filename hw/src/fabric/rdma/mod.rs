//! The RDMA verbs fabric: RC queue pairs, one-sided READ (Pull) and WRITE (Push), initiated by
//! the node (cargo feature `rdma`, on by default; links `libibverbs`/`librdmacm`).
//!
//! * `device.rs` — device list, port, GID (from sysfs), protection domain.
//! * `gid.rs` — pure GID choice (RoCE v2 + IPv4-mapped/global IPv6, never link-local).
//! * `mr.rs` — the pool registered in pieces (local access only), engine buffers (remote).
//! * `qp.rs` — completion queue + channel, RC queue pairs (INIT -> RTR -> RTS -> ERR).
//! * `post.rs` — pure planning: 1 MiB WRs, chains of 32, credits and FIFO, op progress.
//! * `fabric.rs` — [`RdmaFabric`], the [`Fabric`](super::Fabric) implementation.
//!
//! **Untested on hardware.** The development machine has no RDMA (InfiniBand is compiled out of
//! its kernel): the pure parts (`gid`, `post`, endpoint checks, completion-status mapping, the
//! sysfs reader) are unit-tested, `RdmaFabric::open` is tested on its "unavailable" path with a
//! real FFI call, and everything past `open` is compiled only. `scripts/rdma-selftest.sh` runs
//! the checks a host with a NIC can do.
//!
//! Picking the device and GID: `device = "auto"` takes the first device with an active port and
//! a usable GID (or name one, e.g. `"mlx5_0"`); `port` the first active port; `gid_index` the
//! best RoCE v2 entry with an IPv4-mapped address, then a global IPv6 one (`show_gids` or
//! `/sys/class/infiniband/<dev>/ports/<p>/gid_attrs/types/*` list the candidates).

#[cfg(feature = "rdma")]
mod device;
#[cfg(feature = "rdma")]
mod fabric;
#[cfg(feature = "rdma")]
pub mod gid;
#[cfg(feature = "rdma")]
mod mr;
#[cfg(feature = "rdma")]
pub mod post;
#[cfg(feature = "rdma")]
mod qp;

#[cfg(feature = "rdma")]
pub use fabric::RdmaFabric;
#[cfg(feature = "rdma")]
pub use mr::{EngineMr, MAX_MR_REGION_BYTES, MAX_MR_THREADS, MIN_MR_REGION_BYTES};
#[cfg(feature = "rdma")]
pub use qp::{CQ_ENTRIES, QP_MAX_SEND_WR, QP_RETRY_CNT, QP_RNR_RETRY, QP_TIMEOUT};

/// Default bound on ops (batches) accepted and not yet returned by `poll` (beyond it `post`
/// answers `Full`): bounds the memory of the FIFO of waiting batches.
pub const RDMA_DEFAULT_MAX_INFLIGHT_OPS: usize = 4096;

/// How to open an [`RdmaFabric`].
///
/// Invariant: checked by `RdmaFabric::open` (each bound named in its error): `device` not empty;
/// `mr_region_bytes` a multiple of 4096 in `MIN_MR_REGION_BYTES..=MAX_MR_REGION_BYTES` (1 GiB);
/// `mr_threads` in `1..=MAX_MR_THREADS` (8); `max_outstanding_wr` in
/// `MAX_CHAIN_WRS..=QP_MAX_SEND_WR` (32..=512, so a chain always fits and no queue overflows);
/// `max_inflight_ops > 0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaOptions {
    /// Device name (`"mlx5_0"`) or `"auto"`.
    pub device: String,
    /// Port (1-based); `None`: the first active one.
    pub port: Option<u8>,
    /// GID table index; `None`: chosen (see the module doc).
    pub gid_index: Option<u8>,
    /// The pool is registered in pieces of this many bytes (a local range may not span two).
    pub mr_region_bytes: u64,
    /// Pieces registered in parallel.
    pub mr_threads: usize,
    /// Bound on WRs outstanding on the device (the incast bound); excess batches wait in FIFO.
    pub max_outstanding_wr: u32,
    /// Bound on ops accepted and not yet returned by `poll`.
    pub max_inflight_ops: usize,
    /// Whether the queue pairs let the peer READ/WRITE our registered memory: `false` for the
    /// node (its pool is never remotely accessible), `true` for an engine.
    pub remote_access: bool,
    /// Call `ibv_fork_init` before registering (for processes that fork; the node does not).
    pub fork_init: bool,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            device: "auto".into(),
            port: None,
            gid_index: None,
            mr_region_bytes: 1 << 30,
            mr_threads: 8,
            max_outstanding_wr: 256,
            max_inflight_ops: RDMA_DEFAULT_MAX_INFLIGHT_OPS,
            remote_access: false,
            fork_init: false,
        }
    }
}

#[cfg(feature = "rdma")]
impl RdmaOptions {
    /// Checks the invariant of [`RdmaOptions`]; the error names the value and its bounds.
    pub fn check(&self) -> crate::HwResult<()> {
        use mr::{MAX_MR_REGION_BYTES, MAX_MR_THREADS, MIN_MR_REGION_BYTES};
        use post::MAX_CHAIN_WRS;
        use qp::QP_MAX_SEND_WR;
        let bad = |m: String| Err(crate::HwError::Invalid(format!("rdma options: {m}")));
        if self.device.is_empty() {
            return bad("device is empty (a name such as mlx5_0, or \"auto\")".into());
        }
        let piece = self.mr_region_bytes;
        if !(MIN_MR_REGION_BYTES..=MAX_MR_REGION_BYTES).contains(&piece)
            || !piece.is_multiple_of(MIN_MR_REGION_BYTES)
        {
            return bad(format!(
                "mr_region_bytes {piece} must be a multiple of {MIN_MR_REGION_BYTES} in \
                 {MIN_MR_REGION_BYTES}..={MAX_MR_REGION_BYTES}"
            ));
        }
        if !(1..=MAX_MR_THREADS).contains(&self.mr_threads) {
            return bad(format!(
                "mr_threads {} must be in 1..={MAX_MR_THREADS}",
                self.mr_threads
            ));
        }
        let lo = MAX_CHAIN_WRS as u32;
        if !(lo..=QP_MAX_SEND_WR).contains(&self.max_outstanding_wr) {
            return bad(format!(
                "max_outstanding_wr {} must be in {lo}..={QP_MAX_SEND_WR} (a chain of {lo} WRs \
                 must fit; a queue pair holds {QP_MAX_SEND_WR})",
                self.max_outstanding_wr
            ));
        }
        if self.max_inflight_ops == 0 {
            return bad("max_inflight_ops must be > 0".into());
        }
        Ok(())
    }
}

/// What a [`PendingQp`](super::PendingQp) holds: a queue pair in INIT of one `RdmaFabric`.
///
/// Invariant: only `RdmaFabric::prepare_endpoint` builds one; dropping it destroys the QP.
#[cfg(feature = "rdma")]
#[derive(Debug)]
pub(crate) struct PendingInner(pub(crate) qp::Qp);

/// Whether RDMA can be used with `device` (`"auto"`, a name, or `"none"`), for status:
/// `Ok("mlx5_0 port 1 gid 3 (RoCEv2 ::ffff:10.0.0.5 on eth0)")` or `Err(reason)`, e.g.
/// `"no RDMA kernel support (ibv_get_device_list: ENOSYS)"`, `"no RDMA device"`.
///
/// Invariant: opens and closes the device (no registration, no queue pair); never panics.
pub fn rdma_availability(device: &str) -> Result<String, String> {
    if device == "none" {
        return Err("disabled (rdma_device = \"none\")".into());
    }
    available(device)
}

/// The names of this host's RDMA devices, or why there are none (same reasons as
/// [`rdma_availability`]).
///
/// Invariant: opens nothing; never panics.
pub fn rdma_device_names() -> Result<Vec<String>, String> {
    names()
}

#[cfg(feature = "rdma")]
fn names() -> Result<Vec<String>, String> {
    device::device_names().map_err(|e| error_reason(&e))
}

#[cfg(not(feature = "rdma"))]
fn names() -> Result<Vec<String>, String> {
    Err("kvnode was built without the `rdma` feature".into())
}

#[cfg(feature = "rdma")]
fn available(device: &str) -> Result<String, String> {
    let opts = RdmaOptions {
        device: device.to_owned(),
        ..RdmaOptions::default()
    };
    device::open(&opts)
        .map(|d| d.describe())
        .map_err(|e| error_reason(&e))
}

#[cfg(not(feature = "rdma"))]
fn available(_device: &str) -> Result<String, String> {
    Err("kvnode was built without the `rdma` feature".into())
}

/// The reason of an RDMA error without the `"rdma: "` prefix of "unavailable" errors.
#[cfg(feature = "rdma")]
pub(crate) fn error_reason(e: &crate::HwError) -> String {
    match e {
        crate::HwError::Os { op: "rdma", source } => source.to_string(),
        other => other.to_string(),
    }
}

#[cfg(all(test, feature = "rdma"))]
mod tests;
