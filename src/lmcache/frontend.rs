//! LMCache request semantics on top of the native core.
//!
//! Every LMCache request becomes one or more native requests executed through the same
//! dispatcher as the Unix-socket protocol (same instance ordering, limits and liveness). State
//! that LMCache keeps per key or per request id lives here: rolling-hash sessions, pending store
//! and retrieve transfers keyed by `(instance, key)`, and prefetch jobs (LOOKUP results that
//! QUERY_PREFETCH_STATUS hands out exactly once).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::wire::{self, IpcKey, LmRequest, Op, SlotDesc};
use crate::hashing::{chunk_hashes, ChunkHash};
use crate::modules::NodeContext;
use crate::protocol::{
    BlockAllocationRecord, ChunkRange, RegisterRequest, Request, Response, WireLayout, WireSlot,
};
use crate::server::dispatch;
use crate::transport::ReplySink;

/// Connection id the frontend uses for instances it registers (ZMQ hides peer disconnects,
/// so these instances are released by UNREGISTER or by the reaper).
pub const FRONTEND_CONNECTION_ID: u64 = u64::MAX - 1;
/// Most rolling-hash sessions, prefetch jobs and pending transfers kept (each map).
pub const MAX_FRONTEND_ENTRIES: usize = 65_536;

/// Identity of an LMCache key for the pending maps (LMCache compares all fields but
/// `request_id`; the last chunk hash stands for the token prefix).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct KeyId {
    instance: u64,
    model: String,
    world_size: u32,
    worker: Option<u32>,
    salt: String,
    start: u64,
    end: u64,
    last_hash: Option<ChunkHash>,
}

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

/// Outcome of one LMCache request: the reply payload frame, or `None` for "no frame" (LMCache's
/// reply to handlers that return None).
pub type Reply = Option<Vec<u8>>;

/// The typed answer to one LMCache request, before encoding (what the simulator reads).
/// Invariant: [`LmReply::encode`] gives the exact frame LMCache's own server sends for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LmReply {
    /// No reply frame (handlers that return None in LMCache).
    Nothing,
    /// An unsigned integer.
    Uint(u64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// A list of strings.
    StrList(Vec<String>),
    /// PREPARE_STORE: slots and the chunk indices they are for (`None`: pickle mode).
    PrepareStore(Option<(Vec<SlotDesc>, Vec<u32>)>),
    /// PREPARE_RETRIEVE: the slots of a hit, `None` for a miss.
    PrepareRetrieve(Option<Vec<SlotDesc>>),
    /// REGISTER: the segment name and pool size.
    Register {
        /// POSIX shm segment name.
        shm_name: String,
        /// Pool bytes.
        pool_bytes: u64,
    },
    /// The GPU-path STORE/RETRIEVE negative answer.
    BinBool(bool),
}

impl LmReply {
    /// The reply frame.
    pub fn encode(&self) -> Reply {
        Some(match self {
            LmReply::Nothing => return None,
            LmReply::Uint(v) => wire::encode_uint(*v),
            LmReply::Bool(v) => wire::encode_bool(*v),
            LmReply::Str(v) => wire::encode_str(v),
            LmReply::StrList(v) => {
                let items: Vec<&str> = v.iter().map(String::as_str).collect();
                wire::encode_str_list(&items)
            }
            LmReply::PrepareStore(None) => wire::encode_prepare_store_reply(None),
            LmReply::PrepareStore(Some((d, c))) => wire::encode_prepare_store_reply(Some((d, c))),
            LmReply::PrepareRetrieve(v) => wire::encode_prepare_retrieve_reply(v.as_deref()),
            LmReply::Register {
                shm_name,
                pool_bytes,
            } => wire::encode_register_reply(shm_name, *pool_bytes),
            LmReply::BinBool(ok) => wire::encode_bin_bool(&[0u8; 64], *ok),
        })
    }
}

/// The LMCache semantics layer. Invariant: every map is bounded by [`MAX_FRONTEND_ENTRIES`].
pub struct LmFrontend {
    ctx: Arc<NodeContext>,
    hashes: Mutex<HashMap<String, Vec<ChunkHash>>>,
    pending_writes: Mutex<HashMap<KeyId, u64>>,
    pending_reads: Mutex<HashMap<KeyId, u64>>,
    prefetch: Mutex<HashMap<String, u32>>,
    /// Instances that sent pickled tensors (they could not open the segment): their retrieves
    /// are answered as misses, since they would look for the bytes inline.
    pickle_instances: Mutex<HashMap<u64, ()>>,
}

fn bounded_insert<K: std::hash::Hash + Eq + Clone, V>(
    m: &mut HashMap<K, V>,
    k: K,
    v: V,
) -> Option<V> {
    if m.len() >= MAX_FRONTEND_ENTRIES && !m.contains_key(&k) {
        // Forget an arbitrary entry rather than grow without bound (a client that never ends
        // its sessions); any locks it stood for are covered by the node's TTL safety nets.
        if let Some(victim) = m.keys().next().cloned() {
            m.remove(&victim);
        }
    }
    m.insert(k, v)
}

impl LmFrontend {
    /// A frontend over a running node's context.
    pub fn new(ctx: Arc<NodeContext>) -> LmFrontend {
        LmFrontend {
            ctx,
            hashes: Mutex::default(),
            pending_writes: Mutex::default(),
            pending_reads: Mutex::default(),
            prefetch: Mutex::default(),
            pickle_instances: Mutex::default(),
        }
    }

    /// Runs one native request through the dispatcher and waits for its response.
    fn call(&self, req: Request) -> Response {
        let sink = Arc::new(WaitSink {
            slot: Mutex::new(None),
            ready: Condvar::new(),
        });
        let dyn_sink: Arc<dyn ReplySink> = sink.clone();
        dispatch::dispatch(&self.ctx, &dyn_sink, 0, req, &mut Vec::new());
        let mut slot = sink.slot.lock();
        while slot.is_none() {
            sink.ready.wait(&mut slot);
        }
        slot.take().expect("checked")
    }

    fn chunk(&self) -> u64 {
        u64::from(self.ctx.config.chunk_tokens)
    }

    /// Rolling hashes of the chunks `[start/C, end/C)` of `key`, using (and extending) the
    /// request's cached hashes like LMCache's sessions; `Err` if the range is not chunk-aligned.
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
        let mut cache = self.hashes.lock();
        if let Some(h) = cache.get(&key.request_id) {
            if h.len() >= last {
                return Ok((first as u32, h[first..last].to_vec()));
            }
        }
        let all = chunk_hashes(&key.token_ids, self.ctx.config.chunk_tokens);
        let out = all[first..last.min(all.len())].to_vec();
        if !key.request_id.is_empty() {
            bounded_insert(&mut cache, key.request_id.clone(), all);
        }
        Ok((first as u32, out))
    }

    fn key_id(key: &IpcKey, instance: u64, hashes: &[ChunkHash]) -> KeyId {
        KeyId {
            instance,
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
                self.forget_instance(instance_id);
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
                if let Ok((_, hashes)) = self.range_hashes(&key) {
                    let id = Self::key_id(&key, instance_id, &hashes);
                    if let Some(t) = self.pending_reads.lock().remove(&id) {
                        self.call(Request::CommitRetrieve {
                            instance_id,
                            transfer_id: t,
                        });
                    }
                }
                LmReply::Bool(true)
            }
            LmRequest::Lookup { key, tp_size } => {
                self.lookup(&key, tp_size);
                LmReply::Nothing
            }
            LmRequest::QueryPrefetchStatus { request_id }
            | LmRequest::WaitPrefetchStatus { request_id, .. } => {
                // Lookups complete synchronously (no L2 yet): the job is ready, handed out once.
                let hits = self.prefetch.lock().remove(&request_id).unwrap_or(0);
                LmReply::Uint(u64::from(hits))
            }
            LmRequest::QueryPrefetchLookupHits { request_id } => {
                let hits = self.prefetch.lock().get(&request_id).copied().unwrap_or(0);
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
                self.hashes.lock().remove(&request_id);
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

    fn register(&self, p: wire::RegisterPayload) -> LmReply {
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
            Response::Registered(r) => LmReply::Register {
                shm_name: r.shm_name,
                pool_bytes: r.pool_bytes,
            },
            other => {
                tracing::warn!(instance = p.instance_id, response = ?other, "LMCache registration refused");
                self.stateless(Op::RegisterEngineDriven)
            }
        }
    }

    fn forget_instance(&self, instance: u64) {
        self.pickle_instances.lock().remove(&instance);
        self.pending_writes
            .lock()
            .retain(|k, _| k.instance != instance);
        self.pending_reads
            .lock()
            .retain(|k, _| k.instance != instance);
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
        let id = Self::key_id(key, instance_id, &hashes);
        let range = Self::worker_range(key, first, hashes);
        match self.call(Request::PrepareStore { instance_id, range }) {
            Response::StorePrepared {
                transfer_id,
                slots,
                chunk_indices,
                layout,
            } => {
                if transfer_id != 0 {
                    // A repeated prepare of the same key replaces the older reservation, which
                    // is freed (LMCache overwrote and leaked it: W7).
                    if let Some(old) =
                        bounded_insert(&mut self.pending_writes.lock(), id, transfer_id)
                    {
                        self.call(Request::AbortStore {
                            instance_id,
                            transfer_id: old,
                        });
                    }
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

    fn commit_store(&self, key: &IpcKey, instance_id: u64, cpu_data: &[u8]) -> LmReply {
        let Ok((_, hashes)) = self.range_hashes(key) else {
            return LmReply::Bool(false);
        };
        let pending = self
            .pending_writes
            .lock()
            .remove(&Self::key_id(key, instance_id, &hashes));
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
            bounded_insert(&mut self.pickle_instances.lock(), instance_id, ());
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
        if self.pickle_instances.lock().contains_key(&instance_id) {
            tracing::warn!(
                instance = instance_id,
                "PREPARE_RETRIEVE from a pickle-mode client: answering a miss (shared memory only)"
            );
            return LmReply::PrepareRetrieve(None);
        }
        if hashes.is_empty() {
            return LmReply::PrepareRetrieve(Some(Vec::new()));
        }
        let id = Self::key_id(key, instance_id, &hashes);
        let range = Self::worker_range(key, first, hashes);
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
                let replaced = bounded_insert(&mut self.pending_reads.lock(), id, transfer_id);
                if let Some(old) = replaced {
                    self.call(Request::CommitRetrieve {
                        instance_id,
                        transfer_id: old,
                    });
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

    fn lookup(&self, key: &IpcKey, tp_size: u32) {
        // LMCache answers 0 when no worker of this (model, world size) registered a layout.
        let hits = if self
            .ctx
            .layouts
            .get(&key.model_name, key.world_size)
            .is_none()
        {
            0
        } else {
            let hashes = chunk_hashes(&key.token_ids, self.ctx.config.chunk_tokens);
            if hashes.is_empty() {
                0
            } else {
                bounded_insert(
                    &mut self.hashes.lock(),
                    key.request_id.clone(),
                    hashes.clone(),
                );
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
        bounded_insert(&mut self.prefetch.lock(), key.request_id.clone(), hits);
    }
}
