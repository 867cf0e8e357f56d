//! Fuzz harnesses for the code that reads bytes from outside the process: the native
//! frame codec ([`crate::protocol::frame`]) and the LMCache msgpack request decoder
//! ([`crate::lmcache::wire`]).
//!
//! The cargo-fuzz targets in `fuzz/` and the corpus test `tests/fuzz_corpus.rs` call the same
//! functions, so every input the fuzzer keeps (and every crash reproduction committed under
//! `fuzz/regressions/`) is also a regular test. A harness returns normally for every input the
//! decoders handle correctly, whether they accept or reject it; it panics only when a decoder
//! panics or breaks one of the invariants stated on the harness, which is exactly what the
//! fuzzer reports as a crash.

use std::io;
use std::os::fd::OwnedFd;

use rkyv::util::AlignedVec;

use crate::lmcache::wire::{self, IpcKey, LmRequest, Op};
use crate::protocol::frame::{
    decode_request, decode_response, encode_request, encode_response, FrameError, FrameHeader,
    FrameReader, FrameSource, FLAG_FD, FLAG_RESPONSE, HEADER_BYTES,
};
use crate::protocol::messages::{ChunkRange, Request};

// ---------------------------------------------------------------------------------------------
// Native frames
// ---------------------------------------------------------------------------------------------

/// Builds a [`native_frame`] input from a byte stream: `chunking` selects how the stream is
/// delivered to the [`FrameReader`] (0 = as much as the reader asks for; see [`native_frame`]).
pub fn native_frame_input(chunking: u8, stream: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(stream.len() + 1);
    v.push(chunking);
    v.extend_from_slice(stream);
    v
}

/// What reading one frame off a stream gave.
#[derive(Debug, PartialEq)]
enum Step {
    /// A frame with a valid header and its payload bytes.
    Frame(FrameHeader, Vec<u8>),
    /// Clean end of stream between frames.
    End,
    /// The stream cannot go on (bad header, truncation).
    Stop(FrameError),
}

/// A [`FrameSource`] over a byte slice that hands out bytes in varying chunk sizes chosen by a
/// control byte, interleaving `Interrupted` errors when its high bit is set (the reader must
/// retry those). Control byte 0 behaves like a plain `Read` of a slice.
struct Trickle<'a> {
    rest: &'a [u8],
    ctl: u8,
    calls: usize,
}

impl FrameSource for Trickle<'_> {
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
        self.calls += 1;
        if self.ctl & 0x80 != 0 && self.calls.is_multiple_of(3) {
            return Err(io::Error::from(io::ErrorKind::Interrupted));
        }
        let limit = match self.ctl & 0x7f {
            0 => usize::MAX,
            c => 1 + (usize::from(c) * 7 + self.calls * 13) % (usize::from(c) * 3 + 1),
        };
        let n = buf.len().min(self.rest.len()).min(limit);
        buf[..n].copy_from_slice(&self.rest[..n]);
        self.rest = &self.rest[n..];
        Ok((n, None))
    }
}

/// Splits `stream` into frames by plain slicing: the reference [`FrameReader`] must agree with.
fn reference_frames(stream: &[u8]) -> Vec<Step> {
    let mut out = Vec::new();
    let mut pos = 0;
    loop {
        let rest = &stream[pos..];
        if rest.is_empty() {
            out.push(Step::End);
            return out;
        }
        let Some(hb) = rest.get(..HEADER_BYTES) else {
            out.push(Step::Stop(FrameError::Truncated));
            return out;
        };
        let hb: &[u8; HEADER_BYTES] = hb.try_into().expect("slice of HEADER_BYTES");
        let h = match FrameHeader::decode(hb) {
            Ok(h) => h,
            Err(e) => {
                out.push(Step::Stop(e));
                return out;
            }
        };
        // Property: a header that decodes re-encodes to the very same bytes.
        assert_eq!(&h.encode(), hb, "header does not re-encode to its bytes");
        let len = h.payload_len as usize;
        let Some(payload) = rest[HEADER_BYTES..].get(..len) else {
            out.push(Step::Stop(FrameError::Truncated));
            return out;
        };
        out.push(Step::Frame(h, payload.to_vec()));
        pos += HEADER_BYTES + len;
    }
}

/// Reads `stream` the way a server connection does: frames through a [`FrameReader`] until the
/// end of the stream or an unrecoverable error.
fn reader_frames(ctl: u8, stream: &[u8]) -> Vec<Step> {
    let mut src = Trickle {
        rest: stream,
        ctl,
        calls: 0,
    };
    let mut reader = FrameReader::default();
    let mut payload = AlignedVec::<16>::new();
    let mut out = Vec::new();
    loop {
        match reader.read_frame(&mut src, &mut payload) {
            Ok(None) => {
                out.push(Step::End);
                return out;
            }
            Ok(Some((h, fd))) => {
                assert!(fd.is_none(), "an fd appeared from a source that has none");
                assert_eq!(payload.len(), h.payload_len as usize, "payload length");
                out.push(Step::Frame(h, payload.to_vec()));
            }
            Err(e) => {
                out.push(Step::Stop(e));
                return out;
            }
        }
    }
}

/// Units of decoded data in a chunk range (string bytes and hashes).
fn range_units(r: &ChunkRange) -> usize {
    r.model.len() + r.cache_salt.len() + r.chunk_hashes.len()
}

/// Units of decoded data in a request: string bytes plus list elements. Each unit occupies at
/// least one distinct payload byte, so this never exceeds the payload length.
fn request_units(req: &Request) -> usize {
    match req {
        Request::Register(r) => r.model.len() + r.dtype.len(),
        Request::PrepareStore { range, .. } => range_units(range),
        Request::PrepareRetrieve {
            range,
            lookup_session,
            ..
        } => range_units(range) + lookup_session.as_ref().map_or(0, String::len),
        Request::Lookup {
            request_id, range, ..
        } => request_id.len() + range_units(range),
        Request::FreeLookupLocks { request_id, .. } | Request::EndSession { request_id } => {
            request_id.len()
        }
        Request::ReportBlockAllocation { model, records, .. } => {
            model.len()
                + records
                    .iter()
                    .map(|r| 1 + r.req_id.len() + r.new_block_ids.len() + r.new_token_ids.len())
                    .sum::<usize>()
        }
        _ => 0,
    }
}

/// Checks an accepted request: opcode, size bound, and the encode/decode round trip.
fn check_request(h: &FrameHeader, payload: &[u8], req: &Request) {
    assert_eq!(
        req.opcode(),
        h.opcode,
        "accepted request with another opcode"
    );
    assert_eq!(
        h.flags & FLAG_RESPONSE,
        0,
        "accepted a response as a request"
    );
    let units = request_units(req);
    assert!(
        units <= payload.len(),
        "{units} decoded units from a {}-byte payload",
        payload.len()
    );
    let frame = encode_request(h.request_id, req).expect("an accepted request re-encodes");
    let hb: &[u8; HEADER_BYTES] = frame[..HEADER_BYTES].try_into().expect("header bytes");
    let h2 = FrameHeader::decode(hb).expect("re-encoded header decodes");
    assert_eq!(
        (h2.opcode, h2.request_id, h2.flags),
        (h.opcode, h.request_id, 0),
        "re-encoded header"
    );
    let mut p2 = AlignedVec::<16>::new();
    p2.extend_from_slice(&frame[HEADER_BYTES..]);
    let again = decode_request(&h2, &p2).expect("re-encoded request decodes");
    assert_eq!(&again, req, "request changed in a round trip");
    let frame2 = encode_request(h.request_id, &again).expect("re-encodes twice");
    assert_eq!(frame, frame2, "request encoding is not deterministic");
}

/// Native frame decoder, the whole path a server connection runs:
/// `data[0]` picks how the byte stream `data[1..]` is chunked and interrupted on its way into a
/// [`FrameReader`]; every frame read is validated ([`FrameHeader::decode`]) and its payload goes
/// through [`decode_request`] (and [`decode_response`] when the header has the response flag,
/// the path the client runs). Reading stops at the first header error or truncation, like a
/// connection does; payload errors are answered and reading goes on.
///
/// Invariants checked (a violation panics):
/// * nothing panics, and every rejection is a typed [`FrameError`];
/// * the buffered [`FrameReader`] yields exactly the frames (headers, payload bytes) and the
///   final outcome that plain slicing of the stream gives, whatever the chunking;
/// * a header that decodes re-encodes to the same 32 bytes;
/// * an accepted request has the header's opcode and no response flag, decodes to at most one
///   string byte or list element per payload byte, re-encodes with [`encode_request`], decodes
///   back equal, and encodes to the same bytes again;
/// * an accepted response re-encodes with [`encode_response`] and decodes back equal.
pub fn native_frame(data: &[u8]) {
    let Some((&ctl, stream)) = data.split_first() else {
        return;
    };
    let reference = reference_frames(stream);
    let read = reader_frames(ctl, stream);
    assert_eq!(read, reference, "FrameReader disagrees with plain slicing");
    for step in &reference {
        let Step::Frame(h, bytes) = step else {
            continue;
        };
        let mut payload = AlignedVec::<16>::new();
        payload.extend_from_slice(bytes);
        if let Ok(req) = decode_request(h, &payload) {
            check_request(h, &payload, &req);
        }
        if h.flags & FLAG_RESPONSE != 0 {
            if let Ok(resp) = decode_response(&payload) {
                let fd = h.flags & FLAG_FD != 0;
                let frame = encode_response(h.request_id, h.opcode, fd, &resp)
                    .expect("an accepted response re-encodes");
                let mut p2 = AlignedVec::<16>::new();
                p2.extend_from_slice(&frame[HEADER_BYTES..]);
                let again = decode_response(&p2).expect("re-encoded response decodes");
                assert_eq!(again, resp, "response changed in a round trip");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// LMCache requests
// ---------------------------------------------------------------------------------------------

/// Separates the frames of a [`lmcache_request`] input. `0xc1` is neither a msgpack marker nor
/// a byte of valid UTF-8, so a run of four never appears in well-formed frames except inside
/// `bin` data or integer bytes.
pub const LMCACHE_FRAME_SEPARATOR: [u8; 4] = [0xc1; 4];

/// Builds a [`lmcache_request`] input from the type frame and the payload frames of one request.
pub fn lmcache_request_input(type_frame: &[u8], payload: &[&[u8]]) -> Vec<u8> {
    let mut v = type_frame.to_vec();
    for p in payload {
        v.extend_from_slice(&LMCACHE_FRAME_SEPARATOR);
        v.extend_from_slice(p);
    }
    v
}

/// Splits an input at every [`LMCACHE_FRAME_SEPARATOR`] (always at least one frame).
fn split_frames(data: &[u8]) -> Vec<&[u8]> {
    let sep = LMCACHE_FRAME_SEPARATOR.len();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + sep <= data.len() {
        if data[i..i + sep] == LMCACHE_FRAME_SEPARATOR {
            out.push(&data[start..i]);
            i += sep;
            start = i;
        } else {
            i += 1;
        }
    }
    out.push(&data[start..]);
    out
}

fn put_bin(out: &mut Vec<u8>, b: &[u8]) {
    if let Ok(n) = u8::try_from(b.len()) {
        out.extend_from_slice(&[0xc4, n]);
    } else if let Ok(n) = u16::try_from(b.len()) {
        out.push(0xc5);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        let n = u32::try_from(b.len()).expect("bin frames are far below 4 GiB");
        out.push(0xc6);
        out.extend_from_slice(&n.to_be_bytes());
    }
    out.extend_from_slice(b);
}

fn put_array_len(out: &mut Vec<u8>, n: usize) {
    if n <= 15 {
        out.push(0x90 | n as u8);
    } else if let Ok(n) = u16::try_from(n) {
        out.push(0xdc);
        out.extend_from_slice(&n.to_be_bytes());
    } else {
        let n = u32::try_from(n).expect("lists are far below 2^32 elements");
        out.push(0xdd);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

fn put_uint_list(out: &mut Vec<u8>, items: &[u64]) {
    put_array_len(out, items.len());
    for &v in items {
        out.extend(wire::encode_uint(v));
    }
}

/// Encodes the payload frames of `req` as a client would, `v056` choosing the key form; `None`
/// for [`LmRequest::Unsupported`] (never decoded).
fn encode_lm_request(req: &LmRequest, v056: bool) -> Option<Vec<Vec<u8>>> {
    use wire::{encode_bool, encode_key, encode_str, encode_uint};
    let key = |k: &IpcKey| encode_key(k, v056);
    Some(match req {
        LmRequest::GetChunkSize | LmRequest::GetExperimental | LmRequest::Noop => vec![],
        LmRequest::Ping { instance_id } => vec![match instance_id {
            Some(id) => encode_uint(*id),
            None => vec![0xc0],
        }],
        LmRequest::RegisterEngineDriven(p) => vec![wire::encode_register_payload(p)],
        LmRequest::UnregisterEngineDriven { instance_id } => vec![encode_uint(*instance_id)],
        LmRequest::PrepareStore {
            key: k,
            instance_id,
        }
        | LmRequest::PrepareRetrieve {
            key: k,
            instance_id,
        }
        | LmRequest::CommitRetrieve {
            key: k,
            instance_id,
        } => vec![key(k), encode_uint(*instance_id)],
        LmRequest::CommitStore {
            key: k,
            instance_id,
            cpu_data,
        } => {
            let mut bin = Vec::new();
            put_bin(&mut bin, cpu_data);
            vec![key(k), encode_uint(*instance_id), bin]
        }
        LmRequest::Lookup { key: k, tp_size } | LmRequest::FreeLookupLocks { key: k, tp_size } => {
            vec![key(k), encode_uint(u64::from(*tp_size))]
        }
        LmRequest::QueryPrefetchStatus { request_id }
        | LmRequest::QueryPrefetchLookupHits { request_id }
        | LmRequest::EndSession { request_id } => vec![encode_str(request_id)],
        LmRequest::WaitPrefetchStatus {
            request_id,
            timeout_secs,
        } => {
            let mut f = vec![0xcb];
            f.extend_from_slice(&timeout_secs.to_be_bytes());
            vec![encode_str(request_id), f]
        }
        LmRequest::ReportBlockAllocation {
            instance_id,
            model_name,
            records,
        } => {
            let mut r = Vec::new();
            put_array_len(&mut r, records.len());
            for rec in records {
                r.push(0x83);
                r.extend(encode_str("req_id"));
                r.extend(encode_str(&rec.req_id));
                r.extend(encode_str("new_block_ids"));
                put_uint_list(&mut r, &rec.new_block_ids);
                r.extend(encode_str("new_token_ids"));
                put_uint_list(&mut r, &rec.new_token_ids);
            }
            vec![encode_uint(*instance_id), encode_str(model_name), r]
        }
        LmRequest::Clear { force } => force.iter().map(|&b| encode_bool(b)).collect(),
        LmRequest::Unsupported { .. } => return None,
    })
}

/// Units of decoded data in a key (string bytes and token ids).
fn key_units(k: &IpcKey) -> usize {
    k.model_name.len() + k.token_ids.len() + k.request_id.len() + k.cache_salt.len()
}

/// Units of decoded data in a request: string bytes, bin bytes and list elements (a record
/// counts one plus its contents). Each unit occupies at least one distinct input byte.
fn lm_units(req: &LmRequest) -> usize {
    match req {
        LmRequest::RegisterEngineDriven(p) => p.model_name.len() + p.dtype_str.len(),
        LmRequest::PrepareStore { key, .. }
        | LmRequest::PrepareRetrieve { key, .. }
        | LmRequest::CommitRetrieve { key, .. }
        | LmRequest::Lookup { key, .. }
        | LmRequest::FreeLookupLocks { key, .. } => key_units(key),
        LmRequest::CommitStore { key, cpu_data, .. } => key_units(key) + cpu_data.len(),
        LmRequest::QueryPrefetchStatus { request_id }
        | LmRequest::QueryPrefetchLookupHits { request_id }
        | LmRequest::EndSession { request_id }
        | LmRequest::WaitPrefetchStatus { request_id, .. } => request_id.len(),
        LmRequest::ReportBlockAllocation {
            model_name,
            records,
            ..
        } => {
            model_name.len()
                + records
                    .iter()
                    .map(|r| 1 + r.req_id.len() + r.new_block_ids.len() + r.new_token_ids.len())
                    .sum::<usize>()
        }
        _ => 0,
    }
}

/// The key a keyed LMCache request carries.
fn key_of_mut(req: &mut LmRequest) -> Option<&mut IpcKey> {
    match req {
        LmRequest::PrepareStore { key, .. }
        | LmRequest::CommitStore { key, .. }
        | LmRequest::PrepareRetrieve { key, .. }
        | LmRequest::CommitRetrieve { key, .. }
        | LmRequest::Lookup { key, .. }
        | LmRequest::FreeLookupLocks { key, .. } => Some(key),
        _ => None,
    }
}

/// LMCache request decoder, the path a server handler runs: the input is the type frame
/// followed by the payload frames, separated by [`LMCACHE_FRAME_SEPARATOR`] (build inputs with
/// [`lmcache_request_input`]). The type frame goes through [`wire::parse_op`]; if that succeeds,
/// the payload frames go through [`wire::decode_request`] under the parsed op.
///
/// Invariants checked (a violation panics):
/// * nothing panics, and every rejection is a typed [`wire::WireError`];
/// * the printable op name has no control characters, and the op re-encodes with
///   [`wire::encode_op`] to a type frame that parses back to the same op (and, for served ops,
///   the same name);
/// * an accepted request decodes to at most one string/bin byte or list element per input byte
///   (work and memory are linear in the input);
/// * an accepted request (other than [`LmRequest::Unsupported`]) re-encoded as a client would,
///   with both the 0.5.4 (8-field) and the 0.5.6 (10-field) key forms, decodes back equal.
pub fn lmcache_request(data: &[u8]) {
    let frames = split_frames(data);
    let (type_frame, payload) = frames.split_first().expect("at least one frame");
    let Ok((op, name)) = wire::parse_op(type_frame) else {
        return;
    };
    assert!(
        !name.chars().any(char::is_control),
        "op name {name:?} has control characters"
    );
    let (op2, name2) = wire::parse_op(&wire::encode_op(op)).expect("encode_op output parses");
    assert_eq!(op2, op, "op changed in a round trip");
    if op != Op::Unsupported {
        assert_eq!(name2, name, "op name changed in a round trip");
    }
    let Ok(req) = wire::decode_request(op, &name, payload) else {
        return;
    };
    let input_bytes: usize = payload.iter().map(|p| p.len()).sum();
    let units = lm_units(&req);
    assert!(
        units <= input_bytes,
        "{units} decoded units from {input_bytes} payload bytes"
    );
    for v056 in [false, true] {
        let Some(frames2) = encode_lm_request(&req, v056) else {
            break;
        };
        let refs: Vec<&[u8]> = frames2.iter().map(Vec::as_slice).collect();
        let again = wire::decode_request(op, &name, &refs);
        // The 0.5.4 key form has no reader count: it decodes as 0 (not sent).
        let mut want = req.clone();
        if !v056 {
            if let Some(key) = key_of_mut(&mut want) {
                key.num_kv_readers = 0;
            }
        }
        assert_eq!(
            again.as_ref(),
            Ok(&want),
            "request changed in a round trip (v056 = {v056})"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Remote (TCP) handshake: in `fuzzing/remote_handshake.rs`
// ---------------------------------------------------------------------------------------------

mod remote_handshake;
pub use remote_handshake::{
    remote_handshake, remote_handshake_input, HS_MODE_ADMIN, HS_MODE_FABRICS_SHIFT,
    HS_MODE_GENUINE, HS_MODE_INSECURE, HS_MODE_RAW,
};

// ---------------------------------------------------------------------------------------------
// Remote descriptors (regions and per-slot buffers): in `fuzzing/remote_descriptors.rs`
// ---------------------------------------------------------------------------------------------

mod remote_descriptors;
pub use remote_descriptors::{remote_descriptors, remote_descriptors_input};
