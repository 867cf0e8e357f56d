//! The data ops of a connection that chose RDMA: WRITE_SLOTS and READ_SLOTS whose data path is
//! `DataPath::Remote(bufs)` — descriptors of the engine's registered memory. The node moves the
//! bytes itself: RDMA READ from the engine into the store's reserved slots (Pull), RDMA WRITE
//! from the retrieve's read-locked slots into the engine (Push).
//!
//! Same discipline as the TCP path (`serve.rs`): the transfer is taken out of its instance's
//! table ([`ops::take_write`] / [`ops::take_read`]) while the bytes move, the [`Mover`] returns
//! only after the fabric's completion, then the transfer is settled. Descriptors are checked
//! against the connection's [`RegionTable`] before anything is posted (a refused request
//! leaves the transfer prepared); a failed move frees a store (never published) and tells the
//! caller to close the connection, whose end tears the queue pair down.
//!
//! Written against any fabric behind a [`Mover`], so it is tested with `FakeFabric`
//! (`rdma_ops_tests.rs`); over the real RDMA fabric it is **untested on hardware**.

use std::sync::Arc;

use kvnode_hw::fabric::{ConnId, Dir, PostError};

use super::descriptors::RegionTable;
use super::mover::{MoveError, Mover, Pace};
use super::ops;
use crate::error::{Error, ErrorKind};
use crate::modules::{Caller, NodeContext};
use crate::protocol::{RemoteBuf, Response};

/// A connection's path to the engine's memory: the mover of the fabric and the connection in
/// it. Invariant: only the connection's reader thread posts on `conn`, one op at a time.
#[derive(Clone)]
pub struct RemotePath {
    /// The mover of the fabric (RDMA on a node; the fake in tests).
    pub mover: Arc<Mover>,
    /// This connection's queue pair (or fake peer) in that fabric.
    pub conn: ConnId,
}

/// A remote data op's request: which prepared transfer, the engine's buffers (one per slot, in
/// slot order) and whether to commit after the bytes moved.
#[derive(Debug, Clone)]
pub struct RemoteDataOp<'a> {
    /// The instance that prepared the transfer (registered over this connection).
    pub instance_id: u64,
    /// The prepared store or retrieve.
    pub transfer_id: u64,
    /// The engine's buffers, one per slot.
    pub bufs: &'a [RemoteBuf],
    /// Commit (publish the store / release the retrieve's locks) after the bytes moved.
    pub commit: bool,
}

/// What a remote data op did. Invariant: `broken` is set exactly when the op was posted and the
/// fabric completed it with an error, or the fabric reports the connection gone: the
/// connection must then be closed (its end tears the queue pair down); `moved` is the bytes
/// moved on success, else 0.
#[derive(Debug)]
pub struct DataOpOutcome {
    /// The reply to send (no trailer).
    pub resp: Response,
    /// Bytes moved.
    pub moved: u64,
    /// The fabric failed the op: close the connection.
    pub broken: bool,
}

impl DataOpOutcome {
    fn refused(e: &Error) -> DataOpOutcome {
        DataOpOutcome {
            resp: Response::error(e),
            moved: 0,
            broken: false,
        }
    }

    /// The fabric refused the batch: nothing was posted, the transfer was put back untouched.
    fn not_posted(e: &PostError) -> DataOpOutcome {
        DataOpOutcome {
            resp: Response::error(&Error::new(
                ErrorKind::Io,
                format!("the transfer could not be posted to the fabric ({e}); it stays prepared"),
            )),
            moved: 0,
            broken: *e == PostError::ConnGone,
        }
    }
}

/// WRITE_SLOTS over RDMA: checks `op.bufs` against `regions` and the store's slots, pulls the
/// engine's bytes into the slots before `deadline`, settles. A refused descriptor leaves the
/// store prepared; a failed pull frees it, never published.
pub fn write_remote(
    ctx: &Arc<NodeContext>,
    caller: &Caller,
    regions: &RegionTable,
    path: &RemotePath,
    op: &RemoteDataOp<'_>,
    pace: &Pace,
) -> DataOpOutcome {
    let take = match ops::take_write(ctx, caller, op.instance_id, op.transfer_id) {
        Ok(t) => t,
        Err(e) => return DataOpOutcome::refused(&e),
    };
    let items = match regions.work_items(op.bufs, &take.slots()) {
        Ok(items) => items,
        Err(e) => {
            take.put_back();
            return DataOpOutcome::refused(&e);
        }
    };
    let moved = match path
        .mover
        .transfer_paced(path.conn, Dir::Pull, &items, pace)
    {
        Err(MoveError::NotPosted(e)) => {
            take.put_back();
            return DataOpOutcome::not_posted(&e);
        }
        other => other.map_err(|e| format!("reading the engine's memory failed: {e}")),
    };
    let broken = moved.is_err();
    let n = *moved.as_ref().unwrap_or(&0);
    if let Err(why) = &moved {
        tracing::warn!(
            instance = op.instance_id,
            transfer = op.transfer_id,
            error = %why,
            "a remote store's bytes did not arrive; freed, not published"
        );
    }
    DataOpOutcome {
        resp: take.settle(moved, op.commit),
        moved: n,
        broken,
    }
}

/// READ_SLOTS over RDMA: checks `op.bufs` against `regions` and the retrieve's slots, pushes the
/// slots' bytes into the engine's memory before `deadline`, settles (commit releases the read
/// locks). A refused descriptor leaves the retrieve prepared; after a failed push the engine's
/// buffers hold any bytes and the reply is an error.
pub fn read_remote(
    ctx: &Arc<NodeContext>,
    caller: &Caller,
    regions: &RegionTable,
    path: &RemotePath,
    op: &RemoteDataOp<'_>,
    pace: &Pace,
) -> DataOpOutcome {
    let take = match ops::take_read(ctx, caller, op.instance_id, op.transfer_id) {
        Ok(t) => t,
        Err(e) => return DataOpOutcome::refused(&e),
    };
    let total = take.bytes();
    let items = match regions.work_items(op.bufs, take.slots()) {
        Ok(items) => items,
        Err(e) => {
            drop(take); // put back untouched
            return DataOpOutcome::refused(&e);
        }
    };
    let moved = match path
        .mover
        .transfer_paced(path.conn, Dir::Push, &items, pace)
    {
        Err(MoveError::NotPosted(e)) => {
            drop(take); // put back untouched
            return DataOpOutcome::not_posted(&e);
        }
        other => other,
    };
    let ok = moved.is_ok();
    let commit_error = take.settle(ok, op.commit);
    match moved {
        Ok(_) => {
            if let Some(Response::Error { message, .. }) = commit_error {
                // The bytes were read under the locks and are valid; the commit's failure
                // (e.g. the instance was released meanwhile) is only logged, as over TCP.
                tracing::debug!(instance = op.instance_id, %message, "commit after a remote retrieve failed");
            }
            DataOpOutcome {
                resp: Response::SlotsRead { bytes: total },
                moved: total,
                broken: false,
            }
        }
        Err(e) => {
            tracing::warn!(
                instance = op.instance_id,
                transfer = op.transfer_id,
                error = %e,
                "a remote retrieve's bytes could not be written into the engine"
            );
            DataOpOutcome {
                resp: Response::error(&Error::new(
                    ErrorKind::Io,
                    format!(
                        "the retrieve's bytes could not be written into the engine's memory \
                         ({e}); the buffers hold undefined bytes"
                    ),
                )),
                moved: 0,
                broken: true,
            }
        }
    }
}
