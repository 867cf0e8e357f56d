//! The ZMQ side of the LMCache frontend.
//!
//! One I/O thread owns the ROUTER socket: it receives multipart requests
//! `[identity, uid, type, payload...]`, answers the trivial SYNC requests itself, and hands the
//! rest to handler threads chosen by the peer identity (so one client's requests run in order,
//! like LMCache's affinity pool, and different clients run in parallel). A handler serves the
//! clients that share it in turn (`turns`: one request of each client with requests waiting,
//! then the next), so a flooding client delays another by at most one request per request of
//! the other's; what waits is bounded in bytes per client and per handler
//! (`lmcache.queued_bytes_per_client`, `lmcache.queued_bytes_per_handler`), beyond which a
//! request gets its well-typed negative answer at once. Handlers decode the payload (never on
//! the I/O thread: LMCache weak point P4; a key with more than `lmcache.max_tokens_per_request`
//! tokens is refused before its tokens are allocated), run the request as the client it came
//! from, and queue the reply `[identity, uid, type, (payload)]`; a byte on a socket pair wakes
//! the I/O thread, which is the only thread that writes to the ROUTER.
//! A small, cheap request (`handler::runs_inline`: at most `INLINE_MAX_REQUEST_BYTES` of
//! payload) whose connection has nothing queued or running on its handler is run by the I/O
//! thread itself and answered at once: no hand-off to a handler and back (issue 12 §4: the two
//! hand-offs cost more than the work; with a disk tier, LOOKUP and PREPARE_RETRIEVE may wait
//! for a device and stay on the handlers). Its connection's order holds (nothing of it is queued,
//! running, or waiting in the reply queue, which is drained first); other connections are
//! delayed by at most that one small request, in libzmq's fair-queued arrival order.
//! Before routing, the I/O thread checks who sent each request (`access`): refused peers,
//! and clients asking for node-wide operations, get the operation's negative answer there.
//! The ROUTER reports connection opens and closes (`ZMQ_ROUTER_NOTIFY`): the I/O thread hands
//! them to the frontend (`frontend::disconnect`), whose sweeper thread releases a closed
//! client's instances after the grace.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle, Thread};

use crossbeam_queue::SegQueue;
use parking_lot::Mutex;

use super::access::{self, LmAccessOptions, LmPeer, PeerGate};
use super::frontend::{LmFrontend, LogLimit};
use super::handler;
use super::turns::{QueuedBytes, Turns};
use super::wire::{self, Op};
use crate::error::{Error, Result};
use crate::op_stats::OpTable;

/// Operations whose server-side time is tracked (logged at shutdown).
pub const TIMED_OPS: [Op; 10] = [
    Op::RegisterEngineDriven,
    Op::PrepareStore,
    Op::CommitStore,
    Op::Lookup,
    Op::WaitPrefetchStatus,
    Op::PrepareRetrieve,
    Op::CommitRetrieve,
    Op::EndSession,
    Op::FreeLookupLocks,
    Op::Ping,
];

/// Requests waiting for one handler thread (beyond it, requests are answered negatively).
pub use super::turns::HANDLER_QUEUE;
/// Largest multipart request accepted (frames beyond it are refused, not decoded).
pub const MAX_REQUEST_BYTES: usize = 64 << 20;
/// Bookkeeping bytes counted per queued frame beyond its payload.
pub const FRAME_OVERHEAD_BYTES: usize = 64;

/// One received request, routed to a handler (or run inline by the I/O thread).
pub(super) struct Incoming {
    /// The client connection's ZMQ routing id.
    pub(super) identity: Arc<[u8]>,
    /// The peer's uid, when the I/O thread resolved it (it is part of the client's identity
    /// for the frontend: see [`ClientId`]).
    pub(super) peer_uid: Option<u32>,
    /// The frontend's connection stamp when the request was received (orders it against its
    /// connection's open and close notices: `frontend::disconnect`).
    pub(super) stamp: u64,
    pub(super) uid: Vec<u8>,
    pub(super) typ: Vec<u8>,
    pub(super) op: Op,
    pub(super) name: String,
    pub(super) payload: Vec<Vec<u8>>,
    /// When the I/O thread received it (its latency is counted from here).
    pub(super) received: std::time::Instant,
}

impl QueuedBytes for Incoming {
    fn queued_bytes(&self) -> usize {
        let frames = self.payload.len() + 3;
        self.identity.len()
            + self.uid.len()
            + self.typ.len()
            + self.name.len()
            + self.payload.iter().map(Vec::len).sum::<usize>()
            + frames * FRAME_OVERHEAD_BYTES
    }
}

pub(super) struct Handler {
    pub(super) queue: Mutex<Turns<Incoming>>,
    pub(super) thread: OnceLock<Thread>,
}

/// Server-side time of one operation type (decode + execute + encode the reply), for isolating
/// kvnode's own share of what a client measures.
#[derive(Default, Debug)]
pub struct OpTime {
    /// Requests handled.
    pub count: AtomicU64,
    /// Sum of their server-side times in nanoseconds.
    pub total_ns: AtomicU64,
    /// Longest one in nanoseconds.
    pub max_ns: AtomicU64,
}

/// Counters of the frontend, for logs and tests.
#[derive(Default, Debug)]
pub struct FrontendStats {
    /// Server-side time per operation (indexed like [`TIMED_OPS`]).
    pub op_time: [OpTime; TIMED_OPS.len()],
    /// Requests received.
    pub requests: AtomicU64,
    /// Requests whose payload could not be decoded (answered negatively).
    pub malformed: AtomicU64,
    /// Requests of operations kvnode does not serve (answered negatively).
    pub unsupported: AtomicU64,
    /// Requests refused by the access check (answered negatively).
    pub refused: AtomicU64,
    /// Requests, errors (negative answers because the request was refused, over a limit,
    /// malformed, unsupported or failed) and latency per operation (index: `Op as usize`).
    /// Latency runs from the I/O thread's receipt to the reply, for requests executed (by a
    /// handler or inline on the I/O thread); trivial answers and refusals are counted, not
    /// timed.
    pub ops: OpTable<LM_OP_SLOTS>,
}

/// Slots of [`FrontendStats::ops`]: one per [`Op`] variant.
pub const LM_OP_SLOTS: usize = Op::Unsupported as usize + 1;

pub(super) struct Shared {
    pub(super) frontend: LmFrontend,
    replies: SegQueue<Vec<Vec<u8>>>,
    wake_tx: UnixStream,
    pub(super) handlers: Vec<Handler>,
    pub(super) stop: AtomicBool,
    pub(super) stats: FrontendStats,
    /// Rate limit of the refusal log lines.
    pub(super) refusal_log: LogLimit,
    started: std::time::Instant,
}

impl Shared {
    pub(super) fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Queues a reply for the I/O thread and wakes it.
    pub(super) fn push_reply(&self, frames: Vec<Vec<u8>>) {
        self.replies.push(frames);
        // A full socket buffer means a wake-up is already pending: ignore WouldBlock.
        let _ = (&self.wake_tx).write(&[1]);
    }
}

/// A running LMCache frontend. Stop it with [`LmServer::shutdown`].
pub struct LmServer {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    /// Ends the countdowns of closed clients' instances (`None`: closes are not seen).
    sweeper: Option<super::frontend::DisconnectSweeper>,
    /// The endpoint actually bound (e.g. `tcp://127.0.0.1:5555`).
    pub endpoint: String,
}

impl LmServer {
    /// Binds a ROUTER on `tcp://host:port` and starts the I/O thread and `handlers` handler
    /// threads; `access` decides who may use it. A `host` that is not loopback is refused
    /// unless `access.allow_remote`.
    pub fn start(
        frontend: LmFrontend,
        host: &str,
        port: u16,
        handlers: usize,
        access: LmAccessOptions,
    ) -> Result<LmServer> {
        access::check_bind_host(host, access.allow_remote)?;
        let zctx = zmq::Context::new();
        let mut router = zctx
            .socket(zmq::ROUTER)
            .map_err(|e| Error::new(crate::ErrorKind::Io, format!("zmq socket: {e}")))?;
        // Before binding: every connection is then reported opened and closed.
        let sweeper = frontend.attach_router(&mut router);
        let _ = router.set_linger(0);
        let _ = router.set_ipv6(host.starts_with('['));
        // libzmq refuses larger messages before buffering them (hostile peers).
        let _ = router.set_maxmsgsize(MAX_REQUEST_BYTES as i64);
        let _ = router.set_sndhwm(100_000);
        let _ = router.set_rcvhwm(100_000);
        let endpoint = format!("tcp://{host}:{port}");
        router
            .bind(&endpoint)
            .map_err(|e| Error::new(crate::ErrorKind::Io, format!("binding {endpoint}: {e}")))?;
        // The port actually bound (port 0 picks one).
        let bound_port = match router.get_last_endpoint() {
            Ok(Ok(e)) => e.rsplit(':').next().and_then(|p| p.parse().ok()),
            _ => None,
        }
        .unwrap_or(port);
        if access.allow_remote {
            tracing::warn!(
                %endpoint,
                "--allow-remote: peers on other machines cannot be identified; they are served as \
                 clients (data path, never CLEAR). Protect this port at the network level \
                 (firewall, private network)"
            );
        }
        let gate = PeerGate::new(access, bound_port);
        let (wake_rx, wake_tx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        let (per_client, per_handler) = (
            frontend.limits().queued_bytes_per_client,
            frontend.limits().queued_bytes_per_handler,
        );
        let shared = Arc::new(Shared {
            frontend,
            replies: SegQueue::new(),
            wake_tx,
            handlers: (0..handlers.max(1))
                .map(|_| Handler {
                    queue: Mutex::new(Turns::new(per_client, per_handler)),
                    thread: OnceLock::new(),
                })
                .collect(),
            stop: AtomicBool::new(false),
            stats: FrontendStats::default(),
            refusal_log: LogLimit::default(),
            started: std::time::Instant::now(),
        });
        let mut threads = Vec::new();
        for i in 0..shared.handlers.len() {
            let s = shared.clone();
            threads.push(
                thread::Builder::new()
                    .name(format!("kvnode-lmcache-{i}"))
                    .spawn(move || handler::run_handler(&s, i))?,
            );
        }
        let s = shared.clone();
        threads.push(
            thread::Builder::new()
                .name("kvnode-lmcache-io".into())
                .spawn(move || run_io(&s, router, wake_rx, zctx, gate))?,
        );
        tracing::info!(%endpoint, handlers = shared.handlers.len(), "LMCache frontend listening");
        Ok(LmServer {
            shared,
            threads,
            sweeper,
            endpoint,
        })
    }

    /// Frontend counters.
    pub fn stats(&self) -> &FrontendStats {
        &self.shared.stats
    }

    /// A read-only handle on the frontend's counters and queues for as long as the holder
    /// wants them (metrics); it keeps the counters alive, not the threads.
    pub fn probe(&self) -> LmProbe {
        LmProbe(self.shared.clone())
    }

    /// Stops the threads and closes the socket; logs the counters and the server-side time per
    /// operation.
    pub fn shutdown(self) {
        let st = &self.shared.stats;
        let fc = self.shared.frontend.counters();
        tracing::info!(
            requests = st.requests.load(Ordering::Relaxed),
            malformed = st.malformed.load(Ordering::Relaxed),
            unsupported = st.unsupported.load(Ordering::Relaxed),
            refused = st.refused.load(Ordering::Relaxed),
            inline = fc.inline_requests.load(Ordering::Relaxed),
            queue_refused = fc.queue_refused.load(Ordering::Relaxed),
            over_limit = fc.over_limit.load(Ordering::Relaxed),
            not_owner = fc.not_owner.load(Ordering::Relaxed),
            register_refused = fc.register_refused.load(Ordering::Relaxed),
            takeovers = fc.takeovers.load(Ordering::Relaxed),
            long_request_ids = fc.long_request_ids.load(Ordering::Relaxed),
            sessions_dropped = fc.sessions_dropped.load(Ordering::Relaxed),
            hash_mismatches = fc.hash_mismatches.load(Ordering::Relaxed),
            "LMCache frontend stopping"
        );
        for (op, t) in TIMED_OPS.iter().zip(&self.shared.stats.op_time) {
            let n = t.count.load(Ordering::Relaxed);
            if n > 0 {
                tracing::info!(
                    op = ?op,
                    calls = n,
                    mean_us = t.total_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1000.0,
                    max_us = t.max_ns.load(Ordering::Relaxed) as f64 / 1000.0,
                    "LMCache frontend server-side time"
                );
            }
        }
        self.shared.stop.store(true, Ordering::Release);
        let _ = (&self.shared.wake_tx).write(&[1]);
        for h in &self.shared.handlers {
            if let Some(t) = h.thread.get() {
                t.unpark();
            }
        }
        for t in self.threads {
            let _ = t.join();
        }
        if let Some(sw) = self.sweeper {
            sw.stop();
        }
    }
}

/// Read-only view of a running (or stopped) frontend's counters, from [`LmServer::probe`].
/// Reading never blocks a request for longer than one handler queue's push or pop.
pub struct LmProbe(Arc<Shared>);

impl LmProbe {
    /// The server's counters (requests, refusals, per-operation figures).
    pub fn stats(&self) -> &FrontendStats {
        &self.0.stats
    }

    /// The frontend's counters (budgets' refusals, queued bytes).
    pub fn frontend(&self) -> &LmFrontend {
        &self.0.frontend
    }

    /// Requests waiting for a handler thread now, summed over the handlers (each queue's lock
    /// is taken in turn, for a length read).
    pub fn queued_requests(&self) -> usize {
        self.0.handlers.iter().map(|h| h.queue.lock().len()).sum()
    }
}

fn handler_for(identity: &[u8], n: usize) -> usize {
    let mut h = DefaultHasher::new();
    identity.hash(&mut h);
    (h.finish() % n as u64) as usize
}

fn run_io(
    s: &Shared,
    router: zmq::Socket,
    mut wake_rx: UnixStream,
    _zctx: zmq::Context,
    mut gate: PeerGate,
) {
    let wake_fd = wake_rx.as_raw_fd();
    let mut sink = [0u8; 256];
    while !s.stop.load(Ordering::Acquire) {
        let (readable, woken) = {
            let mut items = [
                router.as_poll_item(zmq::POLLIN),
                zmq::PollItem::from_fd(wake_fd, zmq::POLLIN),
            ];
            if let Err(e) = zmq::poll(&mut items, 200) {
                tracing::warn!(error = %e, "zmq poll failed");
                continue;
            }
            (items[0].is_readable(), items[1].is_readable())
        };
        if woken {
            while matches!(wake_rx.read(&mut sink), Ok(n) if n > 0) {}
        }
        if readable {
            // Drain what is there without blocking.
            for _ in 0..1024 {
                match access::recv_request(&router) {
                    Ok((frames, source)) => {
                        if access::is_notification(&frames, &source) {
                            s.frontend.connection_notice(&frames[0]);
                            continue;
                        }
                        let peer = gate.peer(source);
                        let reply = match accept(s, frames, &mut gate, peer) {
                            Some(Route::Inline(req)) => handler::execute(s, req),
                            Some(Route::Reply(frames)) => frames,
                            None => continue,
                        };
                        // Replies the handlers queued go first: one of them may be this
                        // connection's previous answer.
                        send_replies(s, &router);
                        send_reply(&router, reply);
                    }
                    Err(zmq::Error::EAGAIN) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "zmq receive failed");
                        break;
                    }
                }
            }
        }
        send_replies(s, &router);
    }
}

/// Sends every reply the handlers queued.
fn send_replies(s: &Shared, router: &zmq::Socket) {
    while let Some(frames) = s.replies.pop() {
        send_reply(router, frames);
    }
}

fn send_reply(router: &zmq::Socket, frames: Vec<Vec<u8>>) {
    if let Err(e) = router.send_multipart(frames, 0) {
        tracing::debug!(error = %e, "reply to a vanished LMCache client dropped");
    }
}

/// What the I/O thread does with a request [`accept`] did not queue for a handler.
enum Route {
    /// Send this answer now.
    Reply(Vec<Vec<u8>>),
    /// Run it now (small, and its connection has nothing queued or running).
    Inline(Incoming),
}

/// Routes one multipart request from `peer`: requests `peer` may not make are answered
/// negatively, trivial SYNC requests are answered here, a small request whose connection is
/// idle on its handler is run by the I/O thread, the rest go to the identity's handler thread
/// (`None`; requests without uid/type frames cannot be answered and are dropped).
fn accept(
    s: &Shared,
    mut frames: Vec<Vec<u8>>,
    gate: &mut PeerGate,
    peer: LmPeer,
) -> Option<Route> {
    let received = std::time::Instant::now();
    s.stats.requests.fetch_add(1, Ordering::Relaxed);
    if frames.len() < 3 {
        // Without uid and type frames there is nothing to echo: the client cannot be answered.
        tracing::warn!(
            frames = frames.len(),
            "LMCache request without uid/type frames dropped"
        );
        s.stats.malformed.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    let payload = frames.split_off(3);
    let typ = frames.pop().expect("len >= 3");
    let uid = frames.pop().expect("len >= 2");
    let identity = frames.pop().expect("len >= 1");
    let total: usize = payload.iter().map(Vec::len).sum();
    let (op, name) = match wire::parse_op(&typ) {
        Ok(x) => x,
        Err(e) => {
            // An undecodable type: answer with the bare prefix (the client resolves None).
            tracing::warn!(error = %e, "LMCache request with an undecodable type frame");
            s.stats.malformed.fetch_add(1, Ordering::Relaxed);
            return Some(Route::Reply(vec![identity, uid, typ]));
        }
    };
    if !access::permits(peer.role, op) {
        gate.note_refusal(&peer, &name);
        s.stats.refused.fetch_add(1, Ordering::Relaxed);
        s.stats.ops.count(op as usize, true);
        let reply = access::refusal(op).unwrap_or_else(|| s.frontend.stateless_reply(op));
        return respond(identity.into(), uid, typ, reply);
    }
    let quick = match op {
        Op::GetChunkSize | Op::Noop | Op::GetExperimental if payload.is_empty() => {
            s.frontend.stateless_reply(op)
        }
        _ => None,
    };
    if let Some(reply) = quick {
        s.stats.ops.count(op as usize, false);
        return Some(Route::Reply(vec![identity, uid, typ, reply]));
    }
    if total > MAX_REQUEST_BYTES {
        tracing::warn!(op = %name, bytes = total, "LMCache request larger than the limit: refused");
        s.stats.malformed.fetch_add(1, Ordering::Relaxed);
        s.stats.ops.count(op as usize, true);
        return respond(identity.into(), uid, typ, s.frontend.stateless_reply(op));
    }
    let h = handler_for(&identity, s.handlers.len());
    let identity: Arc<[u8]> = identity.into();
    let req = Incoming {
        identity: identity.clone(),
        // The kernel's owner of the peer's socket (`None`: a remote peer, not identified).
        peer_uid: peer.uid,
        stamp: s.frontend.connection_stamp(),
        uid,
        typ,
        op,
        name,
        payload,
        received,
    };
    if handler::runs_inline(op, total, s.frontend.lookups_may_wait())
        && s.handlers[h].queue.lock().idle_for(&identity)
    {
        // Nothing of this connection is queued or running, and only this thread queues: the
        // request cannot overtake one of its connection's earlier ones.
        s.frontend
            .counters()
            .inline_requests
            .fetch_add(1, Ordering::Relaxed);
        return Some(Route::Inline(req));
    }
    let bytes = req.queued_bytes();
    let queued = &s.frontend.counters().queued_bytes;
    // Only this (the I/O) thread adds to the gauge, so the check and the add below cannot be
    // overtaken: the node-wide bound holds whatever the number of handlers.
    let over_node = queued.load(Ordering::Relaxed) + bytes > s.frontend.limits().queued_bytes_total;
    let pushed = if over_node {
        Err((req, super::turns::Refusal::NodeBytes))
    } else {
        // The gauge moves under the queue's lock, so it never runs below what is queued.
        let mut q = s.handlers[h].queue.lock();
        let r = q.push(&identity, req);
        if r.is_ok() {
            queued.fetch_add(bytes, Ordering::Relaxed);
        }
        r
    };
    match pushed {
        Ok(()) => {
            if let Some(t) = s.handlers[h].thread.get() {
                t.unpark();
            }
            None
        }
        Err((req, why)) => {
            s.frontend
                .counters()
                .queue_refused
                .fetch_add(1, Ordering::Relaxed);
            s.stats.ops.count(req.op as usize, true);
            if let Some(suppressed) = s.refusal_log.allow(s.now_ms()) {
                tracing::warn!(
                    op = %req.name,
                    bytes = req.queued_bytes(),
                    budget = why.budget(),
                    suppressed,
                    "LMCache request refused: its handler's queue is at a budget; answering negatively"
                );
            }
            respond(
                req.identity,
                req.uid,
                req.typ,
                s.frontend.stateless_reply(req.op),
            )
        }
    }
}

/// The I/O thread's answer `reply` to a request.
fn respond(
    identity: Arc<[u8]>,
    uid: Vec<u8>,
    typ: Vec<u8>,
    reply: Option<Vec<u8>>,
) -> Option<Route> {
    let mut frames = vec![identity.to_vec(), uid, typ];
    frames.extend(reply);
    Some(Route::Reply(frames))
}
