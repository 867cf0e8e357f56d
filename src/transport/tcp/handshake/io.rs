//! Blocking drivers of the two state machines over a [`TcpStream`], under one deadline: every
//! read and write gets the time that remains as its socket timeout, so a peer that stalls or
//! trickles bytes is cut off at the deadline ([`HandshakeError::TimedOut`]).

use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use super::client::{ClientHandshake, ClientStep};
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
