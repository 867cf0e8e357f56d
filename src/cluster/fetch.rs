//! Peer fetch: before a LOOKUP or retrieve is answered, the chunks this node lacks are brought
//! in from their owners and published in this node's pool, so local engines (native and LMCache
//! clients alike) get cluster-wide hits with no change on their side.
//!
//! Per request: the chunks missing locally are grouped by owner (placement); each owner is
//! asked once, all owners in parallel, for its chunks as one batch: a LOOKUP of the batch (the
//! owner locks the prefix it holds) pipelined with, per rank, a PREPARE_RETRIEVE of the batch
//! adopting those locks (one round trip), then a READ_SLOTS per rank that streams the bytes; an
//! owner holding only part of the batch is asked for the prefix it holds. The bytes land in slots this node
//! reserved for them (reservations of the node's own I/O, which never expire) and are
//! published only after every byte arrived and the owner's layout matched this node's; any
//! failure aborts the reservations (nothing half-written is ever published) and drops the
//! connection (the owner then releases its locks and its instance). A peer that is dead,
//! unreachable or slower than the peer deadline is a miss, never an error.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::members::View;
use super::peers::Taken;
use super::ClusterNode;
use crate::client::RetrievePrepared;
use crate::error::{Error, ErrorKind, Result};
use crate::modules::NodeContext;
use crate::protocol::{ChunkRange, Request, Response};
use crate::storage::{pack_kv_rank, Grant, Layout, NamespaceId, StorageKey};

/// Why a chunk a node looked for was not brought in (status `cluster.fetch_misses`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissCause {
    /// The owner does not hold it.
    NotHeld,
    /// This node owns it and does not hold it.
    OwnedHere,
    /// The owner could not be reached or its call failed.
    Unreachable,
    /// The owner did not answer within the peer deadline.
    Timeout,
    /// The owner's objects have another layout.
    Layout,
    /// No room in this node's pool.
    LocalFull,
    /// Beyond `cluster.max_fetch_bytes` for one request.
    Budget,
}

/// One owner's share of a request: the request's chunk indices it owns, in order.
struct Batch<'a> {
    peer: &'a str,
    endpoint: &'a str,
    chunks: Vec<usize>,
}

/// Reservations in this node's pool for fetched bytes: aborted on drop unless published.
struct Reserved<'a> {
    ctx: &'a NodeContext,
    items: Vec<(StorageKey, Grant)>,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if !self.items.is_empty() {
            self.ctx.storage.abort_write(&self.items);
            self.ctx.storage.assert_consistent();
        }
    }
}

/// The keys of `hashes` for `rank` under `namespace`.
fn rank_keys(
    namespace: NamespaceId,
    world_size: u32,
    rank: u32,
    hashes: &[crate::hashing::ChunkHash],
) -> Vec<StorageKey> {
    hashes
        .iter()
        .map(|h| StorageKey {
            chunk_hash: *h,
            kv_rank: pack_kv_rank(world_size, rank),
            object_group: 0,
            namespace,
        })
        .collect()
}

impl ClusterNode {
    /// See [`crate::modules::cluster_link::ClusterLink::bring_in`].
    pub(super) fn bring_in_range(&self, ctx: &NodeContext, range: &ChunkRange) {
        if range.world_size == 0 || range.chunk_hashes.is_empty() {
            return;
        }
        let objects = range
            .chunk_hashes
            .len()
            .saturating_mul(range.world_size as usize);
        if objects > ctx.config.limits.max_chunks_per_request {
            return; // the request itself is refused with the limit's error
        }
        let view = self.view();
        if view.members.len() < 2 {
            return;
        }
        let Some(layout) = ctx.layouts.get(&range.model, range.world_size) else {
            // Nothing could check a peer's bytes against a layout, and no local engine of this
            // model could read them: LMCache answers such a lookup 0.
            self.counters
                .fetch_no_layout
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        let missing = self.missing_chunks(ctx, range);
        if missing.is_empty() {
            return;
        }
        if !super::peers::shareable(&layout) {
            self.miss(MissCause::Layout, missing.len());
            return;
        }
        // The bytes this request may hold in reservations: its share of the node-wide budget.
        let per_chunk = layout
            .object_bytes()
            .saturating_mul(u64::from(range.world_size));
        let want = per_chunk.saturating_mul(missing.len() as u64);
        let budget = FetchBudgetGuard {
            budget: &self.fetch_budget,
            bytes: self.fetch_budget.take(want),
        };
        let batches = self.batches(&view, range, &missing, per_chunk, budget.bytes);
        if batches.is_empty() {
            return;
        }
        self.counters.fetch_requests.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + self.cfg.peer_timeout();
        let run = |b: &Batch<'_>| self.fetch_batch(ctx, range, &layout, b, deadline);
        if batches.len() == 1 {
            run(&batches[0]);
        } else {
            std::thread::scope(|s| {
                let mut handles = Vec::new();
                for b in &batches {
                    // A thread that cannot be made: that owner's batch runs here, in turn.
                    match std::thread::Builder::new()
                        .name("kvnode-fetch".into())
                        .spawn_scoped(s, move || run(b))
                    {
                        Ok(h) => handles.push(h),
                        Err(_) => run(b),
                    }
                }
                for h in handles {
                    let _ = h.join();
                }
            });
        }
        drop(budget);
    }

    /// The chunk indices of `range` of which this node lacks some rank in L1.
    fn missing_chunks(&self, ctx: &NodeContext, range: &ChunkRange) -> Vec<usize> {
        let Some(ns) = ctx.namespaces.lookup(&range.model, &range.cache_salt) else {
            return (0..range.chunk_hashes.len()).collect();
        };
        range
            .chunk_hashes
            .iter()
            .enumerate()
            .filter(|(_, h)| {
                (0..range.world_size).any(|r| {
                    let k = StorageKey {
                        chunk_hash: **h,
                        kv_rank: pack_kv_rank(range.world_size, r),
                        object_group: 0,
                        namespace: ns,
                    };
                    !ctx.storage.contains_ready(&k)
                })
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// Groups `missing` by owner: up to the first chunk this node owns itself (a miss: nothing
    /// after it can extend the prefix) and within the fetch byte budget.
    fn batches<'v>(
        &self,
        view: &'v View,
        range: &ChunkRange,
        missing: &[usize],
        per_chunk: u64,
        budget_bytes: u64,
    ) -> Vec<Batch<'v>> {
        let budget = (budget_bytes / per_chunk.max(1)) as usize;
        let mut by_owner: BTreeMap<&str, Batch<'v>> = BTreeMap::new();
        for (n, &i) in missing.iter().enumerate() {
            if n >= budget {
                self.miss(MissCause::Budget, missing.len() - n);
                break;
            }
            let key = super::placement::placement_key(
                &range.model,
                &range.cache_salt,
                &range.chunk_hashes[i],
            );
            let Some(owner) = view.owner(key) else { break };
            if owner.local {
                self.miss(MissCause::OwnedHere, 1);
                break;
            }
            by_owner
                .entry(owner.desc.node_id.as_str())
                .or_insert_with(|| Batch {
                    peer: owner.desc.node_id.as_str(),
                    endpoint: owner.desc.endpoints[0].as_str(),
                    chunks: Vec::new(),
                })
                .chunks
                .push(i);
        }
        by_owner.into_values().collect()
    }

    /// Counts `n` chunks missed for `cause`.
    pub(super) fn miss(&self, cause: MissCause, n: usize) {
        let c = &self.counters;
        let counter = match cause {
            MissCause::NotHeld => &c.miss_not_held,
            MissCause::OwnedHere => &c.miss_owned_here,
            MissCause::Unreachable => &c.miss_unreachable,
            MissCause::Timeout => &c.miss_timeout,
            MissCause::Layout => &c.miss_layout,
            MissCause::LocalFull => &c.miss_local_full,
            MissCause::Budget => &c.miss_budget,
        };
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Fetches one owner's batch; every failure is a counted miss.
    fn fetch_batch(
        &self,
        ctx: &NodeContext,
        range: &ChunkRange,
        layout: &Layout,
        b: &Batch<'_>,
        deadline: Instant,
    ) {
        let mut taken = match self.peers.take(b.peer, b.endpoint, deadline) {
            Ok(t) => t,
            Err(e) => {
                tracing::debug!(peer = b.peer, error = %e, "peer fetch: no connection");
                self.miss(cause_of(&e), b.chunks.len());
                return;
            }
        };
        match self.fetch_with(ctx, range, layout, b, &mut taken, deadline) {
            Ok(got) => {
                if got < b.chunks.len() {
                    self.miss(MissCause::NotHeld, b.chunks.len() - got);
                }
                self.peers.put(taken);
            }
            Err(e) => {
                tracing::info!(peer = b.peer, error = %e, "peer fetch failed: a miss");
                self.miss(cause_of(&e), b.chunks.len());
                // Closing the connection makes the peer release what it holds for us.
                self.peers.close(taken);
            }
        }
    }

    /// The calls of one batch on connection `t`; returns the chunks accounted for (see
    /// [`ClusterNode::fetch_rank`]).
    fn fetch_with(
        &self,
        ctx: &NodeContext,
        range: &ChunkRange,
        layout: &Layout,
        b: &Batch<'_>,
        t: &mut Taken,
        deadline: Instant,
    ) -> Result<usize> {
        let hashes: Vec<_> = b.chunks.iter().map(|&i| range.chunk_hashes[i]).collect();
        bound(t, deadline, self.cfg.peer_timeout())?;
        let inst = t
            .conn
            .instance(&range.model, range.world_size, layout, self.peers.ids())?;
        let session = t.conn.session.clone();
        let sub = ChunkRange {
            model: range.model.clone(),
            world_size: range.world_size,
            worker_id: None,
            cache_salt: range.cache_salt.clone(),
            first_chunk: 0,
            chunk_hashes: hashes,
        };
        bound(t, deadline, self.cfg.peer_timeout())?;
        let n = sub.chunk_hashes.len();
        // One write: the LOOKUP and, per rank, a PREPARE_RETRIEVE of the whole batch adopting
        // its locks; when the owner holds the whole batch (the usual hit) the bytes follow in
        // the next round trip, one READ_SLOTS per rank.
        let client = &mut t.conn.client;
        let lookup_id = client.send(&Request::Lookup {
            request_id: session.clone(),
            range: sub.clone(),
            tp_size: 1,
            readers: 0,
        })?;
        let mut prep_ids = Vec::with_capacity(range.world_size as usize);
        for rank in 0..range.world_size {
            prep_ids.push(client.send(&Request::PrepareRetrieve {
                instance_id: inst,
                range: ChunkRange {
                    worker_id: Some(rank),
                    ..sub.clone()
                },
                lookup_session: Some(session.clone()),
            })?);
        }
        let mut replies: HashMap<u64, Response> = HashMap::with_capacity(prep_ids.len() + 1);
        for _ in 0..=prep_ids.len() {
            let (id, resp, _) = client.recv()?;
            replies.insert(id, resp);
        }
        let held = match replies.remove(&lookup_id) {
            Some(Response::LookupHits { chunks }) => (chunks as usize).min(n),
            other => return Err(unexpected("LOOKUP", other)),
        };
        let mut preps: Vec<Option<RetrievePrepared>> = Vec::with_capacity(prep_ids.len());
        for id in &prep_ids {
            preps.push(match replies.remove(id) {
                Some(Response::RetrievePrepared {
                    hit: true,
                    transfer_id,
                    slots,
                    layout,
                }) => Some(RetrievePrepared {
                    transfer_id,
                    slots,
                    layout,
                }),
                Some(Response::RetrievePrepared { hit: false, .. }) => None,
                other => return Err(unexpected("PREPARE_RETRIEVE", other)),
            });
        }
        let namespace = ctx.namespaces.intern(&range.model, &range.cache_salt)?;
        let whole = held == n && preps.iter().all(Option::is_some);
        if !whole {
            // The owner lacks part of the batch (or lost some meanwhile): what was prepared is
            // released, and so were the lookup's locks (a retrieve that misses releases the
            // locks it adopted); each rank takes its own on the prefix held.
            for p in preps.iter_mut().filter_map(Option::take) {
                client.commit_retrieve(inst, p.transfer_id)?;
            }
            if held == 0 {
                return Ok(0);
            }
        }
        let mut published = usize::MAX;
        for (rank, prep) in (0..range.world_size).zip(preps) {
            let got = self.fetch_rank(
                ctx, t, inst, &sub, held, rank, prep, layout, namespace, deadline,
            )?;
            published = published.min(got);
        }
        Ok(published.min(held))
    }

    /// Retrieves rank `rank` of the first `held` chunks of `sub` from the peer into this node's
    /// pool; returns how many of them are accounted for (published, here already, or counted as
    /// no room), 0 when the peer lost them meanwhile; the caller counts the rest `not_held`.
    /// `prepared` is the rank's retrieve when it was prepared already (the whole batch);
    /// otherwise it is prepared here, with locks of its own.
    #[allow(clippy::too_many_arguments)]
    fn fetch_rank(
        &self,
        ctx: &NodeContext,
        t: &mut Taken,
        inst: u64,
        sub: &ChunkRange,
        held: usize,
        rank: u32,
        prepared: Option<RetrievePrepared>,
        layout: &Layout,
        namespace: NamespaceId,
        deadline: Instant,
    ) -> Result<usize> {
        let hashes = &sub.chunk_hashes[..held];
        bound(t, deadline, self.cfg.peer_timeout())?;
        let prep = match prepared {
            Some(p) => p,
            None => {
                let rr = ChunkRange {
                    worker_id: Some(rank),
                    chunk_hashes: hashes.to_vec(),
                    ..sub.clone()
                };
                match t.conn.client.prepare_retrieve(inst, &rr, None)? {
                    Some(p) => p,
                    None => return Ok(0),
                }
            }
        };
        let object_bytes = layout.object_bytes();
        let same_layout = prep.layout.shape == layout.shape
            && prep.layout.dtype == layout.dtype.name()
            && prep.slots.len() == held
            && prep.slots.iter().all(|s| s.length == object_bytes);
        if !same_layout {
            let _ = t.conn.client.commit_retrieve(inst, prep.transfer_id);
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the peer's objects of {} have layout {:?} {}; this node's is {:?} {}",
                    sub.model,
                    prep.layout.shape,
                    prep.layout.dtype,
                    layout.shape,
                    layout.dtype.name()
                ),
            ));
        }
        let keys = rank_keys(namespace, sub.world_size, rank, hashes);
        let grants = ctx.storage.reserve_write_untimed(&keys, object_bytes);
        // Where each chunk's bytes go: its reserved slot, or nowhere (already here, being
        // written by someone else, or no room: received and dropped).
        let mut targets: Vec<Option<u64>> = Vec::with_capacity(held);
        let mut reserved = Reserved {
            ctx,
            items: Vec::new(),
        };
        let mut full = 0;
        for (k, g) in keys.iter().zip(grants) {
            match g {
                Ok(g) => {
                    debug_assert_eq!(g.slot.len, object_bytes);
                    targets.push(Some(g.slot.offset));
                    reserved.items.push((*k, g));
                }
                Err(crate::storage::KeyError::OutOfMemory) => {
                    full += 1;
                    targets.push(None);
                }
                Err(_) => targets.push(None),
            }
        }
        if full > 0 {
            self.miss(MissCause::LocalFull, full);
        }
        bound(t, deadline, self.cfg.peer_timeout())?;
        if reserved.items.is_empty() {
            // Nothing to receive into (all here already, or no room): release the peer's locks
            // without moving a byte.
            t.conn.client.commit_retrieve(inst, prep.transfer_id)?;
            return Ok(held);
        }
        let region = ctx.pool.region();
        let total = object_bytes * held as u64;
        let got = t.conn.client.read_slots_with(
            inst,
            prep.transfer_id,
            total,
            true,
            Some(deadline),
            &mut |at, bytes| {
                // `bytes` may span chunk boundaries.
                let mut done = 0usize;
                while done < bytes.len() {
                    let pos = at + done as u64;
                    let chunk = (pos / object_bytes) as usize;
                    let within = pos % object_bytes;
                    let n = ((object_bytes - within) as usize).min(bytes.len() - done);
                    if let Some(off) = targets[chunk] {
                        region
                            .write_at(off + within, &bytes[done..done + n])
                            .map_err(|e| Error::internal(format!("pool write: {e}")))?;
                    }
                    done += n;
                }
                Ok(())
            },
        )?;
        debug_assert_eq!(got, total);
        let items = std::mem::take(&mut reserved.items);
        let reserved_count = items.len();
        let published = ctx
            .storage
            .finish_write_as(&items, layout.fingerprint(), false)
            .iter()
            .filter(|r| r.is_ok())
            .count();
        ctx.storage.assert_consistent();
        let bytes = published as u64 * object_bytes;
        self.counters
            .fetched_objects
            .fetch_add(published as u64, Ordering::Relaxed);
        self.counters
            .fetched_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        // Accounted for: what was published, what was here (or being written) already, and
        // what found no room (counted `local_full` above); not what could not be published.
        Ok(held - (reserved_count - published))
    }
}

/// The error for a reply that is not the one a pipelined call expects.
fn unexpected(what: &str, r: Option<Response>) -> Error {
    match r {
        Some(Response::Error { kind, message }) => Error::new(ErrorKind::from_code(kind), message),
        Some(other) => Error::internal(format!("{what}: unexpected answer {other:?}")),
        None => Error::internal(format!("{what}: no answer")),
    }
}

/// Bounds the connection's next reply by what is left of `deadline` (at most `per_call`).
fn bound(t: &mut Taken, deadline: Instant, per_call: std::time::Duration) -> Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Error::new(
            ErrorKind::Io,
            "timed out: the peer deadline passed",
        ));
    }
    t.conn.client.set_timeout(Some(left.min(per_call)))
}

/// Bytes of reservations peer fetches may hold at once, node-wide (`cluster.max_fetch_bytes`).
/// Invariant: `used <= max`.
pub struct FetchBudget {
    used: parking_lot::Mutex<u64>,
    max: u64,
}

impl FetchBudget {
    /// A budget of `max` bytes.
    pub fn new(max: u64) -> FetchBudget {
        FetchBudget {
            used: parking_lot::Mutex::new(0),
            max,
        }
    }

    /// Takes up to `want` bytes (what is left when less); returns the bytes taken.
    fn take(&self, want: u64) -> u64 {
        let mut used = self.used.lock();
        let got = want.min(self.max - *used);
        *used += got;
        got
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        *self.used.lock()
    }
}

/// Gives a request's share of the budget back when it ends.
struct FetchBudgetGuard<'a> {
    budget: &'a FetchBudget,
    bytes: u64,
}

impl Drop for FetchBudgetGuard<'_> {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock();
        debug_assert!(*used >= self.bytes);
        *used = used.saturating_sub(self.bytes);
    }
}

/// The miss cause of a failed peer call: another layout (`Unsupported`), a deadline (an I/O
/// error that says it timed out or would block: a socket timeout), else unreachable.
pub(super) fn cause_of(e: &Error) -> MissCause {
    let text = e.context.to_ascii_lowercase();
    match e.kind {
        ErrorKind::Unsupported => MissCause::Layout,
        _ if text.contains("timed out")
            || text.contains("would block")
            || text.contains("temporarily unavailable") =>
        {
            MissCause::Timeout
        }
        _ => MissCause::Unreachable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fetch_budget_hands_out_what_is_left_and_takes_it_back() {
        let b = FetchBudget::new(100);
        let g1 = FetchBudgetGuard {
            budget: &b,
            bytes: b.take(70),
        };
        assert_eq!(g1.bytes, 70);
        let g2 = FetchBudgetGuard {
            budget: &b,
            bytes: b.take(70),
        };
        assert_eq!(g2.bytes, 30, "only what is left");
        assert_eq!(b.take(1), 0);
        drop(g1);
        assert_eq!(b.used(), 30);
        drop(g2);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn miss_causes_follow_the_error() {
        let t = Error::new(ErrorKind::Io, "timed out: the peer deadline passed");
        assert_eq!(cause_of(&t), MissCause::Timeout);
        let w = Error::new(
            ErrorKind::Io,
            "Resource temporarily unavailable (os error 11)",
        );
        assert_eq!(cause_of(&w), MissCause::Timeout);
        let l = Error::new(ErrorKind::Unsupported, "another layout");
        assert_eq!(cause_of(&l), MissCause::Layout);
        let r = Error::new(ErrorKind::Io, "Connection refused (os error 111)");
        assert_eq!(cause_of(&r), MissCause::Unreachable);
    }
}
