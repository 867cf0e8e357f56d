//! The ZMQ side of the LMCache frontend.
//!
//! One I/O thread owns the ROUTER socket: it receives multipart requests
//! `[identity, uid, type, payload...]`, answers the trivial SYNC requests itself, and hands the
//! rest to handler threads chosen by the peer identity (so one client's requests run in order,
//! like LMCache's affinity pool, and different clients run in parallel). Handlers decode the
//! payload (never on the I/O thread: LMCache weak point P4), run the request, and queue the reply
//! `[identity, uid, type, (payload)]`; a byte on a socket pair wakes the I/O thread, which is
//! the only thread that writes to the ROUTER. Before routing, the I/O thread checks who sent
//! each request (`access`): refused peers, and clients asking for node-wide operations, get the
//! operation's negative answer there.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::Duration;

use crossbeam_queue::{ArrayQueue, SegQueue};

use super::access::{self, LmAccessOptions, LmPeer, PeerGate};
use super::frontend::LmFrontend;
use super::wire::{self, Op};
use crate::error::{Error, Result};

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
pub const HANDLER_QUEUE: usize = 4096;
/// Largest multipart request accepted (frames beyond it are refused, not decoded).
pub const MAX_REQUEST_BYTES: usize = 64 << 20;

/// One received request, routed to a handler.
struct Incoming {
    identity: Vec<u8>,
    uid: Vec<u8>,
    typ: Vec<u8>,
    op: Op,
    name: String,
    payload: Vec<Vec<u8>>,
}

struct Handler {
    queue: ArrayQueue<Incoming>,
    thread: OnceLock<Thread>,
}

/// Server-side time of one operation type (decode + execute + queue the reply), for isolating
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
}

struct Shared {
    frontend: LmFrontend,
    replies: SegQueue<Vec<Vec<u8>>>,
    wake_tx: UnixStream,
    handlers: Vec<Handler>,
    stop: AtomicBool,
    stats: FrontendStats,
}

impl Shared {
    fn push_reply(&self, frames: Vec<Vec<u8>>) {
        self.replies.push(frames);
        // A full socket buffer means a wake-up is already pending: ignore WouldBlock.
        let _ = (&self.wake_tx).write(&[1]);
    }
}

/// A running LMCache frontend. Stop it with [`LmServer::shutdown`].
pub struct LmServer {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
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
        let router = zctx
            .socket(zmq::ROUTER)
            .map_err(|e| Error::new(crate::ErrorKind::Io, format!("zmq socket: {e}")))?;
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
        let shared = Arc::new(Shared {
            frontend,
            replies: SegQueue::new(),
            wake_tx,
            handlers: (0..handlers.max(1))
                .map(|_| Handler {
                    queue: ArrayQueue::new(HANDLER_QUEUE),
                    thread: OnceLock::new(),
                })
                .collect(),
            stop: AtomicBool::new(false),
            stats: FrontendStats::default(),
        });
        let mut threads = Vec::new();
        for i in 0..shared.handlers.len() {
            let s = shared.clone();
            threads.push(
                thread::Builder::new()
                    .name(format!("kvnode-lmcache-{i}"))
                    .spawn(move || run_handler(&s, i))?,
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
            endpoint,
        })
    }

    /// Frontend counters.
    pub fn stats(&self) -> &FrontendStats {
        &self.shared.stats
    }

    /// Stops the threads and closes the socket; logs the counters and the server-side time per
    /// operation.
    pub fn shutdown(self) {
        let st = &self.shared.stats;
        tracing::info!(
            requests = st.requests.load(Ordering::Relaxed),
            malformed = st.malformed.load(Ordering::Relaxed),
            unsupported = st.unsupported.load(Ordering::Relaxed),
            refused = st.refused.load(Ordering::Relaxed),
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
                        let peer = gate.peer(source);
                        accept(s, frames, &mut gate, peer)
                    }
                    Err(zmq::Error::EAGAIN) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "zmq receive failed");
                        break;
                    }
                }
            }
        }
        while let Some(frames) = s.replies.pop() {
            if let Err(e) = router.send_multipart(frames, 0) {
                tracing::debug!(error = %e, "reply to a vanished LMCache client dropped");
            }
        }
    }
}

/// Routes one multipart request from `peer`: requests `peer` may not make are answered
/// negatively, trivial SYNC requests are answered here, the rest go to the identity's handler
/// thread.
fn accept(s: &Shared, mut frames: Vec<Vec<u8>>, gate: &mut PeerGate, peer: LmPeer) {
    s.stats.requests.fetch_add(1, Ordering::Relaxed);
    if frames.len() < 3 {
        // Without uid and type frames there is nothing to echo: the client cannot be answered.
        tracing::warn!(
            frames = frames.len(),
            "LMCache request without uid/type frames dropped"
        );
        s.stats.malformed.fetch_add(1, Ordering::Relaxed);
        return;
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
            s.push_reply(vec![identity, uid, typ]);
            return;
        }
    };
    if !access::permits(peer.role, op) {
        gate.note_refusal(&peer, &name);
        s.stats.refused.fetch_add(1, Ordering::Relaxed);
        let reply = access::refusal(op).unwrap_or_else(|| s.frontend.stateless_reply(op));
        respond(s, identity, uid, typ, reply);
        return;
    }
    let quick = match op {
        Op::GetChunkSize | Op::Noop | Op::GetExperimental if payload.is_empty() => {
            s.frontend.stateless_reply(op)
        }
        _ => None,
    };
    if let Some(reply) = quick {
        s.push_reply(vec![identity, uid, typ, reply]);
        return;
    }
    if total > MAX_REQUEST_BYTES {
        tracing::warn!(op = %name, bytes = total, "LMCache request larger than the limit: refused");
        s.stats.malformed.fetch_add(1, Ordering::Relaxed);
        respond(s, identity, uid, typ, s.frontend.stateless_reply(op));
        return;
    }
    let h = handler_for(&identity, s.handlers.len());
    let req = Incoming {
        identity,
        uid,
        typ,
        op,
        name,
        payload,
    };
    match s.handlers[h].queue.push(req) {
        Ok(()) => {
            if let Some(t) = s.handlers[h].thread.get() {
                t.unpark();
            }
        }
        Err(req) => {
            tracing::warn!(op = %req.name, "LMCache handler queue full: answering negatively");
            respond(
                s,
                req.identity,
                req.uid,
                req.typ,
                s.frontend.stateless_reply(req.op),
            );
        }
    }
}

fn respond(s: &Shared, identity: Vec<u8>, uid: Vec<u8>, typ: Vec<u8>, reply: Option<Vec<u8>>) {
    let mut frames = vec![identity, uid, typ];
    frames.extend(reply);
    s.push_reply(frames);
}

fn run_handler(s: &Shared, index: usize) {
    let h = &s.handlers[index];
    let _ = h.thread.set(thread::current());
    while !s.stop.load(Ordering::Acquire) {
        let Some(req) = h.queue.pop() else {
            thread::park_timeout(Duration::from_millis(200));
            continue;
        };
        let started = std::time::Instant::now();
        let payload: Vec<&[u8]> = req.payload.iter().map(Vec::as_slice).collect();
        let reply = match wire::decode_request(req.op, &req.name, &payload) {
            Ok(r) => {
                if matches!(r, wire::LmRequest::Unsupported { .. }) {
                    s.stats.unsupported.fetch_add(1, Ordering::Relaxed);
                }
                // A bug must not leave the client waiting for its whole timeout.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.frontend.handle(r)))
                    .unwrap_or_else(|_| {
                        tracing::error!(op = %req.name, "LMCache handler panicked (bug); answering negatively");
                        s.frontend.stateless_reply(req.op)
                    })
            }
            Err(e) => {
                tracing::warn!(op = %req.name, error = %e, "malformed LMCache request: answering negatively");
                s.stats.malformed.fetch_add(1, Ordering::Relaxed);
                s.frontend.stateless_reply(req.op)
            }
        };
        respond(s, req.identity, req.uid, req.typ, reply);
        if let Some(i) = TIMED_OPS.iter().position(|o| *o == req.op) {
            let ns = started.elapsed().as_nanos() as u64;
            let t = &s.stats.op_time[i];
            t.count.fetch_add(1, Ordering::Relaxed);
            t.total_ns.fetch_add(ns, Ordering::Relaxed);
            t.max_ns.fetch_max(ns, Ordering::Relaxed);
        }
    }
}
