//! The RDMA queue-pair exchange that follows an authenticated handshake whose chosen fabric is
//! RDMA, as a sans-IO state machine ([`RdmaExchange`]).
//!
//! After a `ServerAuth` with status ok and fabric [`super::FABRIC_RDMA`]:
//! 1. client → node `RdmaOffer`: the client's queue pair (created after the `ServerAuth`);
//! 2. node → client `RdmaOffer`: the node's queue pair, created only now — after the client
//!    authenticated and sent a well-formed offer — or `Failed`;
//! 3. each side connects its queue pair to the other's endpoint (INIT → RTR → RTS) and sends one
//!    `RdmaReady` byte; each waits for the other's before going on. The node posts no work
//!    request before the client's ready byte (the client's QP is in RTS by then), and the
//!    client sends no frame before the node's.
//!
//! Layouts in [`super::codec`]. The offers are not covered by the handshake's MACs: like the
//! frames that follow, they ride the authenticated but unencrypted TCP connection; what a
//! forged endpoint can reach is bounded by the hardware's checks (the node's pool is registered
//! for local access only; an engine's memory is reachable only through the rkeys it registered).
//!
//! **Untested on hardware**: the exchange is tested with fake endpoints over loopback TCP; the
//! queue pairs themselves need an RDMA device.

use kvnode_hw::fabric::RdmaEndpoint;

use super::codec::{
    decode_rdma_ready, encode_rdma_ready, RdmaOffer, RDMA_OFFER_BYTES, RDMA_READY_BYTES,
};
use super::{HandshakeError, Outgoing};

const _: () = assert!(RDMA_OFFER_BYTES <= super::HANDSHAKE_MAX_BYTES);

/// Which side of the exchange a machine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaSide {
    /// The engine: sends its offer first.
    Client,
    /// The node: answers the client's offer with its own.
    Node,
}

impl RdmaSide {
    fn peer(self) -> &'static str {
        match self {
            RdmaSide::Client => "the node",
            RdmaSide::Node => "the client",
        }
    }
}

/// What the driver does next after [`RdmaExchange::feed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaStep {
    /// The peer's message is incomplete: feed more (at most [`RdmaExchange::wanted`] bytes).
    NeedMore,
    /// The peer's endpoint arrived. The node now creates its queue pair and calls
    /// [`RdmaExchange::local`]; then both sides connect and call [`RdmaExchange::connected`].
    Peer(RdmaEndpoint),
    /// The peer's queue pair is in RTS: the exchange is over.
    Ready,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading the peer's `RdmaOffer`.
    PeerOffer,
    /// Node only: the client's offer arrived; waiting for [`RdmaExchange::local`].
    Local,
    /// Both offers crossed; waiting for [`RdmaExchange::connected`].
    Connect,
    /// Ready sent; reading the peer's `RdmaReady`.
    PeerReady,
    /// Over (ready, refused or failed): everything further is an error.
    Finished,
}

/// One side of the RDMA exchange. Invariants: it buffers at most [`RDMA_OFFER_BYTES`]; it
/// yields [`RdmaStep::Peer`] only for a well-formed offer, at most once, and [`RdmaStep::Ready`]
/// only after this side's own ready byte was produced with `ok = true` and the peer's says
/// ready; every call out of order is an error (`Malformed`) and finishes the exchange.
#[derive(Debug)]
pub struct RdmaExchange {
    side: RdmaSide,
    phase: Phase,
    buf: [u8; RDMA_OFFER_BYTES],
    len: usize,
}

impl RdmaExchange {
    /// The client's side: `local` is its queue pair's endpoint (`None`: it could not create
    /// one). Returns the machine and the `RdmaOffer` to send; after a `Failed` offer the machine
    /// is finished (the client closes).
    pub fn client(local: Option<&RdmaEndpoint>) -> (RdmaExchange, Outgoing) {
        let offer = local.map_or(RdmaOffer::Failed, |ep| RdmaOffer::Ok(*ep));
        let phase = if local.is_some() {
            Phase::PeerOffer
        } else {
            Phase::Finished
        };
        let m = RdmaExchange {
            side: RdmaSide::Client,
            phase,
            buf: [0; RDMA_OFFER_BYTES],
            len: 0,
        };
        (m, offer.encode())
    }

    /// The node's side: reads the client's offer first.
    pub fn node() -> RdmaExchange {
        RdmaExchange {
            side: RdmaSide::Node,
            phase: Phase::PeerOffer,
            buf: [0; RDMA_OFFER_BYTES],
            len: 0,
        }
    }

    /// How many more bytes the peer's current message needs (0 when no message is expected
    /// now). A driver that reads at most this many never reads into the frames that follow.
    pub fn wanted(&self) -> usize {
        match self.phase {
            Phase::PeerOffer => RDMA_OFFER_BYTES - self.len,
            Phase::PeerReady => RDMA_READY_BYTES - self.len,
            _ => 0,
        }
    }

    /// Bytes of the peer's current message held (never more than [`RDMA_OFFER_BYTES`]).
    pub fn buffered(&self) -> usize {
        self.len
    }

    /// Whether the exchange is over (ready, refused or failed).
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    fn fail(&mut self, e: HandshakeError) -> HandshakeError {
        self.phase = Phase::Finished;
        e
    }

    fn out_of_order(&mut self, what: &str) -> HandshakeError {
        let e = HandshakeError::Malformed(format!("RDMA exchange: {what} out of order"));
        self.fail(e)
    }

    /// Consumes the peer's next bytes, in any chunking; bytes past the current message (or
    /// when none is expected) are a protocol violation. Every error means "close".
    pub fn feed(&mut self, input: &[u8]) -> Result<RdmaStep, HandshakeError> {
        let total = match self.phase {
            Phase::PeerOffer => RDMA_OFFER_BYTES,
            Phase::PeerReady => RDMA_READY_BYTES,
            _ if input.is_empty() => return Ok(RdmaStep::NeedMore),
            _ => {
                let e = HandshakeError::Malformed(format!(
                    "RDMA exchange: {} bytes from {} when none were expected",
                    input.len(),
                    self.side.peer()
                ));
                return Err(self.fail(e));
            }
        };
        if input.len() > total - self.len {
            let e = HandshakeError::Malformed(format!(
                "RDMA exchange: {} bytes past the message from {}",
                input.len() - (total - self.len),
                self.side.peer()
            ));
            return Err(self.fail(e));
        }
        self.buf[self.len..self.len + input.len()].copy_from_slice(input);
        self.len += input.len();
        if self.len < total {
            return Ok(RdmaStep::NeedMore);
        }
        let held = self.buf;
        let msg = &held[..self.len];
        if self.phase == Phase::PeerOffer {
            let offer = RdmaOffer::decode(msg).map_err(|e| self.fail(e))?;
            self.len = 0;
            return match offer {
                RdmaOffer::Ok(ep) => {
                    self.phase = match self.side {
                        RdmaSide::Client => Phase::Connect,
                        RdmaSide::Node => Phase::Local,
                    };
                    Ok(RdmaStep::Peer(ep))
                }
                RdmaOffer::Failed => {
                    let e = HandshakeError::Rdma(format!(
                        "{} could not create an RDMA queue pair",
                        self.side.peer()
                    ));
                    Err(self.fail(e))
                }
            };
        }
        let ready = decode_rdma_ready(msg).map_err(|e| self.fail(e))?;
        self.phase = Phase::Finished;
        if ready {
            Ok(RdmaStep::Ready)
        } else {
            Err(HandshakeError::Rdma(format!(
                "{} could not connect its RDMA queue pair to this side's",
                self.side.peer()
            )))
        }
    }

    /// Node only, after [`RdmaStep::Peer`]: the node's endpoint (`None`: it could not create a
    /// queue pair, the machine is finished). Returns the `RdmaOffer` to send.
    pub fn local(&mut self, local: Option<&RdmaEndpoint>) -> Result<Outgoing, HandshakeError> {
        if self.phase != Phase::Local {
            return Err(self.out_of_order("the node's offer"));
        }
        Ok(match local {
            Some(ep) => {
                self.phase = Phase::Connect;
                RdmaOffer::Ok(*ep).encode()
            }
            None => {
                self.phase = Phase::Finished;
                RdmaOffer::Failed.encode()
            }
        })
    }

    /// After both offers crossed: whether this side's queue pair reached RTS. Returns the
    /// `RdmaReady` to send; with `ok = false` the machine is finished (the driver closes after
    /// sending it).
    pub fn connected(&mut self, ok: bool) -> Result<Outgoing, HandshakeError> {
        if self.phase != Phase::Connect {
            return Err(self.out_of_order("the ready byte"));
        }
        self.phase = if ok {
            Phase::PeerReady
        } else {
            Phase::Finished
        };
        Ok(encode_rdma_ready(ok))
    }
}
