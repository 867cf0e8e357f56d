//! Engine-driven transfers (PREPARE/COMMIT/ABORT STORE, PREPARE/COMMIT RETRIEVE, UNREGISTER),
//! executed on the instance's shard in arrival order. The node hands out slot offsets; the client
//! copies the bytes itself.

use std::sync::Arc;

use super::context::NodeContext;
use super::instances::{Instance, Job, PendingRead, PendingWrite};
use crate::config::WritePolicy;
use crate::error::{Error, ErrorKind, Result};
use crate::protocol::{ChunkRange, Request, Response, WireSlot};
use crate::storage::{pack_kv_rank, Grant, KeyError, StorageKey};

/// Runs one queued job and sends its response.
pub fn execute(ctx: &NodeContext, inst: &Arc<Instance>, job: Job) {
    let opcode = job.request.opcode();
    // A bug must not leave the client without an answer or the instance stuck as "scheduled":
    // a panic becomes a typed Internal error and the caller carries on.
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(ctx, inst, job.request)));
    let resp = match outcome {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::debug!(instance = inst.id, error = %e, "transfer request failed");
            Response::error(&e)
        }
        Err(_) => {
            tracing::error!(
                instance = inst.id,
                opcode,
                "transfer handler panicked (bug); answered with an internal error"
            );
            Response::error(&Error::internal("handler panicked; see the node log"))
        }
    };
    let error = matches!(resp, Response::Error { .. });
    job.reply.send(job.request_id, opcode, &resp, None);
    ctx.counters.answered(opcode, error, job.received);
}

fn run(ctx: &NodeContext, inst: &Arc<Instance>, req: Request) -> Result<Response> {
    if inst.is_released() {
        return Err(not_registered(inst.id));
    }
    match req {
        Request::PrepareStore { range, .. } => prepare_store(ctx, inst, &range),
        Request::CommitStore { transfer_id, .. } => commit_store(ctx, inst, transfer_id),
        Request::AbortStore { transfer_id, .. } => abort_store(ctx, inst, transfer_id),
        Request::PrepareRetrieve {
            range,
            lookup_session,
            ..
        } => prepare_retrieve(ctx, inst, &range, lookup_session.as_deref()),
        Request::CommitRetrieve { transfer_id, .. } => commit_retrieve(ctx, inst, transfer_id),
        Request::Unregister { .. } => {
            let r = ctx.release(inst, "unregistered");
            Ok(Response::Unregistered {
                released_writes: r.writes,
                released_reads: r.reads,
            })
        }
        other => Err(Error::internal(format!(
            "opcode {} routed to a transfer shard",
            other.opcode()
        ))),
    }
}

fn not_registered(id: u64) -> Error {
    Error::new(
        ErrorKind::NotRegistered,
        format!("instance {id} is not registered"),
    )
}

/// Checks a worker-side range against its instance and builds its keys (one per chunk). A
/// store interns the range's namespace; a retrieve only looks it up: `None` when it is unknown
/// (nothing is stored under it, a miss).
fn worker_keys(
    ctx: &NodeContext,
    inst: &Instance,
    range: &ChunkRange,
    intern: bool,
) -> Result<Option<Vec<StorageKey>>> {
    let worker = range
        .worker_id
        .ok_or_else(|| Error::invalid("transfer ranges need a worker_id"))?;
    if range.model != inst.model || range.world_size != inst.world_size {
        return Err(Error::invalid(format!(
            "range is for ({}, world {}) but instance {} registered ({}, world {})",
            range.model, range.world_size, inst.id, inst.model, inst.world_size
        )));
    }
    crate::storage::key::validate_rank(range.world_size, worker)?;
    check_chunk_count(ctx, range.chunk_hashes.len())?;
    let namespace = if range.cache_salt.is_empty() {
        inst.namespace
    } else if intern {
        ctx.namespaces.intern(&range.model, &range.cache_salt)?
    } else {
        crate::storage::key::validate_salt(&range.cache_salt)?;
        match ctx.namespaces.lookup(&range.model, &range.cache_salt) {
            Some(n) => n,
            None => return Ok(None),
        }
    };
    let kv_rank = pack_kv_rank(range.world_size, worker);
    Ok(Some(
        range
            .chunk_hashes
            .iter()
            .map(|h| StorageKey {
                chunk_hash: *h,
                kv_rank,
                object_group: 0,
                namespace,
            })
            .collect(),
    ))
}

/// Enforces the per-request chunk limit (and rejects empty ranges).
pub fn check_chunk_count(ctx: &NodeContext, n: usize) -> Result<()> {
    let max = ctx.config.limits.max_chunks_per_request;
    if n == 0 {
        return Err(Error::invalid("range has no chunks"));
    }
    if n > max {
        return Err(Error::limit(format!(
            "{n} chunks in one request (limit {max})"
        )));
    }
    Ok(())
}

fn check_pending_room(ctx: &NodeContext, pending: usize) -> Result<()> {
    let max = ctx.config.limits.max_pending_transfers;
    if pending >= max {
        return Err(Error::limit(format!(
            "{pending} prepared transfers not yet committed (limit {max})"
        )));
    }
    Ok(())
}

fn wire(grant: &Grant) -> WireSlot {
    WireSlot {
        offset: grant.slot.offset,
        length: grant.slot.len,
    }
}

fn prepare_store(ctx: &NodeContext, inst: &Instance, range: &ChunkRange) -> Result<Response> {
    let keys = worker_keys(ctx, inst, range, true)?.expect("a store interns its namespace");
    let mut pending = inst.pending.lock();
    if inst.is_released() {
        return Err(not_registered(inst.id));
    }
    check_pending_room(ctx, pending.writes.len() + pending.reads.len())?;
    // The quota is charged for every key before anything is reserved (a reservation may evict
    // other clients' objects: an over-quota request must not get that far), and what was not
    // reserved is refunded below.
    let upper = keys.len() as u64 * inst.layout.object_bytes();
    inst.charge(
        upper,
        ctx.reserved_cap_per_instance(),
        ctx.reserved_cap_per_user(),
    )
    .map_err(Error::limit)?;
    let results = ctx
        .storage
        .reserve_write(&keys, inst.layout.object_bytes(), false);
    let mut items = Vec::new();
    let mut chunk_indices = Vec::new();
    let mut oom = 0;
    for (i, (k, r)) in keys.iter().zip(results).enumerate() {
        match r {
            Ok(grant) => {
                debug_assert_eq!(grant.slot.len, inst.layout.object_bytes());
                items.push((*k, grant));
                chunk_indices.push(i as u32);
            }
            Err(KeyError::OutOfMemory) => oom += 1,
            Err(_) => {} // already cached or being written by someone else: skip ("new" mode)
        }
    }
    if oom > 0 {
        tracing::warn!(
            instance = inst.id,
            oom,
            "pool full of locked or in-flight objects: chunks not reserved"
        );
    }
    let charged: u64 = items.iter().map(|(_, g)| g.slot.len).sum();
    debug_assert!(charged <= upper);
    inst.refund(upper - charged);
    let slots = items.iter().map(|(_, s)| wire(s)).collect();
    let transfer_id = if items.is_empty() {
        0
    } else {
        let id = ctx.next_transfer_id();
        pending.writes.insert(
            id,
            PendingWrite {
                charged,
                items,
                created_ms: ctx.now_ms(),
            },
        );
        id
    };
    drop(pending);
    ctx.storage.assert_consistent();
    Ok(Response::StorePrepared {
        transfer_id,
        slots,
        chunk_indices,
        layout: NodeContext::wire_layout(&inst.layout),
    })
}

/// Removes a prepared store of `inst`; a missing id is `NotRegistered` if the instance was
/// released meanwhile (its transfers were handed back), else `UnknownTransfer`.
fn take_pending_write(inst: &Instance, transfer_id: u64) -> Result<PendingWrite> {
    let w = inst.pending.lock().writes.remove(&transfer_id);
    let w = w.ok_or_else(|| missing_transfer(inst, transfer_id))?;
    inst.refund(w.charged);
    Ok(w)
}

fn count_ok<T, E>(results: &[std::result::Result<T, E>]) -> u32 {
    results.iter().filter(|r| r.is_ok()).count() as u32
}

fn commit_store(ctx: &NodeContext, inst: &Instance, transfer_id: u64) -> Result<Response> {
    let w = take_pending_write(inst, transfer_id)?;
    let write_behind = ctx
        .l2
        .as_ref()
        .filter(|l2| l2.policy() == WritePolicy::Always);
    // Published as waiting for write-behind before it is queued, so the writer's clearing of
    // the mark can never come first.
    let layout = inst.layout.fingerprint();
    let results = ctx
        .storage
        .finish_write_as(&w.items, layout, write_behind.is_some());
    let published = count_ok(&results);
    if let Some(link) = ctx.cluster.get() {
        let keys: Vec<StorageKey> = w
            .items
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|((k, _), _)| *k)
            .collect();
        link.published(inst, &keys);
    }
    if let Some(l2) = write_behind {
        // A key stored again while L2 still holds this same object is not written twice (nor
        // marked waiting); a copy under another layout is replaced by the write-behind.
        let keys: Vec<StorageKey> = w
            .items
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_ok())
            .map(|((k, _), _)| *k)
            .collect();
        let held = l2.held_as(&keys, inst.layout.object_bytes(), layout);
        let (on_l2, to_write): (Vec<_>, Vec<_>) = keys.into_iter().zip(held).partition(|p| p.1);
        let mut settled = l2.enqueue(to_write.into_iter().map(|p| p.0));
        settled.extend(on_l2.into_iter().map(|p| p.0));
        ctx.storage.clear_unwritten(&settled);
    }
    ctx.storage.assert_consistent();
    Ok(Response::StoreCommitted { published })
}

fn abort_store(ctx: &NodeContext, inst: &Instance, transfer_id: u64) -> Result<Response> {
    let w = take_pending_write(inst, transfer_id)?;
    let freed = count_ok(&ctx.storage.abort_write(&w.items));
    ctx.storage.assert_consistent();
    Ok(Response::StoreAborted { freed })
}

fn prepare_retrieve(
    ctx: &NodeContext,
    inst: &Instance,
    range: &ChunkRange,
    lookup_session: Option<&str>,
) -> Result<Response> {
    let layout = NodeContext::wire_layout(&inst.layout);
    let Some(keys) = worker_keys(ctx, inst, range, false)? else {
        return Ok(Response::RetrievePrepared {
            hit: false,
            transfer_id: 0,
            slots: Vec::new(),
            layout,
        });
    };
    {
        let pending = inst.pending.lock();
        if inst.is_released() {
            return Err(not_registered(inst.id));
        }
        check_pending_room(ctx, pending.writes.len() + pending.reads.len())?;
    }
    // The pending lock is not held from here on: an L2 load may wait for the disk, and commits,
    // aborts and reaping of this instance must not wait behind it. (Transfers of one instance
    // run one at a time, so the room checked above is still there.)
    // Every found key gets exactly one read lock owned by this retrieve: adopted from the
    // lookup session when it holds a live one, otherwise taken here. (A retrieve never relies on
    // a lock someone else owns: that lock could be released under it.)
    let mut results: Vec<std::result::Result<Grant, KeyError>> = match lookup_session {
        Some(session) => {
            let owner = inst.session_owner;
            let adopted = super::lookup::adopt(ctx, owner, session, range.first_chunk, &keys);
            let own: Vec<StorageKey> = keys
                .iter()
                .zip(&adopted)
                .filter(|(_, a)| a.is_none())
                .map(|(k, _)| *k)
                .collect();
            let mut taken = ctx.storage.reserve_read(&own, 0).into_iter();
            adopted
                .into_iter()
                .map(|a| match a {
                    Some(g) => Ok(g),
                    None => taken.next().expect("one result per key without a lock"),
                })
                .collect()
        }
        None => ctx.storage.reserve_read(&keys, 0),
    };
    load_missing_from_l2(ctx, &keys, &inst.layout, &mut results);
    let found: Vec<(StorageKey, u64)> = keys
        .iter()
        .zip(&results)
        .filter_map(|(k, r)| r.as_ref().ok().map(|g| (*k, g.lease)))
        .collect();
    // An object stored by an instance of another layout under the same model (e.g. other
    // physical slots per chunk) is not this reader's: its slot has another size, and copying
    // this instance's layout out of it would read past it. Such a retrieve is a miss.
    // Nor is one of the same size under another shape or dtype (the object carries the
    // fingerprint of the layout it was committed or loaded under; 0 = unknown): its bytes mean
    // something else (a cluster peer asking with its own layout relies on this check).
    let object_bytes = inst.layout.object_bytes();
    let fingerprint = inst.layout.fingerprint();
    let foreign = results
        .iter()
        .flatten()
        .filter(|g| g.slot.len != object_bytes || (g.layout != 0 && g.layout != fingerprint))
        .count();
    if foreign > 0 {
        tracing::warn!(
            instance = inst.id,
            objects = foreign,
            expected_bytes = object_bytes,
            "PREPARE_RETRIEVE found objects of another layout (size, shape or dtype) under this \
             model: a miss"
        );
    }
    if found.len() < keys.len() || foreign > 0 {
        // All-or-nothing: release the locks of the chunks that were found (LMCache releases the
        // LOOKUP locks of the found subset too), then report a miss.
        ctx.storage.finish_read(&found, 0);
        return Ok(Response::RetrievePrepared {
            hit: false,
            transfer_id: 0,
            slots: Vec::new(),
            layout,
        });
    }
    let mut pending = inst.pending.lock();
    if inst.is_released() {
        // Released while the locks were being taken: its pending reads were already handed
        // back, so these must be released here.
        drop(pending);
        ctx.storage.finish_read(&found, 0);
        return Err(not_registered(inst.id));
    }
    let slots: Vec<WireSlot> = results.iter().flatten().map(wire).collect();
    let transfer_id = ctx.next_transfer_id();
    pending.reads.insert(
        transfer_id,
        PendingRead {
            keys: found,
            slots: slots.iter().map(|s| (s.offset, s.length)).collect(),
            created_ms: ctx.now_ms(),
        },
    );
    Ok(Response::RetrievePrepared {
        hit: true,
        transfer_id,
        slots,
        layout,
    })
}

/// A retrieve without a lookup session: keys missing from L1 but present on L2 are loaded
/// (read-locked once, like the L1 hits) so the all-or-nothing check sees them. Nothing is loaded
/// when some missing key is not on L2 at all (the retrieve misses anyway).
fn load_missing_from_l2(
    ctx: &NodeContext,
    keys: &[StorageKey],
    layout: &crate::storage::Layout,
    results: &mut [std::result::Result<Grant, KeyError>],
) {
    let Some(l2) = &ctx.l2 else { return };
    // Absent, or being loaded into L1 by another request right now (the load waits for it).
    let missing: Vec<usize> = (0..keys.len())
        .filter(|&i| {
            matches!(
                results[i],
                Err(KeyError::KeyNotExist) | Err(KeyError::KeyNotReadable)
            )
        })
        .collect();
    if missing.is_empty() || !missing.iter().all(|&i| l2.contains(&keys[i])) {
        return;
    }
    let want: Vec<StorageKey> = missing.iter().map(|&i| keys[i]).collect();
    let leases = l2.load(&ctx.storage, &want, 0, Some(layout));
    let granted = ctx.storage.read_locked_slots(&want);
    for ((&i, lease), g) in missing.iter().zip(leases).zip(granted) {
        match (lease, g) {
            (Some(lease), Ok(g)) if g.lease == lease => results[i] = Ok(g),
            // Cannot happen while we hold the lock; never leak it if it does.
            (Some(lease), _) => {
                ctx.storage.finish_read(&[(keys[i], lease)], 0);
            }
            (None, _) => {}
        }
    }
}

fn commit_retrieve(ctx: &NodeContext, inst: &Instance, transfer_id: u64) -> Result<Response> {
    let r = inst.pending.lock().reads.remove(&transfer_id);
    let r = r.ok_or_else(|| missing_transfer(inst, transfer_id))?;
    ctx.storage.finish_read(&r.keys, 0);
    ctx.storage.assert_consistent();
    Ok(Response::Ok)
}

fn missing_transfer(inst: &Instance, transfer_id: u64) -> Error {
    if inst.is_released() {
        return not_registered(inst.id);
    }
    Error::new(
        ErrorKind::UnknownTransfer,
        format!("instance {} has no pending transfer {transfer_id}", inst.id),
    )
}
