//! The plain engine of [`TcpFabric`](super::TcpFabric): worker threads doing `poll(2)` and
//! `recv`/`send` with `MSG_DONTWAIT` straight into / out of the pool.
//!
//! The comparison path for CPU per GB and the fallback where io_uring is unavailable. Every
//! system call returns before the worker goes on, so nothing of an op is left in the kernel once
//! the worker stops working on it: a deadline or a teardown completes the op at once (`Deadline`
//! / `Flushed`) and its pool ranges are never touched again. A connection gets at most
//! [`TURN_BYTES`] per turn, so one large op does not starve the others on the thread.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::tcp_core::{errno_error, shutdown_socket, Cmd, Core, Job, Mailbox, OpRun};
use super::types::{ConnId, Dir, FabricError};
use crate::{HwError, HwResult, SharedPool};

/// Bytes one connection may move per turn of the worker loop before the others get theirs.
pub(super) const TURN_BYTES: u64 = 8 << 20;

/// Longest sleep without a deadline (the loop re-checks its state after it).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Starts worker `i`'s thread.
pub(super) fn spawn(i: usize, core: Arc<Core>, mbox: Arc<Mailbox>) -> HwResult<JoinHandle<()>> {
    let worker = PlainWorker {
        pool: None,
        core,
        mbox,
        conns: HashMap::new(),
        stopping: false,
    };
    std::thread::Builder::new()
        .name(format!("kvn-tcpf-plain{i}"))
        .spawn(move || worker.run())
        .map_err(|e| HwError::os("spawn tcp fabric thread", e))
}

struct PConn {
    fd: OwnedFd,
    queue: VecDeque<Job>,
    active: Option<OpRun>,
    broken: bool,
    /// The last call said `EAGAIN`: wait for `poll` to report the socket ready.
    waiting: bool,
}

struct PlainWorker {
    pool: Option<Arc<SharedPool>>,
    core: Arc<Core>,
    mbox: Arc<Mailbox>,
    conns: HashMap<ConnId, PConn>,
    stopping: bool,
}

impl PlainWorker {
    fn run(mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut who: Vec<ConnId> = Vec::new();
        loop {
            for cmd in self.mbox.take() {
                self.handle(cmd);
            }
            let now = Instant::now();
            let ids: Vec<ConnId> = self.conns.keys().copied().collect();
            let mut more = false;
            for id in ids {
                more |= self.drive(id, now);
            }
            if self.stopping && self.conns.is_empty() {
                break;
            }
            fds.clear();
            who.clear();
            fds.push(libc::pollfd {
                fd: self.mbox.wake_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            let mut next: Option<Instant> = None;
            for (&id, c) in &self.conns {
                let Some(run) = &c.active else { continue };
                next = Some(next.map_or(run.job.deadline, |n| n.min(run.job.deadline)));
                if c.waiting {
                    fds.push(libc::pollfd {
                        fd: c.fd.as_raw_fd(),
                        events: match run.job.dir {
                            Dir::Pull => libc::POLLIN,
                            Dir::Push => libc::POLLOUT,
                        },
                        revents: 0,
                    });
                    who.push(id);
                }
            }
            let timeout_ms: libc::c_int = if more {
                0
            } else {
                let wait = next
                    .map(|t| t.saturating_duration_since(Instant::now()))
                    .unwrap_or(IDLE_WAIT)
                    .min(IDLE_WAIT);
                // Round up: waking before the deadline would only spin.
                wait.as_micros().div_ceil(1000) as libc::c_int
            };
            // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfds.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    tracing::warn!(error = %e, "tcp fabric: poll failed");
                    std::thread::sleep(Duration::from_millis(1));
                }
                continue;
            }
            if fds[0].revents != 0 {
                self.mbox.clear_wake();
            }
            for (k, id) in who.iter().enumerate() {
                if fds[k + 1].revents != 0 {
                    if let Some(c) = self.conns.get_mut(id) {
                        c.waiting = false;
                    }
                }
            }
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::AddConn { conn, fd } => {
                self.conns.insert(
                    conn,
                    PConn {
                        fd,
                        queue: VecDeque::new(),
                        active: None,
                        broken: false,
                        waiting: false,
                    },
                );
                if self.stopping {
                    self.teardown(conn);
                }
            }
            Cmd::Register { pool, reply } => {
                self.pool = Some(pool);
                let _ = reply.send(false);
            }
            Cmd::Post(job) => match self.conns.get_mut(&job.conn) {
                Some(c) => c.queue.push_back(job),
                None => {
                    // Unreachable: a post is queued before its connection's teardown.
                    tracing::error!(
                        conn = job.conn.0,
                        "tcp fabric: post for an unknown connection"
                    );
                    self.core.finish(&job, Err(FabricError::Flushed), 0);
                }
            },
            Cmd::Teardown(conn) => self.teardown(conn),
            Cmd::Stop => {
                self.stopping = true;
                let ids: Vec<ConnId> = self.conns.keys().copied().collect();
                for id in ids {
                    self.teardown(id);
                }
            }
        }
    }

    /// Nothing of the connection is in the kernel between two calls: flush, close, report.
    fn teardown(&mut self, conn: ConnId) {
        let Some(mut c) = self.conns.remove(&conn) else {
            return;
        };
        // Only ops in flight need the socket cut; an idle connection's descriptor is just
        // closed, so the node's own descriptor still delivers its last replies.
        if c.active.is_some() || !c.queue.is_empty() {
            shutdown_socket(c.fd.as_raw_fd());
        }
        if let Some(run) = c.active.take() {
            self.core
                .finish(&run.job, Err(FabricError::Flushed), run.moved());
        }
        for job in c.queue.drain(..) {
            self.core.finish(&job, Err(FabricError::Flushed), 0);
        }
        drop(c); // closes the socket
        self.core.teardown_done(conn);
    }

    /// Moves `id`'s bytes until the socket would block, its ops run out, or its turn's
    /// [`TURN_BYTES`] are used (then returns true: more can be done without waiting).
    fn drive(&mut self, id: ConnId, now: Instant) -> bool {
        let Self {
            conns, core, pool, ..
        } = self;
        let Some(c) = conns.get_mut(&id) else {
            return false;
        };
        let mut budget = TURN_BYTES;
        loop {
            if c.active.is_none() {
                let Some(job) = c.queue.pop_front() else {
                    return false;
                };
                if c.broken {
                    core.finish(&job, Err(FabricError::Flushed), 0);
                    continue;
                }
                c.active = Some(OpRun::new(job));
                c.waiting = false;
            }
            let run = c.active.as_mut().expect("set above");
            let fail = if now >= run.job.deadline {
                Some(FabricError::Deadline)
            } else if c.waiting {
                return false;
            } else if let Some(base) = pool.as_ref().map(|p| p.region().as_ptr()) {
                match Self::io_once(c.fd.as_raw_fd(), base, run, budget) {
                    Ok(0) => Some(FabricError::PeerGone),
                    Ok(n) => {
                        run.advance(n);
                        budget = budget.saturating_sub(n);
                        if !run.is_done() {
                            if budget == 0 {
                                return true;
                            }
                            continue;
                        }
                        None
                    }
                    Err(libc::EAGAIN) => {
                        c.waiting = true;
                        return false;
                    }
                    Err(libc::EINTR) => continue,
                    Err(errno) => Some(errno_error(
                        match run.job.dir {
                            Dir::Pull => "recv",
                            Dir::Push => "send",
                        },
                        errno,
                    )),
                }
            } else {
                // Unreachable: post refuses until the pool is registered.
                Some(FabricError::Local("no pool registered".into()))
            };
            let run = c.active.take().expect("set above");
            let moved = run.moved();
            match fail {
                None => core.finish(&run.job, Ok(moved), moved),
                Some(e) => {
                    c.broken = true;
                    core.finish(&run.job, Err(e), moved);
                }
            }
        }
    }

    /// One non-blocking `recv` / `send` of at most `budget` bytes of the op's next I/O: the byte
    /// count, or the errno.
    fn io_once(fd: i32, base: *mut u8, run: &OpRun, budget: u64) -> Result<u64, i32> {
        let io = run.next_io().expect("op not done");
        let len = io.len.min(budget.max(1)) as usize;
        // SAFETY: post validated offset + len <= pool length, so the range lies inside the live
        // mapping (held by this worker's pool); the kernel writes (recv) or reads (send) it only
        // during this call, and the op's range is reserved for this fabric until its completion.
        let r = unsafe {
            let ptr = base.add(io.offset as usize);
            match run.job.dir {
                Dir::Pull => libc::recv(fd, ptr.cast(), len, libc::MSG_DONTWAIT),
                Dir::Push => {
                    libc::send(fd, ptr.cast(), len, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
                }
            }
        };
        if r < 0 {
            Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO))
        } else {
            Ok(r as u64)
        }
    }
}
