//! GPU paths of the client: an engine's KV chunks move between its device memory and the node
//! with one asynchronous copy per chunk (neighbours merged) on the client's own stream and one
//! synchronisation per request.
//!
//! * Local engines ([`Client`] over the Unix socket): the mapped pool is registered with the
//!   GPU driver once per process ([`kvnode_hw::gpu::Gpu::pin`], counted when several clients
//!   share a mapping) and the copies go straight between device memory and the reserved slots:
//!   the node moves metadata only.
//! * Remote engines over TCP ([`RemoteClient`]): the chunks go through a registered staging
//!   buffer of this client (device → staging, then the stream; or the reverse).
//! * Remote engines over RDMA: see [`super::remote_gpu`] (GPUDirect through dma-buf, host
//!   staging when the device or NIC cannot).
//!
//! Slot safety: a store's slots are written only between its PREPARE and its COMMIT/ABORT, and
//! a retrieve's slots are read only while its read locks are held: every copy has finished
//! (the stream waited) before the commit or abort is sent, also when a copy failed.

use std::sync::Arc;

use kvnode_hw::fabric::EngineBuffer;
use kvnode_hw::gpu::{CopyItem, DeviceSpan, Gpu, GpuStream, Pinned};
use kvnode_hw::PoolMapping;

use super::remote::RemoteClient;
use super::{Client, ClientTransport, UnixTransport};
use crate::error::{Error, ErrorKind, Result};
use crate::protocol::ChunkRange;

/// Largest staging buffer a remote client's GPU path allocates (one request's chunks); the
/// node's own limit on one transfer (`remote.max_trailer_bytes`) defaults to the same 1 GiB.
pub const MAX_GPU_STAGING_BYTES: u64 = 1 << 30;

/// Staging buffers grow in steps of this many bytes.
const STAGING_STEP: u64 = 2 << 20;

/// What a client's GPU path did (cumulative).
///
/// Invariant: counts only requests whose copies all completed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuTransferStats {
    /// Stores from device memory that copied at least one chunk.
    pub stores: u64,
    /// Retrieves into device memory that hit.
    pub retrieves: u64,
    /// Bytes copied from device memory.
    pub device_to_host_bytes: u64,
    /// Bytes copied into device memory.
    pub host_to_device_bytes: u64,
    /// Driver copies issued (after merging neighbouring chunks).
    pub copies: u64,
}

/// A client's GPU state: the device handle, this client's own stream, the pinned pool (local)
/// or pinned staging buffer (remote).
///
/// Invariant: at most one request uses the stream at a time (`&mut Client`); the pinned pool is
/// the client's current mapping (an `Arc` of it: the mapping outlives its registration).
pub struct GpuAttachment {
    stream: GpuStream,
    pool: Option<Pinned<Arc<PoolMapping>>>,
    staging: Option<Pinned<EngineBuffer>>,
    stats: GpuTransferStats,
}

impl std::fmt::Debug for GpuAttachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuAttachment")
            .field("gpu", &self.stream.gpu().info().name)
            .field("pool_pinned", &self.pool.is_some())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl GpuAttachment {
    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        self.stream.gpu()
    }

    /// Whether the node's pool is registered with the driver (local clients, after register).
    pub fn pool_pinned(&self) -> bool {
        self.pool.is_some()
    }

    /// Bytes of the pinned staging buffer (remote clients; 0 before the first transfer).
    pub fn staging_bytes(&self) -> u64 {
        self.staging.as_ref().map_or(0, |s| s.inner().len() as u64)
    }

    /// Stream synchronisations so far (one per request that copied).
    pub fn synchronizations(&self) -> u64 {
        self.stream.synchronizations()
    }

    /// Cumulative counters.
    pub fn stats(&self) -> GpuTransferStats {
        self.stats
    }

    #[cfg(feature = "rdma")]
    pub(super) fn stream_mut(&mut self) -> &mut GpuStream {
        &mut self.stream
    }

    fn record(&mut self, to_host: bool, r: kvnode_hw::gpu::CopyReport) {
        if to_host {
            self.stats.stores += 1;
            self.stats.device_to_host_bytes += r.bytes;
        } else {
            self.stats.retrieves += 1;
            self.stats.host_to_device_bytes += r.bytes;
        }
        self.stats.copies += u64::from(r.copies);
    }

    /// A pinned staging buffer of at least `bytes`, grown (re-registered) when too small.
    fn staging(&mut self, bytes: u64) -> Result<&mut Pinned<EngineBuffer>> {
        if bytes > MAX_GPU_STAGING_BYTES {
            return Err(Error::limit(format!(
                "a GPU transfer of {bytes} bytes: one request moves at most \
                 {MAX_GPU_STAGING_BYTES} bytes through the staging buffer; split the request"
            )));
        }
        if self.staging_bytes() < bytes {
            self.staging = None; // unregister the old one first
            let len = bytes.div_ceil(STAGING_STEP) * STAGING_STEP;
            let buf = EngineBuffer::new(len as usize)?;
            let pinned = self.stream.gpu().pin(buf).map_err(|e| {
                Error::from(e).context("cannot register the GPU staging buffer with the driver")
            })?;
            self.staging = Some(pinned);
        }
        Ok(self.staging.as_mut().expect("just ensured"))
    }
}

impl<T: ClientTransport> Client<T> {
    /// Attaches `gpu`: creates this client's copy stream (one per engine instance; instances
    /// copy concurrently) and, for a local client with a mapped pool, registers the pool with
    /// the driver (once per process and mapping). Replaces an earlier attachment.
    pub fn attach_gpu(&mut self, gpu: &Gpu) -> Result<()> {
        let stream = gpu.stream()?;
        self.gpu = None;
        self.gpu = Some(GpuAttachment {
            stream,
            pool: None,
            staging: None,
            stats: GpuTransferStats::default(),
        });
        self.pin_pool()
    }

    /// Ends the GPU attachment (its registrations end with it).
    pub fn detach_gpu(&mut self) {
        self.gpu = None;
    }

    /// The GPU attachment, if any.
    pub fn gpu(&self) -> Option<&GpuAttachment> {
        self.gpu.as_ref()
    }

    fn stream_poisoned(&self) -> bool {
        self.gpu.as_ref().is_some_and(|a| a.stream.is_poisoned())
    }

    /// Registers the mapped pool with the attached GPU if it is not yet.
    pub(super) fn pin_pool(&mut self) -> Result<()> {
        let (Some(att), Some(pool)) = (self.gpu.as_mut(), self.pool.as_ref()) else {
            return Ok(());
        };
        if att
            .pool
            .as_ref()
            .is_some_and(|p| Arc::ptr_eq(p.inner(), pool))
        {
            return Ok(());
        }
        att.pool = None;
        let pinned = att.stream.gpu().pin(pool.clone()).map_err(|e| {
            Error::from(e).context(
                "cannot register the node's pool with the GPU driver (cuMemHostRegister); \
                 copies from unregistered memory would run at a fraction of the bus speed",
            )
        })?;
        att.pool = Some(pinned);
        Ok(())
    }

    fn attachment(&mut self) -> Result<&mut GpuAttachment> {
        self.gpu.as_mut().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidRequest,
                "no GPU attached to this client: call attach_gpu first",
            )
        })
    }

    /// Checks one list of pieces per hash of `range`, each list `object_bytes` long in all.
    fn check_pieces(&self, chunks: &[&[DeviceSpan<'_>]], range: &ChunkRange) -> Result<u64> {
        let n = self.object_bytes()?;
        if chunks.len() != range.chunk_hashes.len() {
            return Err(Error::invalid(format!(
                "{} device chunks for {} hashes",
                chunks.len(),
                range.chunk_hashes.len()
            )));
        }
        let pieces: usize = chunks.iter().map(|c| c.len()).sum();
        if pieces > MAX_GPU_PIECES {
            return Err(Error::limit(format!(
                "{pieces} device pieces in one request: at most {MAX_GPU_PIECES}"
            )));
        }
        for (i, c) in chunks.iter().enumerate() {
            let len: u64 = c.iter().map(DeviceSpan::len).sum();
            if len != n {
                return Err(Error::invalid(format!(
                    "device chunk {i} has {len} bytes in {} piece(s); the layout needs {n}",
                    c.len()
                )));
            }
        }
        Ok(n)
    }
}

/// Most device pieces (copy items) in one request (the GPU stream's own limit).
pub const MAX_GPU_PIECES: usize = kvnode_hw::gpu::MAX_COPY_ITEMS;

/// One chunk per span.
fn whole<'a, 'b>(chunks: &'a [DeviceSpan<'b>]) -> Vec<&'a [DeviceSpan<'b>]> {
    chunks.iter().map(std::slice::from_ref).collect()
}

/// The copy items of one chunk's `pieces`, laid back to back from `host_offset`.
fn chunk_items<'a>(host_offset: u64, pieces: &[DeviceSpan<'a>], out: &mut Vec<CopyItem<'a>>) {
    let mut off = host_offset;
    for &device in pieces {
        out.push(CopyItem {
            host_offset: off,
            device,
        });
        off += device.len();
    }
}

impl Client<UnixTransport> {
    /// Stores `chunks` (one device span per hash of `range`, each `object_bytes`) from device
    /// memory: prepare, copy the chunks the node lacks straight into their slots (one wait),
    /// commit. Returns how many chunks were copied (the rest were cached already). A failed copy
    /// aborts the reservation (never published) and returns the error.
    pub fn store_from_device(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        chunks: &[DeviceSpan<'_>],
    ) -> Result<usize> {
        self.store_from_device_pieces(instance_id, range, &whole(chunks))
    }

    /// [`Client::store_from_device`] for chunks that are not contiguous in device memory (a
    /// paged KV cache: per-layer K and V blocks): chunk `i` is the concatenation of
    /// `chunks[i]`'s pieces, which must add up to `object_bytes`; each piece is one copy into
    /// its place in the slot (neighbours merged), all with one wait.
    pub fn store_from_device_pieces(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        chunks: &[&[DeviceSpan<'_>]],
    ) -> Result<usize> {
        let n = self.check_pieces(chunks, range)?;
        self.attachment()?;
        self.pin_pool()?;
        let p = self.prepare_store(instance_id, range)?;
        if p.slots.is_empty() {
            return Ok(0);
        }
        let mut items = Vec::new();
        let planned: Result<()> =
            p.slots
                .iter()
                .zip(&p.chunk_indices)
                .try_for_each(|(slot, &i)| {
                    let pieces = chunks
                        .get(i as usize)
                        .ok_or_else(|| Error::internal(format!("chunk index {i} out of range")))?;
                    if slot.length != n {
                        return Err(Error::internal("the node's slots do not match the layout"));
                    }
                    chunk_items(slot.offset, pieces, &mut items);
                    Ok(())
                });
        let copied = planned.and_then(|()| {
            let att = self.gpu.as_mut().expect("checked");
            let pool = att.pool.as_mut().ok_or_else(not_pinned)?;
            let r = att.stream.device_to_host(pool, &items)?;
            att.record(true, r);
            Ok(())
        });
        if let Err(e) = copied {
            if self.stream_poisoned() {
                // Copies may still be writing the slots: neither abort (the slots would be
                // handed out again) nor commit; the reservation ends with this client.
                return Err(poisoned(e));
            }
            let _ = self.abort_store(instance_id, p.transfer_id);
            return Err(e);
        }
        self.commit_store(instance_id, p.transfer_id)?;
        Ok(p.slots.len())
    }

    /// Retrieves every chunk of `range` into `out` (one device span per hash, each
    /// `object_bytes`): prepare (read locks), copy the slots into device memory (one wait),
    /// release the locks. `false` (device memory untouched) if any chunk is missing. With
    /// `lookup_session`, relies on that LOOKUP's locks.
    pub fn retrieve_to_device(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        lookup_session: Option<&str>,
        out: &[DeviceSpan<'_>],
    ) -> Result<bool> {
        self.retrieve_to_device_pieces(instance_id, range, lookup_session, &whole(out))
    }

    /// [`Client::retrieve_to_device`] into chunks made of pieces (see
    /// [`Client::store_from_device_pieces`]): each slot is scattered into its chunk's pieces.
    pub fn retrieve_to_device_pieces(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        lookup_session: Option<&str>,
        out: &[&[DeviceSpan<'_>]],
    ) -> Result<bool> {
        let n = self.check_pieces(out, range)?;
        self.attachment()?;
        self.pin_pool()?;
        let Some(p) = self.prepare_retrieve(instance_id, range, lookup_session)? else {
            return Ok(false);
        };
        let copied = if p.slots.len() != out.len() || p.slots.iter().any(|s| s.length != n) {
            Err(Error::internal(
                "the node's slots do not match the device chunks (layout changed?)",
            ))
        } else {
            let mut items = Vec::new();
            for (s, pieces) in p.slots.iter().zip(out) {
                chunk_items(s.offset, pieces, &mut items);
            }
            let att = self.gpu.as_mut().expect("checked");
            match att.pool.as_ref() {
                None => Err(not_pinned()),
                Some(pool) => att
                    .stream
                    .host_to_device(pool, &items)
                    .map(|r| att.record(false, r))
                    .map_err(Error::from),
            }
        };
        if let Err(e) = copied {
            if self.stream_poisoned() {
                // Copies may still be reading the slots: the read locks stay until this client
                // is released.
                return Err(poisoned(e));
            }
            let _ = self.commit_retrieve(instance_id, p.transfer_id);
            return Err(e);
        }
        // The copies are done: the locks can go.
        self.commit_retrieve(instance_id, p.transfer_id)?;
        Ok(true)
    }
}

/// The error of a request whose copies could not be waited for.
fn poisoned(e: Error) -> Error {
    e.context(
        "the GPU stream could not wait for this request's copies: its slots stay reserved (not \
         committed, not aborted) until this client is released; attach the GPU again or reconnect",
    )
}

fn not_pinned() -> Error {
    Error::new(
        ErrorKind::NotRegistered,
        "no pool mapped: register the instance before moving GPU memory",
    )
}

impl RemoteClient {
    /// Stores `chunks` (one device span per hash of `range`, each `object_bytes`) to a remote
    /// node over TCP: prepare, copy the chunks the node lacks into this client's pinned staging
    /// buffer (one wait), send them, publish. Returns how many chunks were sent. A failed copy
    /// aborts the reservation.
    pub fn store_from_device(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        chunks: &[DeviceSpan<'_>],
    ) -> Result<usize> {
        self.store_from_device_pieces(instance_id, range, &whole(chunks))
    }

    /// [`RemoteClient::store_from_device`] for chunks made of pieces (see
    /// [`Client::store_from_device_pieces`]).
    pub fn store_from_device_pieces(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        chunks: &[&[DeviceSpan<'_>]],
    ) -> Result<usize> {
        let n = self.check_pieces(chunks, range)?;
        self.attachment()?;
        let p = self.prepare_store(instance_id, range)?;
        if p.slots.is_empty() {
            return Ok(0);
        }
        let staged = if p.slots.iter().any(|s| s.length != n) {
            Err(Error::internal("the node's slots do not match the layout"))
        } else {
            self.stage_from_device(n, &p.chunk_indices, chunks)
        };
        let len = match staged {
            Ok(len) => len,
            Err(e) => {
                let _ = self.abort_store(instance_id, p.transfer_id);
                return Err(e);
            }
        };
        // Take the staging buffer out while the connection borrows `self` mutably.
        let att = self.gpu.as_mut().expect("checked");
        let staging = att.staging.take().expect("staged");
        let data: Vec<&[u8]> = staging.inner().as_slice()[..len]
            .chunks(n as usize)
            .collect();
        let sent = self.write_slots(instance_id, p.transfer_id, &data, true);
        if let Some(att) = self.gpu.as_mut() {
            att.staging = Some(staging);
        }
        sent?;
        Ok(p.slots.len())
    }

    /// Copies `chunks[indices[k]]` to staging offset `k * n`; returns the bytes staged.
    fn stage_from_device(
        &mut self,
        n: u64,
        indices: &[u32],
        chunks: &[&[DeviceSpan<'_>]],
    ) -> Result<usize> {
        let total = n * indices.len() as u64;
        let mut items = Vec::new();
        for (k, &i) in indices.iter().enumerate() {
            let pieces = chunks
                .get(i as usize)
                .ok_or_else(|| Error::internal(format!("chunk index {i} out of range")))?;
            chunk_items(k as u64 * n, pieces, &mut items);
        }
        let att = self.attachment()?;
        att.staging(total)?;
        let GpuAttachment {
            stream, staging, ..
        } = att;
        let r = stream.device_to_host(staging.as_mut().expect("ensured"), &items)?;
        att.record(true, r);
        Ok(total as usize)
    }

    /// Retrieves every chunk of `range` from a remote node over TCP into `out` (one device span
    /// per hash, each `object_bytes`): the bytes arrive in this client's pinned staging buffer
    /// and are copied into device memory (one wait). `false` (device memory untouched) if any
    /// chunk is missing.
    pub fn retrieve_to_device(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        lookup_session: Option<&str>,
        out: &[DeviceSpan<'_>],
    ) -> Result<bool> {
        self.retrieve_to_device_pieces(instance_id, range, lookup_session, &whole(out))
    }

    /// [`RemoteClient::retrieve_to_device`] into chunks made of pieces.
    pub fn retrieve_to_device_pieces(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        lookup_session: Option<&str>,
        out: &[&[DeviceSpan<'_>]],
    ) -> Result<bool> {
        let n = self.check_pieces(out, range)?;
        let total = n * out.len() as u64;
        self.attachment()?.staging(total)?;
        let att = self.gpu.as_mut().expect("checked");
        let mut staging = att.staging.take().expect("ensured");
        let got = {
            let mut bufs: Vec<&mut [u8]> = staging.inner_mut().as_mut_slice()[..total as usize]
                .chunks_mut(n as usize)
                .collect();
            self.retrieve_into(instance_id, range, lookup_session, &mut bufs)
        };
        let copied = match got {
            Ok(true) => {
                let mut items = Vec::new();
                for (k, pieces) in out.iter().enumerate() {
                    chunk_items(k as u64 * n, pieces, &mut items);
                }
                let att = self.gpu.as_mut().expect("checked");
                att.stream
                    .host_to_device(&staging, &items)
                    .map(|r| att.record(false, r))
                    .map(|()| true)
                    .map_err(Error::from)
            }
            other => other,
        };
        if let Some(att) = self.gpu.as_mut() {
            att.staging = Some(staging);
        }
        copied
    }
}
