//! Fixed-layout little-endian encoding of the four handshake messages. Every decoder checks the
//! exact length and every field it reads, returns [`HandshakeError::Malformed`] naming the problem,
//! and never panics or allocates (names are borrowed from the input).
//!
//! Layouts (offsets in bytes):
//! - `ClientHello` (45 + name_len ≤ 109): `0 magic "KVNH" | 4 hs_version u16 | 6 min_frame u16 |
//!   8 max_frame u16 | 10 fabrics u16 | 12 client_nonce [32] | 44 name_len u8 | 45 name`.
//! - `ServerHello` (64): `0 magic | 4 hs_version u16 | 6 status u8 | 7 auth u8 |
//!   8 frame_version u16 | 10 min_frame u16 | 12 max_frame u16 | 14 fabrics u16 |
//!   16 server_nonce [32] | 48 node_id [16]`.
//! - `ClientAuth` (34): `0 fabric u16 | 2 mac_c [32]`.
//! - `ServerAuth` (34): `0 status u8 | 1 role u8 | 2 mac_s [32]`.
//!
//! Only when the chosen fabric is RDMA, after a `ServerAuth` with status ok (see [`super::rdma`]):
//! - `RdmaOffer` (28), client → node, then node → client: `0 status u8 (0 ok, 1 failed) |
//!   1 mtu u8 | 2 lid u16 | 4 qpn u32 | 8 psn u32 | 12 gid [16]` (all zero after status 1).
//! - `RdmaReady` (1), each way: `0 ready` (the sender's queue pair is in RTS) or `1 failed`.

use super::{FrameRange, HandshakeError, Outgoing, HS_VERSION, MAGIC, MAX_NAME_BYTES};

/// Bytes of the magic and the handshake version, the prefix every version keeps.
pub const PREFIX_BYTES: usize = 6;
/// Bytes of a `ClientHello` without its name.
pub const CLIENT_HELLO_FIXED_BYTES: usize = 45;
/// Bytes of the longest `ClientHello`.
pub const CLIENT_HELLO_MAX_BYTES: usize = CLIENT_HELLO_FIXED_BYTES + MAX_NAME_BYTES;
/// Bytes of a `ServerHello`.
pub const SERVER_HELLO_BYTES: usize = 64;
/// Bytes of a `ClientAuth`.
pub const CLIENT_AUTH_BYTES: usize = 34;
/// Bytes of a `ServerAuth`.
pub const SERVER_AUTH_BYTES: usize = 34;
/// Bytes of an `RdmaOffer`.
pub const RDMA_OFFER_BYTES: usize = 28;
/// Bytes of an `RdmaReady`.
pub const RDMA_READY_BYTES: usize = 1;
/// Largest queue pair number and packet sequence number (both 24 bits on the wire of verbs).
pub const RDMA_MAX_24BIT: u32 = 0x00ff_ffff;
/// Path MTU enum values a peer may send (`IBV_MTU_256` = 1 ..= `IBV_MTU_4096` = 5).
pub const RDMA_MTU_RANGE: std::ops::RangeInclusive<u8> = 1..=5;

/// The `status` byte of the node's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// Go on (ServerHello) / authenticated (ServerAuth).
    Ok = 0,
    /// ServerAuth: the client's MAC matches no token.
    BadToken = 1,
    /// ServerHello: too many handshakes in progress; the node closes.
    Busy = 2,
    /// ServerHello: no common frame or handshake version; the node closes.
    Version = 3,
    /// ServerAuth: the chosen fabric is not offered.
    Fabric = 4,
}

impl Status {
    fn from_byte(b: u8) -> Result<Status, HandshakeError> {
        Ok(match b {
            0 => Status::Ok,
            1 => Status::BadToken,
            2 => Status::Busy,
            3 => Status::Version,
            4 => Status::Fabric,
            _ => return Err(malformed(format!("unknown status {b}"))),
        })
    }
}

fn malformed(what: impl Into<String>) -> HandshakeError {
    HandshakeError::Malformed(what.into())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn array_at<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

fn exact_len(what: &str, b: &[u8], want: usize) -> Result<(), HandshakeError> {
    if b.len() != want {
        return Err(malformed(format!(
            "{what} is {} bytes, expected {want}",
            b.len()
        )));
    }
    Ok(())
}

/// Checks what is known of a hello's first bytes: the magic (as far as it has arrived).
fn check_magic(prefix: &[u8], what: &str) -> Result<(), HandshakeError> {
    let n = prefix.len().min(MAGIC.len());
    if prefix[..n] != MAGIC[..n] {
        return Err(malformed(format!(
            "{what} does not start with the magic \"KVNH\" (not a kvnode client or node?)"
        )));
    }
    Ok(())
}

/// The handshake version in a hello's prefix, once [`PREFIX_BYTES`] have arrived.
pub fn prefix_version(prefix: &[u8]) -> Option<u16> {
    (prefix.len() >= PREFIX_BYTES).then(|| u16_at(prefix, 4))
}

/// The client's first message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello<'a> {
    /// The handshake version ([`HS_VERSION`]).
    pub hs_version: u16,
    /// The frame versions the client speaks.
    pub frames: FrameRange,
    /// Fabric bits the client accepts.
    pub fabrics: u16,
    /// The client's fresh random nonce.
    pub nonce: [u8; 32],
    /// The client's name for logs (≤ [`MAX_NAME_BYTES`] of UTF-8).
    pub name: &'a str,
}

impl ClientHello<'_> {
    /// Total length of the `ClientHello` whose first bytes are `prefix`, as far as they tell: a
    /// lower bound while fewer than [`CLIENT_HELLO_FIXED_BYTES`] have arrived, exact after.
    /// Errors as soon as the magic or the name length is wrong.
    pub fn total_len(prefix: &[u8]) -> Result<usize, HandshakeError> {
        check_magic(prefix, "the ClientHello")?;
        if prefix.len() < CLIENT_HELLO_FIXED_BYTES {
            return Ok(if prefix.len() < PREFIX_BYTES {
                PREFIX_BYTES
            } else {
                CLIENT_HELLO_FIXED_BYTES
            });
        }
        let name_len = usize::from(prefix[CLIENT_HELLO_FIXED_BYTES - 1]);
        if name_len > MAX_NAME_BYTES {
            return Err(malformed(format!(
                "client name of {name_len} bytes (at most {MAX_NAME_BYTES})"
            )));
        }
        Ok(CLIENT_HELLO_FIXED_BYTES + name_len)
    }

    /// Decodes a whole `ClientHello` (exactly its bytes).
    pub fn decode(b: &[u8]) -> Result<ClientHello<'_>, HandshakeError> {
        let total = ClientHello::total_len(b)?;
        exact_len("the ClientHello", b, total.max(CLIENT_HELLO_FIXED_BYTES))?;
        let frames = FrameRange {
            min: u16_at(b, 6),
            max: u16_at(b, 8),
        };
        if frames.min > frames.max {
            return Err(malformed(format!(
                "client frame versions {}..={} are an empty range",
                frames.min, frames.max
            )));
        }
        let name = std::str::from_utf8(&b[CLIENT_HELLO_FIXED_BYTES..])
            .map_err(|_| malformed("client name is not UTF-8"))?;
        Ok(ClientHello {
            hs_version: u16_at(b, 4),
            frames,
            fabrics: u16_at(b, 10),
            nonce: array_at(b, 12),
            name,
        })
    }

    /// Encodes the message; a name longer than [`MAX_NAME_BYTES`] is cut at a character boundary.
    pub fn encode(&self) -> Outgoing {
        let mut name = self.name;
        if name.len() > MAX_NAME_BYTES {
            let mut end = MAX_NAME_BYTES;
            while !name.is_char_boundary(end) {
                end -= 1;
            }
            name = &name[..end];
        }
        let mut o = Outgoing::new();
        o.put(&MAGIC);
        o.put(&self.hs_version.to_le_bytes());
        o.put(&self.frames.min.to_le_bytes());
        o.put(&self.frames.max.to_le_bytes());
        o.put(&self.fabrics.to_le_bytes());
        o.put(&self.nonce);
        // `name.len() <= MAX_NAME_BYTES` (64) fits a byte.
        o.put(&[name.len() as u8]);
        o.put(name.as_bytes());
        o
    }
}

/// The node's first message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerHello {
    /// The handshake version the node speaks.
    pub hs_version: u16,
    /// Go on, or why the node is closing.
    pub status: Status,
    /// Whether the node authenticates clients (`true`: token mode).
    pub auth: bool,
    /// The chosen frame version (0 unless `status` is `Ok`).
    pub frame_version: u16,
    /// The frame versions the node speaks.
    pub frames: FrameRange,
    /// Fabric bits the node offers.
    pub fabrics: u16,
    /// The node's fresh random nonce.
    pub nonce: [u8; 32],
    /// The node's id.
    pub node_id: [u8; 16],
}

impl ServerHello {
    /// Decodes a `ServerHello` (exactly [`SERVER_HELLO_BYTES`]). The handshake version is not
    /// checked here (the caller reports a mismatch as such).
    pub fn decode(b: &[u8]) -> Result<ServerHello, HandshakeError> {
        check_magic(b, "the ServerHello")?;
        exact_len("the ServerHello", b, SERVER_HELLO_BYTES)?;
        let auth = match b[7] {
            0 => false,
            1 => true,
            x => return Err(malformed(format!("unknown auth mode {x}"))),
        };
        Ok(ServerHello {
            hs_version: u16_at(b, 4),
            status: Status::from_byte(b[6])?,
            auth,
            frame_version: u16_at(b, 8),
            frames: FrameRange {
                min: u16_at(b, 10),
                max: u16_at(b, 12),
            },
            fabrics: u16_at(b, 14),
            nonce: array_at(b, 16),
            node_id: array_at(b, 48),
        })
    }

    /// Encodes the message ([`SERVER_HELLO_BYTES`]).
    pub fn encode(&self) -> Outgoing {
        let mut o = Outgoing::new();
        o.put(&MAGIC);
        o.put(&self.hs_version.to_le_bytes());
        o.put(&[self.status as u8, u8::from(self.auth)]);
        o.put(&self.frame_version.to_le_bytes());
        o.put(&self.frames.min.to_le_bytes());
        o.put(&self.frames.max.to_le_bytes());
        o.put(&self.fabrics.to_le_bytes());
        o.put(&self.nonce);
        o.put(&self.node_id);
        o
    }

    /// A refusal (`Busy` or `Version`): no nonce, no chosen version; the node's range, fabrics
    /// and id are still told so the client's error can name them.
    pub fn refusal(
        status: Status,
        auth: bool,
        frames: FrameRange,
        fabrics: u16,
        node_id: [u8; 16],
    ) -> ServerHello {
        ServerHello {
            hs_version: HS_VERSION,
            status,
            auth,
            frame_version: 0,
            frames,
            fabrics,
            nonce: [0; 32],
            node_id,
        }
    }
}

/// The client's proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientAuth {
    /// The fabric bit chosen (0 when none is common: the node answers `Fabric`).
    pub fabric: u16,
    /// `mac_c` (zeros from a tokenless client).
    pub mac: [u8; 32],
}

impl ClientAuth {
    /// Decodes a `ClientAuth` (exactly [`CLIENT_AUTH_BYTES`]).
    pub fn decode(b: &[u8]) -> Result<ClientAuth, HandshakeError> {
        exact_len("the ClientAuth", b, CLIENT_AUTH_BYTES)?;
        Ok(ClientAuth {
            fabric: u16_at(b, 0),
            mac: array_at(b, 2),
        })
    }

    /// Encodes the message ([`CLIENT_AUTH_BYTES`]).
    pub fn encode(&self) -> Outgoing {
        let mut o = Outgoing::new();
        o.put(&self.fabric.to_le_bytes());
        o.put(&self.mac);
        o
    }
}

/// The node's verdict and proof.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerAuth {
    /// `Ok`, `BadToken` or `Fabric`.
    pub status: Status,
    /// The role byte (1 client, 2 admin; 0 with a refusal).
    pub role: u8,
    /// `mac_s` (zeros with a refusal or in insecure mode).
    pub mac: [u8; 32],
}

impl ServerAuth {
    /// Decodes a `ServerAuth` (exactly [`SERVER_AUTH_BYTES`]).
    pub fn decode(b: &[u8]) -> Result<ServerAuth, HandshakeError> {
        exact_len("the ServerAuth", b, SERVER_AUTH_BYTES)?;
        Ok(ServerAuth {
            status: Status::from_byte(b[0])?,
            role: b[1],
            mac: array_at(b, 2),
        })
    }

    /// Encodes the message ([`SERVER_AUTH_BYTES`]).
    pub fn encode(&self) -> Outgoing {
        let mut o = Outgoing::new();
        o.put(&[self.status as u8, self.role]);
        o.put(&self.mac);
        o
    }

    /// A refusal with `status`: no role, no proof.
    pub fn refusal(status: Status) -> ServerAuth {
        ServerAuth {
            status,
            role: 0,
            mac: [0; 32],
        }
    }
}

/// One side's RDMA queue pair, or its failure to create one.
///
/// Invariant (checked by [`RdmaOffer::decode`]): an `Ok` endpoint has a QP number in
/// `1..=0xffffff`, a PSN of at most 24 bits and an MTU enum in [`RDMA_MTU_RANGE`]; a failure
/// carries no other byte (all zero on the wire). The hardware layer checks the endpoint again
/// before connecting (GID and LID against the port's link layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaOffer {
    /// The sender's queue pair, in INIT, waiting for this side's endpoint.
    Ok(kvnode_hw::fabric::RdmaEndpoint),
    /// The sender could not create a queue pair (it closes after this message).
    Failed,
}

impl RdmaOffer {
    /// Decodes an `RdmaOffer` (exactly [`RDMA_OFFER_BYTES`]).
    pub fn decode(b: &[u8]) -> Result<RdmaOffer, HandshakeError> {
        exact_len("the RdmaOffer", b, RDMA_OFFER_BYTES)?;
        match b[0] {
            0 => {}
            1 if b[1..].iter().all(|&x| x == 0) => return Ok(RdmaOffer::Failed),
            1 => return Err(malformed("a failed RdmaOffer carries endpoint bytes")),
            x => return Err(malformed(format!("unknown RdmaOffer status {x}"))),
        }
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let ep = kvnode_hw::fabric::RdmaEndpoint {
            mtu: b[1],
            lid: u16_at(b, 2),
            qpn: u32_at(4),
            psn: u32_at(8),
            gid: array_at(b, 12),
        };
        if ep.qpn == 0 || ep.qpn > RDMA_MAX_24BIT {
            return Err(malformed(format!(
                "RDMA queue pair number {:#x} is not in 1..=0xffffff",
                ep.qpn
            )));
        }
        if ep.psn > RDMA_MAX_24BIT {
            return Err(malformed(format!(
                "RDMA packet sequence number {:#x} is over 24 bits",
                ep.psn
            )));
        }
        if !RDMA_MTU_RANGE.contains(&ep.mtu) {
            return Err(malformed(format!(
                "RDMA path MTU enum {} is not in 1..=5",
                ep.mtu
            )));
        }
        Ok(RdmaOffer::Ok(ep))
    }

    /// Encodes the message ([`RDMA_OFFER_BYTES`]).
    pub fn encode(&self) -> Outgoing {
        let mut o = Outgoing::new();
        match self {
            RdmaOffer::Failed => {
                o.put(&[1u8]);
                o.put(&[0u8; RDMA_OFFER_BYTES - 1]);
            }
            RdmaOffer::Ok(ep) => {
                o.put(&[0u8, ep.mtu]);
                o.put(&ep.lid.to_le_bytes());
                o.put(&ep.qpn.to_le_bytes());
                o.put(&ep.psn.to_le_bytes());
                o.put(&ep.gid);
            }
        }
        o
    }
}

/// Decodes an `RdmaReady` (exactly [`RDMA_READY_BYTES`]): `true` when the sender's queue pair is
/// in RTS, `false` when connecting it failed.
pub fn decode_rdma_ready(b: &[u8]) -> Result<bool, HandshakeError> {
    exact_len("the RdmaReady", b, RDMA_READY_BYTES)?;
    match b[0] {
        0 => Ok(true),
        1 => Ok(false),
        x => Err(malformed(format!("unknown RdmaReady value {x}"))),
    }
}

/// Encodes an `RdmaReady` ([`RDMA_READY_BYTES`]).
pub fn encode_rdma_ready(ready: bool) -> Outgoing {
    let mut o = Outgoing::new();
    o.put(&[u8::from(!ready)]);
    o
}
