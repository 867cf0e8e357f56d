//! The network data path: one [`Fabric`] trait, several implementations.
//!
//! The node moves the bytes: a remote engine registers its buffers and sends their descriptors;
//! the node posts batches of work items between pool ranges and those descriptors and polls their
//! completions. Implementations: the in-process [`FakeFabric`] (fault injection, manual clock,
//! for deterministic tests of the upper layers), [`TcpFabric`] (io_uring or plain sockets) and,
//! with the `rdma` feature, `RdmaFabric` (verbs; untested on hardware).
//!
//! **Invariant of every implementation:** between `post` returning `Ok` and the op's
//! [`Completion`] being returned by `poll`, the op's local ranges are in use by the
//! device/kernel; the caller never frees or reuses them in that window, whatever happens to the
//! peer. `teardown(conn)` completes every op still in flight on `conn` (`Flushed` if it was not
//! done) and then returns exactly one completion with `op == OpId::TEARDOWN_DONE`.

mod engine_buffer;
mod fake;
mod fake_peer;
pub mod rdma;
mod tcp;
mod tcp_core;
mod tcp_plain;
mod tcp_uring;
mod types;

#[cfg(test)]
mod fake_tests;
#[cfg(test)]
mod tcp_tests;
#[cfg(test)]
mod tcp_tests_engines;

use std::sync::Arc;
use std::time::Duration;

use crate::{HwResult, SharedPool};

pub use engine_buffer::{EngineBuffer, MAX_ENGINE_BUFFER_BYTES};
#[cfg(feature = "rdma")]
pub use engine_buffer::{RegisteredBuffer, RegisteredDeviceBuffer};
pub use fake::FakeFabric;
pub use fake_peer::{
    FakeOptions, FakePeer, FakeRegion, FAKE_DEFAULT_MAX_INFLIGHT_OPS, FAKE_DEFAULT_REGION_BYTES,
    INJECTED_OP_ERR, REM_ACCESS_ERR,
};
pub use rdma::{rdma_availability, rdma_device_names, RdmaOptions};
#[cfg(feature = "rdma")]
pub use rdma::{EngineMr, RdmaFabric};
pub use tcp::{
    TcpEngine, TcpFabric, TcpFabricOptions, ZcCounters, TCP_DEFAULT_MAX_INFLIGHT_OPS,
    TCP_DEFAULT_RINGS, TCP_MAX_INFLIGHT_OPS, TCP_MAX_ITEMS_PER_BATCH, TCP_MAX_RINGS,
    TCP_REGION_BYTES, TCP_ZC_MIN_BYTES,
};
pub use types::{
    Completion, ConnId, ConnSetup, Dir, FabricError, FabricKind, FabricStats, LocalRange, OpId,
    PendingQp, PostBatch, PostError, RdmaEndpoint, RegionId, RemoteSeg, WorkItem,
};

/// A way to move bytes between the node's pool and remote engines' memory.
///
/// Invariant: between `post` returning `Ok` and the op's [`Completion`] being returned by
/// `poll`, the op's local ranges are in use; every accepted op is returned by `poll` exactly
/// once; after `teardown(conn)` every op of `conn` is returned (`Flushed` if it was not done)
/// before the single `TEARDOWN_DONE` completion of `conn`. A fabric that cannot drain (device
/// dead) keeps the ops in flight forever (their slots leak, never get corrupted).
pub trait Fabric: Send + Sync {
    /// Which implementation this is.
    fn kind(&self) -> FabricKind;

    /// Registers the pool once (RDMA: `ibv_reg_mr` in pieces; TCP: io_uring fixed buffers in
    /// pieces of at most 1 GiB). Idempotent: a second call returns the same regions.
    fn register(&self, pool: &Arc<SharedPool>) -> HwResult<Vec<RegionId>>;

    /// RDMA only: creates a queue pair in INIT and returns what the peer needs. Others:
    /// `Ok(None)`.
    fn prepare_endpoint(&self) -> HwResult<Option<(PendingQp, RdmaEndpoint)>>;

    /// Takes over a connection after the control-plane handshake succeeded.
    fn connect(&self, setup: ConnSetup) -> HwResult<ConnId>;

    /// Validates every item (ranges inside a registered region, `len > 0`, no overflow, local
    /// ranges of this batch disjoint) and queues the batch; never blocks. `Err` => nothing was
    /// posted.
    fn post(&self, batch: PostBatch<'_>) -> Result<(), PostError>;

    /// Appends up to `max` completions to `out`; waits at most `timeout` for the first. Returns
    /// how many were appended.
    fn poll(&self, out: &mut Vec<Completion>, max: usize, timeout: Duration) -> usize;

    /// Starts teardown of `conn`: every op still in flight on it later completes through `poll`
    /// (`Flushed` if it was not done), then one completion with `op == OpId::TEARDOWN_DONE`.
    /// Idempotent; an unknown connection is ignored.
    fn teardown(&self, conn: ConnId);

    /// A snapshot of the counters.
    fn stats(&self) -> FabricStats;
}
