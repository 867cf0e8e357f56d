//! [`TcpFabric`]: the [`Fabric`] over TCP data streams, with two engines.
//!
//! A connection is the duplicate of an authenticated control connection's socket. The node sends
//! the request/reply headers itself and posts the payload: *Pull* receives exactly the batch's
//! bytes from the stream, in item order, straight into the pool ranges; *Push* sends the pool
//! ranges' bytes in item order. Ops of one connection run one after the other in post order;
//! connections run concurrently.
//!
//! Engines ([`TcpEngine`]):
//! - `Uring` (`tcp_uring.rs`): `rings` io_uring instances, one thread each; connections are
//!   spread round-robin. Pull = `Recv` (`MSG_WAITALL`), Push = `SendZc` (pool registered as fixed
//!   buffers when possible) for items of at least `zc_min_bytes`, `Send` below.
//! - `Plain` (`tcp_plain.rs`): `rings` threads doing `poll(2)` + `recv`/`send` with
//!   `MSG_DONTWAIT` straight into / out of the pool (the CPU-per-GB comparison path and the
//!   fallback where io_uring is unavailable).
//!
//! Neither engine depends on the socket's blocking mode or `SO_RCVTIMEO` (the node's reader
//! shares them through its own duplicate).
//!
//! **Memory rule:** an op's completion is queued only once the kernel can no longer touch its
//! pool ranges: every request of it has completed (a cancelled one too) and, for `SendZc`, every
//! notification has been reaped. Any failure leaves the stream out of step: the connection is
//! marked broken (later posts answer `ConnGone`, queued ops complete `Flushed`) until the node
//! tears it down.

use std::os::fd::AsRawFd;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use super::tcp_core::ZcCounters;
use super::tcp_core::{is_stream_socket, Cmd, Core, Job, Mailbox, CONN_ID_MASK, PIECE_BYTES};
use super::types::{
    Completion, ConnId, ConnSetup, FabricKind, FabricStats, OpId, PendingQp, PostBatch, PostError,
    RdmaEndpoint, RegionId, RemoteSeg,
};
use super::Fabric;
use crate::{HwError, HwResult, SharedPool};

/// Default number of io_uring rings (plain engine: threads).
pub const TCP_DEFAULT_RINGS: usize = 2;

/// Most rings (threads) a TCP fabric may have.
pub const TCP_MAX_RINGS: usize = 64;

/// Default bound on ops in flight (posted, not yet returned by `poll`).
pub const TCP_DEFAULT_MAX_INFLIGHT_OPS: usize = 1024;

/// Largest accepted `max_inflight_ops` (each op in flight holds its item list in memory).
pub const TCP_MAX_INFLIGHT_OPS: usize = 1 << 16;

/// Default smallest item sent with `SendZc` (smaller ones are copied by a plain `Send`).
pub const TCP_ZC_MIN_BYTES: usize = 16 << 10;

/// Most items in one batch (the batch's item list is copied into the fabric).
pub const TCP_MAX_ITEMS_PER_BATCH: usize = 1 << 16;

/// Size of the registered pieces of the pool (`RegionId`s); ranges may span pieces.
pub const TCP_REGION_BYTES: u64 = PIECE_BYTES;

/// Which TCP engine moves the bytes.
///
/// Invariant: plain tag; [`TcpEngine::as_str`] is the stable name (`remote.tcp_engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TcpEngine {
    /// io_uring `Recv` / `SendZc` / `Send`.
    #[default]
    Uring,
    /// `poll(2)` + `recv`/`send` with `MSG_DONTWAIT` on worker threads.
    Plain,
}

impl TcpEngine {
    /// `"uring"` or `"plain"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TcpEngine::Uring => "uring",
            TcpEngine::Plain => "plain",
        }
    }

    /// The engine named `s` (`"uring"` or `"plain"`), or `None`.
    pub fn parse(s: &str) -> Option<TcpEngine> {
        match s {
            "uring" => Some(TcpEngine::Uring),
            "plain" => Some(TcpEngine::Plain),
            _ => None,
        }
    }
}

impl std::fmt::Display for TcpEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How to build a [`TcpFabric`].
///
/// Invariant: validated by [`TcpFabric::new`]: `1 <= rings <= TCP_MAX_RINGS`,
/// `1 <= max_inflight_ops <= TCP_MAX_INFLIGHT_OPS`.
#[derive(Debug, Clone)]
pub struct TcpFabricOptions {
    /// Which engine.
    pub engine: TcpEngine,
    /// io_uring rings, each with its own thread (plain engine: worker threads); connections are
    /// spread round-robin.
    pub rings: usize,
    /// Bound on ops in flight; beyond it `post` answers `Full`.
    pub max_inflight_ops: usize,
    /// Uring engine: Push items of at least this many bytes use `SendZc` (0: all of them).
    pub zc_min_bytes: usize,
    /// Uring engine: register the pool as io_uring fixed buffers (default true; when the
    /// registration fails, e.g. `RLIMIT_MEMLOCK`, the engine goes on without, with a warning).
    pub register_buffers: bool,
}

impl Default for TcpFabricOptions {
    fn default() -> Self {
        TcpFabricOptions {
            engine: TcpEngine::Uring,
            rings: TCP_DEFAULT_RINGS,
            max_inflight_ops: TCP_DEFAULT_MAX_INFLIGHT_OPS,
            zc_min_bytes: TCP_ZC_MIN_BYTES,
            register_buffers: true,
        }
    }
}

struct Worker {
    mbox: Arc<Mailbox>,
    thread: Option<JoinHandle<()>>,
}

/// The TCP [`Fabric`] (io_uring or plain engine).
///
/// Invariant: every accepted op is returned by `poll` exactly once, and only when the kernel no
/// longer touches its pool ranges; ops of a connection move their bytes in post order; after
/// `teardown(conn)` every op of `conn` is returned before its single `TEARDOWN_DONE`, and the
/// socket is closed before that. Dropping the fabric tears every connection down and waits for
/// the kernel (if it cannot drain in time, the ring and the pool are leaked, never freed under
/// the kernel).
pub struct TcpFabric {
    opts: TcpFabricOptions,
    core: Arc<Core>,
    workers: Vec<Worker>,
    /// Serialises `register` (which waits for the workers without holding the core lock).
    register_lock: Mutex<()>,
}

impl std::fmt::Debug for TcpFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpFabric")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl TcpFabric {
    /// Starts the engine's threads (uring: sets up the rings first).
    ///
    /// Errors: `Invalid` for options outside their bounds; `Os` when io_uring (or an eventfd, or
    /// a thread) cannot be set up.
    pub fn new(opts: TcpFabricOptions) -> HwResult<TcpFabric> {
        if opts.rings == 0 || opts.rings > TCP_MAX_RINGS {
            return Err(HwError::Invalid(format!(
                "tcp fabric: rings = {} is not in 1..={TCP_MAX_RINGS}",
                opts.rings
            )));
        }
        if opts.max_inflight_ops == 0 || opts.max_inflight_ops > TCP_MAX_INFLIGHT_OPS {
            return Err(HwError::Invalid(format!(
                "tcp fabric: max_inflight_ops = {} is not in 1..={TCP_MAX_INFLIGHT_OPS}",
                opts.max_inflight_ops
            )));
        }
        let core = Arc::new(Core::new());
        let mut fabric = TcpFabric {
            opts: opts.clone(),
            core: core.clone(),
            workers: Vec::new(),
            register_lock: Mutex::new(()),
        };
        for i in 0..opts.rings {
            let mbox = Arc::new(Mailbox::new()?);
            let thread = match opts.engine {
                TcpEngine::Uring => super::tcp_uring::spawn(i, core.clone(), mbox.clone(), &opts)?,
                TcpEngine::Plain => super::tcp_plain::spawn(i, core.clone(), mbox.clone())?,
            };
            fabric.workers.push(Worker {
                mbox,
                thread: Some(thread),
            });
        }
        tracing::info!(
            engine = opts.engine.as_str(),
            rings = opts.rings,
            max_inflight_ops = opts.max_inflight_ops,
            zc_min_bytes = opts.zc_min_bytes,
            "tcp fabric started"
        );
        Ok(fabric)
    }

    /// The engine in use.
    pub fn engine(&self) -> TcpEngine {
        self.opts.engine
    }

    /// Whether the pool is registered as io_uring fixed buffers on every ring (false before
    /// `register`, for the plain engine, and when the registration failed: `SendZc` then runs
    /// without `buf_index`).
    pub fn registered_buffers(&self) -> bool {
        self.core.lock().fixed_buffers
    }

    /// The uring engine's zero-copy counters (all zero for the plain engine).
    pub fn zc_counters(&self) -> ZcCounters {
        self.core.zc()
    }

    fn validate(&self, pool_len: u64, batch: &PostBatch<'_>) -> Result<(), PostError> {
        let invalid = |m: String| Err(PostError::Invalid(m));
        if batch.op == OpId::TEARDOWN_DONE {
            return invalid("op id TEARDOWN_DONE is reserved".into());
        }
        if batch.items.is_empty() {
            return invalid("batch has no items".into());
        }
        if batch.items.len() > TCP_MAX_ITEMS_PER_BATCH {
            return invalid(format!(
                "batch has {} items, more than TCP_MAX_ITEMS_PER_BATCH = {TCP_MAX_ITEMS_PER_BATCH}",
                batch.items.len()
            ));
        }
        for (i, item) in batch.items.iter().enumerate() {
            if item.local.len == 0 {
                return invalid(format!("item {i}: empty local range"));
            }
            let Some(end) = item.local.end() else {
                return invalid(format!("item {i}: local range overflows"));
            };
            if end > pool_len {
                return invalid(format!(
                    "item {i}: local range [{}, {end}) is not inside the registered pool of \
                     {pool_len} bytes",
                    item.local.offset
                ));
            }
            if item.remote != RemoteSeg::Stream {
                return invalid(format!(
                    "item {i}: the tcp fabric moves only stream segments"
                ));
            }
        }
        super::types::check_disjoint(batch.items)?;
        Ok(())
    }
}

impl Fabric for TcpFabric {
    fn kind(&self) -> FabricKind {
        FabricKind::Tcp
    }

    fn register(&self, pool: &Arc<SharedPool>) -> HwResult<Vec<RegionId>> {
        let _serial = self.register_lock.lock().unwrap_or_else(|p| p.into_inner());
        {
            let st = self.core.lock();
            if let Some(p) = &st.pool {
                if !Arc::ptr_eq(p, pool) {
                    return Err(HwError::Invalid(
                        "tcp fabric: register given another pool than the first one".into(),
                    ));
                }
                return Ok(st.regions.clone());
            }
        }
        let npieces = pool.len().div_ceil(PIECE_BYTES);
        let Ok(npieces) = u16::try_from(npieces) else {
            return Err(HwError::Invalid(format!(
                "tcp fabric: a pool of {} bytes needs {npieces} fixed buffers (at most {})",
                pool.len(),
                u16::MAX
            )));
        };
        // Registration happens on each worker's thread (it owns its ring); no op can be in
        // flight yet (post refuses until the pool is set below).
        let mut fixed = true;
        for w in &self.workers {
            let (tx, rx) = mpsc::channel();
            w.mbox.send(Cmd::Register {
                pool: pool.clone(),
                reply: tx,
            });
            fixed &= rx
                .recv()
                .map_err(|_| HwError::Invalid("tcp fabric: a worker thread is gone".into()))?;
        }
        let fixed = fixed && self.opts.engine == TcpEngine::Uring;
        let regions: Vec<RegionId> = (0..u32::from(npieces)).map(RegionId).collect();
        let mut st = self.core.lock();
        st.pool = Some(pool.clone());
        st.regions = regions.clone();
        st.fixed_buffers = fixed;
        Ok(regions)
    }

    fn prepare_endpoint(&self) -> HwResult<Option<(PendingQp, RdmaEndpoint)>> {
        Ok(None)
    }

    fn connect(&self, setup: ConnSetup) -> HwResult<ConnId> {
        let ConnSetup::Tcp(fd) = setup else {
            return Err(HwError::Invalid(
                "tcp fabric accepts only ConnSetup::Tcp".into(),
            ));
        };
        if !is_stream_socket(fd.as_raw_fd()) {
            return Err(HwError::Invalid(
                "tcp fabric: the descriptor is not a stream socket".into(),
            ));
        }
        let mut st = self.core.lock();
        if st.next_conn >= CONN_ID_MASK {
            return Err(HwError::Invalid(
                "tcp fabric: connection ids exhausted".into(),
            ));
        }
        st.next_conn += 1;
        let conn = ConnId(st.next_conn);
        let worker = st.next_worker % self.workers.len();
        st.next_worker = st.next_worker.wrapping_add(1);
        st.conns.insert(
            conn,
            super::tcp_core::CoreConn {
                worker,
                broken: false,
                tearing: false,
            },
        );
        // Under the core lock: the connection reaches its worker before any post of it.
        self.workers[worker].mbox.push(Cmd::AddConn { conn, fd });
        drop(st);
        self.workers[worker].mbox.wake();
        Ok(conn)
    }

    fn post(&self, batch: PostBatch<'_>) -> Result<(), PostError> {
        let mut st = self.core.lock();
        let Some(pool_len) = st.pool.as_ref().map(|p| p.len()) else {
            return Err(PostError::Invalid("no pool registered".into()));
        };
        self.validate(pool_len, &batch)?;
        let worker = match st.conns.get(&batch.conn) {
            Some(c) if !c.broken && !c.tearing => c.worker,
            _ => return Err(PostError::ConnGone),
        };
        if st.inflight.contains_key(&batch.op) {
            return Err(PostError::Invalid(format!(
                "op id {} is already in flight",
                batch.op.0
            )));
        }
        if st.inflight.len() >= self.opts.max_inflight_ops {
            return Err(PostError::Full);
        }
        let n = batch.items.len() as u64;
        st.inflight.insert(batch.op, n);
        st.stats.posted_ops += 1;
        st.stats.inflight_wr += n;
        // Under the core lock: a teardown of this connection is queued after this post.
        self.workers[worker].mbox.push(Cmd::Post(Job {
            op: batch.op,
            conn: batch.conn,
            dir: batch.dir,
            items: batch.items.iter().map(|w| w.local).collect(),
            deadline: batch.deadline,
        }));
        drop(st);
        self.workers[worker].mbox.wake();
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize, timeout: Duration) -> usize {
        if max == 0 {
            return 0;
        }
        let deadline = Instant::now() + timeout;
        let mut st = self.core.lock();
        while st.done.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                return 0;
            }
            st = self
                .core
                .ready()
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let mut n = 0;
        while n < max {
            let Some(c) = st.done.pop_front() else { break };
            if c.op != OpId::TEARDOWN_DONE {
                if let Some(items) = st.inflight.remove(&c.op) {
                    st.stats.inflight_wr -= items;
                }
                st.stats.completed_ops += 1;
                if c.result.is_err() {
                    st.stats.errors += 1;
                }
            }
            out.push(c);
            n += 1;
        }
        n
    }

    fn teardown(&self, conn: ConnId) {
        let mut st = self.core.lock();
        let worker = match st.conns.get_mut(&conn) {
            Some(c) if !c.tearing => {
                c.tearing = true;
                c.broken = true;
                c.worker
            }
            _ => return,
        };
        self.workers[worker].mbox.push(Cmd::Teardown(conn));
        drop(st);
        self.workers[worker].mbox.wake();
    }

    fn stats(&self) -> FabricStats {
        let st = self.core.lock();
        let mut s = st.stats;
        s.inflight_ops = s.posted_ops - s.completed_ops;
        s
    }
}

impl Drop for TcpFabric {
    fn drop(&mut self) {
        for w in &self.workers {
            w.mbox.send(Cmd::Stop);
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                if t.join().is_err() {
                    tracing::error!("tcp fabric: a worker thread panicked");
                }
            }
        }
    }
}
