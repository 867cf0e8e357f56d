//! Remote engines: the TCP listener, its authenticated connections, and the data path that
//! moves a store's or retrieve's bytes between the pool and an engine on another host.
//!
//! The node moves the bytes (the 3FS and InfiniStore model): a remote engine prepares a store
//! or retrieve with the ordinary requests, then sends WRITE_SLOTS / READ_SLOTS; the node moves
//! the bytes between the transfer's slots and the engine through a fabric
//! (`kvnode_hw::fabric`: TCP with the bytes on the connection's stream, RDMA with the engine's
//! registered memory) and settles the transfer. Slot safety: [`ops`] takes the transfer out of
//! its instance's table while bytes move, and [`mover`] returns only after the fabric's
//! completion, so no release path can free or reuse a slot the fabric may still touch.

pub mod descriptors;
pub mod listener;
pub mod mover;
pub mod ops;
pub mod rdma;
pub mod rdma_ops;
#[cfg(test)]
mod rdma_ops_tests;
pub mod registry;
pub mod serve;

pub use listener::RemoteService;
pub use registry::{RemoteConnInfo, RemoteRegistry};

/// What the status report says about RDMA (`transports.rdma`): with a listener, what it
/// decided at start (the device in use, `"unavailable: <reason>"`, or `"disabled (...)"`);
/// without one, whether `remote.rdma_device` could be used (`"not offered (no --listen): <device>"`
/// or `"unavailable: <reason>"`). RDMA is untested on hardware.
pub fn rdma_status(
    config: &crate::config::RemoteConfig,
    service: Option<&RemoteService>,
) -> String {
    if let Some(s) = service {
        return s.rdma_status().to_owned();
    }
    let Some(device) = config.rdma_device() else {
        return "disabled (remote.rdma_device = \"none\")".into();
    };
    match kvnode_hw::fabric::rdma_availability(device) {
        Ok(device) => format!("not offered (no --listen): {device}"),
        Err(reason) => format!("unavailable: {reason}"),
    }
}
