//! Registered engine instances: identity, layout, liveness stamps, the per-instance lock-free
//! mailbox of queued requests, and the pending (prepared, uncommitted) transfers.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;
use parking_lot::{Mutex, RwLock};

use crate::protocol::Request;
use crate::storage::{Grant, Layout, NamespaceId, StorageKey};
use crate::transport::ReplySink;

/// A request waiting in an instance's mailbox.
pub struct Job {
    /// Caller's request id (echoed in the response).
    pub request_id: u64,
    /// The request (always one with instance affinity).
    pub request: Request,
    /// Where to answer.
    pub reply: Arc<dyn ReplySink>,
    /// When the dispatcher received it (its latency is counted from here).
    pub received: std::time::Instant,
}

/// A prepared store: the exact `(key, grant)` pairs reserved for it.
#[derive(Debug, Clone)]
pub struct PendingWrite {
    /// Pool bytes charged to the instance and its user for it (refunded when it ends).
    pub charged: u64,
    /// Reserved objects, in chunk order.
    pub items: Vec<(StorageKey, Grant)>,
    /// Node-clock millisecond of the PREPARE (for the TTL safety net).
    pub created_ms: u64,
}

/// A prepared retrieve: the `(key, lease)` pairs whose read locks COMMIT_RETRIEVE releases.
#[derive(Debug, Clone)]
pub struct PendingRead {
    /// Read-locked keys with the lease of their lock, in chunk order.
    pub keys: Vec<(StorageKey, u64)>,
    /// Pool offset and length of each key's slot, in the same order (remote retrieves move
    /// them; they stay put while the read locks are held).
    pub slots: Vec<(u64, u64)>,
    /// Node-clock millisecond of the PREPARE (for the TTL safety net).
    pub created_ms: u64,
}

/// Pending transfers of one instance. Invariant: every reservation listed here is
/// `WriteReserved` in storage (or doomed/expired), and every read listed holds one lock per key.
/// Ordered by transfer id, so sweeps release them in a deterministic order.
#[derive(Default)]
pub struct PendingTransfers {
    /// transfer id -> prepared store.
    pub writes: BTreeMap<u64, PendingWrite>,
    /// transfer id -> prepared retrieve.
    pub reads: BTreeMap<u64, PendingRead>,
}

/// One registered engine instance (a worker process of an engine).
/// Invariant: once `released` is set it never clears, and no new pending transfer is added after it.
pub struct Instance {
    /// Engine-chosen id.
    pub id: u64,
    /// Unique among every instance object this node ever created (an id registered again gets
    /// a new generation): timers and frontend state name the exact registration they belong to.
    pub generation: u64,
    /// Model name.
    pub model: String,
    /// KV world size.
    pub world_size: u32,
    /// Engine block size (metadata).
    pub block_size: u32,
    /// One KV plane.
    pub use_mla: bool,
    /// Object layout.
    pub layout: Layout,
    /// Interned `(model, "")` namespace (salted keys intern their own).
    pub namespace: NamespaceId,
    /// Index of the worker shard that runs this instance's requests.
    pub shard: usize,
    /// The process that registered it (kernel-recorded). Only connections of this same process
    /// may join it; its lookup sessions are this uid's.
    pub owner: Option<kvnode_hw::PeerCred>,
    /// Its registering caller's session owner ([`super::Caller::session_owner`]): its
    /// retrieves adopt that owner's lookup sessions, its quotas count against that user.
    pub session_owner: super::lookup::SessionOwner,
    /// Connections that registered it and are still open. When the last one closes, the
    /// instance is released at once (a dead local engine is detected without waiting for the
    /// reaper); a connection that only sends requests does not keep it alive.
    pub connections: Mutex<Vec<u64>>,
    /// Node-clock millisecond of the last request.
    pub last_seen_ms: AtomicU64,
    /// Whether it has ever sent PING (decides reap timeout vs registration grace).
    pub pinged: AtomicBool,
    /// Set when reaped, unregistered or disconnected.
    pub released: AtomicBool,
    /// Queued requests, executed in order by the instance's shard.
    pub mailbox: ArrayQueue<Job>,
    /// Whether the instance sits in its shard's run queue (or is being run).
    pub scheduled: AtomicBool,
    /// Prepared, uncommitted transfers.
    pub pending: Mutex<PendingTransfers>,
    /// Pool bytes its prepared, uncommitted stores hold (bounded by
    /// `max_reserved_fraction_per_instance`).
    pub reserved_bytes: AtomicU64,
    /// Pool bytes the uncommitted stores of every instance of its owner's user hold (shared by
    /// those instances; bounded by `max_reserved_fraction_per_user`).
    pub user_reserved: Arc<AtomicU64>,
}

impl crate::liveness::reaper::Watched for Instance {
    fn id(&self) -> u64 {
        self.id
    }

    fn generation(&self) -> u64 {
        self.generation
    }

    fn last_seen_ms(&self) -> u64 {
        self.last_seen_ms.load(Ordering::Relaxed)
    }

    fn pinged(&self) -> bool {
        self.pinged.load(Ordering::Relaxed)
    }
}

impl Instance {
    /// Records activity at `now_ms` (any request).
    pub fn touch(&self, now_ms: u64) {
        self.last_seen_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    /// Records a PING at `now_ms`: refresh and latch.
    pub fn ping(&self, now_ms: u64) {
        self.touch(now_ms);
        self.pinged.store(true, Ordering::Relaxed);
    }

    /// Adds a registering connection (idempotent; at most [`MAX_CONNECTIONS_PER_INSTANCE`]
    /// are remembered, the oldest is forgotten beyond that). Refused (`false`) once the
    /// instance is released: checked under the same lock [`Instance::mark_released`] takes, so a
    /// registration never joins an instance whose release has begun.
    pub fn attach(&self, connection: u64) -> bool {
        let mut c = self.connections.lock();
        if self.is_released() {
            return false;
        }
        if !c.contains(&connection) {
            if c.len() >= MAX_CONNECTIONS_PER_INSTANCE {
                c.remove(0);
            }
            c.push(connection);
        }
        true
    }

    /// Marks the instance released; `true` for the one caller that did it (under the
    /// connection lock, paired with [`Instance::attach`]).
    pub fn mark_released(&self) -> bool {
        let _c = self.connections.lock();
        !self.released.swap(true, Ordering::AcqRel)
    }

    /// Removes a closed connection. When it was the last one that registered the instance,
    /// the instance is marked released in the same step (under the connection lock, so no
    /// registration can attach in between) and `true` is returned: the caller then finishes
    /// the release with [`crate::modules::NodeContext::finish_release`].
    pub fn detach(&self, connection: u64) -> bool {
        let mut c = self.connections.lock();
        let before = c.len();
        c.retain(|&x| x != connection);
        if before != c.len() && c.is_empty() {
            return !self.released.swap(true, Ordering::AcqRel);
        }
        false
    }

    /// Charges `bytes` of new store reservations to this instance and its user, unless that
    /// would exceed `instance_cap` or `user_cap`: then nothing is charged and the error names the
    /// limit that was hit. Paired with [`Instance::refund`] when the stores end.
    pub fn charge(&self, bytes: u64, instance_cap: u64, user_cap: u64) -> Result<(), String> {
        let mine = self.reserved_bytes.fetch_add(bytes, Ordering::AcqRel) + bytes;
        let users = self.user_reserved.fetch_add(bytes, Ordering::AcqRel) + bytes;
        if mine <= instance_cap && users <= user_cap {
            return Ok(());
        }
        self.refund(bytes);
        Err(if mine > instance_cap {
            format!(
                "instance {} would hold {mine} bytes in uncommitted stores (limit \
                 max_reserved_fraction_per_instance = {instance_cap} bytes); commit or abort first",
                self.id
            )
        } else {
            format!(
                "this user's instances would hold {users} bytes in uncommitted stores (limit \
                 max_reserved_fraction_per_user = {user_cap} bytes); commit or abort first"
            )
        })
    }

    /// Returns `bytes` charged by [`Instance::charge`] (a store committed, aborted, expired or
    /// handed back by a release).
    pub fn refund(&self, bytes: u64) {
        let was = self.reserved_bytes.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(was >= bytes, "refund of {bytes} > {was} charged");
        let was_user = self.user_reserved.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(
            was_user >= bytes,
            "user refund of {bytes} > {was_user} charged"
        );
    }

    /// Whether the instance is gone.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }
}

const TABLE_SHARDS: usize = 16;

/// Registering connections remembered per instance.
pub const MAX_CONNECTIONS_PER_INSTANCE: usize = 64;

/// The instance table is at its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableFull;

/// All registered instances, sharded by id. Invariant: at most `limit` entries.
pub struct InstanceTable {
    shards: Vec<RwLock<HashMap<u64, Arc<Instance>>>>,
    count: AtomicUsize,
    limit: usize,
}

impl InstanceTable {
    /// An empty table holding at most `limit` instances.
    pub fn new(limit: usize) -> InstanceTable {
        InstanceTable {
            shards: (0..TABLE_SHARDS).map(|_| RwLock::default()).collect(),
            count: AtomicUsize::new(0),
            limit,
        }
    }

    fn shard(&self, id: u64) -> &RwLock<HashMap<u64, Arc<Instance>>> {
        &self.shards[(id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as usize % TABLE_SHARDS]
    }

    /// The instance registered under `id`.
    pub fn get(&self, id: u64) -> Option<Arc<Instance>> {
        self.shard(id).read().get(&id).cloned()
    }

    /// Inserts a new instance unless `id` is taken by a live instance or the table is full.
    /// Returns the live instance on conflict, or `Err(TableFull)` when full. An entry that is
    /// already released (its release is between marking and removal) is replaced, never
    /// returned: a registration must never hand out a released instance.
    pub fn insert(&self, inst: Arc<Instance>) -> Result<Option<Arc<Instance>>, TableFull> {
        let mut s = self.shard(inst.id).write();
        if let Some(existing) = s.get(&inst.id) {
            if !existing.is_released() {
                return Ok(Some(existing.clone()));
            }
            // Same count: one entry replaces another (the release's removal then finds a
            // different instance and leaves it).
            s.insert(inst.id, inst);
            return Ok(None);
        }
        if self.count.load(Ordering::Relaxed) >= self.limit {
            return Err(TableFull);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        s.insert(inst.id, inst);
        Ok(None)
    }

    /// Removes `inst` if it is still the registered instance for its id.
    pub fn remove_exact(&self, inst: &Arc<Instance>) -> bool {
        let mut s = self.shard(inst.id).write();
        match s.get(&inst.id) {
            Some(cur) if Arc::ptr_eq(cur, inst) => {
                s.remove(&inst.id);
                self.count.fetch_sub(1, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Number of registered instances.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether no instance is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A snapshot of every instance (status reports, shutdown).
    pub fn all(&self) -> Vec<Arc<Instance>> {
        let mut v: Vec<_> = self
            .shards
            .iter()
            .flat_map(|s| s.read().values().cloned().collect::<Vec<_>>())
            .collect();
        v.sort_by_key(|i| i.id);
        v
    }
}
