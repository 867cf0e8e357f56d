//! The type frame (frame 1): the [`Op`] it names, the table of ops kvnode understands with
//! their 0.5.6 snake_case names and frozen legacy ids, and [`parse_op`].

use super::reader::{Reader, Tok};
use super::{field_err, WireError};

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

impl Op {
    /// LMCache's snake_case name of the operation, as 0.5.6 clients send it
    /// (`"unsupported"` for [`Op::Unsupported`]).
    pub fn name(self) -> &'static str {
        OP_TABLE
            .iter()
            .find(|(op, _, _)| *op == self)
            .map_or("unsupported", |(_, name, _)| name)
    }
}

/// Ops kvnode understands, with their 0.5.6 snake_case name and frozen legacy id.
pub(super) const OP_TABLE: [(Op, &str, u8); 22] = [
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
