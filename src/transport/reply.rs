//! The reply side of one stream connection (Unix socket or TCP): a send never blocks the thread
//! that answers.
//!
//! A reply is written at once with a non-blocking send when nothing of this connection waits
//! before it (the common case: exactly one system call, as a blocking send made). What the
//! socket does not take is queued on the connection, in order, and written by the node's one
//! reply flusher thread when the socket becomes writable again (`epoll`, one-shot, armed only
//! while something waits). So a shard worker or another connection's thread is never held up by
//! a client that does not read its replies: that client's replies wait in its own queue.
//!
//! The queue is bounded in bytes (the budget given to [`UdsReplySink::new`]): a connection whose
//! queued replies would exceed it is closed (its instances are released as on any disconnect)
//! and the node logs it once. A reply always enters an empty queue, whatever its size, so a large
//! reply to a client that reads is never refused. A reply carrying a file descriptor (the pool,
//! on registration) keeps a duplicate of it in its queue entry until it is written; at most
//! [`REPLY_QUEUE_FDS`] such replies wait per connection (beyond: the connection is closed).
//!
//! A reply followed by raw bytes that another component writes on the socket (a remote
//! retrieve's trailer, sent from the pool by a fabric) takes the socket with
//! [`StreamReplySink::hold`]: once everything queued before it is written, replies sent
//! meanwhile wait in the queue (within its budget) until the hold ends, so nothing is
//! interleaved with the trailer.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::event::epoll;
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

use crate::protocol::frame::encode_response;
use crate::protocol::Response;
use crate::transport::ReplySink;

/// Replies carrying a file descriptor that may wait in one connection's queue (each holds a
/// duplicate of the descriptor until written): bounds the descriptors a client that registers
/// without reading its replies can pin.
pub const REPLY_QUEUE_FDS: usize = 1;

/// Events one `epoll_wait` of the flusher takes at most.
const FLUSH_EVENTS: usize = 64;

/// A connected stream socket replies are written to.
pub trait ReplySocket: AsFd + Send + Sync + 'static {
    /// Shuts both directions down (ends the connection's reader too). Idempotent.
    fn shutdown_both(&self);
}

impl ReplySocket for UnixStream {
    fn shutdown_both(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

impl ReplySocket for TcpStream {
    fn shutdown_both(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

/// The reply side of one stream connection. Invariant: replies reach the socket in the order
/// `send` was called; `send` never blocks on the socket; while a [`HeldSocket`] exists nothing
/// is written by the sink.
pub struct StreamReplySink {
    conn: Arc<Conn>,
    peer: Option<kvnode_hw::PeerCred>,
    passes_fd: bool,
}

/// The reply sink of Unix-socket connections (credentials known, descriptors passed).
pub type UdsReplySink = StreamReplySink;

/// What the sink and the flusher share.
struct Conn {
    stream: Arc<dyn ReplySocket>,
    id: u64,
    /// Key of this connection in the flusher's table (unique for the process's life).
    token: u64,
    /// Most bytes of replies that may wait in `out` (see the module docs).
    budget: usize,
    out: Mutex<Backlog>,
}

/// Replies not yet written. Invariants: `bytes` is the unwritten bytes of `queue`, `fds` the
/// entries holding a descriptor; while `queue` is not empty the connection is armed in the
/// flusher (or the flusher holds `out` and re-arms it before letting go); once `closed`, the
/// queue is empty and stays so.
#[derive(Default)]
struct Backlog {
    queue: VecDeque<Queued>,
    bytes: usize,
    fds: usize,
    /// In the flusher's epoll set (armed or spent).
    registered: bool,
    closed: bool,
    /// A [`HeldSocket`] owns the socket: replies only queue.
    held: bool,
}

/// One reply frame, `sent` bytes of it written; `fd` travels with its first byte.
struct Queued {
    frame: Vec<u8>,
    sent: usize,
    fd: Option<OwnedFd>,
}

impl StreamReplySink {
    /// The reply side of Unix-socket connection `id` over `stream` (shared with the
    /// connection's reader), with at most `budget` bytes of replies waiting for the client to
    /// read. The peer's credentials are read from the socket once, here. Starts the node's
    /// reply flusher if it is not running yet.
    pub fn new(stream: Arc<UnixStream>, id: u64, budget: usize) -> StreamReplySink {
        let peer = kvnode_hw::unix_peer_credentials(stream.as_fd()).ok();
        StreamReplySink::over(stream, id, budget, peer, true)
    }

    /// The reply side of TCP connection `id` (no credentials, no descriptor passing).
    pub fn tcp(stream: Arc<TcpStream>, id: u64, budget: usize) -> StreamReplySink {
        StreamReplySink::over(stream, id, budget, None, false)
    }

    fn over(
        stream: Arc<dyn ReplySocket>,
        id: u64,
        budget: usize,
        peer: Option<kvnode_hw::PeerCred>,
        passes_fd: bool,
    ) -> StreamReplySink {
        static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);
        let _ = flusher();
        StreamReplySink {
            conn: Arc::new(Conn {
                stream,
                id,
                token: NEXT_TOKEN.fetch_add(1, Ordering::Relaxed),
                budget,
                out: Mutex::new(Backlog::default()),
            }),
            peer,
            passes_fd,
        }
    }

    /// Bytes of replies waiting for the client (tests and diagnostics).
    pub fn queued_bytes(&self) -> usize {
        self.conn.out.lock().bytes
    }

    /// Waits (until `deadline`) for every reply queued so far to be written, then owns the
    /// socket until the returned guard is dropped: replies sent meanwhile queue. Fails when the
    /// connection closed or the client did not read its earlier replies in time.
    pub fn hold(&self, deadline: Instant) -> io::Result<HeldSocket<'_>> {
        loop {
            {
                let mut out = self.conn.out.lock();
                if out.closed {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        "connection closed",
                    ));
                }
                if out.queue.is_empty() {
                    debug_assert!(!out.held, "one holder at a time (the connection's reader)");
                    out.held = true;
                    return Ok(HeldSocket { sink: self });
                }
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not read its earlier replies in time",
                ));
            }
            std::thread::sleep(HOLD_POLL);
        }
    }
}

/// How often [`StreamReplySink::hold`] looks whether the queue drained (it waits only behind a
/// client that does not read its replies as fast as they come).
const HOLD_POLL: Duration = Duration::from_micros(200);

/// The socket of a connection, owned by one writer (see [`StreamReplySink::hold`]).
/// Invariant: while it exists the sink writes nothing; dropping it lets queued replies go.
pub struct HeldSocket<'a> {
    sink: &'a StreamReplySink,
}

impl HeldSocket<'_> {
    /// Writes all of `data` with non-blocking sends, waiting for the socket to drain until
    /// `deadline`.
    pub fn write_all(&self, mut data: &[u8], deadline: Instant) -> io::Result<()> {
        let fd = self.sink.conn.stream.as_fd();
        while !data.is_empty() {
            match send_some(fd, data, None) {
                Ok(n) => data = &data[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the client did not read in time",
                        ));
                    }
                    wait_writable(fd, left)?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Closes the connection (its stream can no longer be trusted, e.g. a trailer was cut).
    pub fn close(&self) {
        let mut out = self.sink.conn.out.lock();
        self.sink.conn.close(&mut out);
    }
}

impl Drop for HeldSocket<'_> {
    fn drop(&mut self) {
        let conn = &self.sink.conn;
        let mut out = conn.out.lock();
        out.held = false;
        if !out.queue.is_empty() && !out.closed {
            conn.arm(&mut out);
        }
    }
}

impl ReplySink for StreamReplySink {
    fn send(&self, request_id: u64, opcode: u16, resp: &Response, fd: Option<BorrowedFd<'_>>) {
        let frame = match encode_response(request_id, opcode, fd.is_some(), resp) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(error = %e, "response could not be encoded; sending an error instead");
                let err = Response::Error {
                    kind: crate::error::ErrorKind::Internal.code(),
                    message: format!("response could not be encoded: {e}"),
                };
                encode_response(request_id, opcode, false, &err).expect("small error frames encode")
            }
        };
        self.conn.send(frame, fd);
    }

    fn connection_id(&self) -> u64 {
        self.conn.id
    }

    fn can_pass_fd(&self) -> bool {
        self.passes_fd
    }

    fn peer(&self) -> Option<kvnode_hw::PeerCred> {
        self.peer
    }
}

impl Conn {
    fn send(self: &Arc<Self>, frame: Vec<u8>, fd: Option<BorrowedFd<'_>>) {
        let mut out = self.out.lock();
        if out.closed {
            return;
        }
        if !out.queue.is_empty() || out.held {
            let over_bytes = out.bytes.saturating_add(frame.len()) > self.budget;
            if over_bytes || (fd.is_some() && out.fds >= REPLY_QUEUE_FDS) {
                self.overflow(&mut out, frame.len());
                return;
            }
            self.enqueue(&mut out, frame, 0, fd);
            return; // armed already (queue not empty), or armed when the hold ends
        }
        match send_some(self.stream.as_fd(), &frame, fd) {
            Ok(n) if n == frame.len() => {}
            // The descriptor went with the first bytes.
            Ok(n) => {
                self.enqueue(&mut out, frame, n, None);
                self.arm(&mut out);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.enqueue(&mut out, frame, 0, fd);
                self.arm(&mut out);
            }
            Err(e) => self.gone(&mut out, &e),
        }
    }

    /// Appends a frame of which `sent` bytes are written, duplicating `fd` into the entry.
    fn enqueue(&self, out: &mut Backlog, frame: Vec<u8>, sent: usize, fd: Option<BorrowedFd<'_>>) {
        let fd = match fd.map(|f| f.try_clone_to_owned()) {
            None => None,
            Some(Ok(owned)) => Some(owned),
            Some(Err(e)) => {
                tracing::warn!(connection = self.id, error = %e, "cannot keep a reply's descriptor: closing connection");
                self.close(out);
                return;
            }
        };
        out.bytes += frame.len() - sent;
        out.fds += usize::from(fd.is_some());
        out.queue.push_back(Queued { frame, sent, fd });
    }

    /// Asks the flusher to write the queue when the socket can take more.
    fn arm(self: &Arc<Self>, out: &mut Backlog) {
        let Some(f) = flusher() else {
            tracing::error!(
                connection = self.id,
                "no reply flusher (it could not be started): closing a connection whose client \
                 reads its replies slowly"
            );
            self.close(out);
            return;
        };
        if let Err(e) = f.arm(self, out) {
            tracing::error!(connection = self.id, error = %e, "cannot wait for the socket to drain: closing connection");
            self.close(out);
        }
    }

    /// Writes queued replies until the socket is full (then re-arms) or the queue is empty.
    /// Runs on the flusher thread.
    fn flush(self: &Arc<Self>) {
        let mut guard = self.out.lock();
        let out = &mut *guard;
        if out.held {
            return; // the holder arms the connection again when it lets go
        }
        while let Some(q) = out.queue.front_mut() {
            let fd = if q.sent == 0 {
                q.fd.as_ref().map(AsFd::as_fd)
            } else {
                None
            };
            match send_some(self.stream.as_fd(), &q.frame[q.sent..], fd) {
                Ok(n) => {
                    q.sent += n;
                    out.bytes -= n;
                    // The descriptor went with the first of these bytes.
                    if q.fd.take().is_some() {
                        out.fds -= 1;
                    }
                    if q.sent == q.frame.len() {
                        out.queue.pop_front();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.arm(out);
                    return;
                }
                Err(e) => {
                    self.gone(out, &e);
                    return;
                }
            }
        }
    }

    /// The client's queue would pass its budget: close the connection (logged once).
    fn overflow(&self, out: &mut Backlog, adding: usize) {
        tracing::warn!(
            connection = self.id,
            queued_bytes = out.bytes,
            reply_bytes = adding,
            queued_fds = out.fds,
            budget_bytes = self.budget,
            budget_fds = REPLY_QUEUE_FDS,
            "client does not read its replies: its reply queue is over budget; closing the \
             connection (its instances are released)"
        );
        self.close(out);
    }

    /// The client went away or the socket failed: drop what waits (no log beyond debug).
    fn gone(&self, out: &mut Backlog, e: &io::Error) {
        tracing::debug!(connection = self.id, error = %e, "client went away before its replies");
        self.close(out);
    }

    /// Drops the queue and shuts the socket down, which ends the connection's reader (and so
    /// releases its instances). Idempotent.
    fn close(&self, out: &mut Backlog) {
        if out.closed {
            return;
        }
        out.closed = true;
        out.queue.clear();
        out.bytes = 0;
        out.fds = 0;
        self.stream.shutdown_both();
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if self.out.get_mut().registered {
            if let Some(f) = flusher() {
                f.forget(self);
            }
        }
    }
}

/// Waits at most `timeout` for `sock` to take more bytes (or fail: the next send says how).
pub fn wait_writable(sock: BorrowedFd<'_>, timeout: Duration) -> io::Result<()> {
    let mut fds = [rustix::event::PollFd::new(
        &sock,
        rustix::event::PollFlags::OUT,
    )];
    let timeout = rustix::event::Timespec {
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    match rustix::event::poll(&mut fds, Some(&timeout)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// One non-blocking send of `data` (never raises SIGPIPE), with `fd` attached (SCM_RIGHTS) when
/// given; retries interruptions. Returns the bytes the socket took (at least one on success).
fn send_some(sock: BorrowedFd<'_>, data: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<usize> {
    let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
    loop {
        let r = match fd {
            None => rustix::net::send(sock, data, flags),
            Some(fd) => {
                let fds = [fd];
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                control.push(SendAncillaryMessage::ScmRights(&fds));
                rustix::net::sendmsg(sock, &[IoSlice::new(data)], &mut control, flags)
            }
        };
        match r {
            Ok(0) if !data.is_empty() => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "send took 0 bytes",
                ))
            }
            Ok(n) => return Ok(n),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// The node's reply flusher: one thread and one epoll descriptor for the whole process, waking
/// only for connections with queued replies. Invariant: `conns` maps the token of every
/// connection registered in `epoll` to it.
struct Flusher {
    epoll: OwnedFd,
    conns: Mutex<HashMap<u64, Weak<Conn>>>,
}

/// The flusher, started on first use; `None` if it could not be (then queued replies close
/// their connection instead, with an error in the log).
fn flusher() -> Option<&'static Flusher> {
    static FLUSHER: OnceLock<Option<Flusher>> = OnceLock::new();
    let f = FLUSHER.get_or_init(|| {
        let epoll = match epoll::create(epoll::CreateFlags::CLOEXEC) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::error!(error = %e, "cannot create the reply flusher's epoll descriptor");
                return None;
            }
        };
        Some(Flusher {
            epoll,
            conns: Mutex::new(HashMap::new()),
        })
    });
    let f = f.as_ref()?;
    static STARTED: OnceLock<bool> = OnceLock::new();
    let started = *STARTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("kvnode-reply-flush".into())
            .spawn(move || f.run())
            .map_err(|e| tracing::error!(error = %e, "cannot start the reply flusher thread"))
            .is_ok()
    });
    started.then_some(f)
}

impl Flusher {
    /// Arms `conn` for one wake-up when its socket can take more. Caller holds `conn.out`.
    fn arm(&self, conn: &Arc<Conn>, out: &mut Backlog) -> io::Result<()> {
        let flags = epoll::EventFlags::OUT | epoll::EventFlags::ONESHOT;
        let data = epoll::EventData::new_u64(conn.token);
        if out.registered {
            epoll::modify(&self.epoll, conn.stream.as_fd(), data, flags)?;
        } else {
            self.conns.lock().insert(conn.token, Arc::downgrade(conn));
            if let Err(e) = epoll::add(&self.epoll, conn.stream.as_fd(), data, flags) {
                self.conns.lock().remove(&conn.token);
                return Err(e.into());
            }
            out.registered = true;
        }
        Ok(())
    }

    /// Takes a connection that is going away out of the epoll set and the table (before its
    /// descriptor can be closed).
    fn forget(&self, conn: &Conn) {
        let _ = epoll::delete(&self.epoll, conn.stream.as_fd());
        self.conns.lock().remove(&conn.token);
    }

    fn run(&self) {
        let mut events = Vec::with_capacity(FLUSH_EVENTS);
        loop {
            events.clear();
            if let Err(e) = epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                None,
            ) {
                if e != rustix::io::Errno::INTR {
                    tracing::error!(error = %e, "reply flusher: epoll_wait failed");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                continue;
            }
            for ev in &events {
                let token = ev.data.u64();
                // Clone the handle out first: the table's lock is never held while flushing
                // (a connection dropped here takes it in `forget`).
                let conn = self.conns.lock().get(&token).and_then(Weak::upgrade);
                if let Some(conn) = conn {
                    conn.flush();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::frame::{decode_response, FrameReader, FrameSource};
    use rkyv::util::AlignedVec;
    use std::time::Duration;

    struct FdSource<'a>(&'a UnixStream);

    impl FrameSource for FdSource<'_> {
        fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
            kvnode_hw::recv_with_fd(self.0.as_fd(), buf)
        }
    }

    fn pair(budget: usize) -> (UdsReplySink, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        (UdsReplySink::new(Arc::new(a), 1, budget), b)
    }

    fn text(n: usize) -> Response {
        Response::Text("x".repeat(n))
    }

    /// Sends `count` replies of about `size` bytes on a thread; they must all return without
    /// the peer reading (within a generous deadline, only against a hang).
    fn send_all(sink: &Arc<UdsReplySink>, count: u64, size: usize) {
        let s = sink.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for i in 0..count {
                s.send(i, 1, &text(size), None);
            }
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("send returned although the peer reads nothing");
    }

    /// Replies the socket cannot take wait in order and reach a client that reads late.
    #[test]
    fn queued_replies_arrive_in_order() {
        let (sink, peer) = pair(64 << 20);
        let sink = Arc::new(sink);
        send_all(&sink, 3000, 1000);
        assert!(
            sink.queued_bytes() > 0,
            "the socket buffer is full: replies wait"
        );
        let mut reader = FrameReader::default();
        let mut payload = AlignedVec::<16>::new();
        for i in 0..3000 {
            let (h, _) = reader
                .read_frame(&mut FdSource(&peer), &mut payload)
                .unwrap()
                .expect("a frame");
            assert_eq!(h.request_id, i);
            assert_eq!(decode_response(&payload).unwrap(), text(1000));
        }
        assert_eq!(sink.queued_bytes(), 0);
    }

    /// A client whose queue passes the budget is disconnected; the queue is dropped.
    #[test]
    fn over_budget_closes_the_connection() {
        let (sink, peer) = pair(64 << 10);
        let sink = Arc::new(sink);
        send_all(&sink, 3000, 1000);
        assert_eq!(sink.queued_bytes(), 0, "dropped with the connection");
        let mut reader = FrameReader::default();
        let mut payload = AlignedVec::<16>::new();
        let mut got = 0;
        while let Ok(Some(_)) = reader.read_frame(&mut FdSource(&peer), &mut payload) {
            got += 1;
        }
        assert!(got < 3000, "the connection ended after {got} replies");
    }

    /// A reply carrying a descriptor that has to wait keeps a duplicate of it: the client gets
    /// a working descriptor even though the caller closed its own right after `send`.
    #[test]
    fn a_queued_descriptor_stays_alive_until_written() {
        let (sink, peer) = pair(64 << 20);
        let sink = Arc::new(sink);
        send_all(&sink, 2000, 1000);
        assert!(sink.queued_bytes() > 0);
        let dir = std::env::temp_dir().join(format!("kvnode-reply-fd-{}", std::process::id()));
        std::fs::write(&dir, b"pool bytes").unwrap();
        let file = std::fs::File::open(&dir).unwrap();
        sink.send(9999, 2, &text(10), Some(file.as_fd()));
        drop(file);
        std::fs::remove_file(&dir).unwrap();
        let mut reader = FrameReader::default();
        let mut payload = AlignedVec::<16>::new();
        for _ in 0..2000 {
            reader
                .read_frame(&mut FdSource(&peer), &mut payload)
                .unwrap();
        }
        let (h, fd) = reader
            .read_frame(&mut FdSource(&peer), &mut payload)
            .unwrap()
            .unwrap();
        assert_eq!(h.request_id, 9999);
        let fd = fd.expect("the descriptor arrived with its reply");
        let mut got = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(fd), &mut got).unwrap();
        assert_eq!(got, "pool bytes");
        assert_eq!(sink.queued_bytes(), 0);
    }

    /// Only REPLY_QUEUE_FDS descriptor replies may wait: one more closes the connection.
    #[test]
    fn descriptor_replies_waiting_are_bounded() {
        let (sink, _peer) = pair(64 << 20);
        let sink = Arc::new(sink);
        send_all(&sink, 2000, 1000);
        let file = std::fs::File::open("/dev/null").unwrap();
        for i in 0..=REPLY_QUEUE_FDS as u64 {
            assert!(
                sink.queued_bytes() > 0,
                "still open before descriptor reply {i}"
            );
            sink.send(i, 2, &text(10), Some(file.as_fd()));
        }
        assert_eq!(sink.queued_bytes(), 0, "closed: the queue was dropped");
    }
}
