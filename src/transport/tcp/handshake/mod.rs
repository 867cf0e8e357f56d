//! The handshake that opens every TCP connection, before any native frame: protocol versions,
//! fabric, and a mutual challenge-response proof of the pre-shared token.
//!
//! Four fixed-layout little-endian messages, each at most [`HANDSHAKE_MAX_BYTES`]
//! (layouts in [`codec`]):
//! 1. client → node `ClientHello`: magic `KVNH`, handshake version 1, the client's frame-version
//!    range, the fabrics it can use, a 32-byte random nonce, a name for logs (≤ 64 bytes).
//! 2. node → client `ServerHello`: status (0 ok, 2 busy, 3 version: then the node closes), whether
//!    it authenticates, the chosen frame version, its own range, the fabrics it offers, its own
//!    nonce, its node id.
//! 3. client → node `ClientAuth`: the fabric chosen and
//!    `mac_c = keyed_hash(K, "kvnode-auth/v1/client" ‖ T ‖ fabric)` where
//!    `T = blake3(ClientHello ‖ ServerHello)` (the exact bytes) and `K` the key derived from the
//!    token ([`super::auth`]).
//! 4. node → client `ServerAuth`: status (0 ok, 1 bad token, 4 fabric), role (1 client, 2 admin),
//!    `mac_s = keyed_hash(K, "kvnode-auth/v1/server" ‖ T ‖ mac_c ‖ fabric ‖ role)`.
//!
//! The token never crosses the wire; both nonces are in `T`, so a proof cannot be replayed on
//! another connection; the client refuses a node that cannot produce `mac_s` (an impostor) and a
//! node that does not authenticate at all when it was given a token (no downgrade). A node in
//! insecure mode (`--insecure-no-auth`) sends `auth = 0` and accepts any `mac_c` (a tokenless
//! client sends zeros), granting the client role.
//!
//! When the chosen fabric is RDMA, the two sides then exchange their queue pairs' endpoints and
//! a ready byte each ([`rdma`]; the node creates nothing RDMA-related before the `ServerAuth`).
//!
//! [`ServerHandshake`] and [`ClientHandshake`] are sans-IO state machines fed bytes in any
//! chunking (fuzzed: `fuzz/fuzz_targets/remote_handshake.rs`); [`server_handshake`] and
//! [`client_handshake`] drive them over a blocking [`std::net::TcpStream`] under a deadline.

mod client;
pub mod codec;
mod io;
pub mod rdma;
mod server;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_rdma;
#[cfg(test)]
mod tests_wire;

pub use client::{ClientHandshake, ClientStep};
pub use io::{
    client_handshake, client_rdma_exchange, send_busy, server_handshake, server_rdma_exchange,
    QpSetup,
};
pub use rdma::{RdmaExchange, RdmaSide, RdmaStep};
pub use server::{busy_hello, ServerHandshake, Step};

use kvnode_hw::fabric::FabricKind;

use super::auth::Token;
use crate::access::Role;
use crate::error::{Error, ErrorKind};

/// The largest handshake message in bytes: no side ever buffers more than this per message.
pub const HANDSHAKE_MAX_BYTES: usize = 256;
/// The magic that opens a `ClientHello` and a `ServerHello`.
pub const MAGIC: [u8; 4] = *b"KVNH";
/// The handshake version this code speaks (the layout of the four messages).
pub const HS_VERSION: u16 = 1;
/// The longest client name, in bytes of UTF-8 (longer names are cut at a character boundary).
pub const MAX_NAME_BYTES: usize = 64;
/// Fabric bit: TCP (the data moves on the same connection).
pub const FABRIC_TCP: u16 = 1;
/// Fabric bit: RDMA verbs.
pub const FABRIC_RDMA: u16 = 2;
/// Every fabric bit this version knows; others are ignored in offers and refused when chosen.
pub const FABRICS_KNOWN: u16 = FABRIC_TCP | FABRIC_RDMA;

/// An inclusive range of native frame versions. Invariant (checked where decoded): `min <= max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRange {
    /// Lowest version spoken.
    pub min: u16,
    /// Highest version spoken.
    pub max: u16,
}

impl std::fmt::Display for FrameRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}..={}", self.min, self.max)
        }
    }
}

/// What the node offers: the frame versions it speaks, the fabrics it can serve now (the rdma bit
/// only when a device is up and the pool is registered) and its id. Invariant: a `min > max`
/// range makes every client fail with [`HandshakeError::Version`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// The frame versions the node speaks.
    pub frames: FrameRange,
    /// Fabric bits ([`FABRIC_TCP`], [`FABRIC_RDMA`]).
    pub fabrics: u16,
    /// The node's id (sent to clients, for their logs and to tell nodes apart).
    pub node_id: [u8; 16],
}

/// What a client asks for: the frame versions it speaks and the fabrics it accepts (when both
/// sides have RDMA, RDMA is chosen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOffer {
    /// The frame versions the client speaks.
    pub frames: FrameRange,
    /// Fabric bits the client accepts.
    pub fabrics: u16,
}

/// The node's keys. Invariant: `Token` mode never completes a handshake without a verified
/// client MAC; `Insecure` completes every well-formed one with [`Role::Client`].
#[derive(Debug)]
pub enum ServerKeys {
    /// Clients prove `client`'s token (role client) or `admin`'s (role admin).
    Token {
        /// The token of ordinary clients (`--auth-token-file`).
        client: Token,
        /// The administrators' token (`--admin-token-file`), if any.
        admin: Option<Token>,
    },
    /// No authentication (`--insecure-no-auth`).
    Insecure,
}

impl ServerKeys {
    /// Token mode with the client token and an optional admin token. Refuses (`InvalidRequest`)
    /// an admin token equal to the client token: every client would be an administrator.
    pub fn token(client: Token, admin: Option<Token>) -> crate::Result<ServerKeys> {
        if admin.as_ref().is_some_and(|a| a.same_as(&client)) {
            return Err(Error::invalid(
                "the admin token is the same as the client token: every client would be an administrator; use a separate token file",
            ));
        }
        Ok(ServerKeys::Token { client, admin })
    }
}

/// The outcome of a successful handshake on the node. Invariant: `role` is `Admin` only when the
/// client proved the admin token, and `authenticated` is false only in insecure mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// The native frame version both sides speak from now on.
    pub frame_version: u16,
    /// The fabric the client chose ([`FabricKind::Tcp`] or [`FabricKind::Rdma`]).
    pub fabric: FabricKind,
    /// What the client may do.
    pub role: Role,
    /// The name the client gave, control characters replaced by `?` (for logs only; covered by
    /// the MACs, but chosen by the client).
    pub client_name: String,
    /// Whether the client proved a token (false in insecure mode).
    pub authenticated: bool,
}

/// The outcome of a successful handshake on the client. Invariant: when the client held a token,
/// `authenticated` is true and the node proved it knows that token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientNegotiated {
    /// The native frame version both sides speak from now on.
    pub frame_version: u16,
    /// The fabric chosen.
    pub fabric: FabricKind,
    /// The role the node granted.
    pub role: Role,
    /// The node's id.
    pub node_id: [u8; 16],
    /// Whether the node was authenticated (false only for a tokenless client of an insecure node).
    pub authenticated: bool,
}

/// Why a handshake failed. Each variant is one thing a listener or a client reports differently.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The client's proof does not match the node's token (on the client: the node rejected the
    /// token it was given).
    #[error("authentication failed: the token was rejected")]
    BadToken,
    /// The node requires a token and the client had none.
    #[error("authentication failed: the node requires a token and none was given")]
    TokenRequired,
    /// The node has too many handshakes in progress.
    #[error("the node is busy (too many connections in the handshake); retry later")]
    Busy,
    /// No native frame version is spoken by both sides.
    #[error(
        "no common protocol version: this side speaks frame versions {ours}, the peer {theirs}"
    )]
    Version {
        /// This side's range.
        ours: FrameRange,
        /// The peer's range.
        theirs: FrameRange,
    },
    /// The peer speaks another handshake version.
    #[error("unsupported handshake version {theirs} (this side speaks {ours})")]
    HandshakeVersion {
        /// This side's handshake version.
        ours: u16,
        /// The peer's.
        theirs: u16,
    },
    /// No fabric is accepted by both sides.
    #[error("no common fabric: this side accepts {}, the peer {}", fabric_names(*ours), fabric_names(*theirs))]
    NoCommonFabric {
        /// This side's fabric bits.
        ours: u16,
        /// The peer's fabric bits (offered, or chosen).
        theirs: u16,
    },
    /// The client holds a token but the node does not authenticate (insecure mode): refused,
    /// mutual authentication cannot be downgraded.
    #[error("the node does not authenticate (started with --insecure-no-auth) but a token was given; refusing to connect")]
    NotAuthenticating,
    /// The node could not prove it knows the token: possibly an impostor.
    #[error(
        "the node could not prove it knows the token (possible impostor); refusing to connect"
    )]
    ServerProofFailed,
    /// The peer sent bytes that are not a valid handshake message.
    #[error("malformed handshake: {0}")]
    Malformed(String),
    /// The peer closed the connection before the handshake completed.
    #[error("the peer closed the connection during the handshake")]
    Closed,
    /// The deadline passed before the handshake completed.
    #[error("the handshake timed out")]
    TimedOut,
    /// A socket error.
    #[error("I/O error during the handshake: {0}")]
    Io(#[source] std::io::Error),
    /// The RDMA queue-pair exchange after the authentication failed (the reason says which side
    /// and why).
    #[error("RDMA connection setup failed: {0}")]
    Rdma(String),
}

impl HandshakeError {
    /// Whether authentication failed in either direction (the CLI's exit status 3): the token was
    /// rejected or missing, or the node could not or would not prove it.
    pub fn is_auth_failure(&self) -> bool {
        matches!(
            self,
            HandshakeError::BadToken
                | HandshakeError::TokenRequired
                | HandshakeError::NotAuthenticating
                | HandshakeError::ServerProofFailed
        )
    }
}

impl From<HandshakeError> for Error {
    fn from(e: HandshakeError) -> Error {
        let kind = match &e {
            HandshakeError::BadToken
            | HandshakeError::TokenRequired
            | HandshakeError::NotAuthenticating
            | HandshakeError::ServerProofFailed => ErrorKind::PermissionDenied,
            HandshakeError::Busy => ErrorKind::LimitExceeded,
            HandshakeError::Version { .. }
            | HandshakeError::HandshakeVersion { .. }
            | HandshakeError::NoCommonFabric { .. } => ErrorKind::Unsupported,
            HandshakeError::Malformed(_) => ErrorKind::InvalidRequest,
            HandshakeError::Closed
            | HandshakeError::TimedOut
            | HandshakeError::Io(_)
            | HandshakeError::Rdma(_) => ErrorKind::Io,
        };
        Error::new(kind, e.to_string())
    }
}

/// `"tcp"`, `"rdma"`, `"tcp+rdma"` or `"none"` for a set of fabric bits (unknown bits ignored).
pub fn fabric_names(bits: u16) -> &'static str {
    match bits & FABRICS_KNOWN {
        FABRIC_TCP => "tcp",
        FABRIC_RDMA => "rdma",
        FABRICS_KNOWN => "tcp+rdma",
        _ => "none",
    }
}

/// The fabric a client picks from what both sides accept: RDMA when both can, else TCP, else 0.
pub fn choose_fabric(ours: u16, theirs: u16) -> u16 {
    let common = ours & theirs & FABRICS_KNOWN;
    if common & FABRIC_RDMA != 0 {
        FABRIC_RDMA
    } else {
        common & FABRIC_TCP
    }
}

/// The fabric a single chosen bit names, if it is one this version knows.
pub fn fabric_kind(bit: u16) -> Option<FabricKind> {
    match bit {
        FABRIC_TCP => Some(FabricKind::Tcp),
        FABRIC_RDMA => Some(FabricKind::Rdma),
        _ => None,
    }
}

/// The largest message this version sends (a `ClientHello` with the longest name).
const OUTGOING_MAX_BYTES: usize = codec::CLIENT_HELLO_MAX_BYTES;
const _: () = assert!(OUTGOING_MAX_BYTES <= HANDSHAKE_MAX_BYTES);

/// A message to send, held inline (no heap allocation before a client has authenticated).
/// Invariant: at most the largest message of this version, itself below [`HANDSHAKE_MAX_BYTES`].
#[derive(Clone, PartialEq, Eq)]
pub struct Outgoing {
    buf: [u8; OUTGOING_MAX_BYTES],
    len: usize,
}

impl Outgoing {
    pub(crate) fn new() -> Outgoing {
        Outgoing {
            buf: [0; OUTGOING_MAX_BYTES],
            len: 0,
        }
    }

    /// Appends `bytes`; the codec never writes more than a message's fixed maximum, so this
    /// stays within the buffer (a longer write is cut, never a panic).
    pub(crate) fn put(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(OUTGOING_MAX_BYTES - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    /// The bytes to send.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Outgoing({} bytes)", self.len)
    }
}

/// The wire byte of a role (1 client, 2 admin; nothing else is ever granted).
pub(crate) fn role_byte(role: Role) -> u8 {
    match role {
        Role::Admin => 2,
        Role::Client => 1,
        Role::Refused => 0,
    }
}

/// The role a wire byte names, if any.
pub(crate) fn role_from_byte(b: u8) -> Option<Role> {
    match b {
        1 => Some(Role::Client),
        2 => Some(Role::Admin),
        _ => None,
    }
}
