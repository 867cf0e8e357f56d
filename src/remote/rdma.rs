//! The node's RDMA fabric for remote engines: opened at start when `remote.rdma_device` is not
//! `"none"` and a device opens (else the reason is logged once and the node offers TCP only),
//! the pool registered with it (local access only: the node's keys never leave it), a mover of
//! its own, and the queue-pair setup the handshake's RDMA exchange drives.
//!
//! **Untested on hardware**: this host has no RDMA (`ibv_get_device_list` fails with ENOSYS),
//! so only the "unavailable" path runs here; everything past `RdmaFabric::open` is compiled
//! only. The data ops it carries are tested through the fake fabric (`rdma_ops_tests.rs`).

use std::sync::Arc;

use kvnode_hw::fabric::{ConnId, ConnSetup, PendingQp, RdmaEndpoint};
use kvnode_hw::SharedPool;

use super::mover::Mover;
use crate::config::RemoteConfig;
use crate::transport::tcp::handshake::QpSetup;

/// The RDMA side of the remote service. Invariant: `mover` is set exactly when the device
/// opened and the pool is registered with it; `status` is then the device in use, else
/// `"unavailable: <reason>"` or `"disabled (...)"`.
pub struct NodeRdma {
    /// The RDMA fabric's mover (its own polling thread), when RDMA is offered.
    pub mover: Option<Arc<Mover>>,
    /// What status `transports.rdma` says.
    pub status: String,
}

impl NodeRdma {
    /// Opens the device `config.rdma_device` names and registers `pool` with it; never fails:
    /// a node without usable RDMA serves TCP only, and says why once in its log.
    pub fn open(config: &RemoteConfig, pool: &Arc<SharedPool>) -> NodeRdma {
        let Some(device) = config.rdma_device() else {
            return NodeRdma {
                mover: None,
                status: "disabled (remote.rdma_device = \"none\")".into(),
            };
        };
        match open_fabric(device, config, pool) {
            Ok((mover, describe)) => {
                tracing::info!(device = %describe, "offering RDMA to remote engines (untested on hardware)");
                NodeRdma {
                    mover: Some(mover),
                    status: describe,
                }
            }
            Err(reason) => {
                if device == "auto" {
                    tracing::info!(%reason, "RDMA unavailable: serving remote engines over TCP only");
                } else {
                    tracing::warn!(device, %reason, "the RDMA device named by remote.rdma_device cannot be used: serving remote engines over TCP only");
                }
                NodeRdma {
                    mover: None,
                    status: format!("unavailable: {reason}"),
                }
            }
        }
    }

    /// Whether RDMA is offered in the handshake.
    pub fn offered(&self) -> bool {
        self.mover.is_some()
    }
}

#[cfg(feature = "rdma")]
fn open_fabric(
    device: &str,
    config: &RemoteConfig,
    pool: &Arc<SharedPool>,
) -> Result<(Arc<Mover>, String), String> {
    use kvnode_hw::fabric::{Fabric, RdmaFabric, RdmaOptions};
    let fabric = RdmaFabric::open(RdmaOptions {
        device: device.to_owned(),
        gid_index: config.rdma_gid_index,
        remote_access: false,
        ..RdmaOptions::default()
    })
    .map_err(|e| hw_reason(&e))?;
    let describe = fabric.describe();
    fabric.register(pool).map_err(|e| {
        format!(
            "cannot register the pool with {describe}: {}",
            hw_reason(&e)
        )
    })?;
    let mover = Mover::start(Arc::new(fabric))
        .map_err(|e| format!("cannot start the RDMA mover thread: {e}"))?;
    Ok((mover, describe))
}

#[cfg(not(feature = "rdma"))]
fn open_fabric(
    _device: &str,
    _config: &RemoteConfig,
    _pool: &Arc<SharedPool>,
) -> Result<(Arc<Mover>, String), String> {
    Err("kvnode was built without the `rdma` feature".into())
}

/// The reason of a hardware error, without the "rdma:" operation prefix.
#[cfg(feature = "rdma")]
fn hw_reason(e: &kvnode_hw::HwError) -> String {
    match e {
        kvnode_hw::HwError::Os { op: "rdma", source } => source.to_string(),
        other => other.to_string(),
    }
}

/// The node's queue-pair setup for the handshake's RDMA exchange: a queue pair of the RDMA
/// fabric created only when the exchange asks (after authentication), connected through the
/// mover, torn down through it when abandoned.
pub struct MoverQp<'a>(pub &'a Mover);

impl QpSetup for MoverQp<'_> {
    type Pending = PendingQp;
    type Conn = ConnId;

    fn prepare(&mut self) -> Result<(PendingQp, RdmaEndpoint), String> {
        match self.0.fabric().prepare_endpoint() {
            Ok(Some(p)) => Ok(p),
            Ok(None) => Err(format!(
                "the {} fabric has no queue pairs",
                self.0.fabric().kind()
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    fn connect(&mut self, local: PendingQp, remote: RdmaEndpoint) -> Result<ConnId, String> {
        self.0
            .connect(ConnSetup::Rdma { local, remote })
            .map_err(|e| e.to_string())
    }

    fn abandon(&mut self, conn: ConnId) {
        self.0.teardown(conn);
    }
}
