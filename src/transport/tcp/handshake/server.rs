//! The node's side of the handshake as a sans-IO state machine.

use super::codec::{
    prefix_version, ClientAuth, ClientHello, ServerAuth, ServerHello, Status, CLIENT_AUTH_BYTES,
};
use super::{
    fabric_kind, role_byte, HandshakeError, Negotiated, Offer, Outgoing, ServerKeys,
    HANDSHAKE_MAX_BYTES, HS_VERSION, MAX_NAME_BYTES,
};
use crate::access::Role;
use crate::transport::tcp::auth::{transcript, Token};

/// What the node does next after [`ServerHandshake::feed`].
#[derive(Debug)]
pub enum Step {
    /// The current message is incomplete: feed more bytes (at most [`ServerHandshake::wanted`]).
    NeedMore,
    /// Send these bytes, then feed the client's next message.
    Send(Outgoing),
    /// Send these bytes (the `ServerAuth`); the client is authenticated: hand the connection to
    /// the frame layer.
    Done {
        /// The final `ServerAuth`.
        reply: Outgoing,
        /// What was agreed.
        negotiated: Negotiated,
    },
    /// Send these bytes (a refusal the client can report), then close: the handshake failed.
    Refuse {
        /// The refusing `ServerHello` or `ServerAuth`.
        reply: Outgoing,
        /// Why (for the node's log and counters).
        error: HandshakeError,
    },
}

enum Phase {
    /// Reading the `ClientHello`.
    Hello,
    /// `ServerHello` sent; reading the `ClientAuth`.
    Auth {
        transcript: [u8; 32],
        frame_version: u16,
    },
    /// Done, refused or failed: every further feed is an error.
    Finished,
}

/// The node's handshake with one client. Invariants: it holds at most [`HANDSHAKE_MAX_BYTES`]
/// of input (a fixed array: nothing is allocated before the client authenticated); it reaches
/// [`Step::Done`] only after a `ClientAuth` whose MAC verified under one of the node's keys (or in
/// insecure mode), and only once; after `Done`, `Refuse` or an error it accepts nothing more.
pub struct ServerHandshake<'k> {
    keys: &'k ServerKeys,
    offer: Offer,
    nonce: [u8; 32],
    buf: [u8; HANDSHAKE_MAX_BYTES],
    len: usize,
    name: [u8; MAX_NAME_BYTES],
    name_len: usize,
    phase: Phase,
}

impl<'k> ServerHandshake<'k> {
    /// A handshake that will answer with `offer` and the fresh random `nonce` (a test may fix it;
    /// a node must never reuse one).
    pub fn new(keys: &'k ServerKeys, offer: Offer, nonce: [u8; 32]) -> ServerHandshake<'k> {
        ServerHandshake {
            keys,
            offer,
            nonce,
            buf: [0; HANDSHAKE_MAX_BYTES],
            len: 0,
            name: [0; MAX_NAME_BYTES],
            name_len: 0,
            phase: Phase::Hello,
        }
    }

    /// How many more bytes the current message needs at least (0 once finished). A driver that
    /// reads at most this many never reads past the handshake into the frames that follow.
    pub fn wanted(&self) -> usize {
        match self.phase {
            Phase::Hello => ClientHello::total_len(&self.buf[..self.len])
                .map_or(1, |t| t.saturating_sub(self.len).max(1)),
            Phase::Auth { .. } => CLIENT_AUTH_BYTES - self.len,
            Phase::Finished => 0,
        }
    }

    /// Bytes of the current message held (never more than [`HANDSHAKE_MAX_BYTES`]).
    pub fn buffered(&self) -> usize {
        self.len
    }

    /// Consumes `input`, the next bytes from the client in any chunking. `input` must not run past
    /// the current message: a client cannot know its next message before the node's reply, so
    /// bytes beyond it are a protocol violation (`Malformed`). Errors mean "close without a
    /// reply"; [`Step::Refuse`] carries a reply to send first.
    pub fn feed(&mut self, mut input: &[u8]) -> Result<Step, HandshakeError> {
        loop {
            let total = match self.phase {
                Phase::Finished => {
                    return Err(HandshakeError::Malformed(
                        "bytes after the handshake finished".into(),
                    ))
                }
                Phase::Hello => match ClientHello::total_len(&self.buf[..self.len]) {
                    Ok(t) => t,
                    Err(e) => return self.fail(e),
                },
                Phase::Auth { .. } => CLIENT_AUTH_BYTES,
            };
            if let (Phase::Hello, Some(v)) = (&self.phase, prefix_version(&self.buf[..self.len])) {
                if v != HS_VERSION {
                    let reply = self.refusal_hello(Status::Version);
                    return Ok(self.refuse(
                        reply,
                        HandshakeError::HandshakeVersion {
                            ours: HS_VERSION,
                            theirs: v,
                        },
                    ));
                }
            }
            if self.len < total {
                if input.is_empty() {
                    return Ok(Step::NeedMore);
                }
                let take = input.len().min(total - self.len);
                self.buf[self.len..self.len + take].copy_from_slice(&input[..take]);
                self.len += take;
                input = &input[take..];
                continue;
            }
            if !input.is_empty() {
                let what = match self.phase {
                    Phase::Hello => "ClientHello",
                    _ => "ClientAuth",
                };
                return self.fail(HandshakeError::Malformed(format!(
                    "{} bytes after the {what}, before the node's reply",
                    input.len()
                )));
            }
            return match self.phase {
                Phase::Hello => self.on_hello(),
                _ => self.on_auth(),
            };
        }
    }

    fn fail(&mut self, e: HandshakeError) -> Result<Step, HandshakeError> {
        self.phase = Phase::Finished;
        Err(e)
    }

    fn refuse(&mut self, reply: Outgoing, error: HandshakeError) -> Step {
        self.phase = Phase::Finished;
        Step::Refuse { reply, error }
    }

    fn authenticates(&self) -> bool {
        matches!(self.keys, ServerKeys::Token { .. })
    }

    fn refusal_hello(&self, status: Status) -> Outgoing {
        ServerHello::refusal(
            status,
            self.authenticates(),
            self.offer.frames,
            self.offer.fabrics,
            self.offer.node_id,
        )
        .encode()
    }

    fn on_hello(&mut self) -> Result<Step, HandshakeError> {
        let hello = match ClientHello::decode(&self.buf[..self.len]) {
            Ok(h) => h,
            Err(e) => return self.fail(e),
        };
        let ours = self.offer.frames;
        let lo = hello.frames.min.max(ours.min);
        let hi = hello.frames.max.min(ours.max);
        if lo > hi {
            let error = HandshakeError::Version {
                ours,
                theirs: hello.frames,
            };
            let reply = self.refusal_hello(Status::Version);
            return Ok(self.refuse(reply, error));
        }
        let name = hello.name.as_bytes();
        self.name[..name.len()].copy_from_slice(name);
        self.name_len = name.len();
        let reply = ServerHello {
            hs_version: HS_VERSION,
            status: Status::Ok,
            auth: self.authenticates(),
            frame_version: hi,
            frames: ours,
            fabrics: self.offer.fabrics,
            nonce: self.nonce,
            node_id: self.offer.node_id,
        }
        .encode();
        self.phase = Phase::Auth {
            transcript: transcript(&self.buf[..self.len], reply.as_bytes()),
            frame_version: hi,
        };
        self.len = 0;
        Ok(Step::Send(reply))
    }

    fn on_auth(&mut self) -> Result<Step, HandshakeError> {
        let Phase::Auth {
            transcript: t,
            frame_version,
        } = self.phase
        else {
            return self.fail(HandshakeError::Malformed("no ClientAuth expected".into()));
        };
        let auth = match ClientAuth::decode(&self.buf[..self.len]) {
            Ok(a) => a,
            Err(e) => return self.fail(e),
        };
        // Who the client proved to be. Both keys are always tried, so the time taken does not
        // tell which one matched.
        let proved: Option<(Role, Option<&Token>)> = match self.keys {
            ServerKeys::Insecure => Some((Role::Client, None)),
            ServerKeys::Token { client, admin } => {
                let mac = blake3::Hash::from(auth.mac);
                let is_client = client.client_mac(&t, auth.fabric) == mac;
                let is_admin = admin
                    .as_ref()
                    .is_some_and(|a| a.client_mac(&t, auth.fabric) == mac);
                if is_admin {
                    admin.as_ref().map(|a| (Role::Admin, Some(a)))
                } else if is_client {
                    Some((Role::Client, Some(client)))
                } else {
                    None
                }
            }
        };
        let Some((role, key)) = proved else {
            let reply = ServerAuth::refusal(Status::BadToken).encode();
            return Ok(self.refuse(reply, HandshakeError::BadToken));
        };
        let fabric = match fabric_kind(auth.fabric) {
            Some(f) if auth.fabric & self.offer.fabrics != 0 => f,
            _ => {
                let reply = ServerAuth::refusal(Status::Fabric).encode();
                let error = HandshakeError::NoCommonFabric {
                    ours: self.offer.fabrics,
                    theirs: auth.fabric,
                };
                return Ok(self.refuse(reply, error));
            }
        };
        let rb = role_byte(role);
        let mac = key.map_or([0; 32], |k| {
            *k.server_mac(&t, &auth.mac, auth.fabric, rb).as_bytes()
        });
        let reply = ServerAuth {
            status: Status::Ok,
            role: rb,
            mac,
        }
        .encode();
        // The name was UTF-8-checked when the hello was decoded; it goes to logs, so no control
        // characters (no forged log lines).
        let client_name = String::from_utf8_lossy(&self.name[..self.name_len])
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect();
        self.phase = Phase::Finished;
        Ok(Step::Done {
            reply,
            negotiated: Negotiated {
                frame_version,
                fabric,
                role,
                client_name,
                authenticated: key.is_some(),
            },
        })
    }
}

/// The `ServerHello` a node sends when it has too many handshakes in progress, before closing
/// (it does not need to read anything first: the client reads this as [`HandshakeError::Busy`]).
pub fn busy_hello(keys: &ServerKeys, offer: &Offer) -> Outgoing {
    ServerHello::refusal(
        Status::Busy,
        matches!(keys, ServerKeys::Token { .. }),
        offer.frames,
        offer.fabrics,
        offer.node_id,
    )
    .encode()
}
