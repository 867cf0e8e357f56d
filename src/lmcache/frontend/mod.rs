//! LMCache request semantics on top of the native core.
//!
//! Every LMCache request becomes one or more native requests executed through the same
//! dispatcher as the Unix-socket protocol (same instance ordering, limits and liveness). State
//! that LMCache keeps per key or per request id lives here, per client connection
//! ([`ClientId`]) and bounded in bytes (see [`LmLimits`]): rolling-hash caches per request id
//! (`hashes`, lost = recomputed), the transfers handed to workers and not yet committed
//! (`pending`, a FIFO per key per registration, never evicted), prefetch results (LOOKUP answers
//! that QUERY_PREFETCH_STATUS hands out exactly once) and the lookup sessions each client opened
//! (`lookup`). What the frontend keeps for an instance is dropped when the node releases it
//! (UNREGISTER, reaping, re-registration).
//!
//! Ownership (issue 11): the connection that registers an instance owns it. Only the owner may
//! prepare, commit, ping or unregister it; another connection of the same user may take it over
//! by registering it again (a restarted engine process), which starts a new pairing epoch, so
//! no commit of the new owner is ever paired with a transfer of the old one. Prefetch results,
//! hash caches and lookup sessions are kept per (connection, request id): another connection
//! cannot consume, replace, free or end them. The one legitimate crossing is vLLM's: the worker
//! (its own connection) retrieves what the scheduler (another connection) looked up, taking over
//! the session's read locks; it may do so only for a session of a connection of the same user,
//! and only for the very objects its own tokens hash to (the node adopts a lock only on an
//! identical key).
//!
//! This file holds the frontend's state, request dispatch and the stateless, REGISTER, PING and
//! UNREGISTER answers; `hashes` the rolling-hash cache, `transfer` the store and retrieve
//! requests, `lookup` LOOKUP and the session requests, `limits` the budgets, `client` the
//! client identity.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Condvar, Mutex};

use super::bounded::{Budget, ClientMap};
use super::pending::PendingTable;
pub use super::reply::{LmReply, Reply};
use super::wire::{LmRequest, Op};
use crate::modules::instances::Instance;
use crate::modules::NodeContext;
use crate::protocol::{BlockAllocationRecord, Request, Response};
use crate::server::dispatch;
use crate::transport::ReplySink;

mod client;
mod disconnect;
mod hashes;
mod limits;
mod lookup;
mod lost;
mod owners;
mod transfer;

pub use self::client::ClientId;
pub use self::disconnect::{
    ConnectionEvent, DisconnectCounters, DisconnectSweeper, CLOSED_MEMORY_MS,
    EXPIRY_CHECKS_PER_SWEEP, MAX_CLOSED_CONNECTIONS, MAX_OPEN_CONNECTIONS, MAX_UNTRACKED_BYTES,
    OPEN_IDLE_EXPIRY_MS, SWEEP_INTERVAL_MS, UNPROVEN_GRACE_CAP_MS, UNTRACKED_ENTRY_OVERHEAD,
};
pub use self::limits::*;

use self::hashes::{DigestKey, HashEntry};
use self::lookup::LookupSessions;
pub use self::owners::LogLimit;
use self::owners::Owner;

/// Connection id the frontend uses for instances it registers (ZMQ hides peer disconnects from
/// the native core: these instances are released by UNREGISTER, by the reaper, or by the
/// frontend when the ROUTER reports their client's connection closed, see `disconnect`).
pub const FRONTEND_CONNECTION_ID: u64 = u64::MAX - 1;
/// Bytes of pending-transfer bookkeeping (beyond: a new PREPARE is refused, never an older
/// transfer dropped).
pub const MAX_PENDING_BYTES: usize = 32 << 20;
/// A registration's queued transfers may reach this many times `max_pending_transfers`: the
/// node's own limit on open transfers, plus room for entries of transfers the node already
/// expired that wait for their COMMIT to be paired (they must stay queued: dropping one would
/// pair a later COMMIT with a transfer still in flight).
pub const PENDING_PER_REGISTRATION_FACTOR: usize = 2;
/// Refusals of one kind logged per second at most (the rest are counted, and the count is
/// logged with the next line).
pub const REFUSAL_LOGS_PER_SEC: u64 = 10;

/// Waits for the single response of one native request.
struct WaitSink {
    slot: Mutex<Option<Response>>,
    ready: Condvar,
    /// The LMCache client's uid this request acts for (`None`: unidentified, e.g. remote).
    acting_uid: Option<u32>,
}

thread_local! {
    /// The uid of the LMCache client whose request this handler thread is running (set by
    /// [`LmFrontend::handle_typed`] for its duration): native requests made for it count
    /// against that user's instance and reservation quotas and its session name space.
    static ACTING_UID: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// Restores the previous acting uid when a request ends (also on unwind).
struct ActingAs(Option<u32>);

impl ActingAs {
    fn set(uid: Option<u32>) -> ActingAs {
        ActingAs(ACTING_UID.with(|c| c.replace(uid)))
    }
}

impl Drop for ActingAs {
    fn drop(&mut self) {
        ACTING_UID.with(|c| c.set(self.0));
    }
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
    /// The frontend acts inside the node (its I/O thread checked the peer before): as the
    /// client's uid when it is known, so the core's per-user quotas and session name spaces
    /// apply to LMCache users too; as the node's own user for unidentified (remote) peers.
    fn peer(&self) -> Option<kvnode_hw::PeerCred> {
        let (uid, gid) = match self.acting_uid {
            Some(u) => (u, u32::MAX),
            None => (kvnode_hw::effective_uid(), kvnode_hw::effective_gid()),
        };
        Some(kvnode_hw::PeerCred {
            pid: Some(std::process::id() as i32),
            uid,
            gid,
        })
    }
}

/// Counters of the frontend's bounded state and refusals.
#[derive(Default)]
pub struct FrontendCounters {
    /// PREPAREs refused because the pending bookkeeping was at its byte budget.
    pub pending_refused: AtomicU64,
    /// Cached hash lists that did not match the request's tokens (recomputed).
    pub hash_mismatches: AtomicU64,
    /// Requests refused because the instance they name is registered by another connection.
    pub not_owner: AtomicU64,
    /// REGISTERs refused because another user's connection owns the instance.
    pub register_refused: AtomicU64,
    /// REGISTERs that took an instance over from another connection of the same user.
    pub takeovers: AtomicU64,
    /// Requests refused for a request id longer than `max_request_id_bytes`.
    pub long_request_ids: AtomicU64,
    /// Lookup sessions ended because their client was over its session budget, or unused
    /// for the state TTL.
    pub sessions_dropped: AtomicU64,
    /// Requests refused because their handler's queue was at a budget (the server counts).
    pub queue_refused: AtomicU64,
    /// Requests refused while decoding for passing `max_tokens_per_request` (the server
    /// counts).
    pub over_limit: AtomicU64,
    /// Bytes of requests waiting for the handler threads now (the server keeps it).
    pub queued_bytes: AtomicUsize,
    /// Requests naming an instance that is not registered (e.g. reaped while its worker lived).
    pub unregistered: AtomicU64,
    /// PINGs answered `false` so that a worker whose instance the node released registers
    /// again (its heartbeat's recovery).
    pub recovery_pings: AtomicU64,
    /// Requests the server's I/O thread ran itself, with no hand-off to a handler thread (the
    /// server counts).
    pub inline_requests: AtomicU64,
}

/// The frontend's state; shared with the release hook the node calls.
struct State {
    limits: LmLimits,
    hashes: Mutex<ClientMap<HashEntry>>,
    digest_key: DigestKey,
    pending: Mutex<PendingTable>,
    prefetch: Mutex<ClientMap<u32>>,
    sessions: Mutex<LookupSessions>,
    /// Instance id -> the connection that registered it.
    owners: Mutex<HashMap<u64, Owner>>,
    /// Serialises REGISTER and UNREGISTER (ownership check, native call, owner update).
    registering: Mutex<()>,
    /// Instances (id -> generation) that sent pickled tensors (they could not open the
    /// segment): their retrieves are answered as misses, since they would look for the bytes
    /// inline.
    pickle_instances: Mutex<HashMap<u64, u64>>,
    /// Instances the node released while an LMCache connection owned them (see `lost`).
    lost: Mutex<lost::LostInstances>,
    counters: FrontendCounters,
    refusal_log: LogLimit,
    /// Connection opens and closes, and the countdowns of instances whose owner's closed.
    disconnects: disconnect::Disconnects,
}

impl State {
    /// The status report's `lmcache` part: budgets, what is held, refusals.
    fn status(&self, unproven_ms: u64) -> serde_json::Value {
        let c = &self.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (pending_bytes, pending_transfers) = {
            let p = self.pending.lock();
            (p.bytes(), p.len())
        };
        serde_json::json!({
            "limits": &self.limits,
            "queued_bytes": c.queued_bytes.load(Ordering::Relaxed),
            "inline_requests": n(&c.inline_requests),
            "hash_cache_bytes": self.hashes.lock().bytes(),
            "prefetch_bytes": self.prefetch.lock().bytes(),
            "session_bytes": self.sessions.lock().bytes(),
            "pending_bytes": pending_bytes,
            "pending_transfers": pending_transfers,
            "owned_instances": self.owners.lock().len(),
            "released_awaiting_ping": self.lost.lock().len(),
            "unregistered_requests": n(&c.unregistered),
            "recovery_pings": n(&c.recovery_pings),
            "refused": {
                "queue_budget": n(&c.queue_refused),
                "max_tokens_per_request": n(&c.over_limit),
                "max_request_id_bytes": n(&c.long_request_ids),
                "not_owner": n(&c.not_owner),
                "register_other_user": n(&c.register_refused),
                "pending_budget": n(&c.pending_refused),
            },
            "takeovers": n(&c.takeovers),
            "sessions_dropped": n(&c.sessions_dropped),
            "hash_mismatches": n(&c.hash_mismatches),
            "disconnect_releases": n(&self.disconnects.counters().releases),
            "disconnect": LmFrontend::disconnect_status(self, unproven_ms),
        })
    }

    fn forget(&self, inst: &Instance) {
        self.pending.lock().forget(inst.id, Some(inst.generation));
        let mut p = self.pickle_instances.lock();
        if p.get(&inst.id) == Some(&inst.generation) {
            p.remove(&inst.id);
        }
        drop(p);
        let mut o = self.owners.lock();
        if o.get(&inst.id)
            .is_some_and(|w| w.generation == inst.generation)
        {
            if let Some(w) = o.remove(&inst.id) {
                // UNREGISTER and REGISTER forget it again (under `registering`, after the call).
                self.lost.lock().insert(inst.id, w.client);
            }
        }
        drop(o);
        // Lock order: pending, owners, countdowns (none of the others is held here).
        self.disconnects.forget_instance(inst.id);
    }
}

/// The LMCache semantics layer. Invariant: every piece of state is bounded in bytes (see
/// [`LmLimits`] and [`MAX_PENDING_BYTES`]), state kept per request id is kept per client
/// connection, and a transfer handed to a worker is ended only by that worker's COMMIT (paired
/// FIFO per key per registration, from the connection owning the instance) or by the node
/// releasing the instance.
pub struct LmFrontend {
    ctx: Arc<NodeContext>,
    state: Arc<State>,
}

impl LmFrontend {
    /// A frontend over a running node's context, with the budgets of its configuration
    /// (`[lmcache]`). It registers a release hook with the node, so what it keeps for an
    /// instance goes when the node releases that instance.
    pub fn new(ctx: Arc<NodeContext>) -> LmFrontend {
        let limits = ctx.config.lmcache.clone();
        LmFrontend::with_limits(ctx, limits)
    }

    /// A frontend over a running node's context with the budgets `limits` (valid: see
    /// [`LmLimits::validate`]) instead of its configuration's.
    pub fn with_limits(ctx: Arc<NodeContext>, limits: LmLimits) -> LmFrontend {
        let ttl_ms = limits.state_ttl_ms();
        let budget = |total, per_client| Budget {
            total,
            per_client,
            ttl_ms,
        };
        let state = Arc::new(State {
            hashes: Mutex::new(ClientMap::new(budget(
                limits.hash_cache_bytes,
                limits.hash_cache_bytes_per_client,
            ))),
            digest_key: DigestKey::random(),
            pending: Mutex::new(PendingTable::new(
                MAX_PENDING_BYTES,
                PENDING_PER_REGISTRATION_FACTOR * ctx.config.limits.max_pending_transfers,
            )),
            prefetch: Mutex::new(ClientMap::new(budget(
                limits.prefetch_bytes,
                limits.prefetch_bytes_per_client,
            ))),
            sessions: Mutex::new(LookupSessions::new(budget(
                limits.session_bytes,
                limits.session_bytes_per_client,
            ))),
            owners: Mutex::default(),
            registering: Mutex::new(()),
            pickle_instances: Mutex::default(),
            lost: Mutex::default(),
            counters: FrontendCounters::default(),
            refusal_log: LogLimit::default(),
            disconnects: disconnect::Disconnects::new(),
            limits,
        });
        let weak: Weak<State> = Arc::downgrade(&state);
        ctx.on_release(Box::new(move |inst| {
            if let Some(s) = weak.upgrade() {
                s.forget(inst);
            }
        }));
        let weak: Weak<State> = Arc::downgrade(&state);
        let f = LmFrontend { ctx, state };
        let unproven_ms = f.unproven_grace_ms();
        f.ctx.add_status_part(
            "lmcache",
            Box::new(move || {
                weak.upgrade()
                    .map_or(serde_json::Value::Null, |s| s.status(unproven_ms))
            }),
        );
        f
    }

    /// Whether lookups and retrieves may wait: for a device (a disk tier) or for the node's
    /// cluster peers (a peer fetch, up to the peer deadline).
    pub fn lookups_may_wait(&self) -> bool {
        self.ctx.l2.is_some() || self.ctx.cluster.get().is_some()
    }

    /// The budgets in force.
    pub fn limits(&self) -> &LmLimits {
        &self.state.limits
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

    /// Estimated bytes of (cached hashes, prefetch results, session bookkeeping) held.
    pub fn state_bytes(&self) -> (usize, usize, usize) {
        (
            self.state.hashes.lock().bytes(),
            self.state.prefetch.lock().bytes(),
            self.state.sessions.lock().bytes(),
        )
    }

    /// Runs one native request through the dispatcher and waits for its response. Never called
    /// with a frontend lock held (a release inside it runs the release hook, which takes them),
    /// except `registering`, which the hook does not take.
    fn call(&self, req: Request) -> Response {
        let sink = Arc::new(WaitSink {
            slot: Mutex::new(None),
            ready: Condvar::new(),
            acting_uid: ACTING_UID.with(|c| c.get()),
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
            // No slots list: the client's "could not reserve" (it then commits nothing the node
            // keeps). An empty list would mean "already cached": the store would be skipped.
            Op::PrepareStore => LmReply::PrepareStore(None),
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

    /// Executes one decoded request of `client` and returns its reply frame.
    pub fn handle(&self, client: &ClientId, req: LmRequest) -> Reply {
        self.handle_typed(client, req).encode()
    }

    /// The request id `req` carries, if any, with its op.
    fn request_id(req: &LmRequest) -> Option<(Op, &str)> {
        Some(match req {
            LmRequest::PrepareStore { key, .. } => (Op::PrepareStore, &key.request_id),
            LmRequest::CommitStore { key, .. } => (Op::CommitStore, &key.request_id),
            LmRequest::PrepareRetrieve { key, .. } => (Op::PrepareRetrieve, &key.request_id),
            LmRequest::CommitRetrieve { key, .. } => (Op::CommitRetrieve, &key.request_id),
            LmRequest::Lookup { key, .. } => (Op::Lookup, &key.request_id),
            LmRequest::FreeLookupLocks { key, .. } => (Op::FreeLookupLocks, &key.request_id),
            LmRequest::QueryPrefetchStatus { request_id } => (Op::QueryPrefetchStatus, request_id),
            LmRequest::WaitPrefetchStatus { request_id, .. } => {
                (Op::WaitPrefetchStatus, request_id)
            }
            LmRequest::QueryPrefetchLookupHits { request_id } => {
                (Op::QueryPrefetchLookupHits, request_id)
            }
            LmRequest::EndSession { request_id } => (Op::EndSession, request_id),
            _ => return None,
        })
    }

    /// Executes one decoded request of `client` and returns its typed reply.
    pub fn handle_typed(&self, client: &ClientId, req: LmRequest) -> LmReply {
        let reply = self.execute(client, req);
        self.after_request(client);
        reply
    }

    fn execute(&self, client: &ClientId, req: LmRequest) -> LmReply {
        let _acting = ActingAs::set(client.uid());
        if let Some((op, id)) = Self::request_id(&req) {
            let max = self.state.limits.max_request_id_bytes;
            if id.len() > max {
                self.state
                    .counters
                    .long_request_ids
                    .fetch_add(1, Ordering::Relaxed);
                self.refused(
                    client,
                    &format!("{op:?}"),
                    format_args!(
                        "request id of {} bytes exceeds lmcache.max_request_id_bytes = {max}",
                        id.len()
                    ),
                );
                return self.stateless(op);
            }
        }
        match req {
            LmRequest::GetChunkSize => LmReply::Uint(self.chunk()),
            LmRequest::GetExperimental => LmReply::StrList(Vec::new()),
            LmRequest::Noop => LmReply::Str("OK".into()),
            LmRequest::Ping { instance_id } => LmReply::Bool(self.ping(client, instance_id)),
            LmRequest::RegisterEngineDriven(p) => self.register(client, p),
            LmRequest::UnregisterEngineDriven { instance_id } => {
                self.unregister(client, instance_id);
                LmReply::Nothing
            }
            LmRequest::PrepareStore { key, instance_id } => {
                self.prepare_store(client, &key, instance_id)
            }
            LmRequest::CommitStore {
                key,
                instance_id,
                cpu_data,
            } => self.commit_store(client, &key, instance_id, &cpu_data),
            LmRequest::PrepareRetrieve { key, instance_id } => {
                self.prepare_retrieve(client, &key, instance_id)
            }
            LmRequest::CommitRetrieve { key, instance_id } => {
                self.commit_retrieve(client, &key, instance_id);
                LmReply::Bool(true)
            }
            LmRequest::Lookup { key, tp_size } => {
                self.lookup(client, &key, tp_size);
                LmReply::Nothing
            }
            LmRequest::QueryPrefetchStatus { request_id }
            | LmRequest::WaitPrefetchStatus { request_id, .. } => {
                // Lookups complete synchronously: the job is ready, handed out once.
                LmReply::Uint(u64::from(self.take_prefetch(client, &request_id)))
            }
            LmRequest::QueryPrefetchLookupHits { request_id } => {
                LmReply::Uint(u64::from(self.peek_prefetch(client, &request_id)))
            }
            LmRequest::FreeLookupLocks { key, .. } => {
                self.free_lookup_locks(client, &key);
                LmReply::Nothing
            }
            LmRequest::EndSession { request_id } => {
                self.end_session(client, &request_id);
                LmReply::Nothing
            }
            LmRequest::ReportBlockAllocation {
                instance_id,
                model_name,
                records,
            } => {
                // A report refreshes the instance's liveness: only its owner may send one.
                if self
                    .owned(client, instance_id, "REPORT_BLOCK_ALLOCATION")
                    .is_none()
                {
                    return LmReply::Nothing;
                }
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
}
