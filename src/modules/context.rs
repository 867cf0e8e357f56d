//! The node's shared context: everything the transports, shards, reaper and maintenance thread
//! reach through one `Arc`. Also registration and release of instances, which touch several parts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;
use kvnode_hw::SharedPool;
use parking_lot::Mutex;

use super::caller::Caller;
use super::events::{Event, EventBus};
use super::instances::{Instance, InstanceTable, PendingTransfers};
pub use super::layouts::LayoutRegistry;
use super::lookup::SessionTable;
use super::shards::ShardPool;
use crate::clock::Clock;
use crate::config::NodeConfig;
use crate::error::{Error, ErrorKind, Result};
use crate::liveness::Liveness;
use crate::protocol::{RegisterRequest, WireLayout};
use crate::storage::key::{validate_model_name, validate_rank};
use crate::storage::{Dtype, Layout, Namespaces, StorageConfig, StorageCore};

/// Rounds a registration retries when the instance it finds is being released meanwhile.
const MAX_REGISTER_ATTEMPTS: u32 = 16;

/// Most token slots one chunk object may declare at registration (`physical_slots`); the
/// object must also fit the pool.
pub const MAX_PHYSICAL_SLOTS: u32 = 1 << 20;

/// A namespace interned this recently is kept by a reclaim even if nothing uses it yet (the
/// request that interned it is about to store under it).
pub const NAMESPACE_RECLAIM_GRACE_MS: u64 = 2_000;

/// What releasing an instance handed back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Released {
    /// Pending writes deleted and freed.
    pub writes: u32,
    /// Pending reads unlocked.
    pub reads: u32,
}

/// Process-wide counters for the status report.
#[derive(Default)]
pub struct NodeCounters {
    /// Connections currently open.
    pub connections: AtomicUsize,
    /// Requests answered.
    pub requests: AtomicU64,
    /// Error responses sent.
    pub errors: AtomicU64,
    /// Instances reaped by the liveness wheel.
    pub reaped: AtomicU64,
    /// Instances released because their connection closed.
    pub disconnected: AtomicU64,
    /// Read locks retrieves adopted from lookup sessions.
    pub adopted_locks: AtomicU64,
    /// Requests inside `server::dispatch` right now (shutdown waits for them before it drains
    /// the write-behind and releases the L2 engines).
    pub dispatching: AtomicUsize,
    /// Requests, errors and latency per native opcode (index = opcode), for every request the
    /// dispatcher answers (native clients and the LMCache frontend's native calls alike).
    pub ops: crate::op_stats::OpTable<NATIVE_OP_SLOTS>,
}

/// Slots of [`NodeCounters::ops`]: native opcodes are 1..=21 (`Request::opcode`).
pub const NATIVE_OP_SLOTS: usize = 22;

impl NodeCounters {
    /// Counts one answered request of `opcode` (an error response if `error`), received at
    /// `started`: the totals and the per-opcode counters and latency.
    pub fn answered(&self, opcode: u16, error: bool, started: std::time::Instant) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if error {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.ops.record(usize::from(opcode), error, started);
    }
}

/// Shared node state. Invariant: built once by `server::Node::start`; lives until every thread
/// that holds it has exited.
pub struct NodeContext {
    /// Configuration in force.
    pub config: NodeConfig,
    /// The shared memory pool.
    pub pool: Arc<SharedPool>,
    /// The L2 disk tier, when configured.
    pub l2: Option<crate::l2::L2Set>,
    /// Index, allocator and state machine.
    pub storage: StorageCore,
    /// `(model, salt)` interning (shared with the L2 tier's start-up threads).
    pub namespaces: Arc<Namespaces>,
    /// Registered instances.
    pub instances: InstanceTable,
    /// Layout references per `(model, world_size)`.
    pub layouts: LayoutRegistry,
    /// Lookup sessions.
    pub sessions: SessionTable,
    /// Observability events.
    pub events: EventBus,
    /// Instance-shard workers.
    pub shards: ShardPool,
    /// Timer-wheel reaper.
    pub liveness: Liveness,
    /// Counters.
    pub counters: NodeCounters,
    /// Set once shutdown starts.
    pub shutting_down: AtomicBool,
    /// Who may connect and who may run admin operations.
    pub access: crate::access::AccessPolicy,
    /// Open connections per client user (`limits.max_connections_per_client_user`).
    pub user_connections: Arc<super::user_slots::UserSlots>,
    /// Payload bytes native connections are receiving (`limits.max_inflight_payload_bytes`).
    pub payload_budget: Arc<crate::protocol::budget::PayloadBudget>,
    transfer_ids: super::transfer_ids::TransferIds,
    next_generation: AtomicU64,
    clock: Clock,
    release_hooks: parking_lot::RwLock<Vec<ReleaseHook>>,
    register_lock: Mutex<()>,
    user_reserved: Mutex<HashMap<super::lookup::SessionOwner, Arc<AtomicU64>>>,
    status_parts: parking_lot::RwLock<Vec<(&'static str, StatusPart)>>,
    /// The cluster this node belongs to, once joined (set once at start-up).
    pub cluster: std::sync::OnceLock<Arc<dyn super::cluster_link::ClusterLink>>,
}

/// Called with every released instance (after its transfers were handed back), so layers above
/// the core (the LMCache frontend) forget what they kept for it. Must not call back into
/// registration or release.
pub type ReleaseHook = Box<dyn Fn(&Instance) + Send + Sync>;

/// Builds a component's part of the status report (e.g. the LMCache frontend's budgets and
/// counters). Must be cheap and must not call back into the node.
pub type StatusPart = Box<dyn Fn() -> serde_json::Value + Send + Sync>;

/// The reaper's view of the node: live registrations and their release.
impl crate::liveness::reaper::Registrations for NodeContext {
    type Registration = Instance;

    fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    fn now_ms(&self) -> u64 {
        NodeContext::now_ms(self)
    }

    fn max_registrations(&self) -> usize {
        self.config.limits.max_instances
    }

    fn live(&self, id: u64, generation: u64) -> Option<Arc<Instance>> {
        self.instances
            .get(id)
            .filter(|i| i.generation == generation && !i.is_released())
    }

    fn reap(&self, inst: &Arc<Instance>) {
        self.release(inst, "reaped");
        self.counters.reaped.fetch_add(1, Ordering::Relaxed);
    }
}

impl NodeContext {
    /// Builds the context around an already created pool. With an L2 tier, the last
    /// [`crate::l2::L2Set::staging_bytes`] of the pool are the tier's (never handed to clients);
    /// `namespaces` must be the table the tier's recovery interned into.
    pub fn new(
        config: NodeConfig,
        pool: Arc<SharedPool>,
        namespaces: Arc<Namespaces>,
        l2: Option<crate::l2::L2Set>,
    ) -> NodeContext {
        NodeContext::with_clock(config, pool, namespaces, l2, Clock::real())
    }

    /// [`NodeContext::new`] on `clock`: every deadline of the node (TTLs, sessions, liveness)
    /// reads it. The simulator passes a manual clock.
    pub fn with_clock(
        config: NodeConfig,
        pool: Arc<SharedPool>,
        namespaces: Arc<Namespaces>,
        l2: Option<crate::l2::L2Set>,
        clock: Clock,
    ) -> NodeContext {
        // Reserved whenever L2 is configured, even if no device opened: a device left out
        // because it hung may still have an opening thread that touches its staging blocks
        // (it stops at its next I/O, but one may be in the kernel).
        let reserved = if config.l2.enabled() {
            crate::l2::L2Set::staging_bytes(&config.l2)
        } else {
            0
        };
        namespaces.configure(&clock, config.limits.max_namespaces);
        let storage = StorageCore::with_clock(
            pool.len() - reserved,
            StorageConfig {
                write_ttl: std::time::Duration::from_secs(config.write_ttl_secs),
                read_ttl: std::time::Duration::from_secs(config.read_ttl_secs),
                high_watermark: config.high_watermark,
                low_watermark: config.low_watermark,
                max_objects: config.limits.max_objects,
            },
            clock.clone(),
        );
        NodeContext {
            storage,
            namespaces,
            l2,
            instances: InstanceTable::new(config.limits.max_instances),
            layouts: LayoutRegistry::default(),
            sessions: SessionTable::new(config.limits.max_sessions),
            events: EventBus::new(config.limits.event_bus_capacity),
            shards: ShardPool::new(config.worker_threads()),
            liveness: Liveness::new(&config),
            counters: NodeCounters::default(),
            shutting_down: AtomicBool::new(false),
            access: crate::access::AccessPolicy::new(config.access.clone()),
            user_connections: Arc::new(super::user_slots::UserSlots::new(
                config.limits.max_connections_per_client_user,
            )),
            payload_budget: Arc::new(crate::protocol::budget::PayloadBudget::new(
                config.limits.max_inflight_payload_bytes,
            )),
            transfer_ids: super::transfer_ids::TransferIds::random(),
            next_generation: AtomicU64::new(1),
            clock,
            release_hooks: parking_lot::RwLock::new(Vec::new()),
            register_lock: Mutex::new(()),
            user_reserved: Mutex::new(HashMap::new()),
            status_parts: parking_lot::RwLock::new(Vec::new()),
            cluster: std::sync::OnceLock::new(),
            pool,
            config,
        }
    }

    /// The consistency check of every tier, as the wire's MEMCHECK runs it: L1 incrementally
    /// (one index shard at a time, never stopping the hot path; see
    /// [`crate::storage::StorageCore::memcheck_incremental`] for what it proves) and the L2
    /// index. One check at a time node-wide (a second caller waits); STATUS shows the outcome.
    pub fn memcheck(&self) -> crate::storage::core::MemcheckReport {
        self.checked(|| self.storage.memcheck_incremental())
    }

    fn checked(
        &self,
        l1: impl FnOnce() -> crate::storage::core::MemcheckReport,
    ) -> crate::storage::core::MemcheckReport {
        self.storage.run_memcheck(|| {
            let mut r = l1();
            if let Some(Err(p)) = self.l2.as_ref().map(|l2| l2.check()) {
                r.ok = false;
                r.problems.push(format!("L2 index: {p}"));
            }
            r
        })
    }

    /// Milliseconds on the node's clock (liveness, TTLs, sessions).
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The node's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// A fresh, never-reused, unguessable transfer id (never 0).
    pub fn next_transfer_id(&self) -> u64 {
        self.transfer_ids.next()
    }

    /// Makes transfer ids a fixed function of `key` (the simulator: reproducible runs). Call
    /// before any transfer is prepared.
    pub fn use_transfer_key(&mut self, key: [u8; 32]) {
        self.transfer_ids = super::transfer_ids::TransferIds::with_key(key);
    }

    /// The wire form of a layout.
    pub fn wire_layout(layout: &Layout) -> WireLayout {
        WireLayout {
            shape: layout.shape.clone(),
            dtype: layout.dtype.name().to_owned(),
        }
    }

    /// Registers (or refreshes) an engine-driven context. A duplicate registration with the same
    /// parameters refreshes liveness and returns the same instance; different parameters replace
    /// the old registration (releasing its pending transfers). A live instance is only ever
    /// joined or replaced by its own process (a connection that registered it, or another
    /// connection of the same pid and uid); anyone else gets `PermissionDenied`. A new instance
    /// counts against its user's `max_instances_per_user`.
    pub fn register(&self, req: &RegisterRequest, caller: &Caller) -> Result<Arc<Instance>> {
        let connection = caller.connection;
        validate_model_name(&req.model)?;
        validate_rank(req.world_size, 0)?;
        let dtype = Dtype::parse(&req.dtype)?;
        if req.num_layers == 0 || req.hidden_dim == 0 {
            return Err(Error::invalid("num_layers and hidden_dim must be > 0"));
        }
        let slots = match req.physical_slots {
            None => self.config.chunk_tokens,
            Some(n) if (1..=MAX_PHYSICAL_SLOTS).contains(&n) => n,
            Some(n) => {
                return Err(Error::invalid(format!(
                    "physical_slots {n} is outside 1..={MAX_PHYSICAL_SLOTS}"
                )))
            }
        };
        let layout =
            Layout::engine_driven(req.num_layers, slots, req.hidden_dim, dtype, req.use_mla)?;
        if layout.object_bytes() > self.storage.capacity() {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                format!(
                    "one object of this layout ({} bytes) exceeds the pool ({} bytes)",
                    layout.object_bytes(),
                    self.storage.capacity()
                ),
            ));
        }
        let now = self.now_ms();
        let same_as = |i: &Instance| {
            i.model == req.model
                && i.world_size == req.world_size
                && i.use_mla == req.use_mla
                && i.layout == layout
        };
        // A registration never hands out a released instance: `attach` refuses once the release
        // has begun (both under the instance's connection lock), and the loop then registers
        // anew (the table replaces a released entry). Each retry means a release completed.
        // One registration at a time: the per-user count and the insert are one step.
        let _one_at_a_time = self.register_lock.lock();
        let mut attempts = 0;
        let inst = loop {
            attempts += 1;
            if attempts > MAX_REGISTER_ATTEMPTS {
                return Err(Error::internal(format!(
                    "registration of instance {} kept racing its release",
                    req.instance_id
                )));
            }
            if let Some(existing) = self.instances.get(req.instance_id) {
                if caller.require_attached(&existing).is_err()
                    && !caller.same_process_as(existing.owner.as_ref())
                {
                    return Err(Error::denied(format!(
                        "instance {} is registered by another process; it stays its own until \
                         that process unregisters it or disconnects",
                        req.instance_id
                    )));
                }
                if same_as(&existing) {
                    if existing.attach(connection) {
                        existing.touch(now);
                        return Ok(existing);
                    }
                    // Being released: register anew (the table replaces a released entry).
                } else {
                    tracing::info!(
                        instance = req.instance_id,
                        "re-registration with a new layout replaces the old context"
                    );
                    self.release(&existing, "re-registered");
                }
            }
            self.check_user_quota(caller)?;
            let namespace = self.namespaces.intern(&req.model, "")?;
            let inst = Arc::new(Instance {
                id: req.instance_id,
                generation: self.next_generation.fetch_add(1, Ordering::Relaxed),
                model: req.model.clone(),
                world_size: req.world_size,
                block_size: req.block_size,
                use_mla: req.use_mla,
                layout: layout.clone(),
                namespace,
                shard: self.shards.shard_for(req.instance_id),
                owner: caller.peer,
                session_owner: caller.session_owner(),
                connections: Mutex::new(vec![connection]),
                last_seen_ms: AtomicU64::new(now),
                pinged: AtomicBool::new(false),
                released: AtomicBool::new(false),
                mailbox: ArrayQueue::new(self.config.limits.max_queued_per_instance),
                scheduled: AtomicBool::new(false),
                pending: parking_lot::Mutex::new(PendingTransfers::default()),
                reserved_bytes: AtomicU64::new(0),
                user_reserved: self.user_reserved_counter(caller),
            });
            // The layout reference is taken before the instance is visible: a release racing
            // right after the insert then drops exactly this reference.
            self.layouts.acquire(&inst.model, inst.world_size, &layout);
            let inserted = self.instances.insert(inst.clone());
            if !matches!(inserted, Ok(None)) {
                self.layouts.release(&inst.model, inst.world_size);
            }
            match inserted {
                Ok(None) => break inst,
                Ok(Some(raced)) => {
                    // A concurrent registration of the same id won: share it if it is the same
                    // context, never hand out another layout.
                    if !caller.same_process_as(raced.owner.as_ref()) {
                        return Err(Error::denied(format!(
                            "instance {} was registered concurrently by another process",
                            req.instance_id
                        )));
                    }
                    if !same_as(&raced) {
                        return Err(Error::invalid(format!(
                            "instance {} was registered concurrently with another layout",
                            req.instance_id
                        )));
                    }
                    if raced.attach(connection) {
                        raced.touch(now);
                        return Ok(raced);
                    }
                }
                Err(_) => {
                    return Err(Error::limit(format!(
                        "instance limit reached ({} registered)",
                        self.config.limits.max_instances
                    )))
                }
            }
        };
        self.liveness.arm(&*inst);
        tracing::info!(
            instance = inst.id,
            model = %inst.model,
            world_size = inst.world_size,
            shape = ?layout.shape,
            dtype = dtype.name(),
            "instance registered"
        );
        Ok(inst)
    }

    /// The shared counter of store bytes reserved by `caller`'s user (one per uid that ever
    /// registered; unknown peers share one).
    fn user_reserved_counter(&self, caller: &Caller) -> Arc<AtomicU64> {
        let uid = caller.session_owner();
        self.user_reserved.lock().entry(uid).or_default().clone()
    }

    /// The most pool bytes one instance may hold in uncommitted stores.
    pub fn reserved_cap_per_instance(&self) -> u64 {
        (self.storage.capacity() as f64 * self.config.limits.max_reserved_fraction_per_instance)
            as u64
    }

    /// The most pool bytes one user's instances may hold in uncommitted stores.
    pub fn reserved_cap_per_user(&self) -> u64 {
        (self.storage.capacity() as f64 * self.config.limits.max_reserved_fraction_per_user) as u64
    }

    /// Refuses a new instance when the caller's user already holds `max_instances_per_user`.
    /// Runs under the registration lock (no registration races it).
    fn check_user_quota(&self, caller: &Caller) -> Result<()> {
        let uid = caller.session_owner();
        if uid == super::lookup::UNKNOWN_OWNER {
            return Ok(());
        }
        let max = self.config.limits.max_instances_per_user;
        let held = self
            .instances
            .all()
            .iter()
            .filter(|i| i.session_owner == uid)
            .count();
        if held >= max {
            return Err(Error::limit(format!(
                "user {} has {held} instances registered (limit max_instances_per_user = {max})",
                caller.describe()
            )));
        }
        Ok(())
    }

    /// The TTL safety net for prepared transfers that are never committed (a client that timed
    /// out or failed mid-copy but stays alive): stores older than the write TTL are aborted and
    /// freed, retrieves older than the read TTL are released, so they neither hold memory nor
    /// count against the per-instance pending limit. Returns (writes, reads) expired.
    pub fn expire_pending(&self) -> (usize, usize) {
        let now = self.now_ms();
        let write_ttl = self.config.write_ttl_secs.saturating_mul(1000);
        let read_ttl = self.config.read_ttl_secs.saturating_mul(1000);
        let (mut w, mut r) = (0, 0);
        for inst in self.instances.all() {
            let mut p = inst.pending.lock();
            let stale_w: Vec<u64> = p
                .writes
                .iter()
                .filter(|(_, x)| now.saturating_sub(x.created_ms) >= write_ttl)
                .map(|(id, _)| *id)
                .collect();
            for id in stale_w {
                if let Some(x) = p.writes.remove(&id) {
                    self.storage.abort_write(&x.items);
                    inst.refund(x.charged);
                    w += 1;
                }
            }
            let stale_r: Vec<u64> = p
                .reads
                .iter()
                .filter(|(_, x)| now.saturating_sub(x.created_ms) >= read_ttl)
                .map(|(id, _)| *id)
                .collect();
            for id in stale_r {
                if let Some(x) = p.reads.remove(&id) {
                    self.storage.finish_read(&x.keys, 0);
                    r += 1;
                }
            }
        }
        (w, r)
    }

    /// Drops the `(model, salt)` namespaces nothing uses any more (no object in any tier, no
    /// instance, no session) and no request interned within [`NAMESPACE_RECLAIM_GRACE_MS`].
    /// O(objects): run by the maintenance thread, never on a request path. Returns how many.
    pub fn reclaim_namespaces(&self) -> usize {
        let mut in_use = self.storage.namespaces_in_use();
        if let Some(l2) = &self.l2 {
            l2.namespaces_in_use(&mut in_use);
        }
        in_use.extend(self.instances.all().iter().map(|i| i.namespace));
        in_use.extend(self.sessions.namespaces());
        let n = self
            .namespaces
            .reclaim(&in_use, self.now_ms(), NAMESPACE_RECLAIM_GRACE_MS);
        if n > 0 {
            tracing::debug!(
                reclaimed = n,
                held = self.namespaces.len(),
                "namespaces reclaimed"
            );
        }
        n
    }

    /// Adds a hook run for every instance released from now on.
    pub fn on_release(&self, hook: ReleaseHook) {
        self.release_hooks.write().push(hook);
    }

    /// Adds `part` to the status report under the top-level key `name`.
    pub fn add_status_part(&self, name: &'static str, part: StatusPart) {
        self.status_parts.write().push((name, part));
    }

    /// The components' parts of the status report, by key.
    pub fn status_parts(&self) -> std::collections::BTreeMap<String, serde_json::Value> {
        self.status_parts
            .read()
            .iter()
            .map(|(name, part)| ((*name).to_owned(), part()))
            .collect()
    }

    /// A connection closed: every instance it registered that no other open connection
    /// registered is released at once (a dead local engine leaks nothing and waits for no
    /// timeout), and when it ran LOOKUPs (`looked_up`), the sessions it created end (their
    /// locks released; a walk over the session table, so only for such connections).
    /// `registered` lists the instance ids registered over it.
    pub fn connection_closed(&self, connection: u64, registered: &[u64], looked_up: bool) {
        let sessions = if looked_up {
            super::lookup::connection_closed(self, connection)
        } else {
            0
        };
        if sessions > 0 {
            tracing::debug!(
                connection,
                sessions,
                "lookup sessions of a closed connection ended"
            );
        }
        for &iid in registered {
            if let Some(inst) = self.instances.get(iid) {
                if inst.detach(connection) {
                    self.counters.disconnected.fetch_add(1, Ordering::Relaxed);
                    self.finish_release(&inst, "disconnected");
                }
            }
        }
    }

    /// Releases an instance (unregister, reaping, disconnect): marks it released, removes it from
    /// the table, **deletes and frees** its pending writes (never publishes them), unlocks its
    /// pending reads and drops its layout reference. Idempotent.
    pub fn release(&self, inst: &Arc<Instance>, reason: &'static str) -> Released {
        if !inst.mark_released() {
            return Released::default();
        }
        self.finish_release(inst, reason)
    }

    /// The rest of [`NodeContext::release`] for an instance its caller marked released (by
    /// [`Instance::mark_released`] or [`Instance::detach`]); exactly one caller runs it.
    pub fn finish_release(&self, inst: &Arc<Instance>, reason: &'static str) -> Released {
        debug_assert!(inst.is_released());
        self.instances.remove_exact(inst);
        self.liveness.disarm(&**inst);
        let pending = std::mem::take(&mut *inst.pending.lock());
        let mut out = Released::default();
        for (_, w) in pending.writes {
            self.storage.abort_write(&w.items);
            inst.refund(w.charged);
            out.writes += 1;
        }
        for (_, r) in pending.reads {
            self.storage.finish_read(&r.keys, 0);
            out.reads += 1;
        }
        self.layouts.release(&inst.model, inst.world_size);
        for hook in self.release_hooks.read().iter() {
            hook(inst);
        }
        self.events.publish(Event::InstanceReleased {
            instance_id: inst.id,
            reason,
        });
        tracing::info!(
            instance = inst.id,
            reason,
            freed_writes = out.writes,
            released_reads = out.reads,
            "instance released"
        );
        self.storage.assert_consistent();
        out
    }
}
