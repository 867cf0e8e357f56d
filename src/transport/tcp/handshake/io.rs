//! Blocking drivers of the two state machines over a [`TcpStream`], under one deadline: every
//! read and write gets the time that remains as its socket timeout, so a peer that stalls or
//! trickles bytes is cut off at the deadline ([`HandshakeError::TimedOut`]).

use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use kvnode_hw::fabric::RdmaEndpoint;

use super::client::{ClientHandshake, ClientStep};
use super::rdma::{RdmaExchange, RdmaStep};
use super::server::{busy_hello, ServerHandshake, Step};
use super::{
    ClientNegotiated, ClientOffer, HandshakeError, Negotiated, Offer, ServerKeys,
    HANDSHAKE_MAX_BYTES,
};
use crate::transport::tcp::auth::{os_random, Token};

/// The time left before `deadline`, or `TimedOut` when none is.
fn remaining(deadline: Instant) -> Result<std::time::Duration, HandshakeError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(HandshakeError::TimedOut);
    }
    Ok(left)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut)
}

/// A socket error: the peer going away (reset, broken pipe) is [`HandshakeError::Closed`].
fn io_error(e: std::io::Error) -> HandshakeError {
    match e.kind() {
        IoKind::ConnectionReset | IoKind::ConnectionAborted | IoKind::BrokenPipe => {
            HandshakeError::Closed
        }
        _ => HandshakeError::Io(e),
    }
}

/// Reads 1..=`buf.len()` bytes before `deadline`. End of stream is [`HandshakeError::Closed`].
fn read_some(
    mut stream: &TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<usize, HandshakeError> {
    loop {
        stream
            .set_read_timeout(Some(remaining(deadline)?))
            .map_err(HandshakeError::Io)?;
        match stream.read(buf) {
            Ok(0) => return Err(HandshakeError::Closed),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == IoKind::Interrupted || is_timeout(&e) => {}
            Err(e) => return Err(io_error(e)),
        }
    }
}

/// Writes all of `bytes` before `deadline`.
fn write_all(
    mut stream: &TcpStream,
    mut bytes: &[u8],
    deadline: Instant,
) -> Result<(), HandshakeError> {
    while !bytes.is_empty() {
        stream
            .set_write_timeout(Some(remaining(deadline)?))
            .map_err(HandshakeError::Io)?;
        match stream.write(bytes) {
            Ok(0) => return Err(HandshakeError::Closed),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == IoKind::Interrupted || is_timeout(&e) => {}
            Err(e) => return Err(io_error(e)),
        }
    }
    Ok(())
}

/// Clears the socket timeouts the handshake set, so the frame layer starts from the defaults.
fn clear_timeouts(stream: &TcpStream) -> Result<(), HandshakeError> {
    stream.set_read_timeout(None).map_err(HandshakeError::Io)?;
    stream.set_write_timeout(None).map_err(HandshakeError::Io)
}

/// Runs the node's side of the handshake on `stream`, to completion or failure before
/// `deadline`. It never reads past the `ClientAuth` (the frames that follow stay in the socket),
/// sends a refusal the client can report before failing with `BadToken`, `Version`,
/// `HandshakeVersion` or `NoCommonFabric`, and leaves the socket timeouts cleared on success.
/// The caller closes the stream on any error.
pub fn server_handshake(
    stream: &TcpStream,
    keys: &ServerKeys,
    offer: &Offer,
    deadline: Instant,
) -> Result<Negotiated, HandshakeError> {
    let mut nonce = [0u8; 32];
    os_random(&mut nonce).map_err(HandshakeError::Io)?;
    let mut hs = ServerHandshake::new(keys, *offer, nonce);
    let mut buf = [0u8; HANDSHAKE_MAX_BYTES];
    loop {
        let want = hs.wanted().clamp(1, HANDSHAKE_MAX_BYTES);
        let n = read_some(stream, &mut buf[..want], deadline)?;
        match hs.feed(&buf[..n])? {
            Step::NeedMore => {}
            Step::Send(out) => write_all(stream, out.as_bytes(), deadline)?,
            Step::Done { reply, negotiated } => {
                write_all(stream, reply.as_bytes(), deadline)?;
                clear_timeouts(stream)?;
                return Ok(negotiated);
            }
            Step::Refuse { reply, error } => {
                // Best effort: the refusal is a courtesy, the error is what counts.
                let _ = write_all(stream, reply.as_bytes(), deadline);
                return Err(error);
            }
        }
    }
}

/// Tells a client the node is busy (a `ServerHello` with status 2) without reading anything,
/// before `deadline`; the caller then closes the stream. Meant for the accept loop when the
/// handshakes in progress are at their limit: 64 bytes into a fresh socket's empty send buffer.
pub fn send_busy(
    stream: &TcpStream,
    keys: &ServerKeys,
    offer: &Offer,
    deadline: Instant,
) -> Result<(), HandshakeError> {
    write_all(stream, busy_hello(keys, offer).as_bytes(), deadline)
}

/// Runs the client's side of the handshake on `stream` before `deadline`: sends the
/// `ClientHello` named `name` offering `wanted`, proves `token` (if any) and checks the node's
/// proof. It never reads past the `ServerAuth` and leaves the socket timeouts cleared on success.
/// Errors: see [`HandshakeError`]; a token rejected by the node is `BadToken`.
pub fn client_handshake(
    stream: &TcpStream,
    token: Option<&Token>,
    name: &str,
    wanted: &ClientOffer,
    deadline: Instant,
) -> Result<ClientNegotiated, HandshakeError> {
    let mut nonce = [0u8; 32];
    os_random(&mut nonce).map_err(HandshakeError::Io)?;
    let (mut hs, hello) = ClientHandshake::new(token, name, wanted, nonce)?;
    // A node that refused at once (busy) may have closed before the hello arrived: the write
    // then fails, but its refusal may still be waiting to be read, and is the better error.
    let sent = write_all(stream, hello.as_bytes(), deadline);
    if let Err(HandshakeError::Closed) = sent {
        let mut buf = [0u8; HANDSHAKE_MAX_BYTES];
        while let Ok(n) = read_some(
            stream,
            &mut buf[..hs.wanted().clamp(1, HANDSHAKE_MAX_BYTES)],
            deadline,
        ) {
            match hs.feed(&buf[..n]) {
                Ok(ClientStep::NeedMore) => {}
                Err(e) => return Err(e),
                Ok(_) => break,
            }
        }
        return Err(HandshakeError::Closed);
    }
    sent?;
    let mut buf = [0u8; HANDSHAKE_MAX_BYTES];
    loop {
        let want = hs.wanted().clamp(1, HANDSHAKE_MAX_BYTES);
        let n = read_some(stream, &mut buf[..want], deadline)?;
        match hs.feed(&buf[..n])? {
            ClientStep::NeedMore => {}
            ClientStep::Send(out) => write_all(stream, out.as_bytes(), deadline)?,
            ClientStep::Done(negotiated) => {
                clear_timeouts(stream)?;
                return Ok(negotiated);
            }
        }
    }
}

/// How one side creates and connects its RDMA queue pair, for the exchange drivers
/// ([`server_rdma_exchange`], [`client_rdma_exchange`]). The node implements it over its RDMA
/// fabric's mover, the client over its engine-side fabric, tests over fake endpoints.
///
/// Invariant expected of implementations: `connect` consumes what `prepare` returned; a
/// connection returned by `connect` is either kept by the caller or handed to `abandon` (which
/// tears it down), never leaked.
pub trait QpSetup {
    /// A queue pair in INIT, waiting for the peer's endpoint.
    type Pending;
    /// A connected queue pair (in RTS).
    type Conn;
    /// Creates a queue pair in INIT; the error says why (for the log and the peer's error).
    fn prepare(&mut self) -> Result<(Self::Pending, RdmaEndpoint), String>;
    /// Connects `pending` to the peer's endpoint (INIT -> RTR -> RTS).
    fn connect(&mut self, pending: Self::Pending, peer: RdmaEndpoint)
        -> Result<Self::Conn, String>;
    /// Tears down a connected queue pair the exchange does not hand over (the peer failed).
    fn abandon(&mut self, conn: Self::Conn);
}

/// Reads the peer's next exchange message before `deadline` (never more than it asks for).
fn rdma_read(
    stream: &TcpStream,
    ex: &mut RdmaExchange,
    deadline: Instant,
) -> Result<RdmaStep, HandshakeError> {
    let mut buf = [0u8; HANDSHAKE_MAX_BYTES];
    loop {
        let want = ex.wanted().clamp(1, HANDSHAKE_MAX_BYTES);
        let n = read_some(stream, &mut buf[..want], deadline)?;
        match ex.feed(&buf[..n])? {
            RdmaStep::NeedMore => {}
            step => return Ok(step),
        }
    }
}

/// Connects this side's queue pair, sends the ready byte, waits for the peer's.
fn rdma_connect_and_ready<S: QpSetup>(
    stream: &TcpStream,
    ex: &mut RdmaExchange,
    setup: &mut S,
    pending: S::Pending,
    peer: RdmaEndpoint,
    deadline: Instant,
) -> Result<S::Conn, HandshakeError> {
    let conn = match setup.connect(pending, peer) {
        Ok(c) => c,
        Err(why) => {
            let _ = write_all(stream, ex.connected(false)?.as_bytes(), deadline);
            return Err(HandshakeError::Rdma(format!(
                "connecting this side's queue pair failed: {why}"
            )));
        }
    };
    let waited = write_all(stream, ex.connected(true)?.as_bytes(), deadline)
        .and_then(|()| rdma_read(stream, ex, deadline));
    match waited {
        Ok(RdmaStep::Ready) => match clear_timeouts(stream) {
            Ok(()) => Ok(conn),
            Err(e) => {
                setup.abandon(conn);
                Err(e)
            }
        },
        Ok(other) => {
            setup.abandon(conn);
            Err(HandshakeError::Malformed(format!(
                "RDMA exchange: {other:?} where a ready byte was expected"
            )))
        }
        Err(e) => {
            setup.abandon(conn);
            Err(e)
        }
    }
}

/// The node's side of the RDMA exchange on `stream`, after [`server_handshake`] returned a
/// negotiation whose fabric is RDMA: reads the client's offer, creates the node's queue pair
/// only then (`setup.prepare`), answers with its endpoint, connects, exchanges ready bytes, all
/// before `deadline`. Returns the connected queue pair; on any error nothing is kept (a queue
/// pair already connected went to `setup.abandon`) and the caller closes the stream. Never
/// reads past the client's ready byte.
pub fn server_rdma_exchange<S: QpSetup>(
    stream: &TcpStream,
    setup: &mut S,
    deadline: Instant,
) -> Result<S::Conn, HandshakeError> {
    let mut ex = RdmaExchange::node();
    let RdmaStep::Peer(peer) = rdma_read(stream, &mut ex, deadline)? else {
        return Err(HandshakeError::Malformed(
            "RDMA exchange: no offer from the client".into(),
        ));
    };
    let (pending, local) = match setup.prepare() {
        Ok(p) => p,
        Err(why) => {
            let _ = write_all(stream, ex.local(None)?.as_bytes(), deadline);
            return Err(HandshakeError::Rdma(format!(
                "the node could not create a queue pair: {why}"
            )));
        }
    };
    write_all(stream, ex.local(Some(&local))?.as_bytes(), deadline)?;
    rdma_connect_and_ready(stream, &mut ex, setup, pending, peer, deadline)
}

/// The client's side of the RDMA exchange on `stream`, after [`client_handshake`] returned a
/// negotiation whose fabric is RDMA: creates the client's queue pair, sends its endpoint, reads
/// the node's, connects, exchanges ready bytes, before `deadline`. Returns the connected queue
/// pair; on error nothing is kept and the caller closes the stream.
pub fn client_rdma_exchange<S: QpSetup>(
    stream: &TcpStream,
    setup: &mut S,
    deadline: Instant,
) -> Result<S::Conn, HandshakeError> {
    let (pending, local) = match setup.prepare() {
        Ok(p) => p,
        Err(why) => {
            let (_, refusal) = RdmaExchange::client(None);
            let _ = write_all(stream, refusal.as_bytes(), deadline);
            return Err(HandshakeError::Rdma(format!(
                "this client could not create a queue pair: {why}"
            )));
        }
    };
    let (mut ex, offer) = RdmaExchange::client(Some(&local));
    write_all(stream, offer.as_bytes(), deadline)?;
    let RdmaStep::Peer(peer) = rdma_read(stream, &mut ex, deadline)? else {
        return Err(HandshakeError::Malformed(
            "RDMA exchange: no offer from the node".into(),
        ));
    };
    rdma_connect_and_ready(stream, &mut ex, setup, pending, peer, deadline)
}
