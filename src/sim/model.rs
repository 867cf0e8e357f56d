//! The reference model: what every simulated client was promised (the slots of its prepared
//! transfers, the versions it committed), and the invariants checked against the real node
//! after every step.

use std::collections::{BTreeMap, HashMap};

type Ordered<K, V> = BTreeMap<K, V>;

use super::world::{self, READ_TTL_MS, WRITE_TTL_MS};
use crate::modules::NodeContext;
use crate::storage::index::{Entry, ObjectState};
use crate::storage::StorageKey;

/// One slot a client was handed.
#[derive(Debug, Clone)]
pub struct Grant {
    /// The object's key.
    pub key: StorageKey,
    /// Slot offset in the pool.
    pub offset: u64,
    /// Slot length.
    pub len: u64,
    /// For a store: the version the client wrote. For a retrieve: the version it read.
    pub version: u64,
}

/// A prepared transfer a client holds. Invariant: listed in the model exactly while the client
/// may still copy into (store) or out of (retrieve) its slots.
#[derive(Debug, Clone)]
pub struct Transfer {
    /// Instance that prepared it.
    pub instance: u64,
    /// Store (true) or retrieve.
    pub write: bool,
    /// The slots.
    pub grants: Vec<Grant>,
    /// Clock time of the PREPARE.
    pub created_ms: u64,
    /// The CLEAR epoch at PREPARE time (a CLEAR dooms every transfer before it).
    pub clear_epoch: u64,
    /// Human-readable origin for failure messages.
    pub label: String,
}

impl Transfer {
    /// When the node may release it on its own (the TTL safety net).
    pub fn expires_ms(&self) -> u64 {
        self.created_ms
            + if self.write {
                WRITE_TTL_MS
            } else {
                READ_TTL_MS
            }
    }
}

/// What the clients were promised.
#[derive(Default)]
pub struct Model {
    transfers: BTreeMap<u64, Transfer>,
    /// Transfers whose TTL passed while the client held them: the node may or may not have
    /// released them yet; no longer checked, but a COMMIT the node still accepts counts.
    expired: BTreeMap<u64, Transfer>,
    next_id: u64,
    next_version: u64,
    /// key -> version -> slot offset of every committed store (a Ready object must hold one).
    committed: HashMap<StorageKey, HashMap<u64, u64>>,
    /// Incremented by every CLEAR.
    pub clear_epoch: u64,
}

fn overlaps(a: &Grant, b: &Grant) -> bool {
    a.offset < b.offset + b.len && b.offset < a.offset + a.len
}

impl Model {
    /// A fresh version number for a store's bytes (never 0).
    pub fn next_version(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version
    }

    /// Records a transfer the node just handed to a client, after checking that none of its
    /// slots is in another client's hands (a store slot is shared with nobody; a retrieve slot
    /// only with other readers of the same object). Returns its model id.
    pub fn hand_out(&mut self, t: Transfer) -> Result<u64, String> {
        for g in &t.grants {
            for (id, other) in &self.transfers {
                for o in &other.grants {
                    if !overlaps(g, o) {
                        continue;
                    }
                    let shared_read =
                        !t.write && !other.write && o.key == g.key && o.offset == g.offset;
                    if !shared_read {
                        return Err(format!(
                            "slot {}+{} handed to {} ({}) is still held by {} (model transfer {id}, {})",
                            g.offset,
                            g.len,
                            t.label,
                            if t.write { "store" } else { "retrieve" },
                            other.label,
                            if other.write { "store" } else { "retrieve" },
                        ));
                    }
                }
            }
        }
        self.next_id += 1;
        self.transfers.insert(self.next_id, t);
        Ok(self.next_id)
    }

    /// The transfer `id` if the client still holds it.
    pub fn get(&self, id: u64) -> Option<&Transfer> {
        self.transfers.get(&id)
    }

    /// The transfer `id` whether the client still holds it or its TTL passed.
    pub fn get_any(&self, id: u64) -> Option<&Transfer> {
        self.transfers.get(&id).or_else(|| self.expired.get(&id))
    }

    /// The client committed or aborted transfer `id`, or learned it is gone: it no longer
    /// touches the slots. Returns it if it was still held.
    pub fn finish(&mut self, id: u64) -> Option<Transfer> {
        self.take(id).filter(|(_, live)| *live).map(|(t, _)| t)
    }

    /// Removes transfer `id` whether it is still held (`true`) or its TTL passed (`false`:
    /// the node may have released it, or may still accept its commit).
    pub fn take(&mut self, id: u64) -> Option<(Transfer, bool)> {
        if let Some(t) = self.transfers.remove(&id) {
            return Some((t, true));
        }
        self.expired.remove(&id).map(|t| (t, false))
    }

    /// Records that the client committed store `t` (its versions may now be served).
    pub fn committed(&mut self, t: &Transfer) {
        if t.clear_epoch != self.clear_epoch {
            return; // doomed by a CLEAR: must not be published
        }
        for g in &t.grants {
            self.committed
                .entry(g.key)
                .or_default()
                .insert(g.version, g.offset);
        }
    }

    /// Drops every transfer of `instance` (it was released: its slots went back to the node).
    pub fn release_instance(&mut self, instance: u64) {
        self.transfers.retain(|_, t| t.instance != instance);
        self.expired.retain(|_, t| t.instance != instance);
    }

    /// Sets aside the transfers whose TTL passed: from now on the node may release them.
    /// Returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let due: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.expires_ms() <= now_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in &due {
            let t = self.transfers.remove(id).expect("listed");
            self.expired.insert(*id, t);
        }
        due.len()
    }

    /// Whether `version` of `key` was committed into the slot at `offset`.
    pub fn is_committed(&self, key: &StorageKey, version: u64, offset: u64) -> bool {
        self.committed
            .get(key)
            .and_then(|v| v.get(&version))
            .is_some_and(|o| *o == offset)
    }

    /// Every invariant that relates the node's state to the promises: slots in clients' hands
    /// are still theirs, committed objects hold committed bytes, every read lock has exactly
    /// one owner, and the allocator agrees with the index.
    /// `taken_locks` are the read locks of retrieves whose bytes are moving (out of their
    /// instances' tables, still owned). Checks named in `skip` (`memcheck`, `slots`, `bytes`,
    /// `locks`) are not run.
    pub fn check(
        &self,
        ctx: &NodeContext,
        skip: &[String],
        taken_locks: &[(StorageKey, u64)],
    ) -> Result<(), String> {
        let on = |name: &str| !skip.iter().any(|s| s == name);
        let mem = ctx.storage.memcheck();
        if on("memcheck") && !mem.ok {
            return Err(format!("[memcheck] {:?}", mem.problems));
        }
        let snapshot: Ordered<StorageKey, Entry> = ctx.storage.snapshot().into_iter().collect();
        // 1. Slots in clients' hands.
        let mut readers_promised: Ordered<StorageKey, u32> = Ordered::new();
        for (id, t) in self.transfers.iter().filter(|_| on("slots")) {
            for g in &t.grants {
                let Some(e) = snapshot.get(&g.key) else {
                    return Err(format!(
                        "{} (model transfer {id}) still holds slot {} of a {}, but the node \
                         dropped the object",
                        t.label,
                        g.offset,
                        if t.write { "store" } else { "retrieve" }
                    ));
                };
                if e.slot.offset != g.offset || e.slot.len != g.len {
                    return Err(format!(
                        "{} (model transfer {id}) holds slot {}, but the object now lives at {}",
                        t.label, g.offset, e.slot.offset
                    ));
                }
                if t.write && e.state != ObjectState::WriteReserved {
                    return Err(format!(
                        "{} (model transfer {id}): store slot {} was published before COMMIT \
                         ({:?})",
                        t.label, g.offset, e.state
                    ));
                }
                if !t.write {
                    if e.state != ObjectState::Ready {
                        return Err(format!(
                            "{} (model transfer {id}): the object being read is {:?}",
                            t.label, e.state
                        ));
                    }
                    *readers_promised.entry(g.key).or_default() += 1;
                    let v = world::read_stamp(ctx, g.offset, g.len, &g.key);
                    if v != Some(g.version) {
                        return Err(format!(
                            "{} (model transfer {id}): bytes under a read changed (version {} \
                             read, now {v:?})",
                            t.label, g.version
                        ));
                    }
                }
            }
        }
        for (k, n) in &readers_promised {
            let readers = snapshot[k].readers;
            if readers < *n {
                return Err(format!(
                    "{n} retrieves are copying out of {:?}, but it holds only {readers} read locks",
                    &k.chunk_hash[..4]
                ));
            }
        }
        // 2. Committed objects hold committed bytes.
        for (k, e) in snapshot.iter().filter(|_| on("bytes")) {
            if e.state != ObjectState::Ready {
                continue;
            }
            match world::read_stamp(ctx, e.slot.offset, e.slot.len, k) {
                Some(v) if self.is_committed(k, v, e.slot.offset) => {}
                v => {
                    return Err(format!(
                        "object {:?} at {} is readable but holds version {v:?}, which no client \
                         committed there",
                        &k.chunk_hash[..4],
                        e.slot.offset
                    ))
                }
            }
        }
        // 3. Every read lock has exactly one owner: a lookup session, a prepared retrieve, or a
        //    retrieve whose bytes are moving.
        let mut claims: Ordered<StorageKey, u64> = Ordered::new();
        for (key, lease) in taken_locks {
            if snapshot.get(key).is_some_and(|e| e.lease == *lease) {
                *claims.entry(*key).or_default() += 1;
            }
        }
        for (_, key, lease, remaining) in ctx.sessions.held_locks() {
            if snapshot.get(&key).is_some_and(|e| e.lease == lease) {
                *claims.entry(key).or_default() += u64::from(remaining);
            }
        }
        for inst in ctx.instances.all() {
            let p = inst.pending.lock();
            for r in p.reads.values() {
                for (key, lease) in &r.keys {
                    if snapshot.get(key).is_some_and(|e| e.lease == *lease) {
                        *claims.entry(*key).or_default() += 1;
                    }
                }
            }
            for w in p.writes.values() {
                for (key, grant) in &w.items {
                    let ok = snapshot.get(key).is_some_and(|e| {
                        e.state == ObjectState::WriteReserved
                            && e.lease == grant.lease
                            && e.slot == grant.slot
                    });
                    if !ok && snapshot.get(key).is_some_and(|e| e.slot == grant.slot) {
                        return Err(format!(
                            "instance {} lists a pending store of {:?} that the index no longer \
                             holds as its reservation",
                            inst.id,
                            &key.chunk_hash[..4]
                        ));
                    }
                }
            }
        }
        // A prepared retrieve keeps its locks until its TTL: their lease is the object's.
        let now = ctx.now_ms();
        for inst in ctx.instances.all().iter().filter(|_| on("locks")) {
            let p = inst.pending.lock();
            for (t, r) in p.reads.iter() {
                if now >= r.created_ms + READ_TTL_MS {
                    continue;
                }
                for (key, lease) in &r.keys {
                    let ok = snapshot
                        .get(key)
                        .is_some_and(|e| e.lease == *lease && e.state == ObjectState::Ready);
                    if !ok {
                        return Err(format!(
                            "retrieve {t} of instance {} lost its lock on {:?} before its TTL",
                            inst.id,
                            &key.chunk_hash[..4]
                        ));
                    }
                }
            }
        }
        // 4. Sessions: none for a complete miss, books balanced, within the count and bytes.
        if on("sessions") {
            let max = ctx.config.limits.max_session_bytes as usize;
            ctx.sessions.audit(max)?;
        }
        for (k, e) in snapshot.iter().filter(|_| on("locks")) {
            let c = claims.get(k).copied().unwrap_or(0);
            if c != u64::from(e.readers) {
                return Err(format!(
                    "object {:?} holds {} read locks but sessions and prepared retrieves own {c}",
                    &k.chunk_hash[..4],
                    e.readers
                ));
            }
        }
        Ok(())
    }
}
