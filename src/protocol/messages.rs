//! Native request and response payloads (rkyv-archived on the wire).
//!
//! The native API never resends token lists (LMCache weak point P3): clients send the 32-byte
//! chunk hashes of the range they touch, which the client library computes once per request.
// The rkyv derive generates undocumented `Archived*` mirrors; every hand-written item here is documented.
#![allow(missing_docs)]

use rkyv::{Archive, Deserialize, Serialize};

use crate::hashing::ChunkHash;

/// Which chunks of which model shard a transfer or lookup is about.
/// Invariant (checked by the server): `chunk_hashes.len() <= MAX_CHUNKS_PER_REQUEST`, model and
/// salt pass `ObjectKey` validation, `worker_id < world_size` when present.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ChunkRange {
    /// Model name (no `@`).
    pub model: String,
    /// KV world size of the writer/reader group.
    pub world_size: u32,
    /// This shard's rank; `None` = all ranks (scheduler-side lookups).
    pub worker_id: Option<u32>,
    /// Per-tenant isolation salt.
    pub cache_salt: String,
    /// Index of the first chunk of the range within the request (chunk_indices are relative to it).
    pub first_chunk: u32,
    /// Rolling hashes of the chunks, in order.
    pub chunk_hashes: Vec<ChunkHash>,
}

/// Engine-driven context registration (LMCache `RegisterEngineDrivenContextPayload`).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RegisterRequest {
    /// Caller-chosen instance id, unique per engine worker.
    pub instance_id: u64,
    /// Model name.
    pub model: String,
    /// KV world size.
    pub world_size: u32,
    /// Engine block size in tokens (metadata only).
    pub block_size: u32,
    /// Number of layers.
    pub num_layers: u32,
    /// `num_kv_heads * head_size`.
    pub hidden_dim: u32,
    /// PyTorch dtype name.
    pub dtype: String,
    /// One KV plane (MLA) instead of K and V.
    pub use_mla: bool,
    /// Token slots per chunk object; `None`: the node's chunk size (one slot per token). Fewer
    /// under decode-context parallelism (LMCache 0.5.6 `num_physical_slots`); within
    /// `1..=MAX_PHYSICAL_SLOTS` (`modules::context`).
    pub physical_slots: Option<u32>,
}

/// One block-allocation record (vLLM scheduler report).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct BlockAllocationRecord {
    /// Request id.
    pub req_id: String,
    /// Newly allocated block ids.
    pub new_block_ids: Vec<u64>,
    /// Newly scheduled token ids.
    pub new_token_ids: Vec<u32>,
}

/// A buffer of a remote engine registered with the node (RDMA: a memory region the engine
/// registered for remote read and write). Invariant (checked by the node): `len > 0`,
/// `addr + len` does not overflow, ids unique per connection.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Engine-chosen id, named by [`RemoteBuf::region`].
    pub id: u32,
    /// Virtual address of the region's first byte in the engine.
    pub addr: u64,
    /// Bytes in the region.
    pub len: u64,
    /// Remote key of the region (RDMA).
    pub rkey: u32,
}

/// Where one slot's bytes are in a remote engine's registered memory. Invariant (checked by the
/// node): inside its region, `len` equal to the slot's length.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBuf {
    /// Id of a region registered over this connection.
    pub region: u32,
    /// Offset of the first byte within the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// How the bytes of a remote store or retrieve travel.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum DataPath {
    /// In the frame's trailer on the TCP stream, slot after slot in the transfer's order.
    Inline,
    /// The node reads (store) or writes (retrieve) the engine's registered memory, one buffer
    /// per slot in the transfer's order (RDMA).
    Remote(Vec<RemoteBuf>),
}

/// Every native request. The frame header's opcode must equal [`Request::opcode`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Connectivity probe; answered `Text("OK")`.
    Noop,
    /// Liveness heartbeat; refreshes and latches the instance (unknown ids are ignored).
    Ping {
        /// The pinging instance, if any.
        instance_id: Option<u64>,
    },
    /// The configured chunk size in tokens.
    GetChunkSize,
    /// Register (or refresh) an engine-driven context; the reply carries the pool fd.
    Register(RegisterRequest),
    /// Unregister an instance, releasing its pending transfers.
    Unregister {
        /// Instance to drop.
        instance_id: u64,
    },
    /// Reserve slots for the absent chunks of a range.
    PrepareStore {
        /// Writing instance.
        instance_id: u64,
        /// Chunks to store (`worker_id` required).
        range: ChunkRange,
    },
    /// Publish a prepared store.
    CommitStore {
        /// Writing instance.
        instance_id: u64,
        /// Id from the prepare reply.
        transfer_id: u64,
    },
    /// Free a prepared store without publishing it.
    AbortStore {
        /// Writing instance.
        instance_id: u64,
        /// Id from the prepare reply.
        transfer_id: u64,
    },
    /// Get slots for every chunk of a range (all-or-nothing).
    PrepareRetrieve {
        /// Reading instance.
        instance_id: u64,
        /// Chunks to read (`worker_id` required).
        range: ChunkRange,
        /// `Some(request_id)`: rely on the read locks that LOOKUP `request_id` took (LMCache
        /// semantics: no new lock; the commit releases one lock per chunk and the session
        /// forgets it). `None`: take a fresh read lock on each chunk.
        lookup_session: Option<String>,
    },
    /// Release the read locks of a prepared retrieve.
    CommitRetrieve {
        /// Reading instance.
        instance_id: u64,
        /// Id from the prepare reply.
        transfer_id: u64,
    },
    /// Prefix hit count for all ranks, taking one read lock per reader on each object of the
    /// hit prefix.
    Lookup {
        /// Session id (LMCache request id).
        request_id: String,
        /// All chunks of the request (`worker_id` must be `None`).
        range: ChunkRange,
        /// vLLM tensor-parallel size: the legacy (LMCache 0.5.4) reader rule when `readers` is 0.
        tp_size: u32,
        /// Workers that will retrieve each object (LMCache 0.5.6 `num_kv_readers`), within
        /// `1..=MAX_KV_READERS` (`modules::lookup`); 0: derive it from `tp_size` and the world
        /// size.
        readers: u32,
    },
    /// Release lookup locks of chunks `[start_chunk, end_chunk)` clipped to the hit length.
    FreeLookupLocks {
        /// Session id.
        request_id: String,
        /// First chunk.
        start_chunk: u32,
        /// One past the last chunk.
        end_chunk: u32,
    },
    /// End a session: refresh recency of its chunks and forget it.
    EndSession {
        /// Session id.
        request_id: String,
    },
    /// vLLM block-allocation report, published to the event bus.
    ReportBlockAllocation {
        /// Reporting instance.
        instance_id: u64,
        /// Model name.
        model: String,
        /// Records.
        records: Vec<BlockAllocationRecord>,
    },
    /// Drop every object (in-flight ones when their transfer ends).
    Clear,
    /// The status report as JSON.
    Status,
    /// Run the invariant check.
    Memcheck,
    /// Remote engines only: move a prepared store's bytes into its slots (from the frame's
    /// trailer, or from the engine's registered memory), then publish it if `commit`.
    WriteSlots {
        /// Writing instance.
        instance_id: u64,
        /// Id from the prepare reply.
        transfer_id: u64,
        /// Where the bytes are.
        data: DataPath,
        /// Publish the store once the bytes are in (saves the COMMIT_STORE round trip).
        commit: bool,
    },
    /// Remote engines only: move a prepared retrieve's slots to the engine (in the reply's
    /// trailer, or into its registered memory), then release its locks if `commit`.
    ReadSlots {
        /// Reading instance.
        instance_id: u64,
        /// Id from the prepare reply.
        transfer_id: u64,
        /// Where the bytes go.
        data: DataPath,
        /// Release the read locks once the bytes are out (saves the COMMIT_RETRIEVE round trip).
        commit: bool,
    },
    /// Remote engines only: register buffers that later `DataPath::Remote` descriptors name.
    RegisterBuffers {
        /// The regions.
        regions: Vec<RemoteRegion>,
    },
    /// Remote engines only: forget registered buffers (refused while a transfer uses one).
    UnregisterBuffers {
        /// Region ids.
        ids: Vec<u32>,
    },
}

impl Request {
    /// Stable opcode of this request type (frame header field).
    pub fn opcode(&self) -> u16 {
        match self {
            Request::Noop => 1,
            Request::Ping { .. } => 2,
            Request::GetChunkSize => 3,
            Request::Register(_) => 4,
            Request::Unregister { .. } => 5,
            Request::PrepareStore { .. } => 6,
            Request::CommitStore { .. } => 7,
            Request::AbortStore { .. } => 8,
            Request::PrepareRetrieve { .. } => 9,
            Request::CommitRetrieve { .. } => 10,
            Request::Lookup { .. } => 11,
            Request::FreeLookupLocks { .. } => 12,
            Request::EndSession { .. } => 13,
            Request::ReportBlockAllocation { .. } => 14,
            Request::Clear => 15,
            Request::Status => 16,
            Request::Memcheck => 17,
            Request::WriteSlots { .. } => 18,
            Request::ReadSlots { .. } => 19,
            Request::RegisterBuffers { .. } => 20,
            Request::UnregisterBuffers { .. } => 21,
        }
    }

    /// The instance a request belongs to, if it must run in that instance's order.
    pub fn instance_affinity(&self) -> Option<u64> {
        match self {
            Request::Unregister { instance_id }
            | Request::PrepareStore { instance_id, .. }
            | Request::CommitStore { instance_id, .. }
            | Request::AbortStore { instance_id, .. }
            | Request::PrepareRetrieve { instance_id, .. }
            | Request::CommitRetrieve { instance_id, .. } => Some(*instance_id),
            _ => None,
        }
    }
}

/// A slot in the shared pool. Invariant: `offset + length <= pool_bytes`, `offset % 4096 == 0`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireSlot {
    /// Byte offset in the pool.
    pub offset: u64,
    /// Logical object size in bytes.
    pub length: u64,
}

/// Shape and dtype shared by every slot of a reply (all objects of a layout are alike).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct WireLayout {
    /// Tensor shape.
    pub shape: Vec<u64>,
    /// PyTorch dtype name.
    pub dtype: String,
}

/// Reply to a registration. The pool fd travels alongside (SCM_RIGHTS) when the transport can.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RegisterReply {
    /// Pool size in bytes (map this much of the received fd).
    pub pool_bytes: u64,
    /// `hugetlb-2m`, `hugetlb-1g`, `thp` or `4k`.
    pub pool_backing: String,
    /// Name of the POSIX shm segment backing the pool, if any (LMCache clients open it by name).
    pub shm_name: String,
    /// Tokens per chunk.
    pub chunk_tokens: u32,
    /// Layout of this instance's objects.
    pub layout: WireLayout,
    /// Bytes per object.
    pub object_bytes: u64,
    /// Whether the pool fd is attached to this frame.
    pub fd_attached: bool,
}

/// Every native response. Each request gets exactly one, carrying the request id in its header.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// Generic success without data.
    Ok,
    /// A text answer (NOOP's "OK", STATUS's JSON).
    Text(String),
    /// A numeric answer (chunk size).
    Number(u64),
    /// Registration result.
    Registered(RegisterReply),
    /// Unregistration result.
    Unregistered {
        /// Pending writes freed.
        released_writes: u32,
        /// Pending reads unlocked.
        released_reads: u32,
    },
    /// Slots to copy into. `chunk_indices[i]` is the position (within the range) of `slots[i]`.
    /// Empty slots = everything cached already; then `transfer_id` is 0 and no commit is needed.
    StorePrepared {
        /// Id to commit or abort with.
        transfer_id: u64,
        /// Reserved slots.
        slots: Vec<WireSlot>,
        /// Chunk positions of the slots.
        chunk_indices: Vec<u32>,
        /// Layout of every slot.
        layout: WireLayout,
    },
    /// Result of a commit.
    StoreCommitted {
        /// Objects now readable.
        published: u32,
    },
    /// Result of an abort.
    StoreAborted {
        /// Objects freed.
        freed: u32,
    },
    /// Slots to copy from, one per chunk in order; `hit == false` means a miss (nothing held).
    RetrievePrepared {
        /// Whether every chunk was available.
        hit: bool,
        /// Id to commit with (0 on a miss).
        transfer_id: u64,
        /// Slots, one per chunk.
        slots: Vec<WireSlot>,
        /// Layout of every slot.
        layout: WireLayout,
    },
    /// Prefix hit count of a lookup, in chunks.
    LookupHits {
        /// Chunks hit (all ranks present).
        chunks: u32,
    },
    /// CLEAR result.
    Cleared {
        /// Objects deleted at once.
        deleted: u64,
        /// Objects doomed, freed when their transfer ends.
        deferred: u64,
    },
    /// Memcheck result.
    Memcheck {
        /// Whether every invariant holds.
        ok: bool,
        /// Violations, if any.
        problems: Vec<String>,
    },
    /// Result of WRITE_SLOTS.
    SlotsWritten {
        /// Bytes moved into the slots.
        bytes: u64,
        /// Objects published (`Some` when the request asked for the commit).
        published: Option<u32>,
    },
    /// Result of READ_SLOTS; with `DataPath::Inline` the frame's trailer carries the `bytes`.
    SlotsRead {
        /// Bytes moved out of the slots.
        bytes: u64,
    },
    /// Result of REGISTER_BUFFERS.
    BuffersRegistered {
        /// Regions now registered over this connection.
        count: u32,
    },
    /// A typed error.
    Error {
        /// `ErrorKind` wire code.
        kind: u16,
        /// Human-readable context.
        message: String,
    },
}

impl Response {
    /// Builds the error response for `e`.
    pub fn error(e: &crate::error::Error) -> Response {
        Response::Error {
            kind: e.kind.code(),
            message: e.context.clone(),
        }
    }
}
