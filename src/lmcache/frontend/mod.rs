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
//!
//! This file holds the frontend's state and request dispatch (with the stateless, REGISTER and
//! LOOKUP answers); `hashes` the rolling-hash cache, `transfer` the store and retrieve requests.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Weak};

use parking_lot::{Condvar, Mutex};

use super::bounded::ByteBoundedMap;
use super::pending::PendingTable;
pub use super::reply::{LmReply, Reply};
use super::wire::{IpcKey, LmRequest, Op};
use crate::modules::instances::Instance;
use crate::modules::NodeContext;
use crate::protocol::{BlockAllocationRecord, ChunkRange, RegisterRequest, Request, Response};
use crate::server::dispatch;
use crate::transport::ReplySink;

mod hashes;
mod transfer;

use self::hashes::HashEntry;

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
    /// The frontend acts inside the node (it checks its own peers before it gets here).
    fn peer(&self) -> Option<kvnode_hw::PeerCred> {
        Some(kvnode_hw::PeerCred {
            pid: Some(std::process::id() as i32),
            uid: kvnode_hw::effective_uid(),
            gid: kvnode_hw::effective_gid(),
        })
    }
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
