//! The blocking native client: connect, register (receiving and mapping the pool), and store or
//! retrieve chunks by copying straight into or out of the shared pool. The same client talks
//! to a node on another host over TCP ([`RemoteClient`]): the node then moves each chunk's
//! bytes between its pool and the client's buffers.
//!
//! ```no_run
//! use kvnode::client::{Client, ChunkRangeBuilder};
//! let mut c = Client::connect("/tmp/kvnode.sock")?;
//! c.register(&kvnode::protocol::RegisterRequest {
//!     instance_id: 1, model: "m".into(), world_size: 1, block_size: 16,
//!     num_layers: 2, hidden_dim: 128, dtype: "bfloat16".into(), use_mla: false,
//!     physical_slots: None,
//! })?;
//! let tokens: Vec<u32> = (0..512).collect();
//! let range = ChunkRangeBuilder::worker("m", 1, 0).tokens(&tokens, c.chunk_tokens()?);
//! let chunk = vec![7u8; c.object_bytes()? as usize];
//! c.store(1, &range, &[&chunk, &chunk])?;
//! assert!(c.retrieve(1, &range)?.is_some());
//! # Ok::<(), kvnode::error::Error>(())
//! ```

use std::os::fd::OwnedFd;
use std::time::Duration;

mod connect;
pub mod gpu;
mod local;
pub mod remote;
pub mod remote_gpu;
pub mod remote_rdma;

use kvnode_hw::PoolMapping;
use rkyv::util::AlignedVec;

use crate::error::{Error, ErrorKind, Result};
use crate::hashing::{chunk_hashes, ChunkHash};
use crate::protocol::frame::{
    decode_response, encode_request, FrameError, FrameHeader, FrameReader,
};
use crate::protocol::{ChunkRange, RegisterReply, Request, Response, WireLayout, WireSlot};

pub use self::gpu::{GpuAttachment, GpuTransferStats, MAX_GPU_STAGING_BYTES};
pub use self::local::UnixTransport;
pub use self::remote::{RemoteClient, RemoteOptions, TcpTransport};
pub use self::remote_gpu::DevicePath;
pub use self::remote_rdma::{BufSpan, BufferId, FabricChoice};

/// Builds [`ChunkRange`]s from token lists (hashing on the client, once).
pub struct ChunkRangeBuilder {
    model: String,
    world_size: u32,
    worker_id: Option<u32>,
    cache_salt: String,
}

impl ChunkRangeBuilder {
    /// A range for one worker shard (store / retrieve).
    pub fn worker(model: &str, world_size: u32, worker_id: u32) -> Self {
        ChunkRangeBuilder {
            model: model.to_owned(),
            world_size,
            worker_id: Some(worker_id),
            cache_salt: String::new(),
        }
    }

    /// A range for all ranks (scheduler lookups).
    pub fn all_ranks(model: &str, world_size: u32) -> Self {
        ChunkRangeBuilder {
            model: model.to_owned(),
            world_size,
            worker_id: None,
            cache_salt: String::new(),
        }
    }

    /// Sets the per-tenant salt.
    pub fn salt(mut self, salt: &str) -> Self {
        self.cache_salt = salt.to_owned();
        self
    }

    /// The range of every full chunk of `tokens`.
    pub fn tokens(&self, tokens: &[u32], chunk_tokens: u32) -> ChunkRange {
        self.hashes(0, chunk_hashes(tokens, chunk_tokens))
    }

    /// A range from precomputed hashes, starting at chunk `first_chunk` of the request.
    pub fn hashes(&self, first_chunk: u32, chunk_hashes: Vec<ChunkHash>) -> ChunkRange {
        ChunkRange {
            model: self.model.clone(),
            world_size: self.world_size,
            worker_id: self.worker_id,
            cache_salt: self.cache_salt.clone(),
            first_chunk,
            chunk_hashes,
        }
    }
}

/// A prepared store as the client sees it.
#[derive(Debug, Clone)]
pub struct StorePrepared {
    /// Id to commit or abort (0 when nothing was reserved).
    pub transfer_id: u64,
    /// Reserved slots.
    pub slots: Vec<WireSlot>,
    /// Chunk position of each slot.
    pub chunk_indices: Vec<u32>,
    /// Layout of each slot.
    pub layout: WireLayout,
}

/// A prepared retrieve (`None` from `prepare_retrieve` means a miss).
#[derive(Debug, Clone)]
pub struct RetrievePrepared {
    /// Id to commit.
    pub transfer_id: u64,
    /// One slot per chunk.
    pub slots: Vec<WireSlot>,
    /// Layout of each slot.
    pub layout: WireLayout,
}

/// How a [`Client`] reaches its node: a local Unix socket ([`UnixTransport`]) or an
/// authenticated TCP connection ([`TcpTransport`]). Invariant: `send_frame` writes a whole frame
/// (with its trailer, when the caller sends one right after) without interleaving anything else.
pub trait ClientTransport {
    /// Writes one whole frame.
    fn send_frame(&mut self, frame: &[u8]) -> Result<()>;
    /// Reads the next frame into `payload`, with any file descriptor that came with it.
    fn read_frame(
        &mut self,
        reader: &mut FrameReader,
        payload: &mut AlignedVec<16>,
    ) -> std::result::Result<Option<(FrameHeader, Option<OwnedFd>)>, FrameError>;
    /// Bounds how long one read or write may block (`None`: forever).
    fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<()>;
}

/// A blocking connection to a node. Invariant: responses are matched to requests by id; a
/// mismatch is an error, never silently accepted.
pub struct Client<T: ClientTransport = UnixTransport> {
    stream: T,
    next_id: u64,
    payload: AlignedVec<16>,
    reader: FrameReader,
    /// The GPU attachment; dropped before `pool` (its registration of the pool ends first,
    /// although it holds its own reference to the mapping anyway).
    gpu: Option<GpuAttachment>,
    pool: Option<std::sync::Arc<PoolMapping>>,
    registration: Option<RegisterReply>,
}

pub(crate) fn frame_err(e: FrameError) -> Error {
    match e {
        FrameError::Io(m) if m.contains("timed out") || m.contains("temporarily unavailable") => {
            Error::new(
                ErrorKind::Io,
                format!("the node did not answer in time ({m}): still starting up, or hung"),
            )
        }
        FrameError::Io(m) => Error::new(ErrorKind::Io, m),
        FrameError::Truncated => Error::new(ErrorKind::Io, "node closed the connection"),
        other => Error::invalid(format!("bad frame from node: {other}")),
    }
}

impl<T: ClientTransport> Client<T> {
    /// Bounds how long a reply may take (`None`: wait forever, the default). A call that runs
    /// past it fails with an error saying the node did not answer in time.
    pub fn set_timeout(&mut self, timeout: Option<std::time::Duration>) -> Result<()> {
        self.stream.set_timeout(timeout)
    }

    fn over(stream: T) -> Client<T> {
        Client {
            stream,
            next_id: 1,
            payload: AlignedVec::new(),
            reader: FrameReader::default(),
            gpu: None,
            pool: None,
            registration: None,
        }
    }

    /// Sends a request without waiting (pipelining); returns its request id.
    pub fn send(&mut self, req: &Request) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode_request(id, req).map_err(frame_err)?;
        self.stream.send_frame(&frame)?;
        Ok(id)
    }

    /// Receives the next response: (request id, response, fd if one was attached).
    pub fn recv(&mut self) -> Result<(u64, Response, Option<OwnedFd>)> {
        let (h, fd) = self
            .stream
            .read_frame(&mut self.reader, &mut self.payload)
            .map_err(frame_err)?
            .ok_or_else(|| Error::new(ErrorKind::Io, "node closed the connection"))?;
        let resp = decode_response(&self.payload).map_err(frame_err)?;
        Ok((h.request_id, resp, fd))
    }

    pub(crate) fn call_with_fd(&mut self, req: &Request) -> Result<(Response, Option<OwnedFd>)> {
        let id = match self.send(req) {
            Ok(id) => id,
            Err(e) => {
                // A node that refused the connection closed it after its answer: that answer
                // says why, where the failed send would only say "broken pipe".
                if let Ok((0, Response::Error { kind, message }, _)) = self.recv() {
                    return Err(Error::new(ErrorKind::from_code(kind), message));
                }
                return Err(e);
            }
        };
        let (got, resp, fd) = self.recv()?;
        if got == 0 {
            // Request id 0 is never used by a client: a connection-level answer (refused
            // connection, unframeable request), after which the node closes the connection.
            if let Response::Error { kind, message } = resp {
                return Err(Error::new(ErrorKind::from_code(kind), message));
            }
        }
        if got != id {
            return Err(Error::internal(format!(
                "response id {got} for request {id}"
            )));
        }
        match resp {
            Response::Error { kind, message } => {
                Err(Error::new(ErrorKind::from_code(kind), message))
            }
            r => Ok((r, fd)),
        }
    }

    /// Sends a request and waits for its response; typed errors come back as `Err`.
    pub fn call(&mut self, req: &Request) -> Result<Response> {
        self.call_with_fd(req).map(|(r, _)| r)
    }

    pub(crate) fn unexpected(r: Response) -> Error {
        Error::internal(format!("unexpected response {r:?}"))
    }

    fn registration(&self) -> Result<&RegisterReply> {
        self.registration
            .as_ref()
            .ok_or_else(|| Error::new(ErrorKind::NotRegistered, "register before transferring"))
    }

    /// Bytes per object of the registered layout.
    pub fn object_bytes(&self) -> Result<u64> {
        Ok(self.registration()?.object_bytes)
    }

    /// Tokens per chunk (from the registration, else asked from the node).
    pub fn chunk_tokens(&mut self) -> Result<u32> {
        if let Some(r) = &self.registration {
            return Ok(r.chunk_tokens);
        }
        match self.call(&Request::GetChunkSize)? {
            Response::Number(n) => {
                u32::try_from(n).map_err(|_| Error::internal("chunk size out of range"))
            }
            r => Err(Self::unexpected(r)),
        }
    }

    /// Heartbeat.
    pub fn ping(&mut self, instance_id: Option<u64>) -> Result<()> {
        self.call(&Request::Ping { instance_id }).map(drop)
    }

    /// Connectivity probe: the node answers "OK".
    pub fn noop(&mut self) -> Result<String> {
        match self.call(&Request::Noop)? {
            Response::Text(t) => Ok(t),
            r => Err(Self::unexpected(r)),
        }
    }

    /// The status report as a JSON string.
    pub fn status_json(&mut self) -> Result<String> {
        match self.call(&Request::Status)? {
            Response::Text(t) => Ok(t),
            r => Err(Self::unexpected(r)),
        }
    }

    /// The status report, parsed.
    pub fn status(&mut self) -> Result<serde_json::Value> {
        let t = self.status_json()?;
        serde_json::from_str(&t).map_err(|e| Error::internal(format!("status JSON: {e}")))
    }

    /// Drops every object; returns (deleted now, deferred until their transfer ends).
    pub fn clear(&mut self) -> Result<(u64, u64)> {
        match self.call(&Request::Clear)? {
            Response::Cleared { deleted, deferred } => Ok((deleted, deferred)),
            r => Err(Self::unexpected(r)),
        }
    }

    /// Runs the node's invariant check.
    pub fn memcheck(&mut self) -> Result<(bool, Vec<String>)> {
        match self.call(&Request::Memcheck)? {
            Response::Memcheck { ok, problems } => Ok((ok, problems)),
            r => Err(Self::unexpected(r)),
        }
    }

    /// Unregisters an instance; returns (pending writes freed, pending reads released).
    pub fn unregister(&mut self, instance_id: u64) -> Result<(u32, u32)> {
        match self.call(&Request::Unregister { instance_id })? {
            Response::Unregistered {
                released_writes,
                released_reads,
            } => Ok((released_writes, released_reads)),
            r => Err(Self::unexpected(r)),
        }
    }

    /// PREPARE_STORE: slots for the chunks the node does not have yet.
    pub fn prepare_store(&mut self, instance_id: u64, range: &ChunkRange) -> Result<StorePrepared> {
        match self.call(&Request::PrepareStore {
            instance_id,
            range: range.clone(),
        })? {
            Response::StorePrepared {
                transfer_id,
                slots,
                chunk_indices,
                layout,
            } => Ok(StorePrepared {
                transfer_id,
                slots,
                chunk_indices,
                layout,
            }),
            r => Err(Self::unexpected(r)),
        }
    }

    /// COMMIT_STORE: publishes a prepared store; returns objects published.
    pub fn commit_store(&mut self, instance_id: u64, transfer_id: u64) -> Result<u32> {
        match self.call(&Request::CommitStore {
            instance_id,
            transfer_id,
        })? {
            Response::StoreCommitted { published } => Ok(published),
            r => Err(Self::unexpected(r)),
        }
    }

    /// ABORT_STORE: frees a prepared store; returns objects freed.
    pub fn abort_store(&mut self, instance_id: u64, transfer_id: u64) -> Result<u32> {
        match self.call(&Request::AbortStore {
            instance_id,
            transfer_id,
        })? {
            Response::StoreAborted { freed } => Ok(freed),
            r => Err(Self::unexpected(r)),
        }
    }

    /// PREPARE_RETRIEVE: slots for every chunk, or `None` on a (whole-request) miss. With
    /// `lookup_session`, relies on the read locks that LOOKUP of that request id took.
    pub fn prepare_retrieve(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        lookup_session: Option<&str>,
    ) -> Result<Option<RetrievePrepared>> {
        match self.call(&Request::PrepareRetrieve {
            instance_id,
            range: range.clone(),
            lookup_session: lookup_session.map(str::to_owned),
        })? {
            Response::RetrievePrepared {
                hit,
                transfer_id,
                slots,
                layout,
            } => Ok(hit.then_some(RetrievePrepared {
                transfer_id,
                slots,
                layout,
            })),
            r => Err(Self::unexpected(r)),
        }
    }

    /// COMMIT_RETRIEVE: releases the read locks of a prepared retrieve.
    pub fn commit_retrieve(&mut self, instance_id: u64, transfer_id: u64) -> Result<()> {
        self.call(&Request::CommitRetrieve {
            instance_id,
            transfer_id,
        })
        .map(drop)
    }

    /// LOOKUP: prefix hit count (chunks) over all ranks, locking the hit prefix.
    pub fn lookup(&mut self, request_id: &str, range: &ChunkRange, tp_size: u32) -> Result<u32> {
        match self.call(&Request::Lookup {
            request_id: request_id.to_owned(),
            range: range.clone(),
            tp_size,
            readers: 0,
        })? {
            Response::LookupHits { chunks } => Ok(chunks),
            r => Err(Self::unexpected(r)),
        }
    }

    /// FREE_LOOKUP_LOCKS for chunks `[start, end)`.
    pub fn free_lookup_locks(&mut self, request_id: &str, start: u32, end: u32) -> Result<()> {
        self.call(&Request::FreeLookupLocks {
            request_id: request_id.to_owned(),
            start_chunk: start,
            end_chunk: end,
        })
        .map(drop)
    }

    /// END_SESSION.
    pub fn end_session(&mut self, request_id: &str) -> Result<()> {
        self.call(&Request::EndSession {
            request_id: request_id.to_owned(),
        })
        .map(drop)
    }
}
