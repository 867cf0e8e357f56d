//! Encoders, byte-for-byte as msgspec writes them (smallest integer forms, `str` vs `bin`, maps
//! in declaration order with every field present): reply payloads, [`SlotDesc`] for the prepare
//! replies, and the client-side frames for tests and a Rust test client.

use super::op::OP_TABLE;
use super::{IpcKey, Op, RegisterPayload};

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
/// `request_configs: nil` and the key's `num_kv_readers`; else the 8-field 0.5.4 form, which has
/// no reader count), for tests and a Rust test client.
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
        put_uint(&mut out, u64::from(key.num_kv_readers));
    }
    out
}

/// Encodes a RegisterPayload like the client (8 fields as 0.5.4 sends them, plus
/// `num_physical_slots` as 0.5.6 does when the payload has one), for tests / a Rust test client.
pub fn encode_register_payload(p: &RegisterPayload) -> Vec<u8> {
    let mut out = Vec::new();
    put_map_len(&mut out, if p.num_physical_slots.is_some() { 9 } else { 8 });
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
    if let Some(slots) = p.num_physical_slots {
        put_str(&mut out, "num_physical_slots");
        put_uint(&mut out, u64::from(slots));
    }
    out
}

/// Encodes any op's type frame as the 0.5.4/0.5.6 client would (legacy int id). Ids 1..24 are
/// the same in every version; GET_EXPERIMENTAL uses the frozen 0.5.5+/0.5.6 id 32 (0.5.4 sent
/// 40; [`parse_op`] accepts both). [`Op::Unsupported`] has no id and is encoded as the string
/// `"unsupported"`, which [`parse_op`] maps back to [`Op::Unsupported`].
///
/// [`parse_op`]: super::parse_op
pub fn encode_op(op: Op) -> Vec<u8> {
    match OP_TABLE.iter().find(|(o, _, _)| *o == op) {
        Some((_, _, id)) => encode_uint(u64::from(*id)),
        None => encode_str("unsupported"),
    }
}
