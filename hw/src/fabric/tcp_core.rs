//! What both TCP engines share: the fabric-wide bookkeeping ([`Core`]: connections, ops in
//! flight, the completion queue, counters), the worker mailboxes, the progress of one op over a
//! stream ([`OpRun`]) and small socket helpers.
//!
//! Lock order: `Core::st` before a `Mailbox::q`, never the reverse. A worker never holds its
//! mailbox lock while it calls into the core.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::types::{Completion, ConnId, Dir, FabricError, FabricStats, LocalRange, OpId};
use crate::{HwError, HwResult, SharedPool};

/// Size of one registered piece of the pool (io_uring fixed buffer); an I/O never crosses one.
pub(super) const PIECE_BYTES: u64 = crate::uring::PIECE;

/// `TCP_USER_TIMEOUT` (ms) a teardown puts on the socket (when it has none or a longer one), so
/// that data the peer never acknowledges is dropped by the kernel in bounded time (that is what
/// ends a zero-copy send's wait for its notification when the peer is stalled).
pub(super) const TEARDOWN_USER_TIMEOUT_MS: u32 = 1000;

/// Connection ids must fit below the uring engine's request tag (8 bits) in a `user_data`.
pub(super) const CONN_ID_MASK: u64 = (1 << 56) - 1;

/// One posted batch as the worker sees it.
///
/// Invariant: validated by `post` (ranges inside the pool, non-empty, disjoint).
#[derive(Debug)]
pub(super) struct Job {
    pub(super) op: OpId,
    pub(super) conn: ConnId,
    pub(super) dir: Dir,
    pub(super) items: Vec<LocalRange>,
    pub(super) deadline: Instant,
}

/// A command for a worker thread.
pub(super) enum Cmd {
    /// A new connection; the worker owns the socket from now on.
    AddConn { conn: ConnId, fd: OwnedFd },
    /// The pool, before any `Post`; the reply says whether it is registered as fixed buffers.
    Register {
        pool: Arc<SharedPool>,
        reply: mpsc::Sender<bool>,
    },
    /// A batch to run after the ones already queued on its connection.
    Post(Job),
    /// Tear the connection down.
    Teardown(ConnId),
    /// Tear every connection down, drain, exit.
    Stop,
}

/// A worker's command queue and the eventfd that wakes it.
///
/// Invariant: every `send` is followed by a write to the eventfd, so a worker that clears the
/// eventfd before taking the queue never sleeps on a queued command.
pub(super) struct Mailbox {
    q: Mutex<VecDeque<Cmd>>,
    wake: OwnedFd,
}

impl Mailbox {
    pub(super) fn new() -> HwResult<Mailbox> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(HwError::last_os("eventfd"));
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Mailbox {
            q: Mutex::new(VecDeque::new()),
            wake,
        })
    }

    /// Queues `cmd` (without waking: call [`Mailbox::wake`] after releasing other locks).
    pub(super) fn push(&self, cmd: Cmd) {
        self.q
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(cmd);
    }

    /// Wakes the worker.
    pub(super) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local to our eventfd. It can only fail with EAGAIN
        // when the counter is near 2^64 (then the worker is awake anyway).
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Queues `cmd` and wakes the worker.
    pub(super) fn send(&self, cmd: Cmd) {
        self.push(cmd);
        self.wake();
    }

    /// Every queued command, in order.
    pub(super) fn take(&self) -> VecDeque<Cmd> {
        std::mem::take(&mut *self.q.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Resets the eventfd (call before `take`).
    pub(super) fn clear_wake(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live local; the fd is non-blocking.
        unsafe {
            libc::read(
                self.wake.as_raw_fd(),
                (&mut v as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    pub(super) fn wake_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }
}

/// Where one op stands in its stream: which item, how far into it.
///
/// Invariant: `item <= job.items.len()`; `off < job.items[item].len` while `item` is in range;
/// `moved` is the sum of the lengths of the items before `item`.
#[derive(Debug)]
pub(super) struct OpRun {
    pub(super) job: Job,
    item: usize,
    off: u64,
    moved: u64,
}

/// The next I/O of an op: pool offset, length, and the length of the whole item.
#[derive(Debug, Clone, Copy)]
pub(super) struct NextIo {
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) item_len: u64,
}

impl OpRun {
    pub(super) fn new(job: Job) -> OpRun {
        OpRun {
            job,
            item: 0,
            off: 0,
            moved: 0,
        }
    }

    /// Every item moved.
    pub(super) fn is_done(&self) -> bool {
        self.item >= self.job.items.len()
    }

    /// Bytes of the items moved completely.
    pub(super) fn moved(&self) -> u64 {
        self.moved
    }

    /// The rest of the current item, cut at the end of its registered piece.
    pub(super) fn next_io(&self) -> Option<NextIo> {
        let r = self.job.items.get(self.item)?;
        let offset = r.offset + self.off;
        let room = PIECE_BYTES - offset % PIECE_BYTES;
        Some(NextIo {
            offset,
            len: (r.len - self.off).min(room),
            item_len: r.len,
        })
    }

    /// Records `n` more bytes moved (at most what [`OpRun::next_io`] offered).
    pub(super) fn advance(&mut self, n: u64) {
        let Some(r) = self.job.items.get(self.item) else {
            return;
        };
        self.off += n.min(r.len - self.off);
        if self.off == r.len {
            self.moved += r.len;
            self.item += 1;
            self.off = 0;
        }
    }
}

/// The error of a failed socket call: a peer that went away, or a local failure.
pub(super) fn errno_error(what: &str, errno: i32) -> FabricError {
    match errno {
        libc::ECONNRESET
        | libc::EPIPE
        | libc::ENOTCONN
        | libc::ECONNABORTED
        | libc::ETIMEDOUT
        | libc::EHOSTUNREACH
        | libc::ENETUNREACH
        | libc::ESHUTDOWN => FabricError::PeerGone,
        _ => FabricError::Local(format!(
            "{what}: {}",
            std::io::Error::from_raw_os_error(errno)
        )),
    }
}

/// Starts a teardown on the socket: `shutdown(SHUT_RDWR)` (wakes every blocked reader and writer,
/// the node's own too), `SO_LINGER {1, 0}` (the last close resets instead of lingering) and a
/// `TCP_USER_TIMEOUT` of at most [`TEARDOWN_USER_TIMEOUT_MS`] (unacknowledged data is dropped in
/// bounded time). Failures are logged and ignored: the socket may already be dead.
pub(super) fn shutdown_socket(fd: RawFd) {
    // SAFETY: plain syscalls on a descriptor we own; the option buffers are live locals of the
    // sizes passed.
    unsafe {
        if libc::shutdown(fd, libc::SHUT_RDWR) != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOTCONN) {
                tracing::debug!(error = %e, "tcp fabric: shutdown failed");
            }
        }
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
        let mut cur: u32 = 0;
        let mut len = std::mem::size_of::<u32>() as libc::socklen_t;
        let got = libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            (&mut cur as *mut u32).cast(),
            &mut len,
        );
        if got == 0 && (cur == 0 || cur > TEARDOWN_USER_TIMEOUT_MS) {
            let v = TEARDOWN_USER_TIMEOUT_MS;
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_USER_TIMEOUT,
                (&v as *const u32).cast(),
                std::mem::size_of::<u32>() as libc::socklen_t,
            );
        }
    }
}

/// Whether `fd` is a stream socket.
pub(super) fn is_stream_socket(fd: RawFd) -> bool {
    let mut ty: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into a live local.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&mut ty as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    r == 0 && ty == libc::SOCK_STREAM
}

/// A connection as the fabric's front sees it.
#[derive(Debug)]
pub(super) struct CoreConn {
    pub(super) worker: usize,
    /// An op failed (stream desynchronised) or a teardown started: `post` answers `ConnGone`.
    pub(super) broken: bool,
    /// `teardown` was called (a second call is ignored).
    pub(super) tearing: bool,
}

/// Fabric-wide state behind one lock.
#[derive(Default)]
pub(super) struct CoreState {
    pub(super) pool: Option<Arc<SharedPool>>,
    pub(super) regions: Vec<super::types::RegionId>,
    pub(super) fixed_buffers: bool,
    pub(super) next_conn: u64,
    pub(super) next_worker: usize,
    pub(super) conns: HashMap<ConnId, CoreConn>,
    /// Ops accepted and not yet returned by `poll`, with their item count.
    pub(super) inflight: HashMap<OpId, u64>,
    pub(super) done: VecDeque<Completion>,
    pub(super) stats: FabricStats,
}

/// Counters of the io_uring engine's zero-copy sends.
///
/// Invariant: `notifications <= sends`; every op's notifications are counted before its
/// completion is queued.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZcCounters {
    /// `SendZc` requests whose result said a notification follows.
    pub sends: u64,
    /// Notifications reaped (the kernel released the pages).
    pub notifications: u64,
    /// Notifications that said the kernel copied the data after all (e.g. loopback).
    pub copied: u64,
}

/// The bookkeeping shared by the fabric's front (`post`, `poll`, ...) and its workers.
pub(super) struct Core {
    st: Mutex<CoreState>,
    ready: Condvar,
    zc_sends: AtomicU64,
    zc_notifications: AtomicU64,
    zc_copied: AtomicU64,
}

impl Core {
    pub(super) fn new() -> Core {
        Core {
            st: Mutex::new(CoreState::default()),
            ready: Condvar::new(),
            zc_sends: AtomicU64::new(0),
            zc_notifications: AtomicU64::new(0),
            zc_copied: AtomicU64::new(0),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, CoreState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn ready(&self) -> &Condvar {
        &self.ready
    }

    /// Queues the completion of a worker's op; `moved` bytes of whole items count as moved.
    pub(super) fn finish(&self, job: &Job, result: Result<u64, FabricError>, moved: u64) {
        let mut st = self.lock();
        match job.dir {
            Dir::Pull => st.stats.bytes_pulled += moved,
            Dir::Push => st.stats.bytes_pushed += moved,
        }
        if result.is_err() {
            if let Some(c) = st.conns.get_mut(&job.conn) {
                c.broken = true;
            }
        }
        st.done.push_back(Completion {
            op: job.op,
            conn: job.conn,
            result,
        });
        drop(st);
        self.ready.notify_all();
    }

    /// Refuses further posts on `conn` (its stream is out of step).
    pub(super) fn mark_broken(&self, conn: ConnId) {
        if let Some(c) = self.lock().conns.get_mut(&conn) {
            c.broken = true;
        }
    }

    /// Forgets `conn` and queues its `TEARDOWN_DONE` (after every completion of it).
    pub(super) fn teardown_done(&self, conn: ConnId) {
        let mut st = self.lock();
        st.conns.remove(&conn);
        st.done.push_back(Completion {
            op: OpId::TEARDOWN_DONE,
            conn,
            result: Ok(0),
        });
        drop(st);
        self.ready.notify_all();
    }

    /// Counts a zero-copy send whose notification will follow.
    pub(super) fn count_zc_send(&self) {
        self.zc_sends.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a reaped notification (`copied`: the kernel copied the data after all).
    pub(super) fn count_zc_notification(&self, copied: bool) {
        self.zc_notifications.fetch_add(1, Ordering::Relaxed);
        if copied {
            self.zc_copied.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A snapshot of the zero-copy counters.
    pub(super) fn zc(&self) -> ZcCounters {
        ZcCounters {
            sends: self.zc_sends.load(Ordering::Relaxed),
            notifications: self.zc_notifications.load(Ordering::Relaxed),
            copied: self.zc_copied.load(Ordering::Relaxed),
        }
    }
}
