//! LOOKUP, FREE_LOOKUP_LOCKS and END_SESSION (LMCache section 4.5), with sessions kept per
//! request id. Lookups lock the hit prefix for every rank so the retrieve that follows is
//! guaranteed to find it; sessions expire after an idle time (not after creation, fixing W5).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::context::NodeContext;
use super::transfer::check_chunk_count;
use crate::error::{Error, Result};
use crate::hashing::ChunkHash;
use crate::protocol::{ChunkRange, Response};
use crate::storage::{pack_kv_rank, NamespaceId, StorageKey};

/// LMCache's multi-reader rule: `tp = tp_size if tp_size > 1 else world_size`;
/// `extra = tp - 1 if tp > world_size else 0` (MLA: every TP rank reads the same object).
pub fn extra_readers(tp_size: u32, world_size: u32) -> u32 {
    let tp = if tp_size > 1 { tp_size } else { world_size };
    if tp > world_size {
        (tp - 1).min(127)
    } else {
        0
    }
}

/// One key's share of a lookup's read locks.
#[derive(Debug, Clone, Copy)]
struct HeldLock {
    key: StorageKey,
    lease: u64,
    /// Locks this session still holds on the key (starts at `1 + extra`; each retrieve that
    /// relies on the session uses one up; FREE_LOOKUP_LOCKS releases the rest).
    remaining: u32,
}

/// What a lookup remembers for its request. Invariant: `locked.len()` is the hit length in
/// chunks, and every `HeldLock` with `remaining > 0` is backed by that many read locks taken by
/// this session and not yet released by anyone.
#[derive(Debug, Clone)]
pub struct Session {
    namespace: NamespaceId,
    world_size: u32,
    hashes: Vec<ChunkHash>,
    locked: Vec<Vec<HeldLock>>,
    last_used_ms: u64,
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

const SESSION_SHARDS: usize = 16;

/// Who a session belongs to: the uid of the peer that ran the LOOKUP. Request ids are the
/// clients' own names, so each user has its own name space: another user's LOOKUP, FREE, END or
/// retrieve never sees (or replaces) a session it did not create.
pub type SessionOwner = u32;

/// The owner used for a peer whose credentials are unknown (never matches a real user's).
pub const UNKNOWN_OWNER: SessionOwner = u32::MAX;

type SessionKey = (SessionOwner, String);

/// Sessions by (owner, request id). Invariant: at most `limit` sessions. Hash maps with
/// randomly keyed SipHash (clients choose request ids: no hash flooding); every walk over them
/// that acts on sessions (expiry) sorts first, so it runs in a deterministic order.
pub struct SessionTable {
    shards: Vec<Mutex<HashMap<SessionKey, Session>>>,
    count: AtomicUsize,
    limit: usize,
}

impl SessionTable {
    /// An empty table holding at most `limit` sessions.
    pub fn new(limit: usize) -> SessionTable {
        SessionTable {
            shards: (0..SESSION_SHARDS).map(|_| Mutex::default()).collect(),
            count: AtomicUsize::new(0),
            limit,
        }
    }

    fn shard(&self, id: &str) -> &Mutex<HashMap<SessionKey, Session>> {
        let h = blake3::hash(id.as_bytes());
        &self.shards[h.as_bytes()[0] as usize % SESSION_SHARDS]
    }

    fn key(owner: SessionOwner, id: &str) -> SessionKey {
        (owner, id.to_owned())
    }

    /// Number of live sessions.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether there are no sessions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert(&self, owner: SessionOwner, id: &str, s: Session) -> Option<Session> {
        let old = self.shard(id).lock().insert(Self::key(owner, id), s);
        if old.is_none() {
            self.count.fetch_add(1, Ordering::Relaxed);
        }
        old
    }

    fn remove(&self, owner: SessionOwner, id: &str) -> Option<Session> {
        let old = self.shard(id).lock().remove(&Self::key(owner, id));
        if old.is_some() {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
        old
    }

    /// Every lock the sessions hold: `("owner:request id", key, lease, locks remaining)`, sorted
    /// (the simulator's lock-ownership check). O(sessions x keys): never on a request path.
    pub fn held_locks(&self) -> Vec<(String, StorageKey, u64, u32)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            for ((owner, id), s) in shard.lock().iter() {
                for h in s.locked.iter().flatten() {
                    out.push((format!("{owner}:{id}"), h.key, h.lease, h.remaining));
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// The namespace of every live session (the namespace reclaimer keeps them).
    pub fn namespaces(&self) -> Vec<NamespaceId> {
        let mut out: Vec<NamespaceId> = self
            .shards
            .iter()
            .flat_map(|s| s.lock().values().map(|v| v.namespace).collect::<Vec<_>>())
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Removes sessions idle since before `cutoff_ms` and returns them, so the caller releases
    /// the locks they still hold (a retrieve that used them has already consumed its share).
    pub fn expire(&self, cutoff_ms: u64) -> Vec<Session> {
        let mut out = Vec::new();
        for s in &self.shards {
            let mut m = s.lock();
            let mut stale: Vec<SessionKey> = m
                .iter()
                .filter(|(_, v)| v.last_used_ms < cutoff_ms)
                .map(|(k, _)| k.clone())
                .collect();
            stale.sort_unstable();
            out.extend(stale.iter().filter_map(|k| m.remove(k)));
        }
        self.count.fetch_sub(out.len(), Ordering::Relaxed);
        out
    }
}

/// Releases every lock a session still holds (session replaced, ended or expired): locks that
/// nobody will retrieve or free any more must not wait for the TTL (LMCache leaked them, W7).
pub fn release_session(ctx: &NodeContext, s: &Session) {
    for held in s.locked.iter().flatten() {
        if held.remaining > 0 {
            ctx.storage
                .finish_read(&[(held.key, held.lease)], held.remaining - 1);
        }
    }
}

/// LOOKUP: prefix hit count over all ranks, locking the hit prefix with `1 + extra` locks per key.
/// A repeated lookup with the same request id replaces the session and releases the locks the
/// old one still held (LMCache leaked them: W7).
pub fn lookup(
    ctx: &NodeContext,
    owner: SessionOwner,
    request_id: &str,
    range: &ChunkRange,
    tp_size: u32,
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
    if ctx.sessions.len() >= ctx.sessions.limit
        && ctx
            .sessions
            .shard(request_id)
            .lock()
            .get(&SessionTable::key(owner, request_id))
            .is_none()
    {
        return Err(Error::limit(format!(
            "{} lookup sessions open (limit)",
            ctx.sessions.limit
        )));
    }
    let Some(namespace) = ctx.namespaces.lookup(&range.model, &range.cache_salt) else {
        // Interned names were validated then; an unknown pair is checked here, so a bad name
        // is still an error rather than a miss.
        crate::storage::key::validate_model_name(&range.model)?;
        crate::storage::key::validate_salt(&range.cache_salt)?;
        // Nothing is stored under this (model, salt): a miss, never an insertion. Like any
        // LOOKUP, it replaces a session of the same id (whose locks are released).
        if let Some(old) = ctx.sessions.remove(owner, request_id) {
            release_session(ctx, &old);
        }
        return Ok(Response::LookupHits { chunks: 0 });
    };
    let extra = extra_readers(tp_size, range.world_size);
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
    let replaced = ctx.sessions.insert(
        owner,
        request_id,
        Session {
            namespace,
            world_size: range.world_size,
            hashes: range.chunk_hashes.clone(),
            locked: locked
                .into_iter()
                .map(|chunk| {
                    chunk
                        .into_iter()
                        .map(|(key, lease)| HeldLock {
                            key,
                            lease,
                            remaining: 1 + extra,
                        })
                        .collect()
                })
                .collect(),
            last_used_ms: ctx.now_ms(),
        },
    );
    if let Some(old) = replaced {
        release_session(ctx, &old);
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

fn release(ctx: &NodeContext, entry: &[(StorageKey, Option<u64>)], extra: u32) {
    let taken: Vec<(StorageKey, u64)> = entry
        .iter()
        .filter_map(|(k, l)| l.map(|l| (*k, l)))
        .collect();
    ctx.storage.finish_read(&taken, extra);
}

/// FREE_LOOKUP_LOCKS: releases the session's locks on chunks `[start, end)` clipped to the hit
/// length; each chunk at most once. Unknown sessions and empty ranges are no-ops.
pub fn free_lookup_locks(
    ctx: &NodeContext,
    owner: SessionOwner,
    request_id: &str,
    start: u32,
    end: u32,
) -> Result<Response> {
    let mut shard = ctx.sessions.shard(request_id).lock();
    let Some(s) = shard.get_mut(&SessionTable::key(owner, request_id)) else {
        return Ok(Response::Ok);
    };
    s.last_used_ms = ctx.now_ms();
    let end = (end as usize).min(s.locked.len());
    for c in (start as usize).min(end)..end {
        for held in &mut s.locked[c] {
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
            .locked
            .get_mut(c)
            .and_then(|ks| ks.iter_mut().find(|h| h.key == *key && h.remaining > 0))
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
/// recency of all its chunks (every rank).
pub fn end_session(ctx: &NodeContext, owner: SessionOwner, request_id: &str) -> Result<Response> {
    if let Some(s) = ctx.sessions.remove(owner, request_id) {
        release_session(ctx, &s);
        let keys: Vec<StorageKey> = s
            .hashes
            .iter()
            .flat_map(|h| chunk_keys(s.namespace, s.world_size, h))
            .collect();
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
