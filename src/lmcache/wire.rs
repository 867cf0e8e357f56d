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

use rmp::Marker;

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
}

/// RegisterEngineDrivenContextPayload (extra fields such as `num_physical_slots` ignored).
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

/// The operation named by the type frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// REGISTER_KV_CACHE (#1, GPU CUDA-IPC path).
    RegisterKvCache,
    /// UNREGISTER_KV_CACHE (#2, GPU path).
    UnregisterKvCache,
    /// STORE (#6, GPU path).
    Store,
    /// RETRIEVE (#7, GPU path).
    Retrieve,
    /// LOOKUP (#8).
    Lookup,
    /// QUERY_PREFETCH_STATUS (#9).
    QueryPrefetchStatus,
    /// WAIT_PREFETCH_STATUS (#10).
    WaitPrefetchStatus,
    /// QUERY_PREFETCH_LOOKUP_HITS (#11).
    QueryPrefetchLookupHits,
    /// FREE_LOOKUP_LOCKS (#12).
    FreeLookupLocks,
    /// END_SESSION (#13).
    EndSession,
    /// REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT (#14).
    RegisterEngineDriven,
    /// UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT (#15).
    UnregisterEngineDriven,
    /// PREPARE_STORE (#16).
    PrepareStore,
    /// COMMIT_STORE (#17).
    CommitStore,
    /// PREPARE_RETRIEVE (#18).
    PrepareRetrieve,
    /// COMMIT_RETRIEVE (#19).
    CommitRetrieve,
    /// CLEAR (#20).
    Clear,
    /// GET_CHUNK_SIZE (#21).
    GetChunkSize,
    /// PING (#22).
    Ping,
    /// REPORT_BLOCK_ALLOCATION (#23).
    ReportBlockAllocation,
    /// NOOP (#24).
    Noop,
    /// GET_EXPERIMENTAL (#40 in 0.5.4, #32 in 0.5.5+).
    GetExperimental,
    /// Any other known-but-unsupported op (Q cache, CacheBlend, P2P, handshake, unknown ids or
    /// names).
    Unsupported,
}

/// Ops kvnode understands, with their 0.5.6 snake_case name and frozen legacy id.
const OP_TABLE: [(Op, &str, u8); 22] = [
    (Op::RegisterKvCache, "register_kv_cache", 1),
    (Op::UnregisterKvCache, "unregister_kv_cache", 2),
    (Op::Store, "store", 6),
    (Op::Retrieve, "retrieve", 7),
    (Op::Lookup, "lookup", 8),
    (Op::QueryPrefetchStatus, "query_prefetch_status", 9),
    (Op::WaitPrefetchStatus, "wait_prefetch_status", 10),
    (
        Op::QueryPrefetchLookupHits,
        "query_prefetch_lookup_hits",
        11,
    ),
    (Op::FreeLookupLocks, "free_lookup_locks", 12),
    (Op::EndSession, "end_session", 13),
    (
        Op::RegisterEngineDriven,
        "register_kv_cache_engine_driven_context",
        14,
    ),
    (
        Op::UnregisterEngineDriven,
        "unregister_kv_cache_engine_driven_context",
        15,
    ),
    (Op::PrepareStore, "prepare_store", 16),
    (Op::CommitStore, "commit_store", 17),
    (Op::PrepareRetrieve, "prepare_retrieve", 18),
    (Op::CommitRetrieve, "commit_retrieve", 19),
    (Op::Clear, "clear", 20),
    (Op::GetChunkSize, "get_chunk_size", 21),
    (Op::Ping, "ping", 22),
    (Op::ReportBlockAllocation, "report_block_allocation", 23),
    (Op::Noop, "noop", 24),
    // 0.5.5+ legacy id; 0.5.4 used 40 (both are accepted by `parse_op`).
    (Op::GetExperimental, "get_experimental", 32),
];

/// Maps a legacy integer id to an op and a log name. Ids 1..24 are identical in 0.5.4–0.5.6;
/// for 25..39 the name lists the 0.5.4 meaning and the 0.5.5+ meaning (`a|b`).
fn op_from_id(id: u64) -> (Op, String) {
    if let Some((op, name, _)) = OP_TABLE.iter().find(|(_, _, i)| u64::from(*i) == id) {
        return (*op, (*name).to_string());
    }
    let name = match id {
        3 => "register_q_cache",
        4 => "unregister_q_cache",
        5 => "store_q",
        25 => "cb_register_kv_cache|cb_register_rope",
        26 => "cb_unregister_kv_cache|cb_unregister_rope",
        27 => "cb_store_pre_computed|cb_retrieve_pre_computed",
        28 => "cb_lookup_pre_computed|cb_unified_lookup",
        29 => "cb_retrieve_pre_computed|p2p_lookup_and_lock",
        30 => "cb_store_final|p2p_query_lookup_results",
        31 => "cb_lookup_pre_computed_v2|p2p_unlock_objects",
        33 => "cb_register_rope_v3|cb_protocol_handshake",
        34 => "cb_unregister_rope_v3|poll_kv_events",
        35 => "cb_retrieve_pre_computed_v3",
        36 => "cb_unified_lookup",
        37 => "p2p_lookup_and_lock",
        38 => "p2p_query_lookup_results",
        39 => "p2p_unlock_objects",
        40 => return (Op::GetExperimental, "get_experimental".to_string()),
        _ => return (Op::Unsupported, format!("op#{id}")),
    };
    (Op::Unsupported, name.to_string())
}

/// Makes an untrusted operation name safe for logs: at most 64 characters, control
/// characters escaped.
fn printable_name(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i >= 64 {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Parses the type frame: a msgpack int (0.5.4 table #1..#40 with GET_EXPERIMENTAL=40;
/// 0.5.5+/0.5.6 legacy ids where 32=GET_EXPERIMENTAL and 25..31,33 are CB_*/P2P/handshake →
/// [`Op::Unsupported`]; ids 1..24 identical in all) or a msgpack str with the 0.5.6 snake_case
/// operation name (e.g. `"get_chunk_size"`, `"prepare_store"`,
/// `"register_kv_cache_engine_driven_context"`, …; unknown names → [`Op::Unsupported`]).
/// Returns `(Op, a printable name for logs)`. Int ids outside the table (including negative
/// ones) → [`Op::Unsupported`] too. Non-int/non-str values or malformed msgpack → `Err`.
pub fn parse_op(frame: &[u8]) -> std::result::Result<(Op, String), WireError> {
    let mut r = Reader::new(frame, 1);
    let tok = r.next()?;
    let out = match tok {
        Tok::UInt(id) => op_from_id(id),
        Tok::NegInt(id) => (Op::Unsupported, format!("op#{id}")),
        Tok::Str(raw) => {
            let s = std::str::from_utf8(raw)
                .map_err(|_| field_err("request_type", "operation name is not valid UTF-8"))?;
            match OP_TABLE.iter().find(|(_, name, _)| *name == s) {
                Some((op, name, _)) => (*op, (*name).to_string()),
                None => (Op::Unsupported, printable_name(s)),
            }
        }
        other => {
            return Err(field_err(
                "request_type",
                format!("expected integer or string, got {}", other.kind()),
            ))
        }
    };
    r.finish()?;
    Ok(out)
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

/// Decodes the payload frames of `op` (`name` is the printable name from [`parse_op`], used in
/// errors). Checks the frame count first, then decodes each frame as exactly one msgpack
/// document (trailing bytes are an error). Ops kvnode does not serve yield
/// [`LmRequest::Unsupported`] without looking at the payload.
pub fn decode_request(
    op: Op,
    name: &str,
    payload: &[&[u8]],
) -> std::result::Result<LmRequest, WireError> {
    let n = payload.len();
    let count_err = |expected: &str| WireError::FrameCount {
        op: name.to_string(),
        expected: expected.to_string(),
        got: n,
    };
    let expect = |want: usize| -> Result<()> {
        if n == want {
            Ok(())
        } else {
            Err(count_err(&want.to_string()))
        }
    };
    match op {
        Op::RegisterKvCache
        | Op::UnregisterKvCache
        | Op::Store
        | Op::Retrieve
        | Op::Unsupported => Ok(LmRequest::Unsupported {
            op,
            name: name.to_string(),
        }),
        Op::GetChunkSize => expect(0).map(|_| LmRequest::GetChunkSize),
        Op::GetExperimental => expect(0).map(|_| LmRequest::GetExperimental),
        Op::Noop => expect(0).map(|_| LmRequest::Noop),
        Op::Ping => {
            expect(1)?;
            let instance_id = frame(payload, 0, |r| r.read_opt_u64("instance_id"))?;
            Ok(LmRequest::Ping { instance_id })
        }
        Op::RegisterEngineDriven => {
            expect(1)?;
            let p = frame(payload, 0, decode_register_payload)?;
            Ok(LmRequest::RegisterEngineDriven(p))
        }
        Op::UnregisterEngineDriven => {
            expect(1)?;
            let instance_id = frame(payload, 0, |r| r.read_u64("instance_id"))?;
            Ok(LmRequest::UnregisterEngineDriven { instance_id })
        }
        Op::PrepareStore | Op::PrepareRetrieve | Op::CommitRetrieve => {
            expect(2)?;
            let key = frame(payload, 0, decode_key)?;
            let instance_id = frame(payload, 1, |r| r.read_u64("instance_id"))?;
            Ok(match op {
                Op::PrepareStore => LmRequest::PrepareStore { key, instance_id },
                Op::PrepareRetrieve => LmRequest::PrepareRetrieve { key, instance_id },
                _ => LmRequest::CommitRetrieve { key, instance_id },
            })
        }
        Op::CommitStore => {
            if n != 2 && n != 3 {
                return Err(count_err("2 or 3"));
            }
            let key = frame(payload, 0, decode_key)?;
            let instance_id = frame(payload, 1, |r| r.read_u64("instance_id"))?;
            let cpu_data = if n == 3 {
                frame(payload, 2, |r| r.read_bin("cpu_data"))?
            } else {
                Vec::new()
            };
            Ok(LmRequest::CommitStore {
                key,
                instance_id,
                cpu_data,
            })
        }
        Op::Lookup | Op::FreeLookupLocks => {
            expect(2)?;
            let key = frame(payload, 0, decode_key)?;
            let tp_size = frame(payload, 1, |r| r.read_u32("tp_size"))?;
            Ok(if op == Op::Lookup {
                LmRequest::Lookup { key, tp_size }
            } else {
                LmRequest::FreeLookupLocks { key, tp_size }
            })
        }
        Op::QueryPrefetchStatus | Op::QueryPrefetchLookupHits | Op::EndSession => {
            expect(1)?;
            let request_id = frame(payload, 0, |r| r.read_str("request_id"))?;
            Ok(match op {
                Op::QueryPrefetchStatus => LmRequest::QueryPrefetchStatus { request_id },
                Op::QueryPrefetchLookupHits => LmRequest::QueryPrefetchLookupHits { request_id },
                _ => LmRequest::EndSession { request_id },
            })
        }
        Op::WaitPrefetchStatus => {
            expect(2)?;
            let request_id = frame(payload, 0, |r| r.read_str("request_id"))?;
            let timeout = frame(payload, 1, |r| r.read_f64("timeout"))?;
            if !timeout.is_finite() {
                return Err(field_err(
                    "timeout",
                    format!("not a finite number: {timeout}"),
                ));
            }
            Ok(LmRequest::WaitPrefetchStatus {
                request_id,
                timeout_secs: timeout.max(0.0),
            })
        }
        Op::ReportBlockAllocation => {
            expect(3)?;
            let instance_id = frame(payload, 0, |r| r.read_u64("instance_id"))?;
            let model_name = frame(payload, 1, |r| r.read_str("model_name"))?;
            let records = frame(payload, 2, decode_records)?;
            Ok(LmRequest::ReportBlockAllocation {
                instance_id,
                model_name,
                records,
            })
        }
        Op::Clear => {
            let force = match n {
                0 => None,
                1 => frame(payload, 0, |r| r.read_opt_bool("force"))?,
                _ => return Err(count_err("0 or 1")),
            };
            Ok(LmRequest::Clear { force })
        }
    }
}

/// Decodes payload frame `idx` with `f`, requiring that `f` consumes the whole frame.
fn frame<T>(
    payload: &[&[u8]],
    idx: usize,
    f: impl FnOnce(&mut Reader<'_>) -> Result<T>,
) -> Result<T> {
    let buf = payload.get(idx).copied().unwrap_or_default();
    let mut r = Reader::new(buf, idx + 2);
    let v = f(&mut r)?;
    r.finish()?;
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

/// One msgpack token. Containers are headers only: their elements follow as further tokens.
#[derive(Debug, Clone, Copy)]
enum Tok<'a> {
    Nil,
    Bool(bool),
    UInt(u64),
    NegInt(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

impl Tok<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Tok::Nil => "nil",
            Tok::Bool(_) => "bool",
            Tok::UInt(_) => "unsigned integer",
            Tok::NegInt(_) => "negative integer",
            Tok::Float(_) => "float",
            Tok::Str(_) => "str",
            Tok::Bin(_) => "bin",
            Tok::Array(_) => "array",
            Tok::Map(_) => "map",
            Tok::Ext => "ext",
        }
    }

    /// Number of values nested directly inside this token.
    fn children(&self) -> u64 {
        match self {
            Tok::Array(n) => u64::from(*n),
            Tok::Map(n) => 2 * u64::from(*n),
            _ => 0,
        }
    }
}

fn int_tok<'a>(v: i64) -> Tok<'a> {
    match u64::try_from(v) {
        Ok(u) => Tok::UInt(u),
        Err(_) => Tok::NegInt(v),
    }
}

/// Bounds-checked cursor over one frame. Never allocates based on untrusted lengths beyond the
/// bytes actually present, and never recurses.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    frame: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], frame: usize) -> Self {
        Reader { buf, pos: 0, frame }
    }

    fn malformed(&self, detail: impl Into<String>) -> WireError {
        WireError::Malformed {
            frame: self.frame,
            detail: detail.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self.buf.get(self.pos..self.pos.saturating_add(n)) {
            Some(s) if s.len() == n => {
                self.pos += n;
                Ok(s)
            }
            _ => Err(self.malformed(format!(
                "truncated: need {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            ))),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn len32(&mut self) -> Result<usize> {
        // u32 always fits in usize on the 32/64-bit targets kvnode supports; saturate otherwise
        // (the following `take` then reports truncation).
        Ok(usize::try_from(self.u32()?).unwrap_or(usize::MAX))
    }

    /// Reads the next token.
    fn next(&mut self) -> Result<Tok<'a>> {
        if self.remaining() == 0 {
            return Err(self.malformed(format!(
                "truncated: expected a value at offset {}",
                self.pos
            )));
        }
        let m = Marker::from_u8(self.u8()?);
        Ok(match m {
            Marker::FixPos(v) => Tok::UInt(u64::from(v)),
            Marker::FixNeg(v) => Tok::NegInt(i64::from(v)),
            Marker::Null => Tok::Nil,
            Marker::True => Tok::Bool(true),
            Marker::False => Tok::Bool(false),
            Marker::U8 => Tok::UInt(u64::from(self.u8()?)),
            Marker::U16 => Tok::UInt(u64::from(self.u16()?)),
            Marker::U32 => Tok::UInt(u64::from(self.u32()?)),
            Marker::U64 => Tok::UInt(self.u64()?),
            Marker::I8 => int_tok(i64::from(i8::from_be_bytes(self.array()?))),
            Marker::I16 => int_tok(i64::from(i16::from_be_bytes(self.array()?))),
            Marker::I32 => int_tok(i64::from(i32::from_be_bytes(self.array()?))),
            Marker::I64 => int_tok(i64::from_be_bytes(self.array()?)),
            Marker::F32 => Tok::Float(f64::from(f32::from_be_bytes(self.array()?))),
            Marker::F64 => Tok::Float(f64::from_be_bytes(self.array()?)),
            Marker::FixStr(n) => Tok::Str(self.take(usize::from(n))?),
            Marker::Str8 => {
                let n = usize::from(self.u8()?);
                Tok::Str(self.take(n)?)
            }
            Marker::Str16 => {
                let n = usize::from(self.u16()?);
                Tok::Str(self.take(n)?)
            }
            Marker::Str32 => {
                let n = self.len32()?;
                Tok::Str(self.take(n)?)
            }
            Marker::Bin8 => {
                let n = usize::from(self.u8()?);
                Tok::Bin(self.take(n)?)
            }
            Marker::Bin16 => {
                let n = usize::from(self.u16()?);
                Tok::Bin(self.take(n)?)
            }
            Marker::Bin32 => {
                let n = self.len32()?;
                Tok::Bin(self.take(n)?)
            }
            Marker::FixArray(n) => Tok::Array(u32::from(n)),
            Marker::Array16 => Tok::Array(u32::from(self.u16()?)),
            Marker::Array32 => Tok::Array(self.u32()?),
            Marker::FixMap(n) => Tok::Map(u32::from(n)),
            Marker::Map16 => Tok::Map(u32::from(self.u16()?)),
            Marker::Map32 => Tok::Map(self.u32()?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = usize::from(self.u8()?);
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = usize::from(self.u16()?);
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len32()?;
                self.ext(n)?
            }
            Marker::Reserved => {
                return Err(
                    self.malformed(format!("reserved marker 0xc1 at offset {}", self.pos - 1))
                )
            }
        })
    }

    /// Reads an ext body (type byte + `n` data bytes) after its header.
    fn ext(&mut self, n: usize) -> Result<Tok<'a>> {
        self.u8()?;
        self.take(n)?;
        Ok(Tok::Ext)
    }

    /// Skips everything nested inside `tok` (iteratively, so deep nesting cannot overflow the
    /// stack).
    fn skip_children(&mut self, tok: Tok<'a>) -> Result<()> {
        let mut pending = tok.children();
        while pending > 0 {
            pending -= 1;
            let t = self.next()?;
            pending = pending.saturating_add(t.children());
        }
        Ok(())
    }

    /// Skips one complete value.
    fn skip_value(&mut self) -> Result<()> {
        let t = self.next()?;
        self.skip_children(t)
    }

    /// Requires that the whole frame was consumed.
    fn finish(&self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(self.malformed(format!(
                "{n} trailing bytes after the value at offset {}",
                self.pos
            ))),
        }
    }

    /// Upper bound for preallocating `n` elements: each needs at least one byte.
    fn cap(&self, n: u32) -> usize {
        usize::try_from(n)
            .unwrap_or(usize::MAX)
            .min(self.remaining())
    }

    fn read_u64(&mut self, field: &str) -> Result<u64> {
        let t = self.next()?;
        tok_u64(t, field)
    }

    fn read_u32(&mut self, field: &str) -> Result<u32> {
        let t = self.next()?;
        tok_u32(t, field)
    }

    fn read_opt_u64(&mut self, field: &str) -> Result<Option<u64>> {
        match self.next()? {
            Tok::Nil => Ok(None),
            t => tok_u64(t, field).map(Some),
        }
    }

    fn read_opt_u32(&mut self, field: &str) -> Result<Option<u32>> {
        match self.next()? {
            Tok::Nil => Ok(None),
            t => tok_u32(t, field).map(Some),
        }
    }

    fn read_str(&mut self, field: &str) -> Result<String> {
        match self.next()? {
            Tok::Str(raw) => std::str::from_utf8(raw)
                .map(str::to_string)
                .map_err(|_| field_err(field, "string is not valid UTF-8")),
            t => Err(type_err(field, "str", &t)),
        }
    }

    fn read_bin(&mut self, field: &str) -> Result<Vec<u8>> {
        match self.next()? {
            Tok::Bin(raw) => Ok(raw.to_vec()),
            t => Err(type_err(field, "bin", &t)),
        }
    }

    fn read_bool(&mut self, field: &str) -> Result<bool> {
        match self.next()? {
            Tok::Bool(b) => Ok(b),
            t => Err(type_err(field, "bool", &t)),
        }
    }

    fn read_opt_bool(&mut self, field: &str) -> Result<Option<bool>> {
        match self.next()? {
            Tok::Nil => Ok(None),
            Tok::Bool(b) => Ok(Some(b)),
            t => Err(type_err(field, "bool or nil", &t)),
        }
    }

    fn read_f64(&mut self, field: &str) -> Result<f64> {
        match self.next()? {
            Tok::Float(f) => Ok(f),
            // Precision loss above 2^53 is irrelevant for a timeout in seconds.
            Tok::UInt(u) => Ok(u as f64),
            Tok::NegInt(i) => Ok(i as f64),
            t => Err(type_err(field, "number", &t)),
        }
    }

    fn read_array_len(&mut self, field: &str) -> Result<u32> {
        match self.next()? {
            Tok::Array(n) => Ok(n),
            t => Err(type_err(field, "array", &t)),
        }
    }

    fn read_map_len(&mut self, field: &str) -> Result<u32> {
        match self.next()? {
            Tok::Map(n) => Ok(n),
            t => Err(type_err(field, "map", &t)),
        }
    }

    /// Reads a map key, which must be a string (as for msgspec structs / dataclasses).
    fn read_key(&mut self, field: &str) -> Result<&'a [u8]> {
        match self.next()? {
            Tok::Str(raw) => Ok(raw),
            t => Err(field_err(
                field,
                format!("map key must be a str, got {}", t.kind()),
            )),
        }
    }

    fn read_u64_list(&mut self, field: &str) -> Result<Vec<u64>> {
        let n = self.read_array_len(field)?;
        let mut v = Vec::with_capacity(self.cap(n));
        for _ in 0..n {
            v.push(self.read_u64(field)?);
        }
        Ok(v)
    }
}

fn type_err(field: &str, expected: &str, got: &Tok<'_>) -> WireError {
    field_err(field, format!("expected {expected}, got {}", got.kind()))
}

fn tok_u64(t: Tok<'_>, field: &str) -> Result<u64> {
    match t {
        Tok::UInt(v) => Ok(v),
        Tok::NegInt(v) => Err(field_err(
            field,
            format!("negative value {v} for an unsigned field"),
        )),
        t => Err(type_err(field, "unsigned integer", &t)),
    }
}

fn tok_u32(t: Tok<'_>, field: &str) -> Result<u32> {
    let v = tok_u64(t, field)?;
    u32::try_from(v).map_err(|_| field_err(field, format!("value {v} does not fit in u32")))
}

fn missing(field: &str) -> WireError {
    field_err(field, "missing required field")
}

fn decode_key(r: &mut Reader<'_>) -> Result<IpcKey> {
    let n = r.read_map_len("key")?;
    let mut model_name = None;
    let mut world_size = None;
    let mut worker_id = None;
    let mut token_ids = None;
    let mut start = None;
    let mut end = None;
    let mut request_id = String::new();
    let mut cache_salt = String::new();
    for _ in 0..n {
        match r.read_key("key")? {
            b"model_name" => model_name = Some(r.read_str("key.model_name")?),
            b"world_size" => world_size = Some(r.read_u32("key.world_size")?),
            b"worker_id" => worker_id = Some(r.read_opt_u32("key.worker_id")?),
            b"token_ids" => {
                let field = "key.token_ids";
                let len = r.read_array_len(field)?;
                let mut v = Vec::with_capacity(r.cap(len));
                for i in 0..len {
                    match r.next()? {
                        Tok::UInt(t) => match u32::try_from(t) {
                            Ok(t) => v.push(t),
                            Err(_) => {
                                return Err(field_err(
                                    field,
                                    format!("token id {t} at index {i} is not below 2^32"),
                                ))
                            }
                        },
                        Tok::NegInt(t) => {
                            return Err(field_err(
                                field,
                                format!("negative token id {t} at index {i}"),
                            ))
                        }
                        t => {
                            return Err(field_err(
                                field,
                                format!("expected integer token id at index {i}, got {}", t.kind()),
                            ))
                        }
                    }
                }
                token_ids = Some(v);
            }
            b"start" => start = Some(r.read_u64("key.start")?),
            b"end" => end = Some(r.read_u64("key.end")?),
            b"request_id" => request_id = r.read_str("key.request_id")?,
            b"cache_salt" => cache_salt = r.read_str("key.cache_salt")?,
            // request_configs, num_kv_readers and anything newer: ignored.
            _ => r.skip_value()?,
        }
    }
    let model_name = model_name.ok_or_else(|| missing("key.model_name"))?;
    if model_name.contains('@') {
        return Err(field_err("key.model_name", "must not contain '@'"));
    }
    if cache_salt
        .chars()
        .any(|c| matches!(c, '@' | '/' | '\\' | '\0'))
    {
        return Err(field_err(
            "key.cache_salt",
            "must not contain '@', '/', '\\' or NUL",
        ));
    }
    if cache_salt.chars().count() > 128 {
        return Err(field_err("key.cache_salt", "longer than 128 characters"));
    }
    Ok(IpcKey {
        model_name,
        world_size: world_size.ok_or_else(|| missing("key.world_size"))?,
        worker_id: worker_id.ok_or_else(|| missing("key.worker_id"))?,
        token_ids: token_ids.ok_or_else(|| missing("key.token_ids"))?,
        start: start.ok_or_else(|| missing("key.start"))?,
        end: end.ok_or_else(|| missing("key.end"))?,
        request_id,
        cache_salt,
    })
}

fn decode_register_payload(r: &mut Reader<'_>) -> Result<RegisterPayload> {
    let n = r.read_map_len("payload")?;
    let mut instance_id = None;
    let mut model_name = None;
    let mut world_size = None;
    let mut block_size = None;
    let mut num_layers = None;
    let mut hidden_dim_size = None;
    let mut dtype_str = None;
    let mut use_mla = None;
    for _ in 0..n {
        match r.read_key("payload")? {
            b"instance_id" => instance_id = Some(r.read_u64("payload.instance_id")?),
            b"model_name" => model_name = Some(r.read_str("payload.model_name")?),
            b"world_size" => world_size = Some(r.read_u32("payload.world_size")?),
            b"block_size" => block_size = Some(r.read_u32("payload.block_size")?),
            b"num_layers" => num_layers = Some(r.read_u32("payload.num_layers")?),
            b"hidden_dim_size" => hidden_dim_size = Some(r.read_u32("payload.hidden_dim_size")?),
            b"dtype_str" => dtype_str = Some(r.read_str("payload.dtype_str")?),
            b"use_mla" => use_mla = Some(r.read_bool("payload.use_mla")?),
            _ => r.skip_value()?,
        }
    }
    Ok(RegisterPayload {
        instance_id: instance_id.ok_or_else(|| missing("payload.instance_id"))?,
        model_name: model_name.ok_or_else(|| missing("payload.model_name"))?,
        world_size: world_size.ok_or_else(|| missing("payload.world_size"))?,
        block_size: block_size.ok_or_else(|| missing("payload.block_size"))?,
        num_layers: num_layers.ok_or_else(|| missing("payload.num_layers"))?,
        hidden_dim_size: hidden_dim_size.ok_or_else(|| missing("payload.hidden_dim_size"))?,
        dtype_str: dtype_str.ok_or_else(|| missing("payload.dtype_str"))?,
        use_mla: use_mla.ok_or_else(|| missing("payload.use_mla"))?,
    })
}

fn decode_records(r: &mut Reader<'_>) -> Result<Vec<BlockRecord>> {
    let n = r.read_array_len("records")?;
    let mut out = Vec::with_capacity(r.cap(n));
    for i in 0..n {
        let path = |f: &str| format!("records[{i}]{f}");
        let fields = r.read_map_len(&path(""))?;
        let mut req_id = None;
        let mut new_block_ids = None;
        let mut new_token_ids = None;
        for _ in 0..fields {
            match r.read_key(&path(""))? {
                b"req_id" => req_id = Some(r.read_str(&path(".req_id"))?),
                b"new_block_ids" => new_block_ids = Some(r.read_u64_list(&path(".new_block_ids"))?),
                b"new_token_ids" => new_token_ids = Some(r.read_u64_list(&path(".new_token_ids"))?),
                _ => r.skip_value()?,
            }
        }
        out.push(BlockRecord {
            req_id: req_id.ok_or_else(|| missing(&path(".req_id")))?,
            new_block_ids: new_block_ids.ok_or_else(|| missing(&path(".new_block_ids")))?,
            new_token_ids: new_token_ids.ok_or_else(|| missing(&path(".new_token_ids")))?,
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Encoding (msgspec-exact)
// ---------------------------------------------------------------------------------------------

/// Clamps a length to what a 32-bit msgpack header can describe.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if let Ok(b) = u8::try_from(v) {
        out.extend_from_slice(&[0xcc, b]);
    } else if let Ok(h) = u16::try_from(v) {
        out.push(0xcd);
        out.extend_from_slice(&h.to_be_bytes());
    } else if let Ok(w) = u32::try_from(v) {
        out.push(0xce);
        out.extend_from_slice(&w.to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

fn put_nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

fn put_bool(out: &mut Vec<u8>, v: bool) {
    out.push(if v { 0xc3 } else { 0xc2 });
}

/// Writes a header for `n` items using the fix / 16 / 32-bit forms (`fix_max` is the largest
/// count the fix form holds).
fn put_header(out: &mut Vec<u8>, n: u32, fix: u8, fix_max: u32, m16: u8, m32: u8) {
    if n <= fix_max {
        out.push(fix | n as u8);
    } else if let Ok(h) = u16::try_from(n) {
        out.push(m16);
        out.extend_from_slice(&h.to_be_bytes());
    } else {
        out.push(m32);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

/// Writes a str. Strings beyond 4 GiB (not representable in msgpack) are truncated.
fn put_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    let n = len32(bytes.len());
    if n <= 31 {
        out.push(0xa0 | n as u8);
    } else if let Ok(b) = u8::try_from(n) {
        out.extend_from_slice(&[0xd9, b]);
    } else if let Ok(h) = u16::try_from(n) {
        out.push(0xda);
        out.extend_from_slice(&h.to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&n.to_be_bytes());
    }
    out.extend_from_slice(bytes.get(..n as usize).unwrap_or(bytes));
}

/// Writes a bin. Data beyond 4 GiB (not representable in msgpack) is truncated.
fn put_bin(out: &mut Vec<u8>, b: &[u8]) {
    let n = len32(b.len());
    if let Ok(x) = u8::try_from(n) {
        out.extend_from_slice(&[0xc4, x]);
    } else if let Ok(h) = u16::try_from(n) {
        out.push(0xc5);
        out.extend_from_slice(&h.to_be_bytes());
    } else {
        out.push(0xc6);
        out.extend_from_slice(&n.to_be_bytes());
    }
    out.extend_from_slice(b.get(..n as usize).unwrap_or(b));
}

fn put_array_len(out: &mut Vec<u8>, n: usize) {
    put_header(out, len32(n), 0x90, 15, 0xdc, 0xdd);
}

fn put_map_len(out: &mut Vec<u8>, n: usize) {
    put_header(out, len32(n), 0x80, 15, 0xde, 0xdf);
}

fn put_uint_list(out: &mut Vec<u8>, items: impl ExactSizeIterator<Item = u64>) {
    let n = len32(items.len()) as usize;
    put_array_len(out, n);
    for v in items.take(n) {
        put_uint(out, v);
    }
}

fn put_slots(out: &mut Vec<u8>, slots: &[SlotDesc]) {
    let n = len32(slots.len()) as usize;
    put_array_len(out, n);
    for s in slots.iter().take(n) {
        put_map_len(out, 4);
        put_str(out, "offset");
        put_uint(out, s.offset);
        put_str(out, "length");
        put_uint(out, s.length);
        put_str(out, "shape");
        put_uint_list(out, s.shape.iter().copied());
        put_str(out, "dtype");
        put_str(out, &s.dtype);
    }
}

/// Encodes an unsigned integer in its smallest msgpack form (e.g. GET_CHUNK_SIZE, prefetch hit
/// counts).
pub fn encode_uint(v: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(9);
    put_uint(&mut out, v);
    out
}

/// Encodes a bool (PING, COMMIT_STORE, COMMIT_RETRIEVE replies).
pub fn encode_bool(v: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(1);
    put_bool(&mut out, v);
    out
}

/// Encodes a msgpack str (NOOP reply `"OK"`).
pub fn encode_str(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len() + 5);
    put_str(&mut out, s);
    out
}

/// Encodes a list of str (GET_EXPERIMENTAL reply).
pub fn encode_str_list(items: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    let n = len32(items.len()) as usize;
    put_array_len(&mut out, n);
    for s in items.iter().take(n) {
        put_str(&mut out, s);
    }
    out
}

/// Encodes RegisterEngineDrivenContextResponse `{shm_name, pool_size}`. Send `("", 0)` to make
/// the client fall back to pickle mode.
pub fn encode_register_reply(shm_name: &str, pool_size: u64) -> Vec<u8> {
    let mut out = Vec::new();
    put_map_len(&mut out, 2);
    put_str(&mut out, "shm_name");
    put_str(&mut out, shm_name);
    put_str(&mut out, "pool_size");
    put_uint(&mut out, pool_size);
    out
}

/// One SHM slot descriptor `{offset, length, shape, dtype}` of a prepare reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotDesc {
    /// Byte offset of the object in the SHM pool.
    pub offset: u64,
    /// Logical byte size of the object (not the aligned allocation size).
    pub length: u64,
    /// Tensor shape the client reshapes the view to.
    pub shape: Vec<u64>,
    /// torch dtype name, e.g. `bfloat16`.
    pub dtype: String,
}

/// PrepareStoreResponse: `{context: {slots: [...], chunk_indices: [...]}}`; `None` →
/// `{context: {}}` (pickle mode). In SHM mode always pass `Some` (possibly with empty slices):
/// a context without `slots` makes the SHM client lose the data.
pub fn encode_prepare_store_reply(shm: Option<(&[SlotDesc], &[u32])>) -> Vec<u8> {
    let mut out = Vec::new();
    put_map_len(&mut out, 1);
    put_str(&mut out, "context");
    match shm {
        None => put_map_len(&mut out, 0),
        Some((slots, chunk_indices)) => {
            put_map_len(&mut out, 2);
            put_str(&mut out, "slots");
            put_slots(&mut out, slots);
            put_str(&mut out, "chunk_indices");
            put_uint_list(&mut out, chunk_indices.iter().map(|&i| u64::from(i)));
        }
    }
    out
}

/// PrepareRetrieveResponse: `{success, data: b"", context: {slots: [...]}}`; on a miss
/// `{success: false, data: b"", context: {}}`.
pub fn encode_prepare_retrieve_reply(hit: Option<&[SlotDesc]>) -> Vec<u8> {
    let mut out = Vec::new();
    put_map_len(&mut out, 3);
    put_str(&mut out, "success");
    put_bool(&mut out, hit.is_some());
    put_str(&mut out, "data");
    put_bin(&mut out, &[]);
    put_str(&mut out, "context");
    match hit {
        None => put_map_len(&mut out, 0),
        Some(slots) => {
            put_map_len(&mut out, 1);
            put_str(&mut out, "slots");
            put_slots(&mut out, slots);
        }
    }
    out
}

/// `[bin, bool]` (GPU STORE/RETRIEVE-style reply) for negative answers to unsupported ops.
pub fn encode_bin_bool(bin: &[u8], ok: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(bin.len() + 8);
    put_array_len(&mut out, 2);
    put_bin(&mut out, bin);
    put_bool(&mut out, ok);
    out
}

/// Encodes an IpcKey like the client does (10-field 0.5.6 form when `v056`, with
/// `request_configs: nil` and `num_kv_readers: 1`; else the 8-field 0.5.4 form), for tests and a
/// Rust test client.
pub fn encode_key(key: &IpcKey, v056: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(160 + key.token_ids.len() * 5);
    put_map_len(&mut out, if v056 { 10 } else { 8 });
    put_str(&mut out, "model_name");
    put_str(&mut out, &key.model_name);
    put_str(&mut out, "world_size");
    put_uint(&mut out, u64::from(key.world_size));
    put_str(&mut out, "worker_id");
    match key.worker_id {
        Some(w) => put_uint(&mut out, u64::from(w)),
        None => put_nil(&mut out),
    }
    put_str(&mut out, "token_ids");
    put_uint_list(&mut out, key.token_ids.iter().map(|&t| u64::from(t)));
    put_str(&mut out, "start");
    put_uint(&mut out, key.start);
    put_str(&mut out, "end");
    put_uint(&mut out, key.end);
    put_str(&mut out, "request_id");
    put_str(&mut out, &key.request_id);
    put_str(&mut out, "cache_salt");
    put_str(&mut out, &key.cache_salt);
    if v056 {
        put_str(&mut out, "request_configs");
        put_nil(&mut out);
        put_str(&mut out, "num_kv_readers");
        put_uint(&mut out, 1);
    }
    out
}

/// Encodes a RegisterPayload like the 0.5.4 client (8 fields, for tests / a Rust test client).
pub fn encode_register_payload(p: &RegisterPayload) -> Vec<u8> {
    let mut out = Vec::new();
    put_map_len(&mut out, 8);
    put_str(&mut out, "instance_id");
    put_uint(&mut out, p.instance_id);
    put_str(&mut out, "model_name");
    put_str(&mut out, &p.model_name);
    put_str(&mut out, "world_size");
    put_uint(&mut out, u64::from(p.world_size));
    put_str(&mut out, "block_size");
    put_uint(&mut out, u64::from(p.block_size));
    put_str(&mut out, "num_layers");
    put_uint(&mut out, u64::from(p.num_layers));
    put_str(&mut out, "hidden_dim_size");
    put_uint(&mut out, u64::from(p.hidden_dim_size));
    put_str(&mut out, "dtype_str");
    put_str(&mut out, &p.dtype_str);
    put_str(&mut out, "use_mla");
    put_bool(&mut out, p.use_mla);
    out
}

/// Encodes any op's type frame as the 0.5.4/0.5.6 client would (legacy int id). Ids 1..24 are
/// the same in every version; GET_EXPERIMENTAL uses the frozen 0.5.5+/0.5.6 id 32 (0.5.4 sent
/// 40; [`parse_op`] accepts both). [`Op::Unsupported`] has no id and is encoded as the string
/// `"unsupported"`, which [`parse_op`] maps back to [`Op::Unsupported`].
pub fn encode_op(op: Op) -> Vec<u8> {
    match OP_TABLE.iter().find(|(o, _, _)| *o == op) {
        Some((_, _, id)) => encode_uint(u64::from(*id)),
        None => encode_str("unsupported"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        assert!(s.len().is_multiple_of(2), "odd hex length");
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    const KEY_HEX: &str = "88aa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501a9776f726b65725f696400a9746f6b656e5f69647393010203a5737461727400a3656e6403aa726571756573745f6964a3726571aa63616368655f73616c74a0";
    const REG_HEX: &str = "88ab696e7374616e63655f696407aa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501aa626c6f636b5f73697a6510aa6e756d5f6c617965727302af68696464656e5f64696d5f73697a6510a964747970655f737472a7666c6f61743332a77573655f6d6c61c2";
    const REG_REPLY_HEX: &str =
        "82a873686d5f6e616d65b16c6d63616368655f6c315f706f6f6c5f78a9706f6f6c5f73697a65ce40000000";
    const PREP_STORE_HEX: &str = "81a7636f6e7465787482a5736c6f74739184a66f666673657400a66c656e67746810a57368617065920202a56474797065a7666c6f61743332ad6368756e6b5f696e64696365739100";
    const RECORDS_HEX: &str =
        "9183a67265715f6964a172ad6e65775f626c6f636b5f6964739101ad6e65775f746f6b656e5f6964739102";

    fn golden_key() -> IpcKey {
        IpcKey {
            model_name: "m".into(),
            world_size: 1,
            worker_id: Some(0),
            token_ids: vec![1, 2, 3],
            start: 0,
            end: 3,
            request_id: "req".into(),
            cache_salt: String::new(),
        }
    }

    fn golden_reg() -> RegisterPayload {
        RegisterPayload {
            instance_id: 7,
            model_name: "m".into(),
            world_size: 1,
            block_size: 16,
            num_layers: 2,
            hidden_dim_size: 16,
            dtype_str: "float32".into(),
            use_mla: false,
        }
    }

    fn dec(op: Op, payload: &[&[u8]]) -> Result<LmRequest> {
        decode_request(op, "test", payload)
    }

    // ---- golden vectors (lmcache-mp.md Appendix A, lmcache-peer.md §5) ----

    #[test]
    fn golden_ping() {
        assert_eq!(encode_uint(0), unhex("00"));
        assert_eq!(encode_op(Op::Ping), unhex("16"));
        assert_eq!(parse_op(&unhex("16")).unwrap(), (Op::Ping, "ping".into()));
        let nil = unhex("c0");
        assert_eq!(
            dec(Op::Ping, &[&nil]).unwrap(),
            LmRequest::Ping { instance_id: None }
        );
        let id = unhex("cf0000011f71fb04cb");
        assert_eq!(encode_uint(1234567890123), id);
        assert_eq!(
            dec(Op::Ping, &[&id]).unwrap(),
            LmRequest::Ping {
                instance_id: Some(1234567890123)
            }
        );
        assert_eq!(encode_bool(true), unhex("c3"));
        assert_eq!(encode_bool(false), unhex("c2"));
    }

    #[test]
    fn golden_simple_replies() {
        assert_eq!(encode_uint(256), unhex("cd0100"));
        assert_eq!(encode_str("OK"), unhex("a24f4b"));
        assert_eq!(encode_str_list(&[]), unhex("90"));
        assert_eq!(
            encode_str_list(&["transfer_query"]),
            unhex("91ae7472616e736665725f7175657279")
        );
        assert_eq!(encode_bin_bool(&[], false), unhex("92c400c2"));
        assert_eq!(encode_bin_bool(&[1, 2], true), unhex("92c4020102c3"));
    }

    #[test]
    fn golden_key_roundtrip() {
        let raw = unhex(KEY_HEX);
        let inst = encode_uint(5);
        let got = dec(Op::PrepareStore, &[&raw, &inst]).unwrap();
        assert_eq!(
            got,
            LmRequest::PrepareStore {
                key: golden_key(),
                instance_id: 5
            }
        );
        assert_eq!(hex(&encode_key(&golden_key(), false)), KEY_HEX);
    }

    #[test]
    fn key_v056_form_decodes() {
        let k = golden_key();
        let enc = encode_key(&k, true);
        assert_eq!(enc[0], 0x8a);
        // Appended fields: request_configs nil, num_kv_readers 1.
        assert!(hex(&enc)
            .ends_with("af726571756573745f636f6e66696773c0ae6e756d5f6b765f7265616465727301"));
        let tp = encode_uint(1);
        assert_eq!(
            dec(Op::Lookup, &[&enc, &tp]).unwrap(),
            LmRequest::Lookup { key: k, tp_size: 1 }
        );
        // request_configs as a map and a large num_kv_readers are ignored too.
        let mut custom = unhex(KEY_HEX);
        custom[0] = 0x8a;
        custom.extend(encode_str("request_configs"));
        custom.extend(unhex("81a178a179"));
        custom.extend(encode_str("num_kv_readers"));
        custom.extend(encode_uint(1 << 40));
        let inst = encode_uint(9);
        assert!(matches!(
            dec(Op::CommitRetrieve, &[&custom, &inst]).unwrap(),
            LmRequest::CommitRetrieve { instance_id: 9, .. }
        ));
    }

    #[test]
    fn key_defaults_nil_worker_and_unknown_keys() {
        // 6-field map without request_id / cache_salt, worker_id nil, an unknown nested field,
        // big token ids in u32 form and keys in a different order.
        let mut m = unhex("87");
        m.extend(encode_str("token_ids"));
        m.extend(unhex("92ceffffffff00"));
        m.extend(encode_str("future"));
        m.extend(unhex("929191c0a178"));
        m.extend(encode_str("worker_id"));
        m.extend(unhex("c0"));
        m.extend(encode_str("model_name"));
        m.extend(encode_str("x/y"));
        m.extend(encode_str("world_size"));
        m.extend(unhex("d30000000000000004")); // int64 form of 4
        m.extend(encode_str("start"));
        m.extend(unhex("00"));
        m.extend(encode_str("end"));
        m.extend(unhex("cd0200"));
        let tp = unhex("02");
        let got = dec(Op::FreeLookupLocks, &[&m, &tp]).unwrap();
        assert_eq!(
            got,
            LmRequest::FreeLookupLocks {
                key: IpcKey {
                    model_name: "x/y".into(),
                    world_size: 4,
                    worker_id: None,
                    token_ids: vec![u32::MAX, 0],
                    start: 0,
                    end: 512,
                    request_id: String::new(),
                    cache_salt: String::new(),
                },
                tp_size: 2
            }
        );
    }

    #[test]
    fn golden_register_payload() {
        let raw = unhex(REG_HEX);
        let got = dec(Op::RegisterEngineDriven, &[&raw]).unwrap();
        assert_eq!(got, LmRequest::RegisterEngineDriven(golden_reg()));
        assert_eq!(hex(&encode_register_payload(&golden_reg())), REG_HEX);

        // 0.5.6 adds num_physical_slots: ignored.
        let mut v056 = raw.clone();
        v056[0] = 0x89;
        v056.extend(encode_str("num_physical_slots"));
        v056.extend(encode_uint(256));
        assert_eq!(
            dec(Op::RegisterEngineDriven, &[&v056]).unwrap(),
            LmRequest::RegisterEngineDriven(golden_reg())
        );
    }

    #[test]
    fn golden_register_reply() {
        assert_eq!(
            hex(&encode_register_reply("lmcache_l1_pool_x", 1 << 30)),
            REG_REPLY_HEX
        );
        assert_eq!(
            encode_register_reply("", 0),
            unhex("82a873686d5f6e616d65a0a9706f6f6c5f73697a6500")
        );
    }

    #[test]
    fn golden_prepare_store_reply() {
        let slot = SlotDesc {
            offset: 0,
            length: 16,
            shape: vec![2, 2],
            dtype: "float32".into(),
        };
        assert_eq!(
            hex(&encode_prepare_store_reply(Some((
                std::slice::from_ref(&slot),
                &[0]
            )))),
            PREP_STORE_HEX
        );
        assert_eq!(
            hex(&encode_prepare_store_reply(None)),
            "81a7636f6e7465787480"
        );
        // All cached: slots and chunk_indices present but empty.
        assert_eq!(
            hex(&encode_prepare_store_reply(Some((&[], &[])))),
            "81a7636f6e7465787482a5736c6f747390ad6368756e6b5f696e646963657390"
        );
    }

    #[test]
    fn prepare_retrieve_reply_shapes() {
        let slot = SlotDesc {
            offset: 16384,
            length: 16384,
            shape: vec![2, 2, 256, 8],
            dtype: "bfloat16".into(),
        };
        let hit = encode_prepare_retrieve_reply(Some(std::slice::from_ref(&slot)));
        assert_eq!(
            hex(&hit),
            concat!(
                "83a773756363657373c3a464617461c400a7636f6e74657874",
                "81a5736c6f74739184a66f6666736574cd4000a66c656e677468cd4000",
                "a57368617065940202cd010008a56474797065a862666c6f61743136"
            )
        );
        let v = rmpv::decode::read_value(&mut &hit[..]).unwrap();
        assert_eq!(v["success"], rmpv::Value::Boolean(true));
        assert_eq!(v["data"], rmpv::Value::Binary(vec![]));
        assert_eq!(v["context"]["slots"][0]["shape"][2].as_u64(), Some(256));
        let miss = encode_prepare_retrieve_reply(None);
        assert_eq!(
            hex(&miss),
            "83a773756363657373c2a464617461c400a7636f6e7465787480"
        );
    }

    #[test]
    fn golden_block_records() {
        let records = unhex(RECORDS_HEX);
        let inst = encode_uint(4242);
        let model = encode_str("m");
        let got = dec(Op::ReportBlockAllocation, &[&inst, &model, &records]).unwrap();
        assert_eq!(
            got,
            LmRequest::ReportBlockAllocation {
                instance_id: 4242,
                model_name: "m".into(),
                records: vec![BlockRecord {
                    req_id: "r".into(),
                    new_block_ids: vec![1],
                    new_token_ids: vec![2],
                }],
            }
        );
    }

    #[test]
    fn golden_capture_056() {
        // lmcache-peer.md §5 captured frames.
        assert_eq!(
            parse_op(&unhex("15")).unwrap(),
            (Op::GetChunkSize, "get_chunk_size".into())
        );
        assert_eq!(dec(Op::GetChunkSize, &[]).unwrap(), LmRequest::GetChunkSize);
        assert_eq!(parse_op(&unhex("14")).unwrap().0, Op::Clear);
        assert_eq!(
            dec(Op::Clear, &[&unhex("c3")]).unwrap(),
            LmRequest::Clear { force: Some(true) }
        );
        assert_eq!(
            dec(Op::Clear, &[]).unwrap(),
            LmRequest::Clear { force: None }
        );
        assert_eq!(parse_op(&unhex("18")).unwrap().0, Op::Noop);
        assert_eq!(parse_op(&unhex("0e")).unwrap().0, Op::RegisterEngineDriven);
        assert_eq!(parse_op(&unhex("10")).unwrap().0, Op::PrepareStore);
        assert_eq!(parse_op(&unhex("11")).unwrap().0, Op::CommitStore);
        assert_eq!(parse_op(&unhex("0d")).unwrap().0, Op::EndSession);
        assert_eq!(parse_op(&unhex("08")).unwrap().0, Op::Lookup);
        assert_eq!(parse_op(&unhex("0a")).unwrap().0, Op::WaitPrefetchStatus);
        assert_eq!(parse_op(&unhex("12")).unwrap().0, Op::PrepareRetrieve);
        assert_eq!(parse_op(&unhex("13")).unwrap().0, Op::CommitRetrieve);
        assert_eq!(
            parse_op(&unhex("0f")).unwrap().0,
            Op::UnregisterEngineDriven
        );

        let key = encode_key(&golden_key(), true);
        let inst = unhex("cd3729");
        let empty = unhex("c400");
        assert_eq!(
            dec(Op::CommitStore, &[&key, &inst, &empty]).unwrap(),
            LmRequest::CommitStore {
                key: golden_key(),
                instance_id: 0x3729,
                cpu_data: vec![]
            }
        );
        // Missing third frame reads as empty.
        assert_eq!(
            dec(Op::CommitStore, &[&key, &inst]).unwrap(),
            dec(Op::CommitStore, &[&key, &inst, &empty]).unwrap()
        );
        let rid = encode_str("rt-1");
        let timeout = unhex("cb403e000000000000");
        assert_eq!(
            dec(Op::WaitPrefetchStatus, &[&rid, &timeout]).unwrap(),
            LmRequest::WaitPrefetchStatus {
                request_id: "rt-1".into(),
                timeout_secs: 30.0
            }
        );
        assert_eq!(
            dec(Op::WaitPrefetchStatus, &[&rid, &unhex("1e")]).unwrap(),
            LmRequest::WaitPrefetchStatus {
                request_id: "rt-1".into(),
                timeout_secs: 30.0
            }
        );
        assert_eq!(
            dec(Op::EndSession, &[&rid]).unwrap(),
            LmRequest::EndSession {
                request_id: "rt-1".into()
            }
        );
        assert_eq!(
            dec(Op::UnregisterEngineDriven, &[&inst]).unwrap(),
            LmRequest::UnregisterEngineDriven {
                instance_id: 0x3729
            }
        );
        assert_eq!(encode_uint(4294967296), unhex("cf0000000100000000"));
        assert_eq!(encode_uint(2), unhex("02"));
    }

    #[test]
    fn other_requests_decode() {
        let rid = encode_str("q");
        assert_eq!(
            dec(Op::QueryPrefetchStatus, &[&rid]).unwrap(),
            LmRequest::QueryPrefetchStatus {
                request_id: "q".into()
            }
        );
        assert_eq!(
            dec(Op::QueryPrefetchLookupHits, &[&rid]).unwrap(),
            LmRequest::QueryPrefetchLookupHits {
                request_id: "q".into()
            }
        );
        assert_eq!(
            dec(Op::GetExperimental, &[]).unwrap(),
            LmRequest::GetExperimental
        );
        assert_eq!(dec(Op::Noop, &[]).unwrap(), LmRequest::Noop);
        // Negative timeout clamps to 0; f32 accepted.
        assert_eq!(
            dec(Op::WaitPrefetchStatus, &[&rid, &unhex("ff")]).unwrap(),
            LmRequest::WaitPrefetchStatus {
                request_id: "q".into(),
                timeout_secs: 0.0
            }
        );
        assert_eq!(
            dec(Op::WaitPrefetchStatus, &[&rid, &unhex("ca3f000000")]).unwrap(),
            LmRequest::WaitPrefetchStatus {
                request_id: "q".into(),
                timeout_secs: 0.5
            }
        );
        // Unsupported ops are not decoded at all.
        let junk = unhex("c1");
        for op in [
            Op::RegisterKvCache,
            Op::UnregisterKvCache,
            Op::Store,
            Op::Retrieve,
            Op::Unsupported,
        ] {
            assert_eq!(
                decode_request(op, "x", &[&junk, &junk]).unwrap(),
                LmRequest::Unsupported {
                    op,
                    name: "x".into()
                }
            );
        }
        // Clear with a nil frame.
        assert_eq!(
            dec(Op::Clear, &[&unhex("c0")]).unwrap(),
            LmRequest::Clear { force: None }
        );
    }

    // ---- parse_op ----

    #[test]
    fn parse_op_table() {
        let expected = [
            Op::RegisterKvCache,
            Op::UnregisterKvCache,
            Op::Unsupported, // register_q_cache
            Op::Unsupported, // unregister_q_cache
            Op::Unsupported, // store_q
            Op::Store,
            Op::Retrieve,
            Op::Lookup,
            Op::QueryPrefetchStatus,
            Op::WaitPrefetchStatus,
            Op::QueryPrefetchLookupHits,
            Op::FreeLookupLocks,
            Op::EndSession,
            Op::RegisterEngineDriven,
            Op::UnregisterEngineDriven,
            Op::PrepareStore,
            Op::CommitStore,
            Op::PrepareRetrieve,
            Op::CommitRetrieve,
            Op::Clear,
            Op::GetChunkSize,
            Op::Ping,
            Op::ReportBlockAllocation,
            Op::Noop,
        ];
        for (i, want) in expected.iter().enumerate() {
            let id = i as u64 + 1;
            assert_eq!(parse_op(&encode_uint(id)).unwrap().0, *want, "id {id}");
        }
        for id in (25..=31).chain(33..=39) {
            assert_eq!(
                parse_op(&encode_uint(id)).unwrap().0,
                Op::Unsupported,
                "id {id}"
            );
        }
        assert_eq!(
            parse_op(&encode_uint(40)).unwrap(),
            (Op::GetExperimental, "get_experimental".into())
        );
        assert_eq!(parse_op(&encode_uint(32)).unwrap().0, Op::GetExperimental);
        assert_eq!(
            parse_op(&encode_uint(0)).unwrap(),
            (Op::Unsupported, "op#0".into())
        );
        assert_eq!(parse_op(&encode_uint(41)).unwrap().0, Op::Unsupported);
        assert_eq!(parse_op(&encode_uint(u64::MAX)).unwrap().0, Op::Unsupported);
        assert_eq!(parse_op(&unhex("ff")).unwrap().0, Op::Unsupported);
        // Wide int forms of a valid id.
        assert_eq!(parse_op(&unhex("cc16")).unwrap().0, Op::Ping);
        assert_eq!(parse_op(&unhex("d30000000000000016")).unwrap().0, Op::Ping);
    }

    #[test]
    fn parse_op_names() {
        assert_eq!(
            parse_op(&encode_str("get_chunk_size")).unwrap(),
            (Op::GetChunkSize, "get_chunk_size".into())
        );
        for (op, name, _) in OP_TABLE {
            assert_eq!(parse_op(&encode_str(name)).unwrap(), (op, name.to_string()));
            // encode_op round-trips through parse_op.
            assert_eq!(parse_op(&encode_op(op)).unwrap().0, op);
        }
        assert_eq!(
            parse_op(&encode_op(Op::Unsupported)).unwrap().0,
            Op::Unsupported
        );
        assert_eq!(encode_op(Op::GetExperimental), unhex("20"));
        assert_eq!(
            parse_op(&encode_str("subscribe_kv_events")).unwrap(),
            (Op::Unsupported, "subscribe_kv_events".into())
        );
        assert_eq!(parse_op(&encode_str("store_q")).unwrap().0, Op::Unsupported);
        let (op, name) = parse_op(&encode_str("bad\nname")).unwrap();
        assert_eq!(op, Op::Unsupported);
        assert_eq!(name, "bad\\nname");
        let long = "z".repeat(1000);
        assert!(parse_op(&encode_str(&long)).unwrap().1.chars().count() <= 65);
    }

    #[test]
    fn parse_op_garbage() {
        for bad in [
            "",
            "c0",
            "c3",
            "c40101",
            "90",
            "80",
            "cb3ff0000000000000",
            "c1",
            "cd01",
            "1601",
            "a2ff00",
        ] {
            assert!(parse_op(&unhex(bad)).is_err(), "{bad:?} should fail");
        }
        assert!(matches!(
            parse_op(&[]),
            Err(WireError::Malformed { frame: 1, .. })
        ));
        assert!(matches!(
            parse_op(&unhex("c0")),
            Err(WireError::Field { .. })
        ));
    }

    // ---- decode errors ----

    #[test]
    fn frame_count_errors() {
        let key = unhex(KEY_HEX);
        let one = encode_uint(1);
        let s = encode_str("r");
        let cases: Vec<(Op, Vec<&[u8]>, &str)> = vec![
            (Op::GetChunkSize, vec![&one], "0"),
            (Op::GetExperimental, vec![&one], "0"),
            (Op::Noop, vec![&one], "0"),
            (Op::Ping, vec![], "1"),
            (Op::Ping, vec![&one, &one], "1"),
            (Op::RegisterEngineDriven, vec![], "1"),
            (Op::UnregisterEngineDriven, vec![], "1"),
            (Op::PrepareStore, vec![&key], "2"),
            (Op::PrepareRetrieve, vec![&key, &one, &one], "2"),
            (Op::CommitRetrieve, vec![], "2"),
            (Op::CommitStore, vec![&key], "2 or 3"),
            (Op::CommitStore, vec![&key, &one, &one, &one], "2 or 3"),
            (Op::Lookup, vec![&key], "2"),
            (Op::FreeLookupLocks, vec![&key, &one, &one], "2"),
            (Op::QueryPrefetchStatus, vec![], "1"),
            (Op::QueryPrefetchLookupHits, vec![&s, &s], "1"),
            (Op::WaitPrefetchStatus, vec![&s], "2"),
            (Op::EndSession, vec![], "1"),
            (Op::ReportBlockAllocation, vec![&one, &s], "3"),
            (Op::Clear, vec![&one, &one], "0 or 1"),
        ];
        for (op, payload, expected) in cases {
            let got = decode_request(op, "nm", &payload);
            assert_eq!(
                got,
                Err(WireError::FrameCount {
                    op: "nm".into(),
                    expected: expected.into(),
                    got: payload.len()
                }),
                "{op:?}"
            );
        }
    }

    fn field_of(r: Result<LmRequest>) -> String {
        match r {
            Err(WireError::Field { field, .. }) => field,
            other => panic!("expected Field error, got {other:?}"),
        }
    }

    #[test]
    fn wrong_types() {
        let key = unhex(KEY_HEX);
        let s = encode_str("5");
        let one = encode_uint(1);
        assert_eq!(field_of(dec(Op::PrepareStore, &[&key, &s])), "instance_id");
        assert_eq!(field_of(dec(Op::Ping, &[&s])), "instance_id");
        assert_eq!(field_of(dec(Op::Ping, &[&unhex("ff")])), "instance_id");
        assert_eq!(
            field_of(dec(Op::Lookup, &[&key, &unhex("cf0000000100000000")])),
            "tp_size"
        );
        assert_eq!(field_of(dec(Op::Lookup, &[&key, &unhex("c3")])), "tp_size");
        assert_eq!(
            field_of(dec(Op::QueryPrefetchStatus, &[&one])),
            "request_id"
        );
        assert_eq!(
            field_of(dec(Op::QueryPrefetchStatus, &[&unhex("c403616263")])),
            "request_id"
        );
        assert_eq!(
            field_of(dec(Op::EndSession, &[&unhex("a2ff00")])),
            "request_id"
        );
        assert_eq!(field_of(dec(Op::WaitPrefetchStatus, &[&s, &s])), "timeout");
        assert_eq!(
            field_of(dec(
                Op::WaitPrefetchStatus,
                &[&s, &unhex("cb7ff8000000000000")]
            )),
            "timeout"
        );
        assert_eq!(field_of(dec(Op::Clear, &[&one])), "force");
        assert_eq!(
            field_of(dec(Op::CommitStore, &[&key, &one, &s])),
            "cpu_data"
        );
        assert_eq!(
            field_of(dec(Op::RegisterEngineDriven, &[&key])),
            "payload.instance_id"
        );
        assert_eq!(field_of(dec(Op::RegisterEngineDriven, &[&one])), "payload");
        assert_eq!(field_of(dec(Op::PrepareStore, &[&one, &one])), "key");
        assert_eq!(
            field_of(dec(Op::ReportBlockAllocation, &[&one, &one, &unhex("90")])),
            "model_name"
        );
        assert_eq!(
            field_of(dec(Op::ReportBlockAllocation, &[&one, &s, &unhex("9180")])),
            "records[0].req_id"
        );
        assert_eq!(
            field_of(dec(
                Op::ReportBlockAllocation,
                &[&one, &s, &unhex("9181ad6e65775f626c6f636b5f69647391ff")]
            )),
            "records[0].new_block_ids"
        );
        // Negative instance id.
        assert_eq!(
            field_of(dec(Op::UnregisterEngineDriven, &[&unhex("d0ff")])),
            "instance_id"
        );
        // Register payload with a str use_mla.
        let mut reg = unhex(REG_HEX);
        let n = reg.len();
        reg[n - 1] = 0xa0;
        assert_eq!(
            field_of(dec(Op::RegisterEngineDriven, &[&reg])),
            "payload.use_mla"
        );
        // Missing field in register payload.
        let mut short = unhex("87");
        short.extend(&unhex(REG_HEX)[1..unhex(REG_HEX).len() - 9]);
        assert_eq!(
            field_of(dec(Op::RegisterEngineDriven, &[&short])),
            "payload.use_mla"
        );
    }

    fn key_with(f: impl FnOnce(&mut IpcKey)) -> Vec<u8> {
        let mut k = golden_key();
        f(&mut k);
        encode_key(&k, false)
    }

    #[test]
    fn key_errors() {
        let one = encode_uint(1);
        // token id 2^32 (replace the last token 03 with a uint64 form).
        let mut raw = unhex(KEY_HEX);
        let pos = hex(&raw).find("93010203").unwrap() / 2;
        raw.splice(pos + 3..pos + 4, unhex("cf0000000100000000"));
        let err = dec(Op::PrepareStore, &[&raw, &one]).unwrap_err();
        assert_eq!(
            err,
            WireError::Field {
                field: "key.token_ids".into(),
                detail: "token id 4294967296 at index 2 is not below 2^32".into()
            }
        );
        // 2^32 - 1 is fine.
        let mut ok = unhex(KEY_HEX);
        ok.splice(pos + 3..pos + 4, unhex("ceffffffff"));
        assert!(dec(Op::PrepareStore, &[&ok, &one]).is_ok());
        // Negative token / str token.
        let mut neg = unhex(KEY_HEX);
        neg[pos + 3] = 0xff;
        assert_eq!(
            field_of(dec(Op::PrepareStore, &[&neg, &one])),
            "key.token_ids"
        );
        let mut st = unhex(KEY_HEX);
        st[pos + 3] = 0xa0;
        assert_eq!(
            field_of(dec(Op::PrepareStore, &[&st, &one])),
            "key.token_ids"
        );
        // world_size as str.
        let mut ws = unhex(KEY_HEX);
        let p = hex(&ws).find("73697a6501").unwrap() / 2 + 4;
        ws[p] = 0xa0;
        assert_eq!(
            field_of(dec(Op::PrepareStore, &[&ws, &one])),
            "key.world_size"
        );
        // Missing required fields: drop the "end" entry.
        let mut no_end = unhex("87");
        let full = unhex(KEY_HEX);
        let e = hex(&full).find("a3656e6403").unwrap() / 2;
        no_end.extend(&full[1..e]);
        no_end.extend(&full[e + 5..]);
        assert_eq!(field_of(dec(Op::PrepareStore, &[&no_end, &one])), "key.end");
        // Non-str map key.
        let mut nk = unhex(KEY_HEX);
        nk[0] = 0x89;
        nk.extend(unhex("01c0"));
        assert_eq!(field_of(dec(Op::PrepareStore, &[&nk, &one])), "key");
        // Validation of model_name and cache_salt.
        let bad_model = key_with(|k| k.model_name = "a@b".into());
        assert_eq!(
            field_of(dec(Op::PrepareStore, &[&bad_model, &one])),
            "key.model_name"
        );
        let bad_salt = key_with(|k| k.cache_salt = "a/b".into());
        assert_eq!(
            field_of(dec(Op::PrepareStore, &[&bad_salt, &one])),
            "key.cache_salt"
        );
        let long_salt = key_with(|k| k.cache_salt = "s".repeat(129));
        assert_eq!(
            field_of(dec(Op::PrepareStore, &[&long_salt, &one])),
            "key.cache_salt"
        );
        let ok_salt = key_with(|k| k.cache_salt = "é".repeat(128));
        assert!(dec(Op::PrepareStore, &[&ok_salt, &one]).is_ok());
        // worker_id out of u32 range.
        let mut wid = unhex(KEY_HEX);
        let p = hex(&wid).find("776f726b65725f6964").unwrap() / 2 + 9;
        wid.splice(p..p + 1, unhex("cf0000000100000000"));
        assert_eq!(
            field_of(dec(Op::PrepareStore, &[&wid, &one])),
            "key.worker_id"
        );
    }

    #[test]
    fn malformed_errors() {
        let one = encode_uint(1);
        let key = unhex(KEY_HEX);
        // Truncated key at every length: Malformed on frame 2, never a panic.
        for cut in 0..key.len() {
            let err = dec(Op::PrepareStore, &[&key[..cut], &one]).unwrap_err();
            assert!(
                matches!(err, WireError::Malformed { frame: 2, .. }),
                "cut {cut}: {err:?}"
            );
        }
        // Trailing bytes on the second payload frame.
        let err = dec(Op::PrepareStore, &[&key, &unhex("0101")]).unwrap_err();
        assert!(
            matches!(err, WireError::Malformed { frame: 3, .. }),
            "{err:?}"
        );
        // Reserved marker.
        assert!(matches!(
            dec(Op::Ping, &[&unhex("c1")]),
            Err(WireError::Malformed { frame: 2, .. })
        ));
        // Empty frame.
        assert!(matches!(
            dec(Op::EndSession, &[&[]]),
            Err(WireError::Malformed { frame: 2, .. })
        ));
        // Huge claimed lengths with no data.
        for bad in [
            "dbffffffff",
            "c6ffffffff",
            "ddffffffff",
            "dfffffffff",
            "c9ffffffff01",
        ] {
            assert!(dec(Op::EndSession, &[&unhex(bad)]).is_err());
        }
        let mut huge_tokens = unhex(KEY_HEX);
        let pos = hex(&huge_tokens).find("93010203").unwrap() / 2;
        huge_tokens.splice(pos..pos + 1, unhex("ddffffffff"));
        // The following key bytes are read as tokens until the "start" str: a typed error.
        assert_eq!(
            field_of(dec(Op::PrepareStore, &[&huge_tokens, &one])),
            "key.token_ids"
        );
        // Cut right after the huge header: truncation, without allocating 4G entries.
        assert!(matches!(
            dec(Op::PrepareStore, &[&huge_tokens[..pos + 7], &one]),
            Err(WireError::Malformed { frame: 2, .. })
        ));
        // Deeply nested unknown value is skipped iteratively (no stack overflow).
        let mut deep = unhex("81a178");
        deep.extend(std::iter::repeat_n(0x91u8, 1_000_000));
        deep.push(0xc0);
        assert!(matches!(
            dec(Op::PrepareStore, &[&deep, &one]),
            Err(WireError::Field { .. })
        ));
        let mut deep_trunc = unhex("81a178");
        deep_trunc.extend(std::iter::repeat_n(0x91u8, 1_000_000));
        assert!(matches!(
            dec(Op::PrepareStore, &[&deep_trunc, &one]),
            Err(WireError::Malformed { .. })
        ));
    }

    // ---- fuzz: never panic ----

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    const ALL_OPS: [Op; 23] = [
        Op::RegisterKvCache,
        Op::UnregisterKvCache,
        Op::Store,
        Op::Retrieve,
        Op::Lookup,
        Op::QueryPrefetchStatus,
        Op::WaitPrefetchStatus,
        Op::QueryPrefetchLookupHits,
        Op::FreeLookupLocks,
        Op::EndSession,
        Op::RegisterEngineDriven,
        Op::UnregisterEngineDriven,
        Op::PrepareStore,
        Op::CommitStore,
        Op::PrepareRetrieve,
        Op::CommitRetrieve,
        Op::Clear,
        Op::GetChunkSize,
        Op::Ping,
        Op::ReportBlockAllocation,
        Op::Noop,
        Op::GetExperimental,
        Op::Unsupported,
    ];

    fn mutate(rng: &mut Rng, base: &[u8]) -> Vec<u8> {
        let mut v = base.to_vec();
        let interesting: [&[u8]; 10] = [
            &[0xc1],
            &[0xdd, 0xff, 0xff, 0xff, 0xff],
            &[0xdf, 0xff, 0xff, 0xff, 0xff],
            &[0xdb, 0xff, 0xff, 0xff, 0xff],
            &[0xc6, 0x7f, 0xff, 0xff, 0xff],
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
            &[0xcb, 0x7f, 0xf0, 0, 0, 0, 0, 0, 0],
            &[0x9f],
            &[0xc7, 0x03, 0x01],
        ];
        for _ in 0..1 + rng.below(4) {
            match rng.below(6) {
                0 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] = rng.next() as u8;
                }
                1 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] ^= 1 << rng.below(8);
                }
                2 => {
                    let cut = rng.below(v.len() + 1);
                    v.truncate(cut);
                }
                3 => {
                    let i = rng.below(v.len() + 1);
                    let ins = interesting[rng.below(interesting.len())];
                    v.splice(i..i, ins.iter().copied());
                }
                4 => {
                    let i = rng.below(v.len() + 1);
                    v.insert(i, rng.next() as u8);
                }
                _ if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v.remove(i);
                }
                _ => {}
            }
        }
        v
    }

    #[test]
    fn fuzz_never_panics() {
        let key8 = unhex(KEY_HEX);
        let key10 = encode_key(&golden_key(), true);
        let corpus: Vec<Vec<u8>> = vec![
            key8.clone(),
            key10.clone(),
            unhex(REG_HEX),
            unhex(RECORDS_HEX),
            unhex("cf0000011f71fb04cb"),
            unhex("c400"),
            unhex("c3"),
            unhex("cb403e000000000000"),
            encode_str("get_chunk_size"),
            encode_str("req-123"),
            unhex(PREP_STORE_HEX),
        ];
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut ok = 0usize;
        for iter in 0..20_000 {
            let a = if iter % 5 == 0 {
                let len = rng.below(40);
                (0..len).map(|_| rng.next() as u8).collect()
            } else {
                {
                    let i = rng.below(corpus.len());
                    mutate(&mut rng, &corpus[i])
                }
            };
            let b = {
                let i = rng.below(corpus.len());
                mutate(&mut rng, &corpus[i])
            };
            let c = if rng.below(2) == 0 {
                key10.clone()
            } else {
                mutate(&mut rng, &key8)
            };
            let _ = parse_op(&a);
            for op in ALL_OPS {
                let payloads: [&[&[u8]]; 5] = [&[], &[&a], &[&c, &a], &[&a, &b], &[&a, &b, &a]];
                for p in payloads {
                    if decode_request(op, "fuzz", p).is_ok() {
                        ok += 1;
                    }
                }
            }
        }
        // Sanity: some mutated inputs still decode.
        assert!(ok > 0);
    }

    #[test]
    fn rmpv_agrees_on_encoders() {
        // Every encoder output is a single valid msgpack document.
        let slot = SlotDesc {
            offset: u64::MAX,
            length: 70000,
            shape: (0..20).collect(),
            dtype: "x".repeat(300),
        };
        let slots = vec![slot; 17];
        let idx: Vec<u32> = (0..70000).collect();
        let big_key = IpcKey {
            model_name: "m".repeat(40),
            world_size: u32::MAX,
            worker_id: None,
            token_ids: (0..70000).map(|i| i * 60000).collect(),
            start: 1 << 40,
            end: u64::MAX,
            request_id: "r".repeat(70000),
            cache_salt: "s".repeat(100),
        };
        let docs = [
            encode_prepare_store_reply(Some((&slots, &idx))),
            encode_prepare_retrieve_reply(Some(&slots)),
            encode_key(&big_key, true),
            encode_bin_bool(&vec![7u8; 70000], true),
            encode_str_list(&["a"; 20]),
        ];
        for d in &docs {
            let mut rd = &d[..];
            rmpv::decode::read_value(&mut rd).unwrap();
            assert!(rd.is_empty());
        }
        // Big key round-trips through our decoder.
        let tp = encode_uint(8);
        assert_eq!(
            dec(Op::Lookup, &[&docs[2], &tp]).unwrap(),
            LmRequest::Lookup {
                key: big_key,
                tp_size: 8
            }
        );
        // Int boundaries are the smallest forms.
        for (v, h) in [
            (127u64, "7f"),
            (128, "cc80"),
            (255, "ccff"),
            (256, "cd0100"),
            (65535, "cdffff"),
            (65536, "ce00010000"),
            (u32::MAX as u64, "ceffffffff"),
        ] {
            assert_eq!(hex(&encode_uint(v)), h);
        }
        assert_eq!(&encode_str(&"a".repeat(31))[..1], &[0xbf]);
        assert_eq!(&encode_str(&"a".repeat(32))[..2], &[0xd9, 32]);
        assert_eq!(&encode_str(&"a".repeat(256))[..3], &[0xda, 1, 0]);
        assert_eq!(&encode_str_list(&["a"; 16])[..3], &[0xdc, 0, 16]);
    }
}
