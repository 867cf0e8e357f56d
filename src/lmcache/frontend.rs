//! LMCache request semantics on top of the native core.
//!
//! Every LMCache request becomes one or more native requests executed through the same
//! dispatcher as the Unix-socket protocol (same instance ordering, limits and liveness). State
//! that LMCache keeps per key or per request id lives here, each part bounded in bytes:
//! rolling-hash caches per request id (`bounded`, lost = recomputed), the transfers handed to
//! workers and not yet committed (`pending`, a FIFO per key per registration, never evicted),
//! and prefetch results (LOOKUP answers that QUERY_PREFETCH_STATUS hands out exactly once).
//! What the frontend keeps for an instance is dropped when the node releases it (UNREGISTER,
//! reaping, re-registration).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Condvar, Mutex};
use xxhash_rust::xxh3::Xxh3;

use super::bounded::ByteBoundedMap;
use super::pending::{KeyId, Kind, PendingTable};
pub use super::reply::{LmReply, Reply};
use super::wire::{IpcKey, LmRequest, Op, SlotDesc};
use crate::hashing::{chunk_hashes, ChunkHash};
use crate::modules::instances::Instance;
use crate::modules::NodeContext;
use crate::protocol::{
    BlockAllocationRecord, ChunkRange, RegisterRequest, Request, Response, WireLayout, WireSlot,
};
use crate::server::dispatch;
use crate::transport::ReplySink;

/// Connection id the frontend uses for instances it registers (ZMQ hides peer disconnects,
/// so these instances are released by UNREGISTER or by the reaper).
pub const FRONTEND_CONNECTION_ID: u64 = u64::MAX - 1;
/// Bytes of rolling-hash caches kept (beyond: the oldest request ids are forgotten and their
/// hashes recomputed when needed).
pub const MAX_HASH_CACHE_BYTES: usize = 64 << 20;
/// Bytes of pending-transfer bookkeeping (beyond: a new PREPARE is refused, never an older
/// transfer dropped).
pub const MAX_PENDING_BYTES: usize = 32 << 20;
/// A registration's queued transfers may reach this many times `max_pending_transfers`: the
/// node's own limit on open transfers, plus room for entries of transfers the node already
/// expired that wait for their COMMIT to be paired (they must stay queued: dropping one would
/// pair a later COMMIT with a transfer still in flight).
pub const PENDING_PER_REGISTRATION_FACTOR: usize = 2;
/// Bytes of prefetch results kept (beyond: the oldest unqueried results are forgotten; their
/// query answers 0, a miss).
pub const MAX_PREFETCH_BYTES: usize = 8 << 20;

/// Waits for the single response of one native request.
struct WaitSink {
    slot: Mutex<Option<Response>>,
    ready: Condvar,
}

impl ReplySink for WaitSink {
    fn send(
        &self,
        _request_id: u64,
        _opcode: u16,
        resp: &Response,
        _fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) {
        *self.slot.lock() = Some(resp.clone());
        self.ready.notify_one();
    }
    fn connection_id(&self) -> u64 {
        FRONTEND_CONNECTION_ID
    }
    fn can_pass_fd(&self) -> bool {
        false
    }
}

/// The rolling hashes of a request's tokens, with a digest of every chunk-aligned token prefix
/// so a later request under the same id reuses them only for the same tokens.
struct HashEntry {
    hashes: Vec<ChunkHash>,
    /// `digests[i]` = xxh3 of the tokens of chunks `0..=i`.
    digests: Vec<u64>,
}

impl HashEntry {
    fn compute(tokens: &[u32], chunk_tokens: u32) -> HashEntry {
        let hashes = chunk_hashes(tokens, chunk_tokens);
        let mut digests = Vec::with_capacity(hashes.len());
        let mut h = Xxh3::new();
        for chunk in tokens
            .chunks_exact(chunk_tokens as usize)
            .take(hashes.len())
        {
            feed(&mut h, chunk);
            digests.push(h.digest());
        }
        HashEntry { hashes, digests }
    }

    fn bytes(&self) -> usize {
        self.hashes.len() * (32 + 8)
    }
}

fn feed(h: &mut Xxh3, tokens: &[u32]) {
    let mut buf = [0u8; 1024];
    for part in tokens.chunks(buf.len() / 4) {
        for (b, t) in buf.chunks_exact_mut(4).zip(part) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..part.len() * 4]);
    }
}

/// xxh3 of `tokens` as the digests of [`HashEntry`] are computed.
fn prefix_digest(tokens: &[u32]) -> u64 {
    let mut h = Xxh3::new();
    feed(&mut h, tokens);
    h.digest()
}

/// Counters of the frontend's bounded state.
#[derive(Default)]
pub struct FrontendCounters {
    /// PREPAREs refused because the pending bookkeeping was at its byte budget.
    pub pending_refused: AtomicU64,
    /// Cached hash lists that did not match the request's tokens (recomputed).
    pub hash_mismatches: AtomicU64,
}

/// The frontend's state; shared with the release hook the node calls.
struct State {
    hashes: Mutex<ByteBoundedMap<HashEntry>>,
    pending: Mutex<PendingTable>,
    prefetch: Mutex<ByteBoundedMap<u32>>,
    /// Instances (id -> generation) that sent pickled tensors (they could not open the
    /// segment): their retrieves are answered as misses, since they would look for the bytes
    /// inline.
    pickle_instances: Mutex<HashMap<u64, u64>>,
    counters: FrontendCounters,
}

impl State {
    fn forget(&self, inst: &Instance) {
        self.pending.lock().forget(inst.id, Some(inst.generation));
        let mut p = self.pickle_instances.lock();
        if p.get(&inst.id) == Some(&inst.generation) {
            p.remove(&inst.id);
        }
    }
}

/// The LMCache semantics layer. Invariant: every piece of state is bounded in bytes (see the
/// `MAX_*_BYTES` constants), and a transfer handed to a worker is ended only by that worker's
/// COMMIT (paired FIFO per key) or by the node releasing the instance.
pub struct LmFrontend {
    ctx: Arc<NodeContext>,
    state: Arc<State>,
}

impl LmFrontend {
    /// A frontend over a running node's context. It registers a release hook with the node, so
    /// what it keeps for an instance goes when the node releases that instance.
    pub fn new(ctx: Arc<NodeContext>) -> LmFrontend {
        let state = Arc::new(State {
            hashes: Mutex::new(ByteBoundedMap::new(MAX_HASH_CACHE_BYTES)),
            pending: Mutex::new(PendingTable::new(
                MAX_PENDING_BYTES,
                PENDING_PER_REGISTRATION_FACTOR * ctx.config.limits.max_pending_transfers,
            )),
            prefetch: Mutex::new(ByteBoundedMap::new(MAX_PREFETCH_BYTES)),
            pickle_instances: Mutex::default(),
            counters: FrontendCounters::default(),
        });
        let weak: Weak<State> = Arc::downgrade(&state);
        ctx.on_release(Box::new(move |inst| {
            if let Some(s) = weak.upgrade() {
                s.forget(inst);
            }
        }));
        LmFrontend { ctx, state }
    }

    /// Counters of the bounded state.
    pub fn counters(&self) -> &FrontendCounters {
        &self.state.counters
    }

    /// Transfers handed to workers and not yet paired with a COMMIT.
    pub fn pending_transfers(&self) -> usize {
        self.state.pending.lock().len()
    }

    /// The native transfer ids queued for `instance`, waiting for their COMMIT (the simulator
    /// checks them against the node's).
    pub fn queued_transfer_ids(&self, instance: u64) -> Vec<u64> {
        self.state.pending.lock().ids(instance)
    }

    /// Runs one native request through the dispatcher and waits for its response. Never called
    /// with a frontend lock held (a release inside it runs the release hook, which takes them).
    fn call(&self, req: Request) -> Response {
        let sink = Arc::new(WaitSink {
            slot: Mutex::new(None),
            ready: Condvar::new(),
        });
        let dyn_sink: Arc<dyn ReplySink> = sink.clone();
        dispatch::dispatch(
            &self.ctx,
            &dyn_sink,
            0,
            req,
            &mut dispatch::Registered::default(),
        );
        let mut slot = sink.slot.lock();
        while slot.is_none() {
            sink.ready.wait(&mut slot);
        }
        slot.take().expect("checked")
    }

    fn chunk(&self) -> u64 {
        u64::from(self.ctx.config.chunk_tokens)
    }

    /// Rolling hashes of the chunks `[start/C, end/C)` of `key`, reusing the request's cached
    /// hashes only when they were computed from the same tokens; `Err` if the range is not
    /// chunk-aligned or runs past the tokens.
    fn range_hashes(&self, key: &IpcKey) -> Result<(u32, Vec<ChunkHash>), String> {
        let c = self.chunk();
        if !key.start.is_multiple_of(c) || !key.end.is_multiple_of(c) || key.start > key.end {
            return Err(format!(
                "range [{}, {}) is not aligned to {c}-token chunks",
                key.start, key.end
            ));
        }
        let (first, last) = ((key.start / c) as usize, (key.end / c) as usize);
        if (key.token_ids.len() as u64) < key.end {
            return Err(format!(
                "range end {} beyond {} tokens",
                key.end,
                key.token_ids.len()
            ));
        }
        if last == 0 {
            return Ok((first as u32, Vec::new()));
        }
        {
            let cache = self.state.hashes.lock();
            if let Some(e) = cache.get(&key.request_id) {
                if e.hashes.len() >= last {
                    if e.digests[last - 1] == prefix_digest(&key.token_ids[..last * c as usize]) {
                        return Ok((first as u32, e.hashes[first..last].to_vec()));
                    }
                    self.state
                        .counters
                        .hash_mismatches
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let entry = HashEntry::compute(&key.token_ids, self.ctx.config.chunk_tokens);
        let out = entry.hashes[first..last.min(entry.hashes.len())].to_vec();
        if !key.request_id.is_empty() {
            let bytes = entry.bytes();
            self.state
                .hashes
                .lock()
                .insert(key.request_id.clone(), entry, bytes);
        }
        Ok((first as u32, out))
    }

    fn key_id(key: &IpcKey, hashes: &[ChunkHash]) -> KeyId {
        KeyId {
            model: key.model_name.clone(),
            world_size: key.world_size,
            worker: key.worker_id,
            salt: key.cache_salt.clone(),
            start: key.start,
            end: key.end,
            last_hash: hashes.last().copied(),
        }
    }

    fn worker_range(key: &IpcKey, first: u32, hashes: Vec<ChunkHash>) -> ChunkRange {
        ChunkRange {
            model: key.model_name.clone(),
            world_size: key.world_size,
            worker_id: Some(key.worker_id.unwrap_or(0)),
            cache_salt: key.cache_salt.clone(),
            first_chunk: first,
            chunk_hashes: hashes,
        }
    }

    fn slots(slots: &[WireSlot], layout: &WireLayout) -> Vec<SlotDesc> {
        slots
            .iter()
            .map(|s| SlotDesc {
                offset: s.offset,
                length: s.length,
                shape: layout.shape.clone(),
                dtype: layout.dtype.clone(),
            })
            .collect()
    }

    /// The answer for `op` that needs no state: the full answer for the trivial operations
    /// (chunk size, NOOP, GET_EXPERIMENTAL), otherwise the well-typed negative answer (empty
    /// slots, a miss, `false`, `0`) used when a request fails or is not served: never silence.
    pub fn stateless_reply(&self, op: Op) -> Reply {
        self.stateless(op).encode()
    }

    fn stateless(&self, op: Op) -> LmReply {
        match op {
            Op::GetChunkSize => LmReply::Uint(self.chunk()),
            Op::GetExperimental => LmReply::StrList(Vec::new()),
            Op::Noop => LmReply::Str("OK".into()),
            Op::Ping | Op::CommitRetrieve => LmReply::Bool(true),
            Op::CommitStore => LmReply::Bool(false),
            Op::PrepareStore => LmReply::PrepareStore(Some((Vec::new(), Vec::new()))),
            Op::PrepareRetrieve => LmReply::PrepareRetrieve(None),
            Op::QueryPrefetchStatus | Op::WaitPrefetchStatus | Op::QueryPrefetchLookupHits => {
                LmReply::Uint(0)
            }
            Op::RegisterEngineDriven => LmReply::Register {
                shm_name: String::new(),
                pool_bytes: 0,
            },
            Op::Store | Op::Retrieve => LmReply::BinBool(false),
            _ => LmReply::Nothing,
        }
    }

    /// Executes one decoded request and returns its reply frame.
    pub fn handle(&self, req: LmRequest) -> Reply {
        self.handle_typed(req).encode()
    }

    /// Executes one decoded request and returns its typed reply.
    pub fn handle_typed(&self, req: LmRequest) -> LmReply {
        match req {
            LmRequest::GetChunkSize => LmReply::Uint(self.chunk()),
            LmRequest::GetExperimental => LmReply::StrList(Vec::new()),
            LmRequest::Noop => LmReply::Str("OK".into()),
            LmRequest::Ping { instance_id } => {
                self.call(Request::Ping { instance_id });
                LmReply::Bool(true)
            }
            LmRequest::RegisterEngineDriven(p) => self.register(p),
            LmRequest::UnregisterEngineDriven { instance_id } => {
                // The release hook drops what the frontend kept for the instance.
                self.call(Request::Unregister { instance_id });
                LmReply::Nothing
            }
            LmRequest::PrepareStore { key, instance_id } => self.prepare_store(&key, instance_id),
            LmRequest::CommitStore {
                key,
                instance_id,
                cpu_data,
            } => self.commit_store(&key, instance_id, &cpu_data),
            LmRequest::PrepareRetrieve { key, instance_id } => {
                self.prepare_retrieve(&key, instance_id)
            }
            LmRequest::CommitRetrieve { key, instance_id } => {
                self.commit_retrieve(&key, instance_id);
                LmReply::Bool(true)
            }
            LmRequest::Lookup { key, tp_size } => {
                self.lookup(&key, tp_size);
                LmReply::Nothing
            }
            LmRequest::QueryPrefetchStatus { request_id }
            | LmRequest::WaitPrefetchStatus { request_id, .. } => {
                // Lookups complete synchronously: the job is ready, handed out once.
                let hits = self.state.prefetch.lock().remove(&request_id).unwrap_or(0);
                LmReply::Uint(u64::from(hits))
            }
            LmRequest::QueryPrefetchLookupHits { request_id } => {
                let hits = self
                    .state
                    .prefetch
                    .lock()
                    .get(&request_id)
                    .copied()
                    .unwrap_or(0);
                LmReply::Uint(u64::from(hits))
            }
            LmRequest::FreeLookupLocks { key, .. } => {
                let c = self.chunk();
                // Both ends round down, like LMCache: vLLM frees up to its own block-aligned hit,
                // and the chunk straddling that boundary stays locked for the retrieve.
                let clamp = |v: u64| (v / c).min(u64::from(u32::MAX)) as u32;
                self.call(Request::FreeLookupLocks {
                    request_id: key.request_id.clone(),
                    start_chunk: clamp(key.start),
                    end_chunk: clamp(key.end),
                });
                LmReply::Nothing
            }
            LmRequest::EndSession { request_id } => {
                self.state.hashes.lock().remove(&request_id);
                self.call(Request::EndSession { request_id });
                LmReply::Nothing
            }
            LmRequest::ReportBlockAllocation {
                instance_id,
                model_name,
                records,
            } => {
                let records = records
                    .into_iter()
                    .map(|r| BlockAllocationRecord {
                        req_id: r.req_id,
                        new_block_ids: r.new_block_ids,
                        new_token_ids: r.new_token_ids.into_iter().map(|t| t as u32).collect(),
                    })
                    .collect();
                self.call(Request::ReportBlockAllocation {
                    instance_id,
                    model: model_name,
                    records,
                });
                LmReply::Nothing
            }
            LmRequest::Clear { force } => {
                // kvnode's CLEAR is always safe: in-flight objects are freed when their
                // transfer ends, so `force` changes nothing about memory a client may touch.
                if force == Some(false) {
                    tracing::debug!(
                        "CLEAR without force: in-flight objects are deferred, as always"
                    );
                }
                self.call(Request::Clear);
                LmReply::Nothing
            }
            LmRequest::Unsupported { op, name } => {
                tracing::warn!(
                    op = %name,
                    "LMCache request not supported by kvnode (GPU CUDA-IPC, CacheBlend, P2P or Q-cache path); \
                     answering negatively. Use the engine-driven transfer mode \
                     (LMCACHE_MP_TRANSFER_MODE=engine_driven)"
                );
                self.stateless(op)
            }
        }
    }

    fn register(&self, p: super::wire::RegisterPayload) -> LmReply {
        let resp = self.call(Request::Register(RegisterRequest {
            instance_id: p.instance_id,
            model: p.model_name,
            world_size: p.world_size,
            block_size: p.block_size,
            num_layers: p.num_layers,
            hidden_dim: p.hidden_dim_size,
            dtype: p.dtype_str,
            use_mla: p.use_mla,
        }));
        match resp {
            Response::Registered(r) => {
                // A REGISTER is idempotent for the node (LMCache's rule: it refreshes liveness
                // and keeps the registration), but ZMQ hides which process is asking: it may be
                // a restarted worker reusing its id. So COMMITs are never paired with transfers
                // prepared before it: those stay reserved (a live process may still be copying)
                // until the node's write TTL or the instance's release, and are never published.
                let current = self.ctx.instances.get(p.instance_id);
                let mut pending = self.state.pending.lock();
                // Checked under the lock (as in `queue`): a release after this point runs the
                // hook, which waits for the lock and then drops this epoch. An instance released
                // already needs none (its hook drops what was kept for it).
                if let Some(inst) = current.filter(|i| !i.is_released()) {
                    pending.new_epoch(p.instance_id, inst.generation);
                }
                drop(pending);
                self.state.pickle_instances.lock().remove(&p.instance_id);
                LmReply::Register {
                    shm_name: r.shm_name,
                    pool_bytes: r.pool_bytes,
                }
            }
            other => {
                tracing::warn!(instance = p.instance_id, response = ?other, "LMCache registration refused");
                self.stateless(Op::RegisterEngineDriven)
            }
        }
    }

    /// Queues native transfer `transfer_id`, prepared for `instance_id` while `before` was its
    /// registration, under `key`. `false` when it cannot be handed to the worker: the
    /// registration changed or was released meanwhile (the node already took the transfer back),
    /// or the bookkeeping is at its byte budget (the caller ends the transfer).
    fn queue(
        &self,
        before: &Arc<Instance>,
        epoch: u64,
        kind: Kind,
        key: KeyId,
        transfer_id: u64,
    ) -> bool {
        let current = self.ctx.instances.get(before.id);
        if !current.is_some_and(|c| Arc::ptr_eq(&c, before)) {
            return false;
        }
        let mut pending = self.state.pending.lock();
        // Checked under the lock: a release after this point runs the hook, which waits for
        // the lock and then drops this entry.
        if before.is_released() {
            return false;
        }
        match pending.push(before.id, before.generation, epoch, kind, key, transfer_id) {
            Ok(()) => true,
            Err(super::pending::PendingFull::StaleEpoch) => {
                tracing::info!(
                    instance = before.id,
                    "a PREPARE that began before a new REGISTER of its instance is refused"
                );
                false
            }
            Err(super::pending::PendingFull::Budget) => {
                self.state
                    .counters
                    .pending_refused
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    instance = before.id,
                    budget = MAX_PENDING_BYTES,
                    "LMCache pending-transfer bookkeeping at its budget (bytes node-wide, or this \
                     worker's share): PREPARE refused"
                );
                false
            }
        }
    }

    fn prepare_store(&self, key: &IpcKey, instance_id: u64) -> LmReply {
        let (first, hashes) = match self.range_hashes(key) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(instance = instance_id, error = %e, "PREPARE_STORE refused");
                return self.stateless(Op::PrepareStore);
            }
        };
        if hashes.is_empty() {
            return LmReply::PrepareStore(Some((Vec::new(), Vec::new())));
        }
        let Some(inst) = self.ctx.instances.get(instance_id) else {
            tracing::warn!(
                instance = instance_id,
                "PREPARE_STORE for an unregistered instance"
            );
            return self.stateless(Op::PrepareStore);
        };
        let id = Self::key_id(key, &hashes);
        let range = Self::worker_range(key, first, hashes);
        let epoch = self.state.pending.lock().epoch(instance_id);
        match self.call(Request::PrepareStore { instance_id, range }) {
            Response::StorePrepared {
                transfer_id,
                slots,
                chunk_indices,
                layout,
            } => {
                if transfer_id != 0 && !self.queue(&inst, epoch, Kind::Store, id, transfer_id) {
                    self.call(Request::AbortStore {
                        instance_id,
                        transfer_id,
                    });
                    return self.stateless(Op::PrepareStore);
                }
                let descs = Self::slots(&slots, &layout);
                LmReply::PrepareStore(Some((descs, chunk_indices)))
            }
            other => {
                tracing::warn!(instance = instance_id, response = ?other, "PREPARE_STORE failed");
                self.stateless(Op::PrepareStore)
            }
        }
    }

    /// The oldest transfer of `kind` the current registration of `instance_id` holds for `key`.
    fn take(&self, key: &IpcKey, instance_id: u64, kind: Kind) -> Option<u64> {
        let (_, hashes) = self.range_hashes(key).ok()?;
        let inst = self.ctx.instances.get(instance_id)?;
        self.state.pending.lock().pop(
            instance_id,
            inst.generation,
            kind,
            &Self::key_id(key, &hashes),
        )
    }

    fn commit_store(&self, key: &IpcKey, instance_id: u64, cpu_data: &[u8]) -> LmReply {
        let pending = self.take(key, instance_id, Kind::Store);
        if !cpu_data.is_empty() {
            tracing::warn!(
                instance = instance_id,
                bytes = cpu_data.len(),
                "COMMIT_STORE with inline (pickle) data: kvnode serves the shared-memory path only; \
                 the client could not open the pool segment. Answering false."
            );
            if let Some(t) = pending {
                self.call(Request::AbortStore {
                    instance_id,
                    transfer_id: t,
                });
            }
            if let Some(inst) = self.ctx.instances.get(instance_id) {
                let mut pickle = self.state.pickle_instances.lock();
                // Checked under the lock the release hook takes (as in `queue`).
                if !inst.is_released() {
                    pickle.insert(instance_id, inst.generation);
                }
            }
            return LmReply::Bool(false);
        }
        let Some(transfer_id) = pending else {
            return LmReply::Bool(false);
        };
        let ok = matches!(
            self.call(Request::CommitStore {
                instance_id,
                transfer_id
            }),
            Response::StoreCommitted { .. }
        );
        LmReply::Bool(ok)
    }

    fn prepare_retrieve(&self, key: &IpcKey, instance_id: u64) -> LmReply {
        let (first, hashes) = match self.range_hashes(key) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(instance = instance_id, error = %e, "PREPARE_RETRIEVE refused");
                return self.stateless(Op::PrepareRetrieve);
            }
        };
        let generation = self.ctx.instances.get(instance_id).map(|i| i.generation);
        if generation.is_some()
            && self
                .state
                .pickle_instances
                .lock()
                .get(&instance_id)
                .copied()
                == generation
        {
            tracing::warn!(
                instance = instance_id,
                "PREPARE_RETRIEVE from a pickle-mode client: answering a miss (shared memory only)"
            );
            return LmReply::PrepareRetrieve(None);
        }
        if hashes.is_empty() {
            return LmReply::PrepareRetrieve(Some(Vec::new()));
        }
        let Some(inst) = self.ctx.instances.get(instance_id) else {
            tracing::warn!(
                instance = instance_id,
                "PREPARE_RETRIEVE for an unregistered instance"
            );
            return self.stateless(Op::PrepareRetrieve);
        };
        let id = Self::key_id(key, &hashes);
        let range = Self::worker_range(key, first, hashes);
        let epoch = self.state.pending.lock().epoch(instance_id);
        match self.call(Request::PrepareRetrieve {
            instance_id,
            range,
            lookup_session: Some(key.request_id.clone()),
        }) {
            Response::RetrievePrepared {
                hit: true,
                transfer_id,
                slots,
                layout,
            } => {
                if !self.queue(&inst, epoch, Kind::Retrieve, id, transfer_id) {
                    self.call(Request::CommitRetrieve {
                        instance_id,
                        transfer_id,
                    });
                    return LmReply::PrepareRetrieve(None);
                }
                let descs = Self::slots(&slots, &layout);
                LmReply::PrepareRetrieve(Some(descs))
            }
            Response::RetrievePrepared { hit: false, .. } => LmReply::PrepareRetrieve(None),
            other => {
                tracing::warn!(instance = instance_id, response = ?other, "PREPARE_RETRIEVE failed");
                self.stateless(Op::PrepareRetrieve)
            }
        }
    }

    fn commit_retrieve(&self, key: &IpcKey, instance_id: u64) {
        if let Some(transfer_id) = self.take(key, instance_id, Kind::Retrieve) {
            self.call(Request::CommitRetrieve {
                instance_id,
                transfer_id,
            });
        }
    }

    fn lookup(&self, key: &IpcKey, tp_size: u32) {
        // LMCache answers 0 when no worker of this (model, world size) registered a layout.
        let hits = if self
            .ctx
            .layouts
            .get(&key.model_name, key.world_size)
            .is_none()
        {
            // Like any LOOKUP, it replaces the session of its request id: release that one's
            // locks now rather than at its idle expiry.
            self.call(Request::EndSession {
                request_id: key.request_id.clone(),
            });
            0
        } else {
            let entry = HashEntry::compute(&key.token_ids, self.ctx.config.chunk_tokens);
            let hashes = entry.hashes.clone();
            if hashes.is_empty() {
                0
            } else {
                let bytes = entry.bytes();
                self.state
                    .hashes
                    .lock()
                    .insert(key.request_id.clone(), entry, bytes);
                let range = ChunkRange {
                    model: key.model_name.clone(),
                    world_size: key.world_size,
                    worker_id: None,
                    cache_salt: key.cache_salt.clone(),
                    first_chunk: 0,
                    chunk_hashes: hashes,
                };
                match self.call(Request::Lookup {
                    request_id: key.request_id.clone(),
                    range,
                    tp_size,
                }) {
                    Response::LookupHits { chunks } => chunks,
                    other => {
                        tracing::warn!(response = ?other, "LOOKUP failed");
                        0
                    }
                }
            }
        };
        self.state
            .prefetch
            .lock()
            .insert(key.request_id.clone(), hits, 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_hashes_are_reused_only_for_the_same_tokens() {
        let c = 4u32;
        let a: Vec<u32> = (0..16).collect();
        let e = HashEntry::compute(&a, c);
        assert_eq!(e.hashes.len(), 4);
        assert_eq!(e.digests[1], prefix_digest(&a[..8]));
        let mut b = a.clone();
        b[5] = 999;
        assert_ne!(
            e.digests[1],
            prefix_digest(&b[..8]),
            "other tokens, other digest"
        );
        assert_eq!(
            e.digests[0],
            prefix_digest(&b[..4]),
            "the common prefix still matches"
        );
    }
}
