//! LOOKUP, FREE_LOOKUP_LOCKS and END_SESSION (LMCache section 4.5), with sessions kept per
//! request id. Lookups lock the hit prefix for every rank so the retrieve that follows is
//! guaranteed to find it; sessions expire after an idle time (not after creation, fixing W5).
//! A session keeps only the locks of its hit prefix, and a complete miss keeps no session, so
//! a session's memory follows what it hit, never the length of the prompt it was asked about.

use std::sync::atomic::Ordering;

use super::context::NodeContext;
use super::sessions::{HeldLock, Session};
pub use super::sessions::{SessionOwner, SessionTable, UNKNOWN_OWNER};
use super::transfer::check_chunk_count;
use crate::error::{Error, Result};
use crate::hashing::ChunkHash;
use crate::protocol::{ChunkRange, Response};
use crate::storage::{pack_kv_rank, NamespaceId, StorageKey};

/// Most readers one LOOKUP may declare per object (LMCache 0.5.4 clamped its extra locks to
/// 127, i.e. 128 readers); a larger `readers` is refused with `LimitExceeded`.
pub const MAX_KV_READERS: u32 = 128;

/// LMCache 0.5.4's multi-reader rule, used when a LOOKUP does not declare its readers:
/// `tp = tp_size if tp_size > 1 else world_size`; `extra = tp - 1 if tp > world_size else 0`
/// (MLA: every TP rank reads the same object).
pub fn extra_readers(tp_size: u32, world_size: u32) -> u32 {
    let tp = if tp_size > 1 { tp_size } else { world_size };
    if tp > world_size {
        (tp - 1).min(127)
    } else {
        0
    }
}

fn chunk_keys(namespace: NamespaceId, world_size: u32, hash: &ChunkHash) -> Vec<StorageKey> {
    (0..world_size)
        .map(|rank| StorageKey {
            chunk_hash: *hash,
            kv_rank: pack_kv_rank(world_size, rank),
            object_group: 0,
            namespace,
        })
        .collect()
}

/// Releases every lock a session still holds (session replaced, ended or expired): locks that
/// nobody will retrieve or free any more must not wait for the TTL (LMCache leaked them, W7).
pub fn release_session(ctx: &NodeContext, s: &Session) {
    for held in &s.locked {
        if held.remaining > 0 {
            ctx.storage
                .finish_read(&[(held.key, held.lease)], held.remaining - 1);
        }
    }
}

/// LOOKUP: prefix hit count over all ranks, locking each object of the hit prefix once per
/// reader: `readers` when given (LMCache 0.5.6 `num_kv_readers`: each reader's retrieve consumes
/// one lock, so two MLA ranks sharing worker 0 both find theirs), else LMCache 0.5.4's rule from
/// `tp_size` ([`extra_readers`]).
/// A repeated lookup with the same request id replaces the session and releases the locks the
/// old one still held (LMCache leaked them: W7). A lookup that hits nothing keeps no session.
/// Sessions stay within `limits.max_sessions` and `limits.max_session_bytes`: a new one evicts
/// others ([`SessionTable::make_room`]: the largest owner's least recently used first), and one
/// that alone exceeds the byte limit is refused with `LimitExceeded` (its locks released).
pub fn lookup(
    ctx: &NodeContext,
    owner: SessionOwner,
    connection: u64,
    request_id: &str,
    range: &ChunkRange,
    tp_size: u32,
    readers: u32,
) -> Result<Response> {
    if range.worker_id.is_some() {
        return Err(Error::invalid(
            "LOOKUP covers all ranks: worker_id must be absent",
        ));
    }
    crate::storage::key::validate_rank(range.world_size, 0)?;
    check_chunk_count(ctx, range.chunk_hashes.len())?;
    // Key budget: a lookup builds chunks x ranks keys.
    let keys = range
        .chunk_hashes
        .len()
        .saturating_mul(range.world_size as usize);
    if keys > ctx.config.limits.max_chunks_per_request {
        return Err(Error::limit(format!(
            "lookup of {} chunks x {} ranks = {keys} objects (limit {})",
            range.chunk_hashes.len(),
            range.world_size,
            ctx.config.limits.max_chunks_per_request
        )));
    }
    {
        // A LOOKUP replaces the session of its id only if it is its creator's.
        let shard = ctx.sessions.shard(request_id).lock();
        if let Some(s) = shard.get(&SessionTable::key(owner, request_id)) {
            check_creator(s, connection, request_id)?;
        }
    }
    if readers > MAX_KV_READERS {
        return Err(Error::limit(format!(
            "LOOKUP declares {readers} readers per object (limit {MAX_KV_READERS})"
        )));
    }
    let Some(namespace) = ctx.namespaces.lookup(&range.model, &range.cache_salt) else {
        // Interned names were validated then; an unknown pair is checked here, so a bad name
        // is still an error rather than a miss.
        crate::storage::key::validate_model_name(&range.model)?;
        crate::storage::key::validate_salt(&range.cache_salt)?;
        // Nothing is stored under this (model, salt): a miss, never an insertion. Like any
        // LOOKUP, it replaces a session of the same id (whose locks are released).
        let old = ctx
            .sessions
            .remove_if_created_by(owner, request_id, connection)
            .map_err(|()| not_creator(request_id))?;
        if let Some(old) = old {
            release_session(ctx, &old);
        }
        return Ok(Response::LookupHits { chunks: 0 });
    };
    let extra = match readers {
        0 => extra_readers(tp_size, range.world_size),
        n => n - 1,
    };
    // Keys are built one chunk at a time; locking stops at the first gap (in every tier).
    let chunks = range
        .chunk_hashes
        .iter()
        .map(|h| chunk_keys(namespace, range.world_size, h));
    let locked = match &ctx.l2 {
        None => ctx.storage.lock_prefix(chunks, extra),
        // Without a registered layout for the model nothing on disk can be checked against
        // it (nor retrieved by anyone): the lookup sees L1 only.
        Some(l2) => match ctx.layouts.get(&range.model, range.world_size) {
            Some(expected) => lock_prefix_tiered(ctx, l2, chunks, extra, Some(&expected)),
            None => ctx.storage.lock_prefix(chunks, extra),
        },
    };
    let hit = locked.len() as u32;
    // Like any LOOKUP, this one ends the session of the same id (its locks are released).
    match ctx
        .sessions
        .remove_if_created_by(owner, request_id, connection)
    {
        Ok(Some(old)) => release_session(ctx, &old),
        Ok(None) => {}
        Err(()) => {
            // Another connection created it while this one was locking: its own locks go.
            release_locked(ctx, &locked, extra);
            return Err(not_creator(request_id));
        }
    }
    if hit == 0 {
        // A complete miss keeps nothing: no session.
        return Ok(Response::LookupHits { chunks: 0 });
    }
    let session = Session::new(
        namespace,
        range.world_size,
        locked
            .into_iter()
            .flatten()
            .map(|(key, lease)| HeldLock {
                key,
                lease,
                remaining: 1 + extra,
            })
            .collect(),
        request_id,
        ctx.now_ms(),
        connection,
    );
    let max_bytes = usize::try_from(ctx.config.limits.max_session_bytes).unwrap_or(usize::MAX);
    if session.bytes() > max_bytes {
        release_session(ctx, &session);
        return Err(Error::limit(format!(
            "a lookup session of {hit} chunks x {} ranks takes {} bytes, more than all sessions \
             may hold (limits.max_session_bytes = {max_bytes})",
            range.world_size,
            session.bytes()
        )));
    }
    // Within the count and byte budgets: other sessions make room, the largest owner's least
    // recently used first (their locks released, as expiry does).
    let evicted = ctx.sessions.make_room(owner, session.bytes(), max_bytes);
    if !evicted.is_empty() {
        tracing::debug!(
            sessions = evicted.len(),
            "lookup sessions evicted to stay within limits.max_sessions and limits.max_session_bytes"
        );
    }
    for s in &evicted {
        release_session(ctx, s);
    }
    // A concurrent LOOKUP of the same id may have inserted meanwhile: over the same
    // connection the later one wins; over another, this one is refused (its locks released).
    match ctx
        .sessions
        .insert_unless_foreign(owner, request_id, session)
    {
        Ok(Some(old)) => release_session(ctx, &old),
        Ok(None) => {}
        Err(mine) => {
            release_session(ctx, &mine);
            return Err(not_creator(request_id));
        }
    }
    Ok(Response::LookupHits { chunks: hit })
}

/// [`StorageCore::lock_prefix`](crate::storage::StorageCore::lock_prefix) over L1 and L2: a
/// chunk counts when each of its keys is read-locked in L1 or is on L2; the L2-only keys of the
/// counted prefix are then loaded into L1 (prefetch, published with the same `1 + extra` locks),
/// and the prefix is cut at the first chunk whose load failed. Every lock taken for chunks
/// beyond the final prefix is released, so the result has the same meaning as in L1 alone.
fn lock_prefix_tiered(
    ctx: &NodeContext,
    l2: &crate::l2::L2Set,
    chunks: impl Iterator<Item = Vec<StorageKey>>,
    extra: u32,
    expected: Option<&crate::storage::Layout>,
) -> Vec<Vec<(StorageKey, u64)>> {
    // Per chunk, per key: the lease of an L1 lock, or None for "on L2, to load".
    let mut plan: Vec<Vec<(StorageKey, Option<u64>)>> = Vec::new();
    for chunk in chunks {
        let got = ctx.storage.reserve_read(&chunk, extra);
        let complete = chunk
            .iter()
            .zip(&got)
            .all(|(k, r)| r.is_ok() || l2.contains(k));
        let entry: Vec<(StorageKey, Option<u64>)> = chunk
            .iter()
            .zip(&got)
            .map(|(k, r)| (*k, r.as_ref().ok().map(|g| g.lease)))
            .collect();
        if !complete {
            release(ctx, &entry, extra);
            break;
        }
        plan.push(entry);
    }
    let to_load: Vec<StorageKey> = plan
        .iter()
        .flatten()
        .filter(|(_, l)| l.is_none())
        .map(|(k, _)| *k)
        .collect();
    if !to_load.is_empty() {
        let leases = l2.load(&ctx.storage, &to_load, extra, expected);
        let mut loaded = to_load.iter().zip(leases);
        for (k, lease) in plan.iter_mut().flatten().filter(|(_, l)| l.is_none()) {
            let (lk, l) = loaded.next().expect("one result per key to load");
            debug_assert_eq!(k, lk);
            *lease = l;
        }
    }
    let hit = plan
        .iter()
        .position(|c| c.iter().any(|(_, l)| l.is_none()))
        .unwrap_or(plan.len());
    for chunk in plan.drain(hit..) {
        release(ctx, &chunk, extra);
    }
    plan.into_iter()
        .map(|c| {
            c.into_iter()
                .map(|(k, l)| (k, l.expect("in the hit prefix")))
                .collect()
        })
        .collect()
}

/// Releases the `1 + extra` locks a lookup took on each key of `locked`.
fn release_locked(ctx: &NodeContext, locked: &[Vec<(StorageKey, u64)>], extra: u32) {
    let flat: Vec<(StorageKey, u64)> = locked.iter().flatten().copied().collect();
    ctx.storage.finish_read(&flat, extra);
}

fn release(ctx: &NodeContext, entry: &[(StorageKey, Option<u64>)], extra: u32) {
    let taken: Vec<(StorageKey, u64)> = entry
        .iter()
        .filter_map(|(k, l)| l.map(|l| (*k, l)))
        .collect();
    ctx.storage.finish_read(&taken, extra);
}

/// `Ok` when `connection` created session `s`: only it may free, end or replace the session.
fn check_creator(s: &Session, connection: u64, request_id: &str) -> Result<()> {
    if s.connection == connection {
        return Ok(());
    }
    Err(not_creator(request_id))
}

fn not_creator(request_id: &str) -> Error {
    Error::denied(format!(
        "lookup session {request_id:?} belongs to another connection (only the connection whose \
         LOOKUP created it may free, end or replace it)"
    ))
}

/// Ends the sessions created over a closed connection, releasing their locks (a scheduler that
/// died leaves no locks for the session TTL to find).
pub fn connection_closed(ctx: &NodeContext, connection: u64) -> usize {
    let gone = ctx.sessions.remove_of_connection(connection);
    for s in &gone {
        release_session(ctx, s);
    }
    gone.len()
}

/// FREE_LOOKUP_LOCKS: releases the session's locks on chunks `[start, end)` clipped to the hit
/// length; each chunk at most once. Unknown sessions and empty ranges are no-ops.
pub fn free_lookup_locks(
    ctx: &NodeContext,
    owner: SessionOwner,
    connection: u64,
    request_id: &str,
    start: u32,
    end: u32,
) -> Result<Response> {
    let mut shard = ctx.sessions.shard(request_id).lock();
    let Some(s) = shard.get_mut(&SessionTable::key(owner, request_id)) else {
        return Ok(Response::Ok);
    };
    check_creator(s, connection, request_id)?;
    s.last_used_ms = ctx.now_ms();
    let end = (end as usize).min(s.hit_chunks());
    for c in (start as usize).min(end)..end {
        for held in s.chunk_mut(c) {
            if held.remaining > 0 {
                ctx.storage
                    .finish_read(&[(held.key, held.lease)], held.remaining - 1);
                held.remaining = 0;
            }
        }
    }
    Ok(Response::Ok)
}

/// Moves to a retrieve that relies on session `request_id` one of the session's read locks on
/// each of `keys` (chunk positions `first_chunk..`). Entry `i` is the grant of the adopted lock,
/// or `None` when the session holds no live lock on that key (unknown or ended session, locks
/// used up or freed, another prompt, expired): the caller then takes a lock of its own, so a
/// retrieve never relies on a lock that someone else owns. Adopted locks are the retrieve's: its
/// commit (or its miss) releases them, and the session no longer counts them.
pub fn adopt(
    ctx: &NodeContext,
    owner: SessionOwner,
    request_id: &str,
    first_chunk: u32,
    keys: &[StorageKey],
) -> Vec<Option<crate::storage::Grant>> {
    let mut out = vec![None; keys.len()];
    let mut shard = ctx.sessions.shard(request_id).lock();
    let Some(s) = shard.get_mut(&SessionTable::key(owner, request_id)) else {
        return out;
    };
    s.last_used_ms = ctx.now_ms();
    for (i, key) in keys.iter().enumerate() {
        let c = first_chunk as usize + i;
        let Some(held) = s
            .chunk_mut(c)
            .iter_mut()
            .find(|h| h.key == *key && h.remaining > 0)
        else {
            continue;
        };
        match ctx.storage.adopt_read(key, held.lease) {
            Ok(grant) => {
                held.remaining -= 1;
                out[i] = Some(grant);
                ctx.counters.adopted_locks.fetch_add(1, Ordering::Relaxed);
            }
            // The lock is gone (expired): the session has nothing left to release there.
            Err(crate::storage::KeyError::KeyInWrongState) => held.remaining = 0,
            // Still held, but not readable (cleared while locked): the session keeps it, and
            // releasing it later frees the doomed object.
            Err(_) => {}
        }
    }
    out
}

/// END_SESSION: forgets the session, releases any lookup locks it still holds, and refreshes
/// recency of the chunks it hit (every rank; the chunks after the hit prefix were not found).
pub fn end_session(
    ctx: &NodeContext,
    owner: SessionOwner,
    connection: u64,
    request_id: &str,
) -> Result<Response> {
    // Only its creator ends a session (checked and removed in one step).
    let removed = ctx
        .sessions
        .remove_if_created_by(owner, request_id, connection)
        .map_err(|()| not_creator(request_id))?;
    if let Some(s) = removed {
        release_session(ctx, &s);
        let keys: Vec<StorageKey> = s.locked.iter().map(|h| h.key).collect();
        ctx.storage.touch(&keys);
    }
    Ok(Response::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mla_extra_readers() {
        assert_eq!(extra_readers(1, 1), 0);
        assert_eq!(
            extra_readers(4, 1),
            3,
            "MLA: world 1, tp 4 -> 4 locks per key"
        );
        assert_eq!(extra_readers(4, 4), 0);
        assert_eq!(extra_readers(0, 2), 0);
        assert_eq!(extra_readers(1000, 1), 127, "clamped like LMCache");
    }
}
