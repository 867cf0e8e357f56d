//! The routing ids the LMCache frontend knows open, recently closed, or open but untracked
//! (the bookkeeping of `disconnect`, kept apart so it can be tested alone).
//!
//! libzmq's ROUTER notification is the same message for an open and a close, so which one it
//! is follows from what is known of the id: an open id closes; an id opened beyond
//! [`MAX_OPEN_CONNECTIONS`] is remembered (up to [`MAX_UNTRACKED_BYTES`]) so that its next
//! notice is read as its close; any other id opens. A close libzmq dropped (its pipe at the
//! high-water mark) would leave its id open forever: open ids with no request for
//! [`OPEN_IDLE_EXPIRY_MS`] (at least the session TTL), no instance and no session are
//! forgotten, a bounded number per sweep.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Routing ids of open connections remembered (beyond: a new connection is not tracked, and
/// its instances are released by the timeouts alone).
pub const MAX_OPEN_CONNECTIONS: usize = 65_536;
/// Closed routing ids remembered, so requests of the connection that were still queued or
/// running when its close was seen are recognised (the oldest is forgotten beyond it).
pub const MAX_CLOSED_CONNECTIONS: usize = 65_536;
/// Bytes of routing ids of untracked open connections remembered (so their close is not read
/// as an open); an id costs its length plus [`UNTRACKED_ENTRY_OVERHEAD`]. Beyond it an
/// untracked connection's close is misread as an open (counted: `untracked_unremembered`),
/// and that ghost is forgotten by the idle expiry.
pub const MAX_UNTRACKED_BYTES: usize = 4 << 20;
/// Bookkeeping bytes counted per remembered untracked id beyond its length.
pub const UNTRACKED_ENTRY_OVERHEAD: usize = 48;
/// An open connection with no request for this long (milliseconds; at least the session TTL),
/// no instance and no session is forgotten: its close was most likely dropped by libzmq.
pub const OPEN_IDLE_EXPIRY_MS: u64 = 3_600_000;
/// Open connections the sweeper examines for the idle expiry per sweep.
pub const EXPIRY_CHECKS_PER_SWEEP: usize = 64;

/// One open connection.
#[derive(Debug)]
pub(super) struct OpenConn {
    /// The stamp of its open notice.
    pub(super) stamp: u64,
    /// Node-clock ms of its last request (or its open).
    pub(super) last_ms: AtomicU64,
    /// The stamp of the previous close of the same routing id, when that close was still
    /// waiting for the sweeper at this open (a peer that sets its routing id reconnected).
    pub(super) reopened_from: Option<u64>,
}

/// One closed connection remembered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Closed {
    /// Node-clock ms of its close.
    pub(super) ms: u64,
    /// The stamp of its close notice.
    pub(super) stamp: u64,
}

/// What a notice for an id not open means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NotOpen {
    /// An untracked connection's close.
    UntrackedClose,
    /// A new connection, tracked.
    Opened,
    /// A new connection beyond [`MAX_OPEN_CONNECTIONS`]; `remembered`: whether its close will
    /// be recognised.
    Untracked { remembered: bool },
}

/// The routing ids known open, recently closed and open untracked. Invariants: an id is in at
/// most one of `open`, `closed` and `untracked`; `open` holds at most [`MAX_OPEN_CONNECTIONS`]
/// ids, `closed` at most [`MAX_CLOSED_CONNECTIONS`], `untracked` at most
/// [`MAX_UNTRACKED_BYTES`] (`untracked_bytes`); `open_order` lists every open id (plus stale
/// items, at most as many as there are open ids plus [`MAX_OPEN_CONNECTIONS`]) and
/// `closed_order` every closed one (plus stale items) oldest first.
#[derive(Default)]
pub(super) struct Connections {
    pub(super) open: HashMap<Arc<[u8]>, OpenConn>,
    open_order: VecDeque<(Arc<[u8]>, u64)>,
    pub(super) closed: HashMap<Arc<[u8]>, Closed>,
    closed_order: VecDeque<(Arc<[u8]>, u64)>,
    untracked: HashSet<Arc<[u8]>>,
    untracked_bytes: usize,
}

impl Connections {
    /// A notice for `identity`, which is not open, at `stamp` (`close_pending`: the stamp of
    /// the id's close still waiting for the sweeper, if any): see [`NotOpen`].
    pub(super) fn not_open(
        &mut self,
        identity: &[u8],
        stamp: u64,
        now_ms: u64,
        close_pending: Option<u64>,
    ) -> NotOpen {
        if self.untracked.remove(identity) {
            self.untracked_bytes -= identity.len() + UNTRACKED_ENTRY_OVERHEAD;
            return NotOpen::UntrackedClose;
        }
        let previous = self.closed.remove(identity);
        if self.open.len() >= MAX_OPEN_CONNECTIONS {
            let cost = identity.len() + UNTRACKED_ENTRY_OVERHEAD;
            let remembered = self.untracked_bytes + cost <= MAX_UNTRACKED_BYTES;
            if remembered {
                self.untracked.insert(identity.into());
                self.untracked_bytes += cost;
            }
            return NotOpen::Untracked { remembered };
        }
        let id: Arc<[u8]> = identity.into();
        let reopened_from = previous
            .map(|c| c.stamp)
            .filter(|s| close_pending == Some(*s));
        self.open.insert(
            id.clone(),
            OpenConn {
                stamp,
                last_ms: AtomicU64::new(now_ms),
                reopened_from,
            },
        );
        self.open_order.push_back((id, stamp));
        if self.open_order.len() > self.open.len() + MAX_OPEN_CONNECTIONS {
            let open = &self.open;
            self.open_order
                .retain(|(id, s)| open.get(id).is_some_and(|o| o.stamp == *s));
        }
        NotOpen::Opened
    }

    /// `identity` (open or not) closed at `now_ms` with stamp `stamp`; forgets the closed ids
    /// older than `memory_ms` and the oldest beyond [`MAX_CLOSED_CONNECTIONS`].
    pub(super) fn close(&mut self, identity: &[u8], now_ms: u64, stamp: u64, memory_ms: u64) {
        self.open.remove(identity);
        let id: Arc<[u8]> = identity.into();
        self.closed.insert(id.clone(), Closed { ms: now_ms, stamp });
        self.closed_order.push_back((id, stamp));
        self.forget_old(now_ms, memory_ms);
    }

    /// Forgets the closed ids older than `memory_ms`, and the oldest beyond
    /// [`MAX_CLOSED_CONNECTIONS`].
    pub(super) fn forget_old(&mut self, now_ms: u64, memory_ms: u64) {
        while let Some((id, stamp)) = self.closed_order.front() {
            let current = self.closed.get(id).filter(|c| c.stamp == *stamp).copied();
            if let Some(c) = current {
                let old = now_ms.saturating_sub(c.ms) >= memory_ms
                    || self.closed.len() > MAX_CLOSED_CONNECTIONS;
                if !old {
                    break;
                }
            }
            let (id, _) = self.closed_order.pop_front().expect("front");
            if current.is_some() {
                self.closed.remove(&id);
            }
        }
    }

    /// Marks a request of `identity` at `now_ms` (nothing when it is not open).
    pub(super) fn touch(&self, identity: &[u8], now_ms: u64) {
        if let Some(o) = self.open.get(identity) {
            o.last_ms.store(now_ms, Ordering::Relaxed);
        }
    }

    /// Examines up to [`EXPIRY_CHECKS_PER_SWEEP`] open ids (in turn) and returns those with no
    /// request for `idle_ms` (with their open stamps): the caller checks they hold nothing and
    /// calls [`Connections::expire`].
    pub(super) fn idle(&mut self, now_ms: u64, idle_ms: u64) -> Vec<(Arc<[u8]>, u64)> {
        let mut found = Vec::new();
        for _ in 0..EXPIRY_CHECKS_PER_SWEEP.min(self.open_order.len()) {
            let (id, stamp) = self.open_order.pop_front().expect("checked");
            let Some(o) = self.open.get(&id).filter(|o| o.stamp == stamp) else {
                continue; // closed (or reopened: its newer item is further back)
            };
            if now_ms.saturating_sub(o.last_ms.load(Ordering::Relaxed)) >= idle_ms {
                found.push((id.clone(), stamp));
            }
            self.open_order.push_back((id, stamp));
        }
        found
    }

    /// Forgets open `identity` if it is still the one opened at `stamp` and idle for `idle_ms`;
    /// whether it did.
    pub(super) fn expire(
        &mut self,
        identity: &[u8],
        stamp: u64,
        now_ms: u64,
        idle_ms: u64,
    ) -> bool {
        let idle = self.open.get(identity).is_some_and(|o| {
            o.stamp == stamp && now_ms.saturating_sub(o.last_ms.load(Ordering::Relaxed)) >= idle_ms
        });
        if idle {
            self.open.remove(identity);
        }
        idle
    }

    /// Open ids remembered as untracked.
    pub(super) fn untracked_len(&self) -> usize {
        self.untracked.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMORY: u64 = 60_000;

    #[test]
    fn closed_ids_are_forgotten_by_age_and_count() {
        let mut c = Connections::default();
        for i in 0..3u8 {
            c.close(&[i], u64::from(i), u64::from(i) + 1, MEMORY);
        }
        c.forget_old(10, MEMORY);
        assert_eq!(c.closed.len(), 3);
        c.forget_old(MEMORY + 1, MEMORY);
        assert_eq!(c.closed.len(), 1, "ids 0 and 1 aged out");
        assert!(c.closed.contains_key(&[2u8][..]));
        assert_eq!(c.closed_order.len(), 1);
    }

    fn fill(c: &mut Connections) {
        for i in 0..MAX_OPEN_CONNECTIONS as u32 {
            let r = c.not_open(&i.to_be_bytes(), u64::from(i) + 1, 0, None);
            assert_eq!(r, NotOpen::Opened);
        }
    }

    /// Issue 12 §1 review: the close of a connection opened beyond the cap was read as an open
    /// once a tracked connection had closed, and that ghost stayed open for ever.
    #[test]
    fn an_untracked_connections_close_is_not_read_as_an_open() {
        let mut c = Connections::default();
        fill(&mut c);
        let late = b"late-connection";
        assert_eq!(
            c.not_open(late, 1_000_000, 0, None),
            NotOpen::Untracked { remembered: true }
        );
        // A tracked connection closes: room for one.
        c.close(&0u32.to_be_bytes(), 5, 1_000_001, MEMORY);
        assert_eq!(c.open.len(), MAX_OPEN_CONNECTIONS - 1);
        // The late connection's close.
        assert_eq!(
            c.not_open(late, 1_000_002, 5, None),
            NotOpen::UntrackedClose
        );
        assert!(!c.open.contains_key(&late[..]), "no ghost");
        assert_eq!(c.untracked_len(), 0);
        assert_eq!(c.untracked_bytes, 0);
        // Its next notice is an open again.
        assert_eq!(c.not_open(late, 1_000_003, 6, None), NotOpen::Opened);
    }

    #[test]
    fn untracked_ids_are_bounded_in_bytes() {
        let mut c = Connections::default();
        fill(&mut c);
        let per = 200 + UNTRACKED_ENTRY_OVERHEAD;
        let fit = MAX_UNTRACKED_BYTES / per;
        for i in 0..fit as u32 + 3 {
            let mut id = vec![7u8; 200];
            id[..4].copy_from_slice(&i.to_be_bytes());
            let r = c.not_open(&id, 2_000_000 + u64::from(i), 0, None);
            let remembered = (i as usize) < fit;
            assert_eq!(r, NotOpen::Untracked { remembered }, "id {i}");
        }
        assert!(c.untracked_bytes <= MAX_UNTRACKED_BYTES);
        assert_eq!(c.untracked_len(), fit);
    }

    /// A close libzmq dropped leaves its id open: it is forgotten once idle, a bounded number
    /// of ids examined per sweep.
    #[test]
    fn idle_open_ids_are_found_in_bounded_turns() {
        let mut c = Connections::default();
        for i in 0..200u32 {
            c.not_open(&i.to_be_bytes(), u64::from(i) + 1, 0, None);
        }
        c.touch(&5u32.to_be_bytes(), 500);
        let idle = 1_000;
        let mut found = Vec::new();
        let mut sweeps = 0;
        while found.len() < 199 {
            let batch = c.idle(1_000, idle);
            assert!(batch.len() <= EXPIRY_CHECKS_PER_SWEEP);
            for (id, stamp) in batch {
                assert!(c.expire(&id, stamp, 1_000, idle));
                found.push(id);
            }
            sweeps += 1;
            assert!(sweeps < 100, "found {}", found.len());
        }
        assert_eq!(c.open.len(), 1, "the id used at 500 ms stays");
        assert!(c.open.contains_key(&5u32.to_be_bytes()[..]));
        // The forgotten ids' items go at their next turn.
        for _ in 0..4 {
            assert!(c.idle(1_000, idle).is_empty());
        }
        assert_eq!(c.open_order.len(), 1);
    }

    #[test]
    fn a_reopen_before_the_close_is_processed_remembers_that_close() {
        let mut c = Connections::default();
        c.not_open(b"w", 1, 0, None);
        c.close(b"w", 10, 2, MEMORY);
        assert_eq!(c.not_open(b"w", 3, 20, Some(2)), NotOpen::Opened);
        assert_eq!(c.open[&b"w"[..]].reopened_from, Some(2));
        assert!(!c.closed.contains_key(&b"w"[..]));
        c.close(b"w", 30, 4, MEMORY);
        assert_eq!(c.not_open(b"w", 5, 40, None), NotOpen::Opened);
        assert_eq!(
            c.open[&b"w"[..]].reopened_from,
            None,
            "close processed already"
        );
    }
}
