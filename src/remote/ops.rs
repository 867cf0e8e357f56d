//! The node's side of a remote store's or retrieve's data movement, independent of the fabric.
//!
//! A data op takes its prepared transfer **out** of the instance's pending table for as long as
//! bytes move ([`take_write`], [`take_read`]) and **pins** its reservations or read locks in
//! storage. Nothing else can then free or reuse its slots: releasing the instance (disconnect,
//! reaper, UNREGISTER), the table's TTL sweep and ABORT_STORE only see the table; storage keeps
//! the slots reserved (writes) or read-locked (reads), so eviction and CLEAR cannot take them,
//! and the pin stops storage's own TTL from expiring them (a lock that had already expired at
//! the take cannot be pinned: the op is refused before any byte moves). When the bytes have moved (the fabric returned
//! the op's completion), the taken transfer is settled: put back if its instance is still
//! registered (then committed through the instance's shard when asked), else handed back to
//! storage — a store is freed, **never published**, a retrieve's locks are released. A failed
//! move of a store frees it at once (its slots may hold any bytes).

use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, ErrorKind, Result};
use crate::modules::instances::{Instance, Job, PendingRead, PendingWrite};
use crate::modules::{Caller, NodeContext};
use crate::protocol::{Request, Response};
use crate::storage::Moving;
use crate::transport::ReplySink;

/// A prepared store taken out of its instance's table while its bytes move. Invariant: holds
/// the only reference to its reservations; dropping it without [`WriteTake::settle`] frees them
/// (never publishes).
pub struct WriteTake {
    ctx: Arc<NodeContext>,
    inst: Arc<Instance>,
    transfer_id: u64,
    write: Option<PendingWrite>,
    /// Its reservations, pinned in storage (their TTL cannot free them while bytes move).
    pinned: Vec<Moving>,
}

/// A prepared retrieve taken out of its instance's table while its bytes move. Invariant: holds
/// the only reference to its read locks; dropping it without [`ReadTake::settle`] puts it back
/// (or releases the locks when the instance is gone).
pub struct ReadTake {
    ctx: Arc<NodeContext>,
    inst: Arc<Instance>,
    transfer_id: u64,
    read: Option<PendingRead>,
    /// Its read locks, pinned in storage (their TTL cannot drop them while bytes move).
    pinned: Vec<Moving>,
}

/// The instance `instance_id`, if `caller` registered it over its connection.
fn attached(ctx: &NodeContext, caller: &Caller, instance_id: u64) -> Result<Arc<Instance>> {
    let inst = ctx.instances.get(instance_id).ok_or_else(|| {
        Error::new(
            ErrorKind::NotRegistered,
            format!("instance {instance_id} is not registered"),
        )
    })?;
    caller.require_attached(&inst)?;
    inst.touch(ctx.now_ms());
    Ok(inst)
}

fn expired(inst: &Instance, transfer_id: u64, ttl: &str) -> Error {
    Error::new(
        ErrorKind::UnknownTransfer,
        format!(
            "transfer {transfer_id} of instance {} expired (its locks outlived {ttl}); no byte \
             was moved and the transfer is gone",
            inst.id
        ),
    )
}

fn unknown(inst: &Instance, transfer_id: u64) -> Error {
    if inst.is_released() {
        return Error::new(
            ErrorKind::NotRegistered,
            format!("instance {} is not registered", inst.id),
        );
    }
    Error::new(
        ErrorKind::UnknownTransfer,
        format!(
            "instance {} has no pending transfer {transfer_id} of this kind (or its bytes are \
             moving already)",
            inst.id
        ),
    )
}

/// Takes prepared store `transfer_id` of `instance_id` out of the pending table for its bytes
/// to move. Only a connection that registered the instance may.
pub fn take_write(
    ctx: &Arc<NodeContext>,
    caller: &Caller,
    instance_id: u64,
    transfer_id: u64,
) -> Result<WriteTake> {
    let inst = attached(ctx, caller, instance_id)?;
    let write = inst.pending.lock().writes.remove(&transfer_id);
    let write = write.ok_or_else(|| unknown(&inst, transfer_id))?;
    let pinned: Vec<Moving> = write
        .items
        .iter()
        .map(|(k, g)| (*k, g.lease, g.slot.offset))
        .collect();
    if ctx.storage.pin_for_move(&pinned, true).is_err() {
        // Its reservations expired (the TTL safety net freed them; their slots may hold
        // another object already): no byte may move, and the transfer ends here (what is
        // left of it is freed; the expired ones' stale leases touch nothing).
        free_write(ctx, &inst, write);
        return Err(expired(&inst, transfer_id, "write_ttl_secs"));
    }
    Ok(WriteTake {
        ctx: ctx.clone(),
        inst,
        transfer_id,
        write: Some(write),
        pinned,
    })
}

/// Takes prepared retrieve `transfer_id` of `instance_id` out of the pending table for its
/// bytes to move. Only a connection that registered the instance may.
pub fn take_read(
    ctx: &Arc<NodeContext>,
    caller: &Caller,
    instance_id: u64,
    transfer_id: u64,
) -> Result<ReadTake> {
    let inst = attached(ctx, caller, instance_id)?;
    let read = inst.pending.lock().reads.remove(&transfer_id);
    let read = read.ok_or_else(|| unknown(&inst, transfer_id))?;
    let pinned: Vec<Moving> = read
        .keys
        .iter()
        .zip(&read.slots)
        .map(|(&(k, lease), &(offset, _))| (k, lease, offset))
        .collect();
    if read.keys.len() != read.slots.len() || ctx.storage.pin_for_move(&pinned, false).is_err() {
        // Its read locks expired: the bytes may no longer be the object's. The transfer ends
        // here (the locks still held are released; the expired ones' stale leases touch
        // nothing).
        ctx.storage.finish_read(&read.keys, 0);
        ctx.storage.assert_consistent();
        return Err(expired(&inst, transfer_id, "read_ttl_secs"));
    }
    Ok(ReadTake {
        ctx: ctx.clone(),
        inst,
        transfer_id,
        read: Some(read),
        pinned,
    })
}

impl WriteTake {
    /// Pool offset and length of each reserved slot, in the transfer's order.
    pub fn slots(&self) -> Vec<(u64, u64)> {
        self.write
            .as_ref()
            .map(|w| {
                w.items
                    .iter()
                    .map(|(_, g)| (g.slot.offset, g.slot.len))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Bytes the slots hold in all.
    pub fn bytes(&self) -> u64 {
        self.slots().iter().map(|s| s.1).sum()
    }

    /// The reserved objects (key and grant, in the transfer's order) and the bytes charged for
    /// them: what storage must keep `WriteReserved` while the bytes move (for checkers such as
    /// the simulator). Empty once settled.
    pub fn reserved(&self) -> (&[(crate::storage::StorageKey, crate::storage::Grant)], u64) {
        self.write
            .as_ref()
            .map_or((&[], 0), |w| (&w.items[..], w.charged))
    }

    /// Puts the store back untouched (its bytes never started to move).
    pub fn put_back(mut self) {
        let write = self.write.take().expect("settled once");
        self.ctx.storage.unpin_moved(&self.pinned, true);
        put_back_write(&self.ctx, &self.inst, self.transfer_id, write);
    }

    /// Settles the store after its bytes moved (`moved`: the fabric's outcome, completion
    /// already returned). Success: put back, then committed through the instance's shard when
    /// `commit`; failure: freed at once. Returns the reply to send.
    pub fn settle(mut self, moved: std::result::Result<u64, String>, commit: bool) -> Response {
        let write = self.write.take().expect("settled once");
        // The fabric has let go of the slots (the caller got the op's completion).
        self.ctx.storage.unpin_moved(&self.pinned, true);
        match moved {
            Err(why) => {
                free_write(&self.ctx, &self.inst, write);
                Response::error(&Error::new(
                    ErrorKind::Io,
                    format!(
                        "the store's bytes did not arrive ({why}); its slots were freed, \
                         nothing published"
                    ),
                ))
            }
            Ok(bytes) => {
                if !put_back_write(&self.ctx, &self.inst, self.transfer_id, write) {
                    return Response::error(&unknown(&self.inst, self.transfer_id));
                }
                if !commit {
                    return Response::SlotsWritten {
                        bytes,
                        published: None,
                    };
                }
                let req = Request::CommitStore {
                    instance_id: self.inst.id,
                    transfer_id: self.transfer_id,
                };
                match run_on_shard(&self.ctx, &self.inst, req) {
                    Response::StoreCommitted { published } => Response::SlotsWritten {
                        bytes,
                        published: Some(published),
                    },
                    other => other,
                }
            }
        }
    }
}

impl Drop for WriteTake {
    fn drop(&mut self) {
        if let Some(w) = self.write.take() {
            self.ctx.storage.unpin_moved(&self.pinned, true);
            free_write(&self.ctx, &self.inst, w);
        }
    }
}

impl ReadTake {
    /// Pool offset and length of each read-locked slot, in the transfer's order.
    pub fn slots(&self) -> &[(u64, u64)] {
        self.read.as_ref().map_or(&[], |r| &r.slots)
    }

    /// Bytes the slots hold in all.
    pub fn bytes(&self) -> u64 {
        self.slots().iter().map(|s| s.1).sum()
    }

    /// The read-locked keys with the lease of their lock, in the transfer's order: what storage
    /// must keep locked while the bytes move (for checkers such as the simulator). Empty once
    /// settled.
    pub fn locked(&self) -> &[(crate::storage::StorageKey, u64)] {
        self.read.as_ref().map_or(&[], |r| &r.keys)
    }

    /// Settles the retrieve after its bytes moved: put back, then committed through the
    /// instance's shard when `commit` and the move succeeded. Returns the commit's error, if
    /// any (the bytes were valid: they were read under the locks).
    pub fn settle(mut self, moved_ok: bool, commit: bool) -> Option<Response> {
        let read = self.read.take().expect("settled once");
        self.ctx.storage.unpin_moved(&self.pinned, false);
        if !put_back_read(&self.ctx, &self.inst, self.transfer_id, read) || !commit || !moved_ok {
            return None;
        }
        let req = Request::CommitRetrieve {
            instance_id: self.inst.id,
            transfer_id: self.transfer_id,
        };
        match run_on_shard(&self.ctx, &self.inst, req) {
            Response::Ok => None,
            other => Some(other),
        }
    }
}

impl Drop for ReadTake {
    fn drop(&mut self) {
        if let Some(r) = self.read.take() {
            self.ctx.storage.unpin_moved(&self.pinned, false);
            put_back_read(&self.ctx, &self.inst, self.transfer_id, r);
        }
    }
}

/// Frees a taken store's reservations (never publishes) and refunds its charge.
fn free_write(ctx: &NodeContext, inst: &Instance, w: PendingWrite) {
    ctx.storage.abort_write(&w.items);
    inst.refund(w.charged);
    ctx.storage.assert_consistent();
}

/// Puts a taken store back in its instance's table; if the instance was released meanwhile
/// (its table handed back), frees it instead. Returns whether it was put back. The check and
/// the insert happen under the table's lock, which the release takes after marking the
/// instance released: a store put back is always seen by the release.
fn put_back_write(ctx: &NodeContext, inst: &Instance, id: u64, w: PendingWrite) -> bool {
    let mut pending = inst.pending.lock();
    if inst.is_released() {
        drop(pending);
        free_write(ctx, inst, w);
        return false;
    }
    pending.writes.insert(id, w);
    true
}

/// [`put_back_write`] for a retrieve: its locks are released when the instance is gone.
fn put_back_read(ctx: &NodeContext, inst: &Instance, id: u64, r: PendingRead) -> bool {
    let mut pending = inst.pending.lock();
    if inst.is_released() {
        drop(pending);
        ctx.storage.finish_read(&r.keys, 0);
        ctx.storage.assert_consistent();
        return false;
    }
    pending.reads.insert(id, r);
    true
}

/// Runs `req` (a commit) in the instance's order, on its shard, and waits for its reply.
fn run_on_shard(ctx: &NodeContext, inst: &Arc<Instance>, req: Request) -> Response {
    let sink = Arc::new(Captured::default());
    let job = Job {
        request_id: 0,
        request: req,
        reply: sink.clone(),
        received: std::time::Instant::now(),
    };
    if ctx.shards.run_or_submit(ctx, inst, job).is_err() {
        return Response::error(&Error::limit(format!(
            "instance {} has {} requests queued (limit); the bytes moved but were not committed",
            inst.id, ctx.config.limits.max_queued_per_instance
        )));
    }
    let mut got = sink.resp.lock();
    let mut stopping_since: Option<std::time::Instant> = None;
    loop {
        if let Some(r) = got.take() {
            return r;
        }
        sink.cv.wait_for(&mut got, SHARD_WAIT_POLL);
        // Shards stop at shutdown without running what is queued: give up then (the transfer
        // stays in the table; the release at shutdown ends it).
        if ctx.shutting_down.load(std::sync::atomic::Ordering::Acquire) {
            let since = *stopping_since.get_or_insert_with(std::time::Instant::now);
            if got.is_none() && since.elapsed() >= SHARD_WAIT_AT_SHUTDOWN {
                return Response::error(&Error::new(
                    ErrorKind::ShuttingDown,
                    "the node is shutting down: the bytes moved but were not committed",
                ));
            }
        }
    }
}

/// How often [`run_on_shard`] looks whether the node is stopping while it waits.
const SHARD_WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// How long [`run_on_shard`] still waits for a shard once the node is stopping.
const SHARD_WAIT_AT_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(1);

/// A reply sink that keeps the one reply it gets (a commit run for a data op).
#[derive(Default)]
struct Captured {
    resp: Mutex<Option<Response>>,
    cv: Condvar,
}

impl ReplySink for Captured {
    fn send(&self, _: u64, _: u16, resp: &Response, _: Option<std::os::fd::BorrowedFd<'_>>) {
        *self.resp.lock() = Some(resp.clone());
        self.cv.notify_all();
    }

    fn connection_id(&self) -> u64 {
        0
    }

    fn can_pass_fd(&self) -> bool {
        false
    }

    fn peer(&self) -> Option<kvnode_hw::PeerCred> {
        None
    }
}
