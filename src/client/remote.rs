//! The remote transport: an authenticated TCP connection to a node on another host. The node
//! moves each chunk's bytes between its pool and this client: a store's chunks follow its
//! WRITE_SLOTS frame on the stream (sent straight from the caller's buffers), a retrieve's
//! follow the READ_SLOTS reply (received straight into the caller's buffers).
//!
//! A connection may choose RDMA in its handshake ([`RemoteOptions::fabric`]): the node then
//! moves the bytes of [`RemoteClient::store_registered`] / [`RemoteClient::retrieve_registered`]
//! with RDMA READ/WRITE straight from and into buffers the engine registered
//! (`remote_rdma.rs`; untested on hardware); the inline calls above keep working on it.
//!
//! A background thread sends a heartbeat (a NOOP with [`HEARTBEAT_REQUEST_ID`], never
//! answered) whenever nothing was sent for [`HEARTBEAT_MS`]: the node treats a connection that
//! stays silent for `remote.dead_after_ms` as dead and releases its instances.

use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rkyv::util::AlignedVec;

use super::remote_rdma::{self, ClientRdma, FabricChoice};
use super::{frame_err, Client, ClientTransport};
use crate::config::{parse_tcp_url, HEARTBEAT_MS};
use crate::error::{Error, ErrorKind, Result};
use crate::protocol::frame::{
    decode_response, encode_request, encode_request_with_trailer, FrameError, FrameHeader,
    FrameReader, PlainSource, HEARTBEAT_REQUEST_ID, VERSION,
};
use crate::protocol::{ChunkRange, DataPath, RegisterReply, RegisterRequest, Request, Response};
use crate::transport::tcp::auth::Token;
use crate::transport::tcp::handshake::{
    client_handshake, ClientNegotiated, ClientOffer, FrameRange, HandshakeError, FABRIC_RDMA,
    FABRIC_TCP,
};
use kvnode_hw::fabric::FabricKind;

/// A client of a node on another host.
pub type RemoteClient = Client<TcpTransport>;

/// How a [`RemoteClient`] connects.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// The name sent in the handshake (the node's logs).
    pub name: String,
    /// Longest the TCP connect plus the handshake may take.
    pub connect_timeout: Duration,
    /// Longest one reply (or one trailer) may take; `None`: wait forever.
    pub reply_timeout: Option<Duration>,
    /// The fabric to ask for: `Auto` (RDMA when this host and the node both can, else TCP),
    /// `Tcp`, or `Rdma` (an error naming why when either side cannot).
    pub fabric: FabricChoice,
    /// The RDMA device this host uses (`"auto"` or a name such as `"mlx5_0"`).
    pub rdma_device: String,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            name: format!("kvnode-client pid {}", std::process::id()),
            connect_timeout: Duration::from_secs(5),
            reply_timeout: Some(Duration::from_secs(60)),
            fabric: FabricChoice::Auto,
            rdma_device: "auto".into(),
        }
    }
}

/// The writing half, shared with the heartbeat thread. Invariant: a frame and its trailer are
/// written under one lock, so a heartbeat never lands inside them.
struct Writer {
    stream: TcpStream,
    /// Milliseconds since `epoch` of the last write.
    last_write_ms: u64,
}

/// An authenticated TCP connection to a node. Invariant: the handshake succeeded (the node
/// proved the token when one was given); a heartbeat thread runs until it is dropped.
pub struct TcpTransport {
    read: TcpStream,
    writer: Arc<Mutex<Writer>>,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    heartbeat: Option<JoinHandle<()>>,
    peer: SocketAddr,
    negotiated: ClientNegotiated,
    heartbeats: Arc<AtomicU64>,
    /// The queue pair and registered buffers, when the handshake chose RDMA.
    rdma: Option<ClientRdma>,
    /// Why the registered buffers may no longer be touched: a descriptor op failed without the
    /// node's answer, so its RDMA READ or WRITE may still run (set once, never cleared).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(super) rdma_poisoned: Option<String>,
}

impl TcpTransport {
    /// Connects to `url` (`tcp://HOST:PORT`), proves `token` and checks the node's proof, then
    /// (when both sides chose RDMA) connects the queue pairs. Errors name the address; a
    /// rejected token is `PermissionDenied` ("authentication failed"); `FabricChoice::Rdma`
    /// towards a node or from a host without RDMA is `Unsupported`, naming why.
    pub fn connect(url: &str, token: Option<&Token>, opts: &RemoteOptions) -> Result<TcpTransport> {
        let addr = parse_tcp_url(url)?;
        let engine = remote_rdma::open_for(opts.fabric, &opts.rdma_device)?;
        let deadline = Instant::now() + opts.connect_timeout;
        let stream = TcpStream::connect_timeout(&addr, opts.connect_timeout).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("cannot connect to the node at {addr}: {e}"),
            )
        })?;
        stream.set_nodelay(true)?;
        let wanted = ClientOffer {
            frames: FrameRange {
                min: VERSION,
                max: VERSION,
            },
            fabrics: match (opts.fabric, engine.is_some()) {
                (FabricChoice::Rdma, _) => FABRIC_RDMA,
                (_, true) => FABRIC_TCP | FABRIC_RDMA,
                (_, false) => FABRIC_TCP,
            },
        };
        let negotiated = client_handshake(&stream, token, &opts.name, &wanted, deadline).map_err(
            |e| match e {
                HandshakeError::NoCommonFabric { .. } if opts.fabric == FabricChoice::Rdma => {
                    Error::new(
                        ErrorKind::Unsupported,
                        format!(
                            "RDMA was asked for (fabric rdma) but the node at {addr} does not \
                             offer it (its status transports.rdma says why); use fabric auto \
                             or tcp"
                        ),
                    )
                }
                e => Error::from(e).context(format!("node at {addr}")),
            },
        )?;
        let chose_rdma = negotiated.fabric == FabricKind::Rdma;
        let rdma = remote_rdma::exchange(&stream, engine, chose_rdma, deadline)
            .map_err(|e| Error::from(e).context(format!("node at {addr}")))?;
        let read = stream.try_clone()?;
        let epoch = Instant::now();
        let writer = Arc::new(Mutex::new(Writer {
            stream,
            last_write_ms: 0,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let heartbeats = Arc::new(AtomicU64::new(0));
        let heartbeat = {
            let (writer, stop, heartbeats) = (writer.clone(), stop.clone(), heartbeats.clone());
            std::thread::Builder::new()
                .name("kvnode-heartbeat".into())
                .spawn(move || heartbeat_loop(&writer, &stop, epoch, &heartbeats))?
        };
        let mut t = TcpTransport {
            read,
            writer,
            epoch,
            stop,
            heartbeat: Some(heartbeat),
            peer: addr,
            negotiated,
            heartbeats,
            rdma,
            rdma_poisoned: None,
        };
        t.set_timeout(opts.reply_timeout)?;
        Ok(t)
    }

    /// The node's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// What the handshake agreed.
    pub fn negotiated(&self) -> &ClientNegotiated {
        &self.negotiated
    }

    /// The fabric the handshake chose (`Tcp` or `Rdma`).
    pub fn fabric(&self) -> FabricKind {
        self.negotiated.fabric
    }

    /// The connection's RDMA state, when it chose RDMA.
    pub(super) fn rdma_state(&self) -> Option<&ClientRdma> {
        self.rdma.as_ref()
    }

    /// The connection's RDMA state, when it chose RDMA.
    #[cfg(feature = "rdma")]
    pub(super) fn rdma_state_mut(&mut self) -> Option<&mut ClientRdma> {
        self.rdma.as_mut()
    }

    /// Heartbeats sent so far.
    pub fn heartbeats(&self) -> u64 {
        self.heartbeats.load(Ordering::Relaxed)
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Writes `frame` and then every slice of `trailer`, under one lock.
    fn send_with_trailer(&mut self, frame: &[u8], trailer: &[&[u8]]) -> Result<()> {
        let now = self.now_ms();
        let mut w = self.writer.lock();
        w.stream.write_all(frame)?;
        write_all_vectored(&mut w.stream, trailer)?;
        w.last_write_ms = now;
        Ok(())
    }

    /// Reads exactly the bytes of `out`, first those `reader` holds already.
    fn read_trailer(&mut self, reader: &mut FrameReader, out: &mut [&mut [u8]]) -> Result<()> {
        for buf in out.iter_mut() {
            let have = reader.take_buffered(buf.len() as u64);
            let n = have.len();
            buf[..n].copy_from_slice(have);
            self.read.read_exact(&mut buf[n..]).map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    format!("the retrieve's bytes from {} were cut: {e}", self.peer),
                )
            })?;
        }
        reader.forget_armed_timeout();
        Ok(())
    }
}

/// Bytes a [`RemoteClient::read_slots_with`] receives at a time (its one buffer).
pub const TRAILER_PIECE_BYTES: usize = 1 << 20;

impl TcpTransport {
    /// Reads `total` trailer bytes (first those `reader` holds) in pieces of at most
    /// [`TRAILER_PIECE_BYTES`], handing each to `sink` with its offset in the trailer.
    fn read_trailer_with(
        &mut self,
        reader: &mut FrameReader,
        total: u64,
        deadline: Option<Instant>,
        sink: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let mut buf = vec![0u8; TRAILER_PIECE_BYTES.min(total as usize)];
        let mut at = 0u64;
        while at < total {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::new(
                    ErrorKind::Io,
                    format!(
                        "timed out: the retrieve's bytes from {} did not arrive before the \
                         deadline ({at} of {total}); the connection cannot be used further",
                        self.peer
                    ),
                ));
            }
            let want = (total - at).min(buf.len() as u64) as usize;
            let have = reader.take_buffered(want as u64);
            let n = have.len();
            buf[..n].copy_from_slice(have);
            self.read.read_exact(&mut buf[n..want]).map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    format!("the retrieve's bytes from {} were cut: {e}", self.peer),
                )
            })?;
            sink(at, &buf[..want])?;
            at += want as u64;
        }
        reader.forget_armed_timeout();
        Ok(())
    }
}

/// Writes every slice, in order, with vectored writes.
fn write_all_vectored(stream: &mut TcpStream, parts: &[&[u8]]) -> std::io::Result<()> {
    let mut idx = 0;
    let mut off = 0;
    while idx < parts.len() {
        let slices: Vec<IoSlice<'_>> = std::iter::once(&parts[idx][off..])
            .chain(parts[idx + 1..].iter().copied())
            .take(64)
            .map(IoSlice::new)
            .collect();
        let mut n = stream.write_vectored(&slices)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while idx < parts.len() && n > 0 {
            let left = parts[idx].len() - off;
            if n >= left {
                n -= left;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
        while idx < parts.len() && parts[idx].len() == off {
            idx += 1;
            off = 0;
        }
    }
    Ok(())
}

fn heartbeat_loop(writer: &Mutex<Writer>, stop: &AtomicBool, epoch: Instant, sent: &AtomicU64) {
    let frame = encode_request(HEARTBEAT_REQUEST_ID, &Request::Noop).expect("a NOOP encodes");
    let period = Duration::from_millis(HEARTBEAT_MS);
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(period / 6);
        let now = epoch.elapsed().as_millis() as u64;
        // Never waits for the lock: a writer holding it is sending, which is a heartbeat too.
        let Some(mut w) = writer.try_lock() else {
            continue;
        };
        if now.saturating_sub(w.last_write_ms) < HEARTBEAT_MS {
            continue;
        }
        if w.stream.write_all(&frame).is_err() {
            return; // the connection is gone; the next call reports it
        }
        w.last_write_ms = now;
        sent.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.read.shutdown(std::net::Shutdown::Both);
        if let Some(h) = self.heartbeat.take() {
            let _ = h.join();
        }
    }
}

impl ClientTransport for TcpTransport {
    fn send_frame(&mut self, frame: &[u8]) -> Result<()> {
        self.send_with_trailer(frame, &[])
    }

    fn read_frame(
        &mut self,
        reader: &mut FrameReader,
        payload: &mut AlignedVec<16>,
    ) -> std::result::Result<Option<(FrameHeader, Option<OwnedFd>)>, FrameError> {
        reader.read_frame(&mut PlainSource(&self.read), payload)
    }

    fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.read.set_read_timeout(timeout)?;
        self.writer.lock().stream.set_write_timeout(timeout)?;
        Ok(())
    }
}

impl Client<TcpTransport> {
    /// Connects to the node at `url` (`tcp://HOST:PORT`) with `token` (none: only a node
    /// started with `--insecure-no-auth` accepts it).
    pub fn connect_remote(
        url: &str,
        token: Option<&Token>,
        opts: &RemoteOptions,
    ) -> Result<RemoteClient> {
        Ok(Client::over(TcpTransport::connect(url, token, opts)?))
    }

    /// The transport (peer address, what the handshake agreed, heartbeats).
    pub fn transport(&self) -> &TcpTransport {
        &self.stream
    }

    /// Registers an engine-driven context (no pool is mapped: the node moves the bytes).
    pub fn register(&mut self, req: &RegisterRequest) -> Result<RegisterReply> {
        let resp = self.call(&Request::Register(req.clone()))?;
        let Response::Registered(reply) = resp else {
            return Err(Self::unexpected(resp));
        };
        self.registration = Some(reply.clone());
        Ok(reply)
    }

    /// WRITE_SLOTS: sends `data` (one slice per slot of prepared store `transfer_id`, in slot
    /// order, each exactly its slot's length) as the frame's trailer; the node receives it
    /// into the slots and publishes the store when `commit`. Returns (bytes, published).
    pub fn write_slots(
        &mut self,
        instance_id: u64,
        transfer_id: u64,
        data: &[&[u8]],
        commit: bool,
    ) -> Result<(u64, Option<u32>)> {
        let total: u64 = data.iter().map(|d| d.len() as u64).sum();
        let id = self.next_id;
        self.next_id += 1;
        let req = Request::WriteSlots {
            instance_id,
            transfer_id,
            data: DataPath::Inline,
            commit,
        };
        let frame = encode_request_with_trailer(id, &req, total).map_err(frame_err)?;
        if let Err(sending) = self.stream.send_with_trailer(&frame, data) {
            // The node may have refused the store (e.g. over its size limit) and closed: its
            // answer, if it arrived, says why, where the failed send only says "broken pipe".
            return Err(match self.reply_to(id) {
                Err(answer) if answer.kind != ErrorKind::Io => answer,
                _ => sending,
            });
        }
        match self.reply_to(id)? {
            Response::SlotsWritten { bytes, published } => Ok((bytes, published)),
            r => Err(Self::unexpected(r)),
        }
    }

    /// READ_SLOTS: the node sends the slots of prepared retrieve `transfer_id` in the reply's
    /// trailer, received straight into `out` (one buffer per slot, each exactly its slot's
    /// length), and releases its locks when `commit`. Returns the bytes received.
    pub fn read_slots(
        &mut self,
        instance_id: u64,
        transfer_id: u64,
        out: &mut [&mut [u8]],
        commit: bool,
    ) -> Result<u64> {
        let want: u64 = out.iter().map(|b| b.len() as u64).sum();
        let bytes = self.read_slots_header(instance_id, transfer_id, want, commit)?;
        self.stream.read_trailer(&mut self.reader, out)?;
        Ok(bytes)
    }

    /// Sends READ_SLOTS and reads its reply up to the trailer, which must announce exactly
    /// `want` bytes (what the caller reads next). Returns the bytes announced.
    fn read_slots_header(
        &mut self,
        instance_id: u64,
        transfer_id: u64,
        want: u64,
        commit: bool,
    ) -> Result<u64> {
        let id = self.send(&Request::ReadSlots {
            instance_id,
            transfer_id,
            data: DataPath::Inline,
            commit,
        })?;
        let (h, _) = self
            .stream
            .read_frame(&mut self.reader, &mut self.payload)
            .map_err(frame_err)?
            .ok_or_else(|| Error::new(ErrorKind::Io, "node closed the connection"))?;
        let resp = decode_response(&self.payload).map_err(frame_err)?;
        if h.request_id != id {
            return Err(Error::internal(format!(
                "response id {} for request {id}",
                h.request_id
            )));
        }
        match resp {
            Response::SlotsRead { bytes } if bytes == h.trailer_len && bytes == want => Ok(bytes),
            Response::SlotsRead { bytes } => Err(Error::internal(format!(
                "the node sends {bytes} bytes ({} announced) for {want} expected; the \
                 connection cannot be used further",
                h.trailer_len
            ))),
            Response::Error { kind, message } => {
                Err(Error::new(ErrorKind::from_code(kind), message))
            }
            r => Err(Self::unexpected(r)),
        }
    }

    /// READ_SLOTS whose bytes go to `sink` rather than to caller buffers: `sink(offset, bytes)`
    /// receives the trailer (the slots of prepared retrieve `transfer_id`, in slot order,
    /// `want` bytes in all) in pieces through one bounded buffer ([`TRAILER_PIECE_BYTES`]). An
    /// error from `sink` ends the call after the trailer was read (the connection stays in
    /// step) — for a node bringing a peer's chunks into its own pool. Past `deadline` (checked
    /// between pieces; each read is bounded by the connection's timeout) the call fails and the
    /// connection must be dropped. Returns the bytes.
    pub fn read_slots_with(
        &mut self,
        instance_id: u64,
        transfer_id: u64,
        want: u64,
        commit: bool,
        deadline: Option<Instant>,
        sink: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<u64> {
        let bytes = self.read_slots_header(instance_id, transfer_id, want, commit)?;
        let mut failed = None;
        self.stream
            .read_trailer_with(&mut self.reader, bytes, deadline, &mut |at, b| {
                if failed.is_none() {
                    if let Err(e) = sink(at, b) {
                        failed = Some(e);
                    }
                }
                Ok(())
            })?;
        match failed {
            Some(e) => Err(e),
            None => Ok(bytes),
        }
    }

    fn reply_to(&mut self, id: u64) -> Result<Response> {
        let (got, resp, _) = self.recv()?;
        if got == 0 {
            if let Response::Error { kind, message } = resp {
                return Err(Error::new(ErrorKind::from_code(kind), message));
            }
        }
        if got != id {
            return Err(Error::internal(format!(
                "response id {got} for request {id}"
            )));
        }
        match resp {
            Response::Error { kind, message } => {
                Err(Error::new(ErrorKind::from_code(kind), message))
            }
            r => Ok(r),
        }
    }

    /// Stores `chunks` (one per hash of `range`, each exactly `object_bytes`): prepare, send
    /// the chunks the node lacks straight from the caller's buffers, publish. Returns how many
    /// chunks were sent (the rest were cached already).
    pub fn store(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        chunks: &[&[u8]],
    ) -> Result<usize> {
        check_chunks(chunks.iter().map(|c| c.len()), range, self.object_bytes()?)?;
        let p = self.prepare_store(instance_id, range)?;
        if p.slots.is_empty() {
            return Ok(0);
        }
        let data: Vec<&[u8]> = p
            .chunk_indices
            .iter()
            .map(|&i| {
                chunks
                    .get(i as usize)
                    .copied()
                    .ok_or_else(|| Error::internal(format!("chunk index {i} out of range")))
            })
            .collect::<Result<_>>()?;
        for (slot, d) in p.slots.iter().zip(&data) {
            if slot.length != d.len() as u64 {
                let _ = self.abort_store(instance_id, p.transfer_id);
                return Err(Error::invalid(format!(
                    "chunk of {} bytes for a slot of {} bytes",
                    d.len(),
                    slot.length
                )));
            }
        }
        self.write_slots(instance_id, p.transfer_id, &data, true)?;
        Ok(p.slots.len())
    }

    /// Retrieves every chunk of `range` into `out` (one buffer per chunk, each exactly
    /// `object_bytes`), received straight from the stream; `false` (nothing written) if any
    /// chunk is missing. With `lookup_session`, relies on that LOOKUP's locks.
    pub fn retrieve_into(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
        lookup_session: Option<&str>,
        out: &mut [&mut [u8]],
    ) -> Result<bool> {
        check_chunks(out.iter().map(|c| c.len()), range, self.object_bytes()?)?;
        let Some(p) = self.prepare_retrieve(instance_id, range, lookup_session)? else {
            return Ok(false);
        };
        if p.slots.len() != out.len()
            || p.slots
                .iter()
                .zip(out.iter())
                .any(|(s, o)| s.length != o.len() as u64)
        {
            let _ = self.commit_retrieve(instance_id, p.transfer_id);
            return Err(Error::internal(
                "the node's slots do not match the buffers (layout changed?)",
            ));
        }
        self.read_slots(instance_id, p.transfer_id, out, true)?;
        Ok(true)
    }

    /// Retrieves every chunk of `range` into new buffers; `None` if any chunk is missing.
    pub fn retrieve(
        &mut self,
        instance_id: u64,
        range: &ChunkRange,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let n = usize::try_from(self.object_bytes()?)
            .map_err(|_| Error::internal("object size out of range"))?;
        let mut bufs = vec![vec![0u8; n]; range.chunk_hashes.len()];
        let mut out: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        Ok(self
            .retrieve_into(instance_id, range, None, &mut out)?
            .then_some(bufs))
    }
}

/// Checks one buffer per hash of `range`, each exactly `object_bytes`.
fn check_chunks(
    lens: impl ExactSizeIterator<Item = usize>,
    range: &ChunkRange,
    object_bytes: u64,
) -> Result<()> {
    if lens.len() != range.chunk_hashes.len() {
        return Err(Error::invalid(format!(
            "{} buffers for {} hashes",
            lens.len(),
            range.chunk_hashes.len()
        )));
    }
    let mut lens = lens;
    if let Some(bad) = lens.find(|&l| l as u64 != object_bytes) {
        return Err(Error::invalid(format!(
            "buffer of {bad} bytes; the layout needs {object_bytes}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectored_writes_send_every_slice_in_order() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            got
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let parts: Vec<Vec<u8>> = (0..200u32)
            .map(|i| vec![(i % 251) as u8; (i as usize * 977) % 70_000])
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        write_all_vectored(&mut c, &refs).unwrap();
        drop(c);
        assert_eq!(t.join().unwrap(), parts.concat());
    }
}
