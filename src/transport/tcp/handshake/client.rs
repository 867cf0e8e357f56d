//! The client's side of the handshake as a sans-IO state machine.

use super::codec::{
    prefix_version, ClientAuth, ClientHello, ServerAuth, ServerHello, Status, SERVER_AUTH_BYTES,
    SERVER_HELLO_BYTES,
};
use super::{
    choose_fabric, fabric_kind, role_from_byte, ClientNegotiated, ClientOffer, HandshakeError,
    Outgoing, HANDSHAKE_MAX_BYTES, HS_VERSION,
};
use crate::transport::tcp::auth::{transcript, Token};

/// What the client does next after [`ClientHandshake::feed`].
#[derive(Debug)]
pub enum ClientStep {
    /// The node's message is incomplete: feed more bytes (at most [`ClientHandshake::wanted`]).
    NeedMore,
    /// Send these bytes (the `ClientAuth`), then feed the node's answer.
    Send(Outgoing),
    /// The node is authenticated (or both sides are in insecure mode): frames may follow.
    Done(ClientNegotiated),
}

enum Phase {
    /// `ClientHello` sent; reading the `ServerHello`.
    Hello,
    /// `ClientAuth` sent; reading the `ServerAuth`.
    Auth {
        transcript: [u8; 32],
        mac_c: [u8; 32],
        fabric: u16,
        server_fabrics: u16,
        frame_version: u16,
        node_id: [u8; 16],
        authenticated: bool,
    },
    /// Done or failed.
    Finished,
}

/// The client's handshake with one node. Invariants: holding a token, it reaches
/// [`ClientStep::Done`] only after the node proved that token (`mac_s`), and never with a node
/// that does not authenticate; it buffers at most [`HANDSHAKE_MAX_BYTES`] per message.
pub struct ClientHandshake<'t> {
    token: Option<&'t Token>,
    offer: ClientOffer,
    hello: Outgoing,
    buf: [u8; HANDSHAKE_MAX_BYTES],
    len: usize,
    phase: Phase,
}

impl<'t> ClientHandshake<'t> {
    /// Starts a handshake; returns the machine and the `ClientHello` to send. `nonce` must be
    /// fresh random bytes (a test may fix it); `name` (for the node's logs) is cut to
    /// [`super::MAX_NAME_BYTES`]. An empty frame range is refused (`Malformed`, naming it).
    pub fn new(
        token: Option<&'t Token>,
        name: &str,
        offer: &ClientOffer,
        nonce: [u8; 32],
    ) -> Result<(ClientHandshake<'t>, Outgoing), HandshakeError> {
        if offer.frames.min > offer.frames.max {
            return Err(HandshakeError::Malformed(format!(
                "this client's frame versions {}..={} are an empty range",
                offer.frames.min, offer.frames.max
            )));
        }
        let hello = ClientHello {
            hs_version: HS_VERSION,
            frames: offer.frames,
            fabrics: offer.fabrics,
            nonce,
            name,
        }
        .encode();
        let hs = ClientHandshake {
            token,
            offer: *offer,
            hello: hello.clone(),
            buf: [0; HANDSHAKE_MAX_BYTES],
            len: 0,
            phase: Phase::Hello,
        };
        Ok((hs, hello))
    }

    /// How many more bytes the node's current message needs (0 once finished).
    pub fn wanted(&self) -> usize {
        match self.phase {
            Phase::Hello => SERVER_HELLO_BYTES - self.len,
            Phase::Auth { .. } => SERVER_AUTH_BYTES - self.len,
            Phase::Finished => 0,
        }
    }

    /// Consumes `input`, the next bytes from the node in any chunking; bytes past the current
    /// message are a protocol violation (`Malformed`). Every error means "close".
    pub fn feed(&mut self, mut input: &[u8]) -> Result<ClientStep, HandshakeError> {
        let total = match self.phase {
            Phase::Hello => SERVER_HELLO_BYTES,
            Phase::Auth { .. } => SERVER_AUTH_BYTES,
            Phase::Finished => {
                return Err(HandshakeError::Malformed(
                    "bytes after the handshake finished".into(),
                ))
            }
        };
        let take = input.len().min(total - self.len);
        self.buf[self.len..self.len + take].copy_from_slice(&input[..take]);
        self.len += take;
        input = &input[take..];
        let r = self.step(total, input.len());
        if !matches!(r, Ok(ClientStep::NeedMore) | Ok(ClientStep::Send(_))) {
            self.phase = Phase::Finished;
        }
        r
    }

    fn step(&mut self, total: usize, extra: usize) -> Result<ClientStep, HandshakeError> {
        if let Phase::Hello = self.phase {
            // Reject a stranger early, from the first bytes.
            let n = self.len.min(4);
            if self.buf[..n] != super::MAGIC[..n] {
                return Err(HandshakeError::Malformed(
                    "the ServerHello does not start with the magic \"KVNH\" (not a kvnode node?)"
                        .into(),
                ));
            }
            if let Some(v) = prefix_version(&self.buf[..self.len]) {
                if v != HS_VERSION {
                    return Err(HandshakeError::HandshakeVersion {
                        ours: HS_VERSION,
                        theirs: v,
                    });
                }
            }
        }
        if self.len < total {
            return Ok(ClientStep::NeedMore);
        }
        if extra > 0 {
            return Err(HandshakeError::Malformed(format!(
                "{extra} bytes after the node's message, before this client's reply"
            )));
        }
        let msg = &self.buf[..self.len];
        match self.phase {
            Phase::Hello => self.on_hello(),
            _ => self.on_auth(ServerAuth::decode(msg)?),
        }
    }

    fn on_hello(&mut self) -> Result<ClientStep, HandshakeError> {
        let sh = ServerHello::decode(&self.buf[..self.len])?;
        match sh.status {
            Status::Ok => {}
            Status::Busy => return Err(HandshakeError::Busy),
            Status::Version => {
                return Err(HandshakeError::Version {
                    ours: self.offer.frames,
                    theirs: sh.frames,
                })
            }
            s => {
                return Err(HandshakeError::Malformed(format!(
                    "status {s:?} in a ServerHello"
                )))
            }
        }
        if !sh.auth && self.token.is_some() {
            return Err(HandshakeError::NotAuthenticating);
        }
        let fv = sh.frame_version;
        let ours = self.offer.frames;
        if fv < ours.min || fv > ours.max || fv < sh.frames.min || fv > sh.frames.max {
            return Err(HandshakeError::Malformed(format!(
                "the node chose frame version {fv}, outside this client's {ours} or its own {}",
                sh.frames
            )));
        }
        let fabric = choose_fabric(self.offer.fabrics, sh.fabrics);
        let t = transcript(self.hello.as_bytes(), &self.buf[..self.len]);
        // A tokenless client sends zeros: an insecure node ignores them, a token node answers
        // BadToken (reported as TokenRequired).
        let mac_c = match (sh.auth, self.token) {
            (true, Some(k)) => *k.client_mac(&t, fabric).as_bytes(),
            _ => [0; 32],
        };
        self.phase = Phase::Auth {
            transcript: t,
            mac_c,
            fabric,
            server_fabrics: sh.fabrics,
            frame_version: fv,
            node_id: sh.node_id,
            authenticated: sh.auth,
        };
        self.len = 0;
        Ok(ClientStep::Send(ClientAuth { fabric, mac: mac_c }.encode()))
    }

    fn on_auth(&mut self, sa: ServerAuth) -> Result<ClientStep, HandshakeError> {
        let Phase::Auth {
            transcript: t,
            mac_c,
            fabric,
            server_fabrics,
            frame_version,
            node_id,
            authenticated,
        } = self.phase
        else {
            return Err(HandshakeError::Malformed("no ServerAuth expected".into()));
        };
        match sa.status {
            Status::Ok => {}
            Status::BadToken if self.token.is_some() => return Err(HandshakeError::BadToken),
            Status::BadToken => return Err(HandshakeError::TokenRequired),
            Status::Fabric => {
                return Err(HandshakeError::NoCommonFabric {
                    ours: self.offer.fabrics,
                    theirs: server_fabrics,
                })
            }
            s => {
                return Err(HandshakeError::Malformed(format!(
                    "status {s:?} in a ServerAuth"
                )))
            }
        }
        if let Some(k) = self.token {
            // `authenticated` is true here: a token client stops at an insecure ServerHello.
            let want = k.server_mac(&t, &mac_c, fabric, sa.role);
            if want != blake3::Hash::from(sa.mac) {
                return Err(HandshakeError::ServerProofFailed);
            }
        }
        let Some(kind) = fabric_kind(fabric) else {
            return Err(HandshakeError::Malformed(format!(
                "the node accepted fabric bits {fabric:#x}, which this client did not choose"
            )));
        };
        let Some(role) = role_from_byte(sa.role) else {
            return Err(HandshakeError::Malformed(format!(
                "unknown role {} in a ServerAuth",
                sa.role
            )));
        };
        Ok(ClientStep::Done(ClientNegotiated {
            frame_version,
            fabric: kind,
            role,
            node_id,
            authenticated: authenticated && self.token.is_some(),
        }))
    }
}
