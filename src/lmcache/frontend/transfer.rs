//! Store and retrieve requests of the frontend: PREPARE hands a native transfer to the worker
//! and queues it under its key, COMMIT pairs with the oldest queued transfer (FIFO per key per
//! registration) and ends it on the node. Only the connection that registered the instance may
//! do either (checked before anything is hashed or cached).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{ClientId, LmFrontend, LmReply, MAX_PENDING_BYTES};
use crate::hashing::ChunkHash;
use crate::lmcache::pending::{KeyId, Kind, PendingFull};
use crate::lmcache::wire::{IpcKey, Op, SlotDesc};
use crate::modules::instances::Instance;
use crate::protocol::{ChunkRange, Request, Response, WireLayout, WireSlot};

impl LmFrontend {
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
            Err(PendingFull::StaleEpoch) => {
                tracing::info!(
                    instance = before.id,
                    "a PREPARE that began before a new REGISTER of its instance is refused"
                );
                false
            }
            Err(PendingFull::Budget) => {
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

    pub(super) fn prepare_store(
        &self,
        client: &ClientId,
        key: &IpcKey,
        instance_id: u64,
    ) -> LmReply {
        let Some(inst) = self.owned(client, instance_id, "PREPARE_STORE") else {
            return self.stateless(Op::PrepareStore);
        };
        let (first, hashes) = match self.range_hashes(client, key) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(instance = instance_id, error = %e, "PREPARE_STORE refused");
                return self.stateless(Op::PrepareStore);
            }
        };
        if hashes.is_empty() {
            return LmReply::PrepareStore(Some((Vec::new(), Vec::new())));
        }
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

    /// The oldest transfer of `kind` the current registration of `instance_id` holds for `key`,
    /// when `client` registered the instance.
    fn take(&self, client: &ClientId, key: &IpcKey, instance_id: u64, kind: Kind) -> Option<u64> {
        let op = match kind {
            Kind::Store => "COMMIT_STORE",
            Kind::Retrieve => "COMMIT_RETRIEVE",
        };
        let inst = self.owned(client, instance_id, op)?;
        let (_, hashes) = self.range_hashes(client, key).ok()?;
        self.state.pending.lock().pop(
            instance_id,
            inst.generation,
            kind,
            &Self::key_id(key, &hashes),
        )
    }

    pub(super) fn commit_store(
        &self,
        client: &ClientId,
        key: &IpcKey,
        instance_id: u64,
        cpu_data: &[u8],
    ) -> LmReply {
        let pending = self.take(client, key, instance_id, Kind::Store);
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
            if let Some(inst) = self.owned(client, instance_id, "COMMIT_STORE") {
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

    pub(super) fn prepare_retrieve(
        &self,
        client: &ClientId,
        key: &IpcKey,
        instance_id: u64,
    ) -> LmReply {
        let Some(inst) = self.owned(client, instance_id, "PREPARE_RETRIEVE") else {
            return self.stateless(Op::PrepareRetrieve);
        };
        let (first, hashes) = match self.range_hashes(client, key) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(instance = instance_id, error = %e, "PREPARE_RETRIEVE refused");
                return self.stateless(Op::PrepareRetrieve);
            }
        };
        if self
            .state
            .pickle_instances
            .lock()
            .get(&instance_id)
            .copied()
            == Some(inst.generation)
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
        let id = Self::key_id(key, &hashes);
        let lookup_session = self.retrieve_session(client, &key.request_id, first, &hashes);
        let range = Self::worker_range(key, first, hashes);
        let epoch = self.state.pending.lock().epoch(instance_id);
        match self.call(Request::PrepareRetrieve {
            instance_id,
            range,
            lookup_session,
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

    pub(super) fn commit_retrieve(&self, client: &ClientId, key: &IpcKey, instance_id: u64) {
        if let Some(transfer_id) = self.take(client, key, instance_id, Kind::Retrieve) {
            self.call(Request::CommitRetrieve {
                instance_id,
                transfer_id,
            });
        }
    }
}
