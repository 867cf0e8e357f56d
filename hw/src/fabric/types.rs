//! Plain data types of the [`Fabric`](super::Fabric) interface.
//!
//! The node always initiates data movement: *Pull* moves engine memory into pool slots (a store:
//! RDMA READ / TCP receive), *Push* moves pool slots into engine memory (a retrieve: RDMA WRITE /
//! TCP send).

use std::os::fd::OwnedFd;
use std::time::Instant;

use super::fake_peer::FakePeer;

/// Which implementation a fabric is.
///
/// Invariant: plain tag; [`FabricKind::as_str`] is the stable name used in status JSON and CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FabricKind {
    /// TCP (io_uring or plain sockets).
    Tcp,
    /// RDMA verbs (RC queue pairs, one-sided READ/WRITE).
    Rdma,
    /// The in-process fake used by deterministic tests.
    Fake,
}

impl FabricKind {
    /// The stable name: `"tcp"`, `"rdma"` or `"fake"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FabricKind::Tcp => "tcp",
            FabricKind::Rdma => "rdma",
            FabricKind::Fake => "fake",
        }
    }
}

impl std::fmt::Display for FabricKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Direction of a batch, always seen from the node.
///
/// Invariant: `Pull` writes only the batch's local ranges (remote memory is read); `Push` reads
/// only the local ranges (remote memory is written).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    /// Engine memory -> pool slots (store).
    Pull,
    /// Pool slots -> engine memory (retrieve).
    Push,
}

/// Identifies one posted batch.
///
/// Invariant: unique among the ops in flight on a fabric (the caller takes it from a node-wide
/// counter); [`OpId::TEARDOWN_DONE`] is reserved and never accepted by `post`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

impl OpId {
    /// The op id of the single completion that ends a connection's teardown: every op of that
    /// connection has been returned by `poll` before it.
    pub const TEARDOWN_DONE: OpId = OpId(u64::MAX);
}

/// Identifies one connection of a fabric.
///
/// Invariant: assigned by [`Fabric::connect`](super::Fabric::connect), never reused by the same
/// fabric instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// A registered piece of the pool.
///
/// Invariant: assigned by [`Fabric::register`](super::Fabric::register); valid for the lifetime
/// of the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u32);

/// A byte range of the pool (offsets from the pool's start).
///
/// Invariant: plain data; `post` accepts it only when `len > 0`, `offset + len` does not
/// overflow and the range lies inside one registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalRange {
    /// Start offset in the pool.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl LocalRange {
    /// `offset + len`, or `None` on overflow.
    pub fn end(&self) -> Option<u64> {
        self.offset.checked_add(self.len)
    }

    /// Whether the two ranges share at least one byte (overflowing ends saturate).
    pub fn overlaps(&self, other: &LocalRange) -> bool {
        let a_end = self.offset.saturating_add(self.len);
        let b_end = other.offset.saturating_add(other.len);
        self.len > 0 && other.len > 0 && self.offset < b_end && other.offset < a_end
    }
}

/// `Err` naming the first two local ranges of `items` that overlap (a batch's local ranges
/// must be pairwise disjoint; every fabric's `post` checks it).
pub fn check_disjoint(items: &[WorkItem]) -> Result<(), PostError> {
    let mut sorted: Vec<LocalRange> = items.iter().map(|w| w.local).collect();
    sorted.sort_by_key(|r| r.offset);
    match sorted.windows(2).find(|w| w[0].overlaps(&w[1])) {
        Some(w) => Err(PostError::Invalid(format!(
            "local ranges at {} and {} overlap",
            w[0].offset, w[1].offset
        ))),
        None => Ok(()),
    }
}

/// The remote side of one work item.
///
/// Invariant: plain data from the peer, untrusted: a fabric checks it like a NIC would (RDMA:
/// the remote key and bounds are checked by the peer's NIC and a violation completes the op with
/// `FabricError::Remote("REM_ACCESS_ERR")`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemoteSeg {
    /// Remote virtual address and key of a region the engine registered.
    Rdma {
        /// Remote virtual address of the first byte.
        addr: u64,
        /// The remote key of the engine's memory region.
        rkey: u32,
    },
    /// The next `len` bytes of the connection's TCP data stream.
    Stream,
}

/// One transfer between a local range and a remote segment of the same length.
///
/// Invariant: plain data; validated by `post`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkItem {
    /// The pool range (written by a Pull, read by a Push).
    pub local: LocalRange,
    /// Where the other `local.len` bytes are on the peer.
    pub remote: RemoteSeg,
}

/// A batch of work items posted as one op.
///
/// Invariant: the op completes as a whole (one [`Completion`]); on success every item was moved;
/// on error the local ranges of a Pull may hold any bytes.
#[derive(Debug, Clone, Copy)]
pub struct PostBatch<'a> {
    /// The op's id (unique among ops in flight; not `TEARDOWN_DONE`).
    pub op: OpId,
    /// The connection it runs on.
    pub conn: ConnId,
    /// Pull or Push.
    pub dir: Dir,
    /// At least one item; local ranges pairwise disjoint.
    pub items: &'a [WorkItem],
    /// The op completes with `FabricError::Deadline` if it is not done by then.
    pub deadline: Instant,
}

/// The outcome of one op, or the end of a teardown.
///
/// Invariant: returned by `poll` exactly once per accepted op; once returned, the op's local
/// ranges are no longer touched by the fabric. `op == OpId::TEARDOWN_DONE` marks the end of
/// `conn`'s teardown (its `result` is `Ok(0)`): no completion of `conn` follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Which op (or `TEARDOWN_DONE`).
    pub op: OpId,
    /// Its connection.
    pub conn: ConnId,
    /// `Ok(bytes moved)` (the batch's total) or why it failed.
    pub result: Result<u64, FabricError>,
}

/// Why an op failed.
///
/// Invariant: an op that failed never counts as done: its local ranges (Pull) may hold any bytes
/// and must never be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FabricError {
    /// The connection was torn down (or broke) before the op was done.
    #[error("flushed by teardown")]
    Flushed,
    /// The peer (or its NIC) reported an error, e.g. `REM_ACCESS_ERR`.
    #[error("remote error: {0}")]
    Remote(String),
    /// The local side failed.
    #[error("local error: {0}")]
    Local(String),
    /// The op was not done by its deadline.
    #[error("deadline exceeded")]
    Deadline,
    /// The peer disappeared while the op ran.
    #[error("peer gone")]
    PeerGone,
}

/// Why `post` refused a batch.
///
/// Invariant: whenever `post` returns an error, nothing of the batch was queued and no byte
/// moved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// The batch is malformed (caller or peer bug): the reason says which item and why.
    #[error("invalid batch: {0}")]
    Invalid(String),
    /// The connection is unknown, torn down or broken.
    #[error("connection gone")]
    ConnGone,
    /// The fabric's bound on ops in flight is reached; retry after polling.
    #[error("too many operations in flight")]
    Full,
}

/// What the peer needs to connect its RDMA queue pair to ours.
///
/// Invariant: plain data exchanged in the control-plane handshake; untrusted when received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// The chosen GID.
    pub gid: [u8; 16],
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Path MTU enum value (`IBV_MTU_*`).
    pub mtu: u8,
}

/// A queue pair created by `prepare_endpoint`, in INIT state, waiting for the peer's endpoint.
///
/// Invariant: opaque; only the RDMA fabric constructs one (without the `rdma` feature no value
/// of this type can exist); dropping it destroys the queue pair.
#[derive(Debug)]
pub struct PendingQp {
    #[cfg(feature = "rdma")]
    inner: super::rdma::PendingInner,
    #[cfg(not(feature = "rdma"))]
    _private: (),
}

#[cfg(feature = "rdma")]
impl PendingQp {
    pub(crate) fn from_rdma(inner: super::rdma::PendingInner) -> PendingQp {
        PendingQp { inner }
    }

    pub(crate) fn into_rdma(self) -> super::rdma::PendingInner {
        self.inner
    }
}

/// How a connection is handed to a fabric after the control-plane handshake.
///
/// Invariant: a fabric accepts only its own variant (`Invalid` otherwise).
#[derive(Debug)]
pub enum ConnSetup {
    /// The data socket of a TCP connection (the fabric owns it from now on).
    Tcp(OwnedFd),
    /// Our queue pair (from `prepare_endpoint`) and the peer's endpoint (untrusted: checked).
    Rdma {
        /// The queue pair `prepare_endpoint` returned.
        local: PendingQp,
        /// What the peer sent in the handshake.
        remote: RdmaEndpoint,
    },
    /// The fake peer's memory.
    Fake(FakePeer),
}

/// Counters of a fabric.
///
/// Invariant: `inflight_ops == posted_ops - completed_ops` at the moment of the snapshot
/// (`TEARDOWN_DONE` completions are not ops); bytes count only items that were moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FabricStats {
    /// Ops accepted by `post`.
    pub posted_ops: u64,
    /// Op completions returned by `poll` (any result).
    pub completed_ops: u64,
    /// Ops accepted and not yet returned by `poll`.
    pub inflight_ops: u64,
    /// Work items (RDMA: work requests) of the ops in flight.
    pub inflight_wr: u64,
    /// Bytes moved into the pool by Pull items.
    pub bytes_pulled: u64,
    /// Bytes moved out of the pool by Push items.
    pub bytes_pushed: u64,
    /// Op completions returned with an error.
    pub errors: u64,
}
