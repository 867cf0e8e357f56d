//! Native frame codec: a fixed 32-byte little-endian header followed by an rkyv payload.
//!
//! ```text
//! 0  magic u32 "KVN1"   4 version u16   6 opcode u16   8 flags u32   12 payload_len u32
//! 16 request_id u64     24 trailer_len u64             32 payload (16-byte aligned in memory)
//! ```
//! `trailer_len` is zero unless `FLAG_TRAILER` is set: then that many raw bytes follow the payload
//! (TCP only: the data of a remote store or retrieve, received into or sent from pool slots).
//! Payloads are validated with bytecheck (`rkyv::from_bytes`) before use; anything corrupt,
//! truncated, misaligned or oversized is a typed [`FrameError`], never a panic. Frames are read
//! from a stream by [`FrameReader`] (`super::reader`, re-exported here).

use rkyv::rancor;

use super::messages::{Request, Response};

/// `b"KVN1"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"KVN1");
/// Protocol version spoken by this build.
pub const VERSION: u16 = 3;
/// Header size in bytes.
pub const HEADER_BYTES: usize = 32;
/// Largest payload accepted in either direction.
pub const MAX_PAYLOAD_BYTES: u32 = 16 << 20;
/// Header flag: this frame is a response.
pub const FLAG_RESPONSE: u32 = 1;
/// Header flag: a file descriptor (the pool) travels with this frame.
pub const FLAG_FD: u32 = 2;
/// Request id of a heartbeat: on a remote connection, a NOOP with this id is never answered (it
/// only proves the engine is alive; see `config::HEARTBEAT_MS`).
pub const HEARTBEAT_REQUEST_ID: u64 = u64::MAX;
/// Header flag: `trailer_len` raw bytes follow the payload (never together with `FLAG_FD`).
pub const FLAG_TRAILER: u32 = 4;
/// Largest trailer the codec accepts (a transport enforces its own, smaller, configured limit).
pub const MAX_TRAILER_BYTES: u64 = 16 << 30;
/// Flags this version understands; others are rejected.
const KNOWN_FLAGS: u32 = FLAG_RESPONSE | FLAG_FD | FLAG_TRAILER;

/// Why a frame was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// The first four bytes are not `KVN1`.
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// A protocol version this build does not speak.
    #[error("unsupported protocol version {0}")]
    BadVersion(u16),
    /// Payload length above the limit. The header's framing was intact, so the refusal can be
    /// addressed to the request that announced it.
    #[error("payload of {len} bytes exceeds the {max}-byte limit")]
    Oversized {
        /// Declared length.
        len: u32,
        /// Limit.
        max: u32,
        /// Request id of the frame that announced it.
        request_id: u64,
        /// Opcode of that frame.
        opcode: u16,
    },
    /// Reserved header bits are set.
    #[error("reserved header field or flags set ({0:#x})")]
    Reserved(u64),
    /// The payload failed validation.
    #[error("invalid payload: {0}")]
    Payload(String),
    /// The header opcode disagrees with the payload.
    #[error("header opcode {header} does not match payload opcode {payload}")]
    OpcodeMismatch {
        /// Opcode in the header.
        header: u16,
        /// Opcode of the decoded payload.
        payload: u16,
    },
    /// The stream ended inside a frame.
    #[error("connection closed mid-frame")]
    Truncated,
    /// The transport failed.
    #[error("i/o: {0}")]
    Io(String),
    /// A frame's bytes did not all arrive within the frame deadline of its first byte (the
    /// client sent part of a header or payload and stalled). `request_id` and `opcode` are
    /// those of its header, or 0 when the header itself was incomplete.
    #[error("frame not received within {limit_ms} ms of its first byte")]
    Stalled {
        /// Request id of the frame's header (0: header incomplete).
        request_id: u64,
        /// Opcode of the frame's header (0: header incomplete).
        opcode: u16,
        /// The deadline in milliseconds.
        limit_ms: u64,
    },
    /// A frame's payload could not get room in the node-wide payload budget before its frame
    /// deadline (other connections held it): the node is saturated, not necessarily the client
    /// at fault.
    #[error(
        "frame not received within {limit_ms} ms of its first byte: the node's payload budget \
         stayed full"
    )]
    BudgetTimeout {
        /// Request id of the frame's header.
        request_id: u64,
        /// Opcode of the frame's header.
        opcode: u16,
        /// The frame deadline in milliseconds.
        limit_ms: u64,
    },
    /// No frame began within the idle deadline (the connection is otherwise intact).
    #[error("no request for {limit_ms} ms")]
    Idle {
        /// The deadline in milliseconds.
        limit_ms: u64,
    },
}

/// A decoded header. Invariant: produced only by [`FrameHeader::decode`] (validated) or by this
/// module's encoders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Request type (see `Request::opcode`); echoed in responses.
    pub opcode: u16,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Caller's id, echoed in the response (pipelining).
    pub request_id: u64,
    /// Bytes of payload that follow.
    pub payload_len: u32,
    /// Raw bytes that follow the payload (0 unless `flags` has `FLAG_TRAILER`; then at least 1
    /// and at most `MAX_TRAILER_BYTES`).
    pub trailer_len: u64,
}

impl FrameHeader {
    /// Serialises the header.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.opcode.to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.payload_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.request_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.trailer_len.to_le_bytes());
        b
    }

    /// Parses and validates a header.
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<FrameHeader, FrameError> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(FrameError::BadVersion(version));
        }
        let flags = u32_at(8);
        let trailer_len = u64_at(24);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(FrameError::Reserved(u64::from(flags & !KNOWN_FLAGS)));
        }
        let trailer_ok = if flags & FLAG_TRAILER != 0 {
            flags & FLAG_FD == 0 && (1..=MAX_TRAILER_BYTES).contains(&trailer_len)
        } else {
            trailer_len == 0
        };
        if !trailer_ok {
            return Err(FrameError::Reserved(trailer_len));
        }
        let payload_len = u32_at(12);
        if payload_len > MAX_PAYLOAD_BYTES {
            return Err(FrameError::Oversized {
                len: payload_len,
                max: MAX_PAYLOAD_BYTES,
                request_id: u64_at(16),
                opcode: u16::from_le_bytes([b[6], b[7]]),
            });
        }
        Ok(FrameHeader {
            opcode: u16::from_le_bytes([b[6], b[7]]),
            flags,
            request_id: u64_at(16),
            payload_len,
            trailer_len,
        })
    }
}

fn encode_frame(
    opcode: u16,
    flags: u32,
    request_id: u64,
    payload: &[u8],
    trailer_len: u64,
) -> Result<Vec<u8>, FrameError> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&l| l <= MAX_PAYLOAD_BYTES)
        .ok_or(FrameError::Oversized {
            len: u32::try_from(payload.len()).unwrap_or(u32::MAX),
            max: MAX_PAYLOAD_BYTES,
            request_id,
            opcode,
        })?;
    if trailer_len > MAX_TRAILER_BYTES {
        return Err(FrameError::Payload(format!(
            "trailer of {trailer_len} bytes exceeds the {MAX_TRAILER_BYTES}-byte limit"
        )));
    }
    let flags = if trailer_len > 0 {
        flags | FLAG_TRAILER
    } else {
        flags
    };
    let h = FrameHeader {
        opcode,
        flags,
        request_id,
        payload_len: len,
        trailer_len,
    };
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&h.encode());
    out.extend_from_slice(payload);
    Ok(out)
}

/// Encodes a request frame.
pub fn encode_request(request_id: u64, req: &Request) -> Result<Vec<u8>, FrameError> {
    encode_request_with_trailer(request_id, req, 0)
}

/// Encodes a request frame announcing `trailer_len` raw bytes after it (0: none). The caller
/// sends those bytes right after the frame.
pub fn encode_request_with_trailer(
    request_id: u64,
    req: &Request,
    trailer_len: u64,
) -> Result<Vec<u8>, FrameError> {
    let payload =
        rkyv::to_bytes::<rancor::Error>(req).map_err(|e| FrameError::Payload(e.to_string()))?;
    encode_frame(req.opcode(), 0, request_id, &payload, trailer_len)
}

/// Encodes a response frame answering `request_id` of type `opcode`.
pub fn encode_response(
    request_id: u64,
    opcode: u16,
    fd: bool,
    resp: &Response,
) -> Result<Vec<u8>, FrameError> {
    let payload =
        rkyv::to_bytes::<rancor::Error>(resp).map_err(|e| FrameError::Payload(e.to_string()))?;
    let flags = FLAG_RESPONSE | if fd { FLAG_FD } else { 0 };
    encode_frame(opcode, flags, request_id, &payload, 0)
}

/// Encodes a response frame announcing `trailer_len` raw bytes after it (never with an fd).
pub fn encode_response_with_trailer(
    request_id: u64,
    opcode: u16,
    resp: &Response,
    trailer_len: u64,
) -> Result<Vec<u8>, FrameError> {
    let payload =
        rkyv::to_bytes::<rancor::Error>(resp).map_err(|e| FrameError::Payload(e.to_string()))?;
    encode_frame(opcode, FLAG_RESPONSE, request_id, &payload, trailer_len)
}

/// Validates and decodes a request payload; the header opcode must match the payload.
/// `payload` must be 16-byte aligned (an [`AlignedVec`](rkyv::util::AlignedVec)); misaligned input is rejected.
pub fn decode_request(h: &FrameHeader, payload: &[u8]) -> Result<Request, FrameError> {
    if h.flags & FLAG_RESPONSE != 0 {
        return Err(FrameError::Payload("response flag set on a request".into()));
    }
    let req = rkyv::from_bytes::<Request, rancor::BoxedError>(payload)
        .map_err(|e| FrameError::Payload(redact_addresses(&e.to_string())))?;
    if req.opcode() != h.opcode {
        return Err(FrameError::OpcodeMismatch {
            header: h.opcode,
            payload: req.opcode(),
        });
    }
    Ok(req)
}

/// Validates and decodes a response payload.
pub fn decode_response(payload: &[u8]) -> Result<Response, FrameError> {
    rkyv::from_bytes::<Response, rancor::BoxedError>(payload)
        .map_err(|e| FrameError::Payload(redact_addresses(&e.to_string())))
}

/// Hexadecimal numbers of 9 digits or more in a validation error are memory addresses (the
/// validator reports pointers into the node's receive buffer): they are replaced, so an error
/// sent to a client never tells it where the node's heap lies. Offsets and lengths inside a
/// 16 MiB payload have at most 7 hex digits and stay.
fn redact_addresses(msg: &str) -> String {
    let b = msg.as_bytes();
    let mut out = String::with_capacity(msg.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'0' && b.get(i + 1).is_some_and(|&c| c == b'x' || c == b'X') {
            let digits = b[i + 2..]
                .iter()
                .take_while(|c| c.is_ascii_hexdigit())
                .count();
            if digits >= 9 {
                out.push_str("<address>");
                i += 2 + digits;
                continue;
            }
        }
        let ch = msg[i..].chars().next().expect("inside the string");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

pub use super::reader::{
    FrameReader, FrameSource, PlainSource, ReadLimits, ReadTimeout, READ_BUFFER_BYTES,
};

#[cfg(test)]
mod tests {
    use std::io;
    use std::os::fd::OwnedFd;

    use rkyv::util::AlignedVec;

    use super::*;
    use crate::protocol::messages::ChunkRange;

    fn sample() -> Request {
        Request::PrepareStore {
            instance_id: 7,
            range: ChunkRange {
                model: "m".into(),
                world_size: 1,
                worker_id: Some(0),
                cache_salt: String::new(),
                first_chunk: 0,
                chunk_hashes: vec![[1; 32], [2; 32]],
            },
        }
    }

    /// A LOOKUP of `chunks` copies of the hash `[fill; 32]`.
    fn lookup(id: &str, fill: u8, chunks: usize) -> Request {
        Request::Lookup {
            request_id: id.into(),
            range: ChunkRange {
                model: "m".into(),
                world_size: 1,
                worker_id: None,
                cache_salt: String::new(),
                first_chunk: 0,
                chunk_hashes: vec![[fill; 32]; chunks],
            },
            tp_size: 1,
            readers: 0,
        }
    }

    fn read_all(bytes: &[u8]) -> Result<Option<Request>, FrameError> {
        let mut src = PlainSource(bytes);
        let mut buf = AlignedVec::new();
        match FrameReader::default().read_frame(&mut src, &mut buf)? {
            None => Ok(None),
            Some((h, _)) => decode_request(&h, &buf).map(Some),
        }
    }

    #[test]
    fn round_trip() {
        let f = encode_request(42, &sample()).unwrap();
        assert_eq!(read_all(&f).unwrap(), Some(sample()));
        let r = Response::LookupHits { chunks: 3 };
        let f = encode_response(42, 11, false, &r).unwrap();
        let h = FrameHeader::decode(f[..32].try_into().unwrap()).unwrap();
        assert_eq!((h.request_id, h.opcode, h.flags), (42, 11, FLAG_RESPONSE));
        let mut p = AlignedVec::<16>::new();
        p.extend_from_slice(&f[32..]);
        assert_eq!(decode_response(&p).unwrap(), r);
    }

    #[test]
    fn buffered_reader_splits_pipelined_and_large_frames() {
        // Several small frames in one burst, then one frame larger than the read buffer.
        let mut bytes = Vec::new();
        for id in 0..5 {
            bytes.extend(encode_request(id, &sample()).unwrap());
        }
        let big = lookup("big", 9, 10_000);
        bytes.extend(encode_request(99, &big).unwrap());
        // Deliver in odd-sized pieces to exercise every boundary.
        struct Trickle<'a>(&'a [u8], usize);
        impl FrameSource for Trickle<'_> {
            fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
                let n = buf.len().min(self.1).min(self.0.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                self.1 = self.1 % 97 + 13;
                Ok((n, None))
            }
        }
        let mut src = Trickle(&bytes, 7);
        let mut r = FrameReader::default();
        let mut p = AlignedVec::new();
        for id in 0..5 {
            let (h, _) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
            assert_eq!(h.request_id, id);
            assert_eq!(decode_request(&h, &p).unwrap(), sample());
        }
        let (h, _) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
        assert_eq!(decode_request(&h, &p).unwrap(), big);
        assert!(r.read_frame(&mut src, &mut p).unwrap().is_none());
    }

    #[test]
    fn fd_goes_to_the_frame_that_announces_it() {
        // One receive returns a plain reply followed by the fd-carrying registration reply,
        // with the fd attached to that receive: only the second frame may get it.
        let mut bytes = encode_response(1, 1, false, &Response::Text("OK".into())).unwrap();
        bytes.extend(encode_response(2, 4, true, &Response::Ok).unwrap());
        struct Once(Option<(Vec<u8>, OwnedFd)>);
        impl FrameSource for Once {
            fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
                match self.0.take() {
                    Some((b, fd)) => {
                        buf[..b.len()].copy_from_slice(&b);
                        Ok((b.len(), Some(fd)))
                    }
                    None => Ok((0, None)),
                }
            }
        }
        let fd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let mut src = Once(Some((bytes, fd)));
        let mut r = FrameReader::default();
        let mut p = AlignedVec::new();
        let (h1, fd1) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
        assert_eq!((h1.request_id, fd1.is_none()), (1, true));
        let (h2, fd2) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
        assert_eq!((h2.request_id, fd2.is_some()), (2, true));
    }

    /// A trailer is announced only with its flag, within its bound, never with an fd; the
    /// reader hands out its first bytes (read with the frame) and resumes after the rest.
    #[test]
    fn trailers_are_announced_checked_and_handed_out() {
        let req = Request::WriteSlots {
            instance_id: 1,
            transfer_id: 2,
            data: crate::protocol::DataPath::Inline,
            commit: true,
        };
        let f = encode_request_with_trailer(7, &req, 5).unwrap();
        let h = FrameHeader::decode(f[..HEADER_BYTES].try_into().unwrap()).unwrap();
        assert_eq!((h.trailer_len, h.flags & FLAG_TRAILER), (5, FLAG_TRAILER));
        let mut stream = f.clone();
        stream.extend_from_slice(b"hello");
        stream.extend(encode_request(8, &Request::Noop).unwrap());
        let mut r = FrameReader::default();
        let mut src = PlainSource(&stream[..]);
        let mut p = AlignedVec::new();
        let (h1, _) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
        assert_eq!(decode_request(&h1, &p).unwrap(), req);
        assert_eq!(r.take_buffered(3), b"hel");
        assert_eq!(r.take_buffered(2), b"lo");
        let (h2, _) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
        assert_eq!((h2.request_id, h2.trailer_len), (8, 0));
        // The flag without a length, a length without the flag, too long, or with an fd.
        let mut bad = f.clone();
        bad[24..32].copy_from_slice(&0u64.to_le_bytes());
        assert!(matches!(read_all(&bad), Err(FrameError::Reserved(_))));
        let mut bad = f.clone();
        bad[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(read_all(&bad), Err(FrameError::Reserved(_))));
        let mut bad = f.clone();
        bad[24..32].copy_from_slice(&(MAX_TRAILER_BYTES + 1).to_le_bytes());
        assert!(matches!(read_all(&bad), Err(FrameError::Reserved(_))));
        let mut bad = f;
        bad[8..12].copy_from_slice(&(FLAG_TRAILER | FLAG_FD).to_le_bytes());
        assert!(matches!(read_all(&bad), Err(FrameError::Reserved(_))));
        assert!(encode_request_with_trailer(1, &Request::Noop, MAX_TRAILER_BYTES + 1).is_err());
    }

    #[test]
    fn empty_stream_is_clean_eof() {
        assert_eq!(read_all(&[]).unwrap(), None);
    }

    #[test]
    fn rejects_bad_headers() {
        let f = encode_request(1, &Request::Noop).unwrap();
        let mut bad = f.clone();
        bad[0] = b'X';
        assert!(matches!(read_all(&bad), Err(FrameError::BadMagic(_))));
        let mut bad = f.clone();
        bad[4] = 9;
        assert_eq!(read_all(&bad), Err(FrameError::BadVersion(9)));
        let mut bad = f.clone();
        bad[12..16].copy_from_slice(&(MAX_PAYLOAD_BYTES + 1).to_le_bytes());
        assert!(matches!(read_all(&bad), Err(FrameError::Oversized { .. })));
        let mut bad = f.clone();
        bad[30] = 1;
        assert!(matches!(read_all(&bad), Err(FrameError::Reserved(_))));
        let mut bad = f.clone();
        bad[8] = 0x80;
        assert!(matches!(read_all(&bad), Err(FrameError::Reserved(_))));
    }

    #[test]
    fn rejects_truncated_frames() {
        let f = encode_request(1, &sample()).unwrap();
        for cut in [1, 16, 31, 33, f.len() - 1] {
            assert_eq!(
                read_all(&f[..cut]),
                Err(FrameError::Truncated),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn rejects_opcode_mismatch_and_response_flag() {
        let mut f = encode_request(1, &sample()).unwrap();
        f[6] = 2;
        assert_eq!(
            read_all(&f),
            Err(FrameError::OpcodeMismatch {
                header: 2,
                payload: 6
            })
        );
        let mut f = encode_request(1, &sample()).unwrap();
        f[8] = FLAG_RESPONSE as u8;
        assert!(matches!(read_all(&f), Err(FrameError::Payload(_))));
    }

    #[test]
    fn rejects_corrupt_payloads_without_panicking() {
        let f = encode_request(1, &sample()).unwrap();
        let mut rng = 0x1234_5678_u64;
        for _ in 0..2000 {
            let mut bad = f.clone();
            for _ in 0..4 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let i = 32 + (rng as usize) % (bad.len() - 32);
                bad[i] ^= (rng >> 32) as u8 | 1;
            }
            // Either a valid (different) request or a typed error: never a panic.
            let _ = read_all(&bad);
        }
        // Garbage payload of the right length is rejected.
        let mut garbage = f[..32].to_vec();
        garbage.extend(std::iter::repeat_n(0xFFu8, f.len() - 32));
        assert!(read_all(&garbage).is_err());
    }

    #[test]
    fn rejects_misaligned_payloads() {
        let f = encode_request(1, &sample()).unwrap();
        let h = FrameHeader::decode(f[..32].try_into().unwrap()).unwrap();
        let mut storage = AlignedVec::<16>::new();
        storage.push(0);
        storage.extend_from_slice(&f[32..]);
        let err = decode_request(&h, &storage[1..]).unwrap_err();
        assert!(matches!(err, FrameError::Payload(_)), "{err:?}");
    }

    #[test]
    fn oversized_payloads_cannot_be_encoded() {
        let big = lookup("r", 0, (MAX_PAYLOAD_BYTES as usize / 32) + 1);
        assert!(matches!(
            encode_request(1, &big),
            Err(FrameError::Oversized { .. })
        ));
    }

    /// A header declaring a large payload commits the reader only to the bytes that arrive
    /// (32 bytes from a client used to make the node allocate 16 MiB), and a large frame's
    /// buffer is not kept for the connection's life.
    #[test]
    fn payload_memory_follows_the_bytes_received() {
        let h = FrameHeader {
            opcode: 11,
            flags: 0,
            request_id: 1,
            payload_len: MAX_PAYLOAD_BYTES,
            trailer_len: 0,
        };
        let mut stream = h.encode().to_vec();
        stream.extend(vec![7u8; 100_000]);
        let mut payload = AlignedVec::<16>::new();
        let r = FrameReader::default().read_frame(&mut PlainSource(&stream[..]), &mut payload);
        assert_eq!(r.unwrap_err(), FrameError::Truncated);
        assert!(
            payload.capacity() < 1 << 20,
            "{} bytes held for 100 000 received",
            payload.capacity()
        );
        // A whole large frame is read, then its buffer is released at the next frame.
        let big = FrameHeader {
            payload_len: 4 << 20,
            ..h
        };
        let mut stream = big.encode().to_vec();
        stream.extend(vec![1u8; 4 << 20]);
        stream.extend(
            FrameHeader {
                payload_len: 0,
                ..h
            }
            .encode(),
        );
        let mut reader = FrameReader::default();
        let mut src = PlainSource(&stream[..]);
        let (got, _) = reader.read_frame(&mut src, &mut payload).unwrap().unwrap();
        assert_eq!((got.payload_len, payload.len()), (4 << 20, 4 << 20));
        assert!(payload.iter().all(|b| *b == 1));
        reader.read_frame(&mut src, &mut payload).unwrap().unwrap();
        assert!(payload.capacity() < 1 << 20);
    }
}

#[cfg(test)]
mod redaction_tests {
    use super::*;

    #[test]
    fn validation_errors_never_carry_heap_addresses() {
        let h = FrameHeader::decode(
            encode_request(5, &Request::Noop).unwrap()[..HEADER_BYTES]
                .try_into()
                .unwrap(),
        )
        .unwrap();
        let mut a = rkyv::util::AlignedVec::<16>::new();
        a.extend_from_slice(&[0xEEu8; 64]);
        let e = decode_request(&h, &a).unwrap_err().to_string();
        assert!(e.contains("<address>"), "{e}");
        assert!(!e.contains("0x0000"), "{e}");
        assert_eq!(
            redact_addresses("ptr 0x00007fb9240016b0 size 72 at 0x40, é 0xdeadbeef1"),
            "ptr <address> size 72 at 0x40, é <address>"
        );
    }
}
