//! The io_uring engine of [`TcpFabric`](super::TcpFabric): one ring per thread.
//!
//! Per connection one data request (`Recv` / `Send` / `SendZc`, `MSG_WAITALL`) is in flight at
//! a time, so the stream's bytes go in item order; a short result is continued with the rest.
//! The thread sleeps in `io_uring_enter` until a completion, a command (an eventfd watched by a
//! `PollAdd`) or the nearest timer (an op's deadline, a repeated cancel).
//!
//! An op is finished only when nothing of it is left in the kernel: no data request awaiting its
//! result, no `SendZc` notification outstanding (`IORING_CQE_F_MORE` on a result announces one),
//! no `AsyncCancel` of it in flight. A deadline or a teardown marks the op failed and cancels its
//! data request (again every [`RECANCEL_EVERY`] while it is still there); the completion is
//! queued after the last of those CQEs. Only then can the caller reuse the pool ranges.
//!
//! A zero-copy Push that misses its deadline also shuts the socket down: the kernel keeps the
//! pages until the peer acknowledges the data, which a stalled peer never does; only an aborted
//! connection (`TCP_USER_TIMEOUT`, see `shutdown_socket`) releases them in bounded time.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use super::tcp::TcpFabricOptions;
use super::tcp_core::{
    errno_error, shutdown_socket, Cmd, Core, Job, Mailbox, OpRun, CONN_ID_MASK, PIECE_BYTES,
};
use super::types::{ConnId, Dir, FabricError};
use crate::{HwError, HwResult, SharedPool};

/// Submission queue entries per ring.
const RING_ENTRIES: u32 = 256;

/// Completion queue entries per ring (notifications come on top of results).
const CQ_ENTRIES: u32 = 4096;

/// How often a failed op's data request is cancelled again while it is still in the kernel.
pub(super) const RECANCEL_EVERY: Duration = Duration::from_millis(100);

/// Longest sleep without a timer (the loop re-checks its state after it).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// How long a dropped fabric waits for the kernel to finish its ops before it leaks the ring and
/// the pool (never freeing memory the kernel may still use).
const STOP_DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// Consecutive failed `io_uring_enter` calls before the process aborts (it can no longer reap
/// requests that may write into the pool).
const MAX_ENTER_FAILURES: u32 = 1000;

/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel copied after all.
const SEND_ZC_REPORT_USAGE: u16 = 8;

/// `IORING_NOTIF_USAGE_ZC_COPIED` in a notification's result.
const NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;

const KIND_SHIFT: u32 = 56;
const KIND_DATA: u64 = 1;
const KIND_CANCEL: u64 = 2;
const KIND_WAKE: u64 = 3;

fn user_data(kind: u64, conn: ConnId) -> u64 {
    (kind << KIND_SHIFT) | (conn.0 & CONN_ID_MASK)
}

/// Starts ring `i`'s thread.
pub(super) fn spawn(
    i: usize,
    core: Arc<Core>,
    mbox: Arc<Mailbox>,
    opts: &TcpFabricOptions,
) -> HwResult<JoinHandle<()>> {
    let ring = IoUring::<squeue::Entry, cqueue::Entry>::builder()
        .setup_cqsize(CQ_ENTRIES)
        .build(RING_ENTRIES)
        .map_err(|e| HwError::os("io_uring_setup", e))?;
    let worker = UringWorker {
        ring,
        pool: None,
        core,
        mbox,
        zc_min: opts.zc_min_bytes as u64,
        want_fixed: opts.register_buffers,
        fixed: false,
        conns: HashMap::new(),
        sqes: VecDeque::new(),
        wake_armed: false,
        stopping: None,
    };
    std::thread::Builder::new()
        .name(format!("kvn-tcpf-uring{i}"))
        .spawn(move || worker.run())
        .map_err(|e| HwError::os("spawn tcp fabric thread", e))
}

/// The op running on a connection.
struct Active {
    run: OpRun,
    failed: Option<FabricError>,
    /// A data request awaits its result CQE.
    data_out: bool,
    /// `SendZc` notifications still to come.
    notifs: u32,
    /// `AsyncCancel` requests in flight.
    cancels: u32,
    last_cancel: Option<Instant>,
    /// A `SendZc` of this op was issued.
    zc_used: bool,
}

impl Active {
    /// Whether the deadline still applies: bytes left to move, or pages the kernel still holds.
    fn timed(&self) -> bool {
        self.failed.is_none() && (!self.run.is_done() || self.notifs > 0)
    }
}

struct UConn {
    fd: OwnedFd,
    queue: VecDeque<Job>,
    active: Option<Active>,
    broken: bool,
    tearing: bool,
    /// The kernel reported that it copied a zero-copy send of this connection anyway (the
    /// peer is on this host: loopback, veth): later sends are plain copies, which cost less
    /// than a zero-copy send that copies and notifies.
    zc_copies: bool,
}

struct UringWorker {
    // Field order is drop order: the ring (and its buffer registration) before the pool.
    ring: IoUring<squeue::Entry, cqueue::Entry>,
    pool: Option<Arc<SharedPool>>,
    core: Arc<Core>,
    mbox: Arc<Mailbox>,
    zc_min: u64,
    want_fixed: bool,
    /// The pool is registered as fixed buffers on this ring.
    fixed: bool,
    conns: HashMap<ConnId, UConn>,
    /// Entries not yet in the submission queue (it was full), in order.
    sqes: VecDeque<squeue::Entry>,
    wake_armed: bool,
    stopping: Option<Instant>,
}

impl UringWorker {
    fn run(mut self) {
        let mut failures = 0u32;
        loop {
            if !self.wake_armed {
                let e = opcode::PollAdd::new(types::Fd(self.mbox.wake_fd()), libc::POLLIN as u32)
                    .build()
                    .user_data(user_data(KIND_WAKE, ConnId(0)));
                self.sqes.push_back(e);
                self.wake_armed = true;
            }
            for cmd in self.mbox.take() {
                self.handle(cmd);
            }
            let now = Instant::now();
            let ids: Vec<ConnId> = self.conns.keys().copied().collect();
            for id in ids {
                self.drive(id, now);
            }
            if let Some(since) = self.stopping {
                if self.conns.is_empty() {
                    break;
                }
                if since.elapsed() > STOP_DRAIN_LIMIT {
                    tracing::error!(
                        conns = self.conns.len(),
                        "tcp fabric: the kernel did not finish the ops of a dropped fabric; \
                         leaking its ring and pool"
                    );
                    std::mem::forget(self);
                    return;
                }
            }
            self.flush();
            let wait = self
                .next_timer()
                .map(|t| t.saturating_duration_since(Instant::now()))
                .unwrap_or(IDLE_WAIT)
                .min(IDLE_WAIT);
            let ts = types::Timespec::from(wait);
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => failures = 0,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ETIME | libc::EINTR | libc::EBUSY | libc::EAGAIN)
                    ) =>
                {
                    failures = 0
                }
                Err(e) => {
                    failures += 1;
                    if failures > MAX_ENTER_FAILURES {
                        tracing::error!(error = %e, "io_uring cannot reap in-flight network I/O: aborting to protect pool memory");
                        std::process::abort();
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            self.reap();
        }
    }

    /// Moves queued entries into the submission queue (submitting when it is full); what does
    /// not fit stays queued for the next round.
    fn flush(&mut self) {
        while let Some(e) = self.sqes.front() {
            // SAFETY: every queued entry is a data request into / out of a pool range of an op
            // that stays unfinished until the request's CQE is reaped (`data_out`), with the pool
            // held by this worker for longer than the ring; or a PollAdd / AsyncCancel naming no
            // memory. The socket stays open until its connection's ops are finished.
            let pushed = unsafe { self.ring.submission().push(e) }.is_ok();
            if pushed {
                self.sqes.pop_front();
                continue;
            }
            if let Err(err) = self.ring.submit() {
                tracing::debug!(error = %err, "io_uring submit with a full queue");
            }
            // SAFETY: as above.
            if unsafe { self.ring.submission().push(e) }.is_err() {
                return;
            }
            self.sqes.pop_front();
        }
    }

    fn reap(&mut self) {
        let cqes: Vec<(u64, i32, u32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result(), c.flags()))
            .collect();
        for (ud, res, flags) in cqes {
            self.on_cqe(ud, res, flags);
        }
    }

    fn on_cqe(&mut self, ud: u64, res: i32, flags: u32) {
        let conn = ConnId(ud & CONN_ID_MASK);
        match ud >> KIND_SHIFT {
            KIND_WAKE => {
                self.mbox.clear_wake();
                self.wake_armed = false;
            }
            KIND_CANCEL => {
                if let Some(a) = self.conns.get_mut(&conn).and_then(|c| c.active.as_mut()) {
                    a.cancels = a.cancels.saturating_sub(1);
                }
            }
            KIND_DATA => {
                let Some(c) = self.conns.get_mut(&conn) else {
                    tracing::error!(
                        conn = conn.0,
                        "tcp fabric: completion of an unknown connection"
                    );
                    return;
                };
                let Some(a) = c.active.as_mut() else {
                    tracing::error!(conn = conn.0, "tcp fabric: completion without an op");
                    return;
                };
                if cqueue::notif(flags) {
                    a.notifs = a.notifs.saturating_sub(1);
                    let copied = res as u32 & NOTIF_USAGE_ZC_COPIED != 0;
                    self.core.count_zc_notification(copied);
                    if copied && !c.zc_copies {
                        c.zc_copies = true;
                        tracing::debug!(
                            conn = conn.0,
                            "tcp fabric: the kernel copies this connection's zero-copy sends \
                             (a local peer); plain sends from now on"
                        );
                    }
                    return;
                }
                a.data_out = false;
                if cqueue::more(flags) {
                    a.notifs += 1;
                    self.core.count_zc_send();
                }
                let err = if res > 0 {
                    a.run.advance(res as u64);
                    None
                } else if res == 0 {
                    Some(FabricError::PeerGone)
                } else {
                    match -res {
                        libc::EAGAIN | libc::EINTR => None,
                        libc::ECANCELED if a.failed.is_some() => None,
                        errno => Some(errno_error(
                            match a.run.job.dir {
                                Dir::Pull => "recv",
                                Dir::Push => "send",
                            },
                            errno,
                        )),
                    }
                };
                if let Some(e) = err {
                    if a.failed.is_none() {
                        a.failed = Some(e);
                        c.broken = true;
                        self.core.mark_broken(conn);
                    }
                }
            }
            _ => tracing::error!(ud, "tcp fabric: completion with an unknown tag"),
        }
    }

    /// The nearest time something must happen without a completion.
    fn next_timer(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        for c in self.conns.values() {
            let Some(a) = &c.active else { continue };
            let due = if a.timed() {
                Some(a.run.job.deadline)
            } else if a.failed.is_some() && a.data_out && a.cancels == 0 {
                Some(
                    a.last_cancel
                        .map_or_else(Instant::now, |l| l + RECANCEL_EVERY),
                )
            } else {
                None
            };
            if let Some(d) = due {
                t = Some(t.map_or(d, |t| t.min(d)));
            }
        }
        t
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::AddConn { conn, fd } => {
                self.conns.insert(
                    conn,
                    UConn {
                        fd,
                        queue: VecDeque::new(),
                        active: None,
                        broken: false,
                        tearing: false,
                        zc_copies: false,
                    },
                );
                if self.stopping.is_some() {
                    self.teardown(conn);
                }
            }
            Cmd::Register { pool, reply } => {
                if self.want_fixed && !self.fixed {
                    self.fixed = self.register(&pool);
                }
                self.pool = Some(pool);
                let _ = reply.send(self.fixed);
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
                self.stopping = Some(Instant::now());
                let ids: Vec<ConnId> = self.conns.keys().copied().collect();
                for id in ids {
                    self.teardown(id);
                }
            }
        }
    }

    /// Registers the pool as fixed buffers (pieces of at most 1 GiB); false (with a warning)
    /// when the kernel refuses, e.g. for `RLIMIT_MEMLOCK`.
    fn register(&mut self, pool: &Arc<SharedPool>) -> bool {
        let base = pool.region().as_ptr();
        let len = pool.len();
        let iovecs: Vec<libc::iovec> = (0..len.div_ceil(PIECE_BYTES))
            .map(|i| {
                let off = i * PIECE_BYTES;
                libc::iovec {
                    // SAFETY: off < len, inside the live pool mapping.
                    iov_base: unsafe { base.add(off as usize) }.cast(),
                    iov_len: (len - off).min(PIECE_BYTES) as usize,
                }
            })
            .collect();
        // SAFETY: the iovecs describe the pool mapping, which this worker keeps alive (its
        // `pool` field) for longer than the ring (field order); no request uses the buffers
        // before this returns.
        match unsafe { self.ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "tcp fabric: cannot register the pool as io_uring fixed buffers \
                     (RLIMIT_MEMLOCK?); zero-copy sends go without them"
                );
                false
            }
        }
    }

    fn teardown(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if c.tearing {
            return;
        }
        c.tearing = true;
        c.broken = true;
        // Only ops in flight need the socket cut (a zero-copy send to a peer that stopped
        // reading is released by the reset); an idle connection's descriptor is just closed,
        // so the node's own descriptor still delivers its last replies.
        if c.active.is_some() || !c.queue.is_empty() {
            shutdown_socket(c.fd.as_raw_fd());
        }
        for job in c.queue.drain(..) {
            self.core.finish(&job, Err(FabricError::Flushed), 0);
        }
        if let Some(a) = c.active.as_mut() {
            if a.failed.is_none() && !a.run.is_done() {
                a.failed = Some(FabricError::Flushed);
            }
        }
    }

    /// Runs `conn`'s ops as far as they go without waiting: starts the next op, issues its next
    /// request or cancel, finishes it once nothing of it is left in the kernel; ends a teardown.
    fn drive(&mut self, id: ConnId, now: Instant) {
        let Self {
            conns,
            core,
            sqes,
            pool,
            fixed,
            zc_min,
            ..
        } = self;
        let Some(c) = conns.get_mut(&id) else { return };
        loop {
            if c.active.is_none() {
                let Some(job) = c.queue.pop_front() else {
                    break;
                };
                if c.broken {
                    core.finish(&job, Err(FabricError::Flushed), 0);
                    continue;
                }
                c.active = Some(Active {
                    run: OpRun::new(job),
                    failed: None,
                    data_out: false,
                    notifs: 0,
                    cancels: 0,
                    last_cancel: None,
                    zc_used: false,
                });
            }
            let a = c.active.as_mut().expect("set above");
            if a.timed() && now >= a.run.job.deadline {
                a.failed = Some(FabricError::Deadline);
                c.broken = true;
                core.mark_broken(id);
                if a.zc_used && !c.tearing {
                    // The kernel holds zero-copy pages until the peer acknowledges them; a
                    // stalled peer never does. Only an aborted connection lets them go, in
                    // bounded time; the connection is broken anyway.
                    shutdown_socket(c.fd.as_raw_fd());
                }
            }
            if a.failed.is_some() {
                if a.data_out {
                    let due = a.last_cancel.is_none_or(|l| now >= l + RECANCEL_EVERY);
                    if a.cancels == 0 && due {
                        sqes.push_back(
                            opcode::AsyncCancel::new(user_data(KIND_DATA, id))
                                .build()
                                .user_data(user_data(KIND_CANCEL, id)),
                        );
                        a.cancels += 1;
                        a.last_cancel = Some(now);
                    }
                    break;
                }
            } else if !a.run.is_done() {
                if a.data_out {
                    break;
                }
                let Some(base) = pool.as_ref().map(|p| p.region().as_ptr()) else {
                    // Unreachable: post refuses until the pool is registered.
                    a.failed = Some(FabricError::Local("no pool registered".into()));
                    c.broken = true;
                    core.mark_broken(id);
                    continue;
                };
                let io = a.run.next_io().expect("not done");
                // SAFETY: post validated offset + len <= pool length, so the pointer stays inside
                // the live mapping held by this worker.
                let ptr = unsafe { base.add(io.offset as usize) };
                let len = io.len as u32; // <= PIECE_BYTES (1 GiB)
                let fd = types::Fd(c.fd.as_raw_fd());
                let entry = match a.run.job.dir {
                    Dir::Pull => opcode::Recv::new(fd, ptr, len)
                        .flags(libc::MSG_WAITALL)
                        .build(),
                    Dir::Push if io.item_len >= *zc_min && !c.zc_copies => {
                        let mut op = opcode::SendZc::new(fd, ptr, len)
                            .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL)
                            .zc_flags(SEND_ZC_REPORT_USAGE);
                        if *fixed {
                            op = op.buf_index(Some((io.offset / PIECE_BYTES) as u16));
                        }
                        a.zc_used = true;
                        op.build()
                    }
                    Dir::Push => opcode::Send::new(fd, ptr, len)
                        .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL)
                        .build(),
                };
                sqes.push_back(entry.user_data(user_data(KIND_DATA, id)));
                a.data_out = true;
                break;
            }
            // Data finished or failed, no data request out: wait for what is left.
            if a.notifs > 0 || a.cancels > 0 {
                break;
            }
            let a = c.active.take().expect("set above");
            let moved = a.run.moved();
            let result = match a.failed {
                Some(e) => Err(e),
                None => Ok(moved),
            };
            core.finish(&a.run.job, result, moved);
        }
        if c.tearing && c.active.is_none() && c.queue.is_empty() {
            // Nothing of this connection is in the kernel any more: close, then report.
            conns.remove(&id);
            core.teardown_done(id);
        }
    }
}
