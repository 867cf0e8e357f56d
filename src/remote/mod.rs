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
pub mod registry;
pub mod serve;

pub use listener::RemoteService;
pub use registry::{RemoteConnInfo, RemoteRegistry};

/// What the status report says about RDMA: the device RDMA would use, or
/// `"unavailable: <reason>"` (no kernel support, no device, built without the `rdma` feature).
/// The node serves remote engines over TCP; the RDMA data path is built and tested through the
/// fake fabric but not yet offered in the handshake (untested on hardware).
pub fn rdma_status() -> String {
    match kvnode_hw::fabric::rdma_availability("auto") {
        Ok(device) => format!("available, not yet offered to engines: {device}"),
        Err(reason) => format!("unavailable: {reason}"),
    }
}
