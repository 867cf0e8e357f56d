//! Reading native frames from a byte stream: one buffered receive per burst of small frames,
//! large payloads received straight into place with memory that follows the bytes that
//! arrived, optional deadlines (a frame must arrive within a time of its first byte; a new frame
//! must begin within an idle time) and an optional node-wide [`PayloadBudget`].
//!
//! Deadlines are receive timeouts on the socket (`SO_RCVTIMEO`), set only when the wanted time
//! differs from the one in force by more than an eighth of the deadline, so the usual
//! request/reply exchange, where every receive waits for a new frame, sets it once per
//! connection. A deadline is therefore kept to within an eighth of itself (and 1 ms).

use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rkyv::util::AlignedVec;

use super::budget::{PayloadBudget, PayloadCharge};
use super::frame::{FrameError, FrameHeader, FLAG_FD, HEADER_BYTES};

/// A byte source that may also deliver a file descriptor (SCM_RIGHTS) with its bytes.
pub trait FrameSource {
    /// Reads some bytes (0 = end of stream) and any fd that arrived with them.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)>;

    /// Limits how long one [`FrameSource::recv`] may block (`None`: no limit); past it the
    /// receive fails with `WouldBlock` or `TimedOut`. A source that cannot time out ignores it
    /// (a [`FrameReader`] then checks its deadlines only when bytes arrive).
    fn set_recv_timeout(&mut self, _timeout: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

/// A reader whose blocking reads can be limited in time (sockets), or that never blocks.
pub trait ReadTimeout {
    /// Sets the longest one read may block (`None`: no limit; never zero).
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl ReadTimeout for std::os::unix::net::UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        std::os::unix::net::UnixStream::set_read_timeout(self, t)
    }
}

impl ReadTimeout for std::net::TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, t)
    }
}

impl<T: ReadTimeout> ReadTimeout for &T {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        (**self).set_read_timeout(t)
    }
}

/// Byte slices never block.
impl ReadTimeout for &[u8] {
    fn set_read_timeout(&self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

/// Adapts a `Read` (no fd passing) into a [`FrameSource`].
pub struct PlainSource<R>(pub R);

impl<R: Read + ReadTimeout> FrameSource for PlainSource<R> {
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
        Ok((self.0.read(buf)?, None))
    }

    fn set_recv_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.0.set_read_timeout(timeout)
    }
}

/// Bytes a [`FrameReader`] asks the transport for at once: small frames (every control request)
/// arrive in one system call together with their header, and pipelined frames share one.
pub const READ_BUFFER_BYTES: usize = 64 << 10;

/// Smallest step by which a payload buffer grows while its bytes arrive.
const PAYLOAD_GROWTH_BYTES: usize = 64 << 10;
/// Payload buffer capacity a [`FrameReader::default`] keeps between frames (beyond: freed once
/// the frame is finished).
pub const RETAINED_PAYLOAD_BYTES: usize = 1 << 20;

/// Deadlines and memory a [`FrameReader`] keeps to. Invariant: durations are non-zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// Longest a frame may take to arrive once its first byte has (`None`: no limit).
    pub frame_timeout: Option<Duration>,
    /// Longest the reader waits for the first byte of a frame (`None`: forever).
    pub idle_timeout: Option<Duration>,
    /// Payload buffer capacity kept between frames; a larger buffer is freed when its frame is
    /// finished.
    pub retain_bytes: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            frame_timeout: None,
            idle_timeout: None,
            retain_bytes: RETAINED_PAYLOAD_BYTES,
        }
    }
}

/// Reads frames from a byte stream with one buffered receive per burst of small frames instead
/// of one per header and one per payload. Invariants: `buf[start..end]` holds received bytes not
/// yet returned; an fd that arrived is handed out only with the next frame whose header has
/// `FLAG_FD`; `charge` is held only while a large payload is being received or has been
/// returned and not yet finished; `armed` is the receive timeout last set on the source.
pub struct FrameReader {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    fd: Option<OwnedFd>,
    limits: ReadLimits,
    budget: Option<Arc<PayloadBudget>>,
    charge: Option<PayloadCharge>,
    armed: Option<Duration>,
    /// Deadline of the frame whose first bytes are in (`None`: none, or no frame timeout).
    deadline: Option<Instant>,
}

impl Default for FrameReader {
    fn default() -> Self {
        FrameReader::new(ReadLimits::default(), None)
    }
}

/// A large frame went by: give its memory back rather than keep it per connection.
#[cold]
#[inline(never)]
fn release_payload(payload: &mut AlignedVec<16>) {
    *payload = AlignedVec::new();
}

/// What one timed receive got.
enum Got {
    Bytes(usize),
    Expired,
}

impl FrameReader {
    /// A reader keeping to `limits`, holding the payload bytes of large frames in `budget`.
    pub fn new(limits: ReadLimits, budget: Option<Arc<PayloadBudget>>) -> FrameReader {
        FrameReader {
            buf: vec![0u8; READ_BUFFER_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            fd: None,
            limits,
            budget,
            charge: None,
            armed: None,
            deadline: None,
        }
    }

    /// Ends the frame last returned: gives its payload bytes back to the budget and frees a
    /// payload buffer larger than `retain_bytes`. Call it once the payload has been decoded;
    /// [`FrameReader::read_frame`] does it anyway before reading the next frame.
    pub fn finish(&mut self, payload: &mut AlignedVec<16>) {
        self.charge = None;
        if payload.capacity() > self.limits.retain_bytes {
            release_payload(payload);
        }
    }

    fn timed(&self) -> bool {
        self.limits.frame_timeout.is_some() || self.limits.idle_timeout.is_some()
    }

    /// Sets the source's receive timeout to `want` unless the one in force is within an eighth
    /// of `limit` of it (so steady traffic does not pay a system call per receive).
    fn arm<S: FrameSource>(
        &mut self,
        src: &mut S,
        want: Option<Duration>,
        limit: Duration,
    ) -> Result<(), FrameError> {
        let want = want.map(|w| w.max(Duration::from_millis(1)));
        let tolerance = (limit / 8).max(Duration::from_millis(1));
        let close_enough = match (self.armed, want) {
            (armed, None) => armed.is_none(),
            (None, Some(_)) => false,
            (Some(a), Some(w)) => a <= w + tolerance && w <= a + tolerance,
        };
        if !close_enough {
            src.set_recv_timeout(want)
                .map_err(|e| FrameError::Io(e.to_string()))?;
            self.armed = want;
        }
        Ok(())
    }

    /// One receive into `buf` that gives up at `deadline` (`limit` is the deadline's length,
    /// for the timeout tolerance). Without a deadline a timeout is an I/O error (a client's own
    /// socket timeout), as is every other failure but `Interrupted`.
    fn recv_until<S: FrameSource>(
        &mut self,
        src: &mut S,
        into_payload: Option<(&mut AlignedVec<16>, usize)>,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<Got, FrameError> {
        let mut into_payload = into_payload;
        loop {
            if self.timed() {
                let (want, limit) = match deadline {
                    None => (None, Duration::ZERO),
                    Some((d, limit)) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Ok(Got::Expired);
                        }
                        (Some(left), limit)
                    }
                };
                self.arm(src, want, limit)?;
            }
            let r = match &mut into_payload {
                Some((p, got)) => src.recv(&mut p.as_mut_slice()[*got..]),
                None => src.recv(&mut self.buf[self.end..]),
            };
            match r {
                Ok((n, fd)) => {
                    if fd.is_some() {
                        self.fd = fd;
                    }
                    return Ok(Got::Bytes(n));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if deadline.is_some()
                        && matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) => {}
                Err(e) => return Err(FrameError::Io(e.to_string())),
            }
        }
    }

    fn frame_timeout_ms(&self) -> u64 {
        self.limits
            .frame_timeout
            .map_or(0, |d| d.as_millis() as u64)
    }

    fn stalled(&self, header: Option<&FrameHeader>) -> FrameError {
        FrameError::Stalled {
            request_id: header.map_or(0, |h| h.request_id),
            opcode: header.map_or(0, |h| h.opcode),
            limit_ms: self.frame_timeout_ms(),
        }
    }

    /// Starts the frame deadline: the first bytes of a frame are in.
    fn frame_started(&mut self) {
        self.deadline = self.limits.frame_timeout.map(|t| Instant::now() + t);
    }

    /// The rest of a payload larger than what was buffered with its header, received straight
    /// into its final place. The buffer grows as bytes arrive (at most doubling), so a header
    /// alone never commits the node to the payload size it declares; with a budget, each growth
    /// first takes its bytes from it, waiting at most until the frame's deadline when they are
    /// not free. (Out of line: the common, small frame stays on the short path.)
    #[cold]
    #[inline(never)]
    fn read_large_payload<S: FrameSource>(
        &mut self,
        src: &mut S,
        h: &FrameHeader,
        payload: &mut AlignedVec<16>,
    ) -> Result<(), FrameError> {
        let len = h.payload_len as usize;
        // Payloads no larger than the read buffer (small frames that happened to straddle it)
        // are not charged: a client holding the budget with large frames never makes another's
        // small requests wait (each connection keeps at most its retained buffer for them).
        if len > READ_BUFFER_BYTES {
            if let Some(b) = &self.budget {
                self.charge = Some(b.begin(len as u64));
            }
        }
        let mut got = payload.len();
        while got < len {
            if got == payload.len() {
                let next = len.min(got.max(PAYLOAD_GROWTH_BYTES).saturating_mul(2));
                if let Some(c) = &mut self.charge {
                    if !c.grow_to(next as u64, self.deadline) {
                        return Err(FrameError::BudgetTimeout {
                            request_id: h.request_id,
                            opcode: h.opcode,
                            limit_ms: self.frame_timeout_ms(),
                        });
                    }
                }
                payload.reserve_exact(next - payload.len());
                payload.resize(next, 0);
            }
            let deadline = self.deadline.zip(self.limits.frame_timeout);
            match self.recv_until(src, Some((&mut *payload, got)), deadline)? {
                Got::Bytes(0) => return Err(FrameError::Truncated),
                Got::Bytes(n) => got += n,
                Got::Expired => return Err(self.stalled(Some(h))),
            }
        }
        Ok(())
    }

    /// Receives more bytes into the buffer: Ok(Some(0)) at end of stream, Ok(None) when the
    /// deadline in force (the frame's once some of it is buffered, else the idle one) passed.
    fn fill<S: FrameSource>(&mut self, src: &mut S) -> Result<Option<usize>, FrameError> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let deadline = if self.end > 0 {
            self.deadline.zip(self.limits.frame_timeout)
        } else {
            self.limits
                .idle_timeout
                .map(|t| (self.deadline.unwrap_or_else(|| Instant::now() + t), t))
        };
        match self.recv_until(src, None, deadline)? {
            Got::Bytes(n) => {
                if self.end == 0 && n > 0 {
                    self.frame_started();
                }
                self.end += n;
                Ok(Some(n))
            }
            Got::Expired => Ok(None),
        }
    }

    /// Reads one frame: validates the header, copies the payload into `payload` (reused,
    /// 16-byte aligned). Returns `Ok(None)` on a clean end of stream between frames;
    /// [`FrameError::Idle`] when no frame began within the idle deadline (the reader stays
    /// usable: calling again waits another idle period), [`FrameError::Stalled`] when a frame
    /// did not arrive within the frame deadline of its first byte.
    #[inline]
    pub fn read_frame<S: FrameSource>(
        &mut self,
        src: &mut S,
        payload: &mut AlignedVec<16>,
    ) -> Result<Option<(FrameHeader, Option<OwnedFd>)>, FrameError> {
        self.finish(payload);
        if self.timed() {
            // Bytes already buffered (pipelined) start the frame's clock; otherwise the idle
            // deadline, kept in the same field until the first byte arrives.
            self.deadline = if self.end > self.start {
                self.limits.frame_timeout.map(|t| Instant::now() + t)
            } else {
                self.limits.idle_timeout.map(|t| Instant::now() + t)
            };
        }
        while self.end - self.start < HEADER_BYTES {
            let was_empty = self.end == self.start;
            match self.fill(src)? {
                Some(0) => {
                    return if self.end == self.start {
                        Ok(None)
                    } else {
                        Err(FrameError::Truncated)
                    };
                }
                Some(_) => {}
                None if was_empty => {
                    return Err(FrameError::Idle {
                        limit_ms: self.limits.idle_timeout.map_or(0, |d| d.as_millis() as u64),
                    })
                }
                None => return Err(self.stalled(None)),
            }
        }
        let hb: &[u8; HEADER_BYTES] = self.buf[self.start..self.start + HEADER_BYTES]
            .try_into()
            .expect("header length");
        let h = FrameHeader::decode(hb)?;
        self.start += HEADER_BYTES;
        let len = h.payload_len as usize;
        let buffered = (self.end - self.start).min(len);
        payload.clear();
        payload.extend_from_slice(&self.buf[self.start..self.start + buffered]);
        self.start += buffered;
        if payload.len() < len {
            if let Err(e) = self.read_large_payload(src, &h, payload) {
                self.finish(payload);
                return Err(e);
            }
        }
        // An fd belongs to the frame that announces it (FLAG_FD): one receive may return an
        // earlier frame's bytes together with the fd of a later one.
        let fd = if h.flags & FLAG_FD != 0 {
            self.fd.take()
        } else {
            None
        };
        Ok(Some((h, fd)))
    }

    /// Hands out up to `max` bytes that arrived after the last frame returned and were not
    /// consumed yet (the first bytes of its trailer, read together with it); they count as
    /// consumed. The rest of a trailer is read from the stream by its consumer, never by this
    /// reader, which resumes with the next frame.
    pub fn take_buffered(&mut self, max: u64) -> &[u8] {
        let n = (self.end - self.start).min(usize::try_from(max).unwrap_or(usize::MAX));
        let out = &self.buf[self.start..self.start + n];
        self.start += n;
        out
    }

    /// Forgets the receive timeout this reader last set on its source: a consumer that read
    /// the stream itself may have changed it, so the next frame sets its own.
    pub fn forget_armed_timeout(&mut self) {
        // Matches no wanted timeout, so the next receive sets its own.
        self.armed = Some(Duration::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::frame::{decode_request, encode_request};
    use crate::protocol::messages::{ChunkRange, Request};

    /// Hands out `data` at most `piece` bytes per receive, then stalls: each receive waits out the
    /// timeout in force and fails as `SO_RCVTIMEO` does (a receive without one is a test bug).
    struct Stalling {
        data: Vec<u8>,
        pos: usize,
        piece: usize,
        timeout: Option<Duration>,
        sets: usize,
    }

    impl Stalling {
        fn new(data: Vec<u8>, piece: usize) -> Stalling {
            Stalling {
                data,
                pos: 0,
                piece,
                timeout: None,
                sets: 0,
            }
        }
    }

    impl FrameSource for Stalling {
        fn recv(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
            if self.pos < self.data.len() {
                let n = buf.len().min(self.piece).min(self.data.len() - self.pos);
                buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
                self.pos += n;
                return Ok((n, None));
            }
            let t = self
                .timeout
                .expect("a receive without a timeout would block forever");
            std::thread::sleep(t);
            Err(io::ErrorKind::WouldBlock.into())
        }

        fn set_recv_timeout(&mut self, t: Option<Duration>) -> io::Result<()> {
            self.timeout = t;
            self.sets += 1;
            Ok(())
        }
    }

    fn limits(frame_ms: u64, idle_ms: u64) -> ReadLimits {
        ReadLimits {
            frame_timeout: Some(Duration::from_millis(frame_ms)),
            idle_timeout: Some(Duration::from_millis(idle_ms)),
            retain_bytes: 128 << 10,
        }
    }

    /// A LOOKUP frame of `chunks` hashes (32 bytes each) with request id `id`.
    fn lookup_frame(id: u64, chunks: usize) -> Vec<u8> {
        let req = Request::Lookup {
            request_id: "r".into(),
            range: ChunkRange {
                model: "m".into(),
                world_size: 1,
                worker_id: None,
                cache_salt: String::new(),
                first_chunk: 0,
                chunk_hashes: vec![[3; 32]; chunks],
            },
            tp_size: 1,
            readers: 0,
        };
        encode_request(id, &req).unwrap()
    }

    #[test]
    fn a_partial_header_that_stalls_is_refused_at_the_frame_deadline() {
        let f = lookup_frame(5, 1);
        let mut src = Stalling::new(f[..10].to_vec(), usize::MAX);
        let mut r = FrameReader::new(limits(20, 60_000), None);
        let e = r.read_frame(&mut src, &mut AlignedVec::new()).unwrap_err();
        assert_eq!(
            e,
            FrameError::Stalled {
                request_id: 0,
                opcode: 0,
                limit_ms: 20
            }
        );
    }

    #[test]
    fn a_partial_payload_that_stalls_names_its_request_and_gives_its_budget_back() {
        let f = lookup_frame(7, 10_000);
        let h = FrameHeader::decode(f[..HEADER_BYTES].try_into().unwrap()).unwrap();
        let budget = Arc::new(PayloadBudget::new(16 << 20));
        let mut src = Stalling::new(f[..f.len() / 2].to_vec(), 4096);
        let mut r = FrameReader::new(limits(20, 60_000), Some(Arc::clone(&budget)));
        let mut p = AlignedVec::new();
        let e = r.read_frame(&mut src, &mut p).unwrap_err();
        assert_eq!(
            e,
            FrameError::Stalled {
                request_id: 7,
                opcode: h.opcode,
                limit_ms: 20
            }
        );
        assert_eq!(budget.held(), 0);
        assert!(p.capacity() <= 128 << 10, "{} bytes kept", p.capacity());
    }

    #[test]
    fn the_idle_deadline_leaves_the_reader_usable() {
        let mut src = Stalling::new(Vec::new(), usize::MAX);
        let mut r = FrameReader::new(limits(60_000, 20), None);
        let mut p = AlignedVec::new();
        assert_eq!(
            r.read_frame(&mut src, &mut p).unwrap_err(),
            FrameError::Idle { limit_ms: 20 }
        );
        src.data = lookup_frame(9, 3);
        let (h, _) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
        assert_eq!(h.request_id, 9);
        assert!(decode_request(&h, &p).is_ok());
    }

    #[test]
    fn steady_traffic_sets_the_receive_timeout_once() {
        // One frame per receive, as a request/reply client sends them.
        let mut data = Vec::new();
        for id in 0..100 {
            data.extend(lookup_frame(id, 2));
        }
        let one = lookup_frame(0, 2).len();
        let mut src = Stalling::new(data, one);
        let mut r = FrameReader::new(limits(10_000, 60_000), None);
        let mut p = AlignedVec::new();
        for id in 0..100 {
            let (h, _) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
            assert_eq!(h.request_id, id);
        }
        assert_eq!(src.sets, 1);
    }

    #[test]
    fn a_large_frame_holds_budget_until_finished_and_its_buffer_is_freed() {
        let f = lookup_frame(1, 100_000);
        let budget = Arc::new(PayloadBudget::new(16 << 20));
        let mut src = Stalling::new(f.clone(), 100_000);
        let mut r = FrameReader::new(limits(60_000, 60_000), Some(Arc::clone(&budget)));
        let mut p = AlignedVec::new();
        let (h, _) = r.read_frame(&mut src, &mut p).unwrap().unwrap();
        assert_eq!(p.as_slice(), &f[HEADER_BYTES..]);
        assert_eq!(budget.held(), u64::from(h.payload_len));
        assert_eq!(p.capacity(), h.payload_len as usize, "grown exactly");
        r.finish(&mut p);
        assert_eq!((budget.held(), p.capacity()), (0, 0));
    }

    #[test]
    fn a_frame_waits_for_budget_only_until_its_deadline() {
        let budget = Arc::new(PayloadBudget::new(1 << 20));
        let mut other = budget.begin(1 << 20);
        assert!(other.grow_to(1 << 20, None));
        let f = lookup_frame(4, 10_000);
        let mut src = Stalling::new(f, usize::MAX);
        let mut r = FrameReader::new(limits(20, 60_000), Some(Arc::clone(&budget)));
        let e = r.read_frame(&mut src, &mut AlignedVec::new()).unwrap_err();
        assert!(
            matches!(e, FrameError::BudgetTimeout { request_id: 4, .. }),
            "{e:?}"
        );
        assert_eq!(budget.held(), 1 << 20, "only the other frame's bytes");
    }

    #[test]
    fn a_real_socket_times_out_a_stalled_header() {
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut a, &lookup_frame(1, 1)[..5]).unwrap();
        let mut r = FrameReader::new(limits(30, 60_000), None);
        let e = r
            .read_frame(&mut PlainSource(&b), &mut AlignedVec::new())
            .unwrap_err();
        assert!(matches!(e, FrameError::Stalled { .. }), "{e:?}");
        drop(a);
    }
}
