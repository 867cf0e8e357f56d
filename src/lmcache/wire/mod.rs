//! Msgpack wire codec for the LMCache multiprocess ("MP") protocol, as spoken by the
//! unmodified LMCache 0.5.4–0.5.6 Python client (vLLM connector / worker adapter).
//!
//! The transport is ZeroMQ DEALER → ROUTER. A request, as the DEALER sends it, is
//! `[uid, type, payload_0, …, payload_n]`; every frame is an independent msgpack document
//! produced by msgspec. This module only deals with the *contents* of frames:
//!
//! * [`parse_op`] decodes the type frame (frame 1): a legacy integer id or, for 0.5.6, a
//!   snake_case operation name string.
//! * [`decode_request`] decodes the payload frames (frames 2..) of one operation into an
//!   [`LmRequest`]. Decoders are lenient where msgspec is (unknown map keys are ignored,
//!   integers of any width are accepted) and strict elsewhere; hostile input never panics, it
//!   yields a [`WireError`].
//! * The `encode_*` functions produce reply payloads byte-for-byte as msgspec would (smallest
//!   integer forms, `str` vs `bin`, maps in declaration order with every field present), plus
//!   client-side encoders for tests and a Rust test client.
//!
//! Frame numbers in [`WireError::Malformed`] follow the DEALER-side request layout: `1` is the
//! type frame and `2 + i` is payload frame `i` (the uid frame, 0, is not decoded here).
//!
//! Files: `op` (the type frame), `reader` (the msgpack tokenizer), `decode` (payload frames),
//! `encode` (replies and client-side frames); the error and message types live here.

mod decode;
mod encode;
mod op;
mod reader;
#[cfg(test)]
mod tests;

pub use decode::{decode_request, decode_request_limited};
pub use encode::{
    encode_bin_bool, encode_bool, encode_key, encode_op, encode_prepare_retrieve_reply,
    encode_prepare_store_reply, encode_register_payload, encode_register_reply, encode_str,
    encode_str_list, encode_uint, SlotDesc,
};
pub use op::{parse_op, Op};

/// Errors produced while decoding LMCache request frames.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WireError {
    /// A frame is not a single well-formed msgpack document (truncated, reserved marker,
    /// trailing bytes).
    #[error("malformed msgpack in frame {frame}: {detail}")]
    Malformed {
        /// Frame index in the DEALER-side request: 1 = type frame, 2 + i = payload frame i.
        frame: usize,
        /// What was wrong.
        detail: String,
    },
    /// The request carries the wrong number of payload frames for its operation.
    #[error("request type {op}: expected {expected} payload frames, got {got}")]
    FrameCount {
        /// Printable operation name (as returned by [`parse_op`]).
        op: String,
        /// Accepted frame count(s), e.g. `"2"` or `"2 or 3"`.
        expected: String,
        /// Number of payload frames received.
        got: usize,
    },
    /// A well-formed request beyond a configured limit (e.g. more tokens than
    /// `max_tokens_per_request`), refused before what it announces is allocated.
    #[error("field {field}: {detail}")]
    Limit {
        /// Dotted path of the offending field.
        field: String,
        /// The size seen and the limit, named.
        detail: String,
    },
    /// Well-formed msgpack whose value does not fit the expected schema (wrong type, missing
    /// required field, out-of-range or invalid value).
    #[error("field {field}: {detail}")]
    Field {
        /// Dotted path of the offending field, e.g. `key.token_ids` or `records[2].req_id`.
        field: String,
        /// What was wrong.
        detail: String,
    },
}

type Result<T> = std::result::Result<T, WireError>;

fn field_err(field: &str, detail: impl Into<String>) -> WireError {
    WireError::Field {
        field: field.to_string(),
        detail: detail.into(),
    }
}

/// LMCache IPCCacheServerKey. Decoding accepts the 8-field (0.5.4) and 10-field (0.5.5+:
/// `request_configs`, `num_kv_readers`) maps, ignores unknown keys, requires
/// `model_name`/`world_size`/`token_ids`/`start`/`end` (and the `worker_id` entry, whose value
/// may be nil); `request_id` and `cache_salt` default to `""`. Every token id must be < 2^32
/// (else a [`WireError::Field`] error). Like the Python key's validation, `model_name` must not
/// contain `@`, and `cache_salt` must not contain `@`, `/`, `\` or NUL and is at most 128
/// characters long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcKey {
    /// Model identifier.
    pub model_name: String,
    /// KV world size (number of KV shards per chunk).
    pub world_size: u32,
    /// This shard's index in `[0, world_size)`; `None` (nil) for scheduler keys = all shards.
    pub worker_id: Option<u32>,
    /// The request's whole token sequence so far.
    pub token_ids: Vec<u32>,
    /// Start of the operation's token range.
    pub start: u64,
    /// End (exclusive) of the operation's token range.
    pub end: u64,
    /// Session id (not part of the key's identity).
    pub request_id: String,
    /// Per-tenant isolation salt (part of the key's identity).
    pub cache_salt: String,
    /// Workers that will retrieve this key's objects (0.5.6+): a LOOKUP takes that many read
    /// locks per object. 0 = not sent (0.5.4 clients): the legacy rule from the LOOKUP's tp
    /// argument applies. Not part of the key's identity.
    pub num_kv_readers: u32,
}

/// RegisterEngineDrivenContextPayload (unknown extra fields ignored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisterPayload {
    /// Engine instance id (workers use a random 63-bit value).
    pub instance_id: u64,
    /// Model identifier.
    pub model_name: String,
    /// KV world size.
    pub world_size: u32,
    /// Engine block size in tokens (metadata only).
    pub block_size: u32,
    /// Number of layers.
    pub num_layers: u32,
    /// `num_kv_heads × head_size`.
    pub hidden_dim_size: u32,
    /// torch dtype name without the `torch.` prefix, e.g. `bfloat16`.
    pub dtype_str: String,
    /// One KV plane (MLA / fused formats) instead of separate K and V planes.
    pub use_mla: bool,
    /// Token slots per chunk object (0.5.6+, e.g. fewer than the chunk's tokens under decode
    /// context parallelism); `None` (absent or nil): one per token of a chunk.
    pub num_physical_slots: Option<u32>,
}

/// One entry of a REPORT_BLOCK_ALLOCATION records list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRecord {
    /// vLLM request id.
    pub req_id: String,
    /// Newly allocated block ids.
    pub new_block_ids: Vec<u64>,
    /// Newly scheduled token ids.
    pub new_token_ids: Vec<u64>,
}

/// A decoded LMCache request (payload frames of one operation).
#[derive(Debug, Clone, PartialEq)]
pub enum LmRequest {
    /// GET_CHUNK_SIZE: no payload; reply [`encode_uint`].
    GetChunkSize,
    /// GET_EXPERIMENTAL: no payload; reply [`encode_str_list`].
    GetExperimental,
    /// NOOP: no payload; reply [`encode_str`]`("OK")`.
    Noop,
    /// PING: reply [`encode_bool`]`(true)`.
    Ping {
        /// Instance to refresh; `None` (nil) for an untracked prober.
        instance_id: Option<u64>,
    },
    /// REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT: reply [`encode_register_reply`].
    RegisterEngineDriven(RegisterPayload),
    /// UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT: no reply payload.
    UnregisterEngineDriven {
        /// Instance to unregister.
        instance_id: u64,
    },
    /// PREPARE_STORE: reply [`encode_prepare_store_reply`].
    PrepareStore {
        /// Key (worker_id set).
        key: IpcKey,
        /// Registered engine instance.
        instance_id: u64,
    },
    /// COMMIT_STORE: reply [`encode_bool`].
    CommitStore {
        /// Key (worker_id set).
        key: IpcKey,
        /// Registered engine instance.
        instance_id: u64,
        /// Inline data: empty in SHM mode, a Python pickle in pickle mode. A missing third
        /// frame is accepted as empty.
        cpu_data: Vec<u8>,
    },
    /// PREPARE_RETRIEVE: reply [`encode_prepare_retrieve_reply`].
    PrepareRetrieve {
        /// Key (worker_id set).
        key: IpcKey,
        /// Registered engine instance.
        instance_id: u64,
    },
    /// COMMIT_RETRIEVE: reply [`encode_bool`]`(true)`.
    CommitRetrieve {
        /// Key (worker_id set).
        key: IpcKey,
        /// Registered engine instance.
        instance_id: u64,
    },
    /// LOOKUP: no reply payload; the job is registered under `key.request_id`.
    Lookup {
        /// Key (worker_id nil = all shards).
        key: IpcKey,
        /// Engine tensor-parallel size.
        tp_size: u32,
    },
    /// QUERY_PREFETCH_STATUS: reply hit chunks ([`encode_uint`]) or nothing while in progress.
    QueryPrefetchStatus {
        /// Session id used by the LOOKUP.
        request_id: String,
    },
    /// WAIT_PREFETCH_STATUS: reply hit chunks or nothing on timeout.
    WaitPrefetchStatus {
        /// Session id used by the LOOKUP.
        request_id: String,
        /// Wait limit in seconds; sent as int or float. Always finite and ≥ 0 (negative values
        /// are clamped to 0, NaN/infinity are rejected).
        timeout_secs: f64,
    },
    /// QUERY_PREFETCH_LOOKUP_HITS: reply hit count or nothing.
    QueryPrefetchLookupHits {
        /// Session id used by the LOOKUP.
        request_id: String,
    },
    /// FREE_LOOKUP_LOCKS: no reply payload.
    FreeLookupLocks {
        /// Key (worker_id nil).
        key: IpcKey,
        /// Engine tensor-parallel size.
        tp_size: u32,
    },
    /// END_SESSION: no reply payload.
    EndSession {
        /// Session to drop.
        request_id: String,
    },
    /// REPORT_BLOCK_ALLOCATION: no reply payload.
    ReportBlockAllocation {
        /// Scheduler pid.
        instance_id: u64,
        /// Model identifier.
        model_name: String,
        /// Allocation records.
        records: Vec<BlockRecord>,
    },
    /// CLEAR: 0 frames (0.5.4) or 1 bool frame (0.5.6); no reply payload.
    Clear {
        /// The `force` flag when sent (a nil frame also reads as `None`).
        force: Option<bool>,
    },
    /// Known op that kvnode does not serve (GPU CUDA-IPC path, Q cache, CacheBlend, P2P):
    /// payload not decoded.
    Unsupported {
        /// The op from [`parse_op`].
        op: Op,
        /// Its printable name.
        name: String,
    },
}
