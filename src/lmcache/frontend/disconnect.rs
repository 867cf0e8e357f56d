//! Releasing what an LMCache client held once its connection closed (issue 12 §1).
//!
//! ZMQ hides disconnects from the application, so without this a crashed worker's instance
//! (its uncommitted stores' slots, its read locks) waits for the reaper (`reap_timeout`, or
//! `registration_grace` for a worker that never pinged). The server turns on libzmq's ROUTER
//! notifications (`ZMQ_ROUTER_NOTIFY`): the ROUTER then delivers `[routing id, empty frame]`
//! when a connection completes its handshake and again when it ends, through the connection's
//! own pipe, so the close arrives after every request the connection sent. [`Disconnects`]
//! tells the two apart by the routing ids it knows to be open (see `connections`).
//!
//! Semantics (compatible with LMCache's `--worker-disconnect-grace-seconds`):
//! * Only the connection that registered an instance may use it (issue 11's ownership), so
//!   "every connection that used the instance is gone" is "its owner's connection closed".
//!   Only such instances start a countdown: the grace (default 1 s) for an instance that has
//!   pinged, the longer *unproven* countdown for one that never did (see
//!   [`LmFrontend::unproven_grace_ms`]). At the end of the countdown the instance is released
//!   through the node's release path (pending stores deleted and freed, never published; read
//!   locks released), counted in status (`lmcache.disconnect.releases`) and logged.
//! * A request for the instance over another connection of the same user (a worker that
//!   reconnected with a new routing id) before the countdown ends cancels it: that connection
//!   becomes the owner, under a new pairing epoch (as a re-REGISTER would: its COMMITs are never
//!   paired with transfers prepared over the closed connection, which stay reserved until the
//!   node's write TTL). Another user's connection cannot. The closed connection's own requests
//!   still queued when the close is seen run in order (an UNREGISTER sent just before exiting
//!   still unregisters, a COMMIT still publishes what was committed) but never cancel it.
//! * A peer that sets its own routing id reconnects with it: the reopened connection's requests
//!   are the owner's as far as ownership goes, and are told from the closed connection's by
//!   their stamp (every notice increments it on the I/O thread; a request carries its value at
//!   reception, `ClientId::stamp`). libzmq accepts the reopened connection only after the old
//!   pipe, close notice included, was read, so a request stamped after the close came over
//!   the reopened connection: its first request for the instance cancels the countdown, or
//!   keeps it from starting when the sweeper has not processed the close yet ([`Countdowns`]'s
//!   `reclaimed`), under a new pairing epoch ([`LmFrontend::reclaim`]).
//! * The closed connection's lookup sessions end at once (their read locks released), and its
//!   prefetch results and cached hashes go. Requests of that connection that were already
//!   running when the close was seen are caught after they finish (see
//!   [`LmFrontend::after_request`]).
//! * Registrations over a transport with no known connection (notifications refused by the
//!   linked libzmq, more than [`MAX_OPEN_CONNECTIONS`] open connections, a frontend driven
//!   without ZMQ) are released by the timeouts alone; so is everything when the grace is 0.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use super::lookup::session_name;
use super::owners::Owner;
use super::{ClientId, LmFrontend};
use crate::protocol::Request;

mod connections;
mod countdown;

use connections::{Connections, NotOpen};
pub use connections::{
    EXPIRY_CHECKS_PER_SWEEP, MAX_CLOSED_CONNECTIONS, MAX_OPEN_CONNECTIONS, MAX_UNTRACKED_BYTES,
    OPEN_IDLE_EXPIRY_MS, UNTRACKED_ENTRY_OVERHEAD,
};

/// How long a closed routing id is remembered at least (milliseconds; longer when a countdown
/// is longer).
pub const CLOSED_MEMORY_MS: u64 = 60_000;
/// The countdown of an instance that never pinged is at least the grace and otherwise the
/// registration grace capped at this (milliseconds).
pub const UNPROVEN_GRACE_CAP_MS: u64 = 10_000;
/// How often the sweeper thread looks for countdowns that ended (milliseconds).
pub const SWEEP_INTERVAL_MS: u64 = 25;

/// What a ROUTER notification meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionEvent {
    /// A connection with a routing id not open before: it opened.
    Opened,
    /// An open connection's routing id (tracked, or remembered untracked): it closed.
    Closed,
    /// A new connection beyond [`MAX_OPEN_CONNECTIONS`]: not tracked.
    Untracked,
}

/// Whether the server learns of closed connections.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Notify {
    /// No ZMQ endpoint attached (the frontend is driven directly).
    Detached,
    On,
    Off(String),
}

#[derive(Debug, Clone)]
struct Countdown {
    generation: u64,
    owner: ClientId,
    closed_ms: u64,
    /// The stamp of the close that started it: a request of the owner's routing id stamped
    /// later came over a connection opened after that close, and cancels it.
    closed_stamp: u64,
    due_ms: u64,
}

/// The countdowns, and the instances a reopened routing id used before the sweeper processed
/// its close. Invariant: `reclaimed` maps an instance to the stamp of a close still waiting
/// for the sweeper (entries go when it is processed); no countdown is started for the
/// instance by that close.
#[derive(Default)]
struct Countdowns {
    map: BTreeMap<u64, Countdown>,
    reclaimed: HashMap<u64, u64>,
}

/// A close seen and not yet processed by the sweeper.
#[derive(Debug, Clone, Copy)]
struct PendingClose {
    ms: u64,
    stamp: u64,
}

/// Counters of connection closes, for status and logs.
#[derive(Default, Debug)]
pub struct DisconnectCounters {
    /// Connections opened (notified).
    pub opened: AtomicU64,
    /// Connections closed (notified).
    pub closed: AtomicU64,
    /// New connections not tracked ([`MAX_OPEN_CONNECTIONS`]).
    pub untracked: AtomicU64,
    /// Closes of untracked connections recognised (processed as closes).
    pub untracked_closes: AtomicU64,
    /// Untracked connections not remembered ([`MAX_UNTRACKED_BYTES`]): their close will be
    /// read as an open (that ghost goes by the idle expiry).
    pub untracked_unremembered: AtomicU64,
    /// Open connections forgotten by the idle expiry ([`OPEN_IDLE_EXPIRY_MS`]: most likely a
    /// close libzmq dropped).
    pub expired: AtomicU64,
    /// Closes not processed because [`MAX_CLOSED_CONNECTIONS`] were waiting already.
    pub closes_dropped: AtomicU64,
    /// Instances released because their owner's connection closed.
    pub releases: AtomicU64,
    /// Countdowns cancelled by a request over another connection of the same user.
    pub adoptions: AtomicU64,
    /// Countdowns cancelled (or never started) because the owner's routing id reconnected
    /// (a peer that sets its routing id) and used the instance.
    pub reconnects: AtomicU64,
    /// Lookup sessions ended because their connection closed.
    pub sessions_ended: AtomicU64,
}

/// The frontend's view of its clients' connections. Invariant: a countdown names the exact
/// registration (id, generation) and the owner whose close started it; it releases the
/// instance only if that owner still owns that registration when it ends. Lock order:
/// `countdowns`, `conns`, `closes` (and the frontend's `pending`, `owners` before them).
pub(super) struct Disconnects {
    conns: RwLock<Connections>,
    /// Closes seen and not yet processed, at most [`MAX_CLOSED_CONNECTIONS`], one per id (the
    /// latest).
    closes: Mutex<HashMap<Arc<[u8]>, PendingClose>>,
    /// `closes.len()`, readable without the lock.
    closes_waiting: AtomicUsize,
    countdowns: Mutex<Countdowns>,
    /// `countdowns.map.len()`, readable without the lock.
    counting: AtomicUsize,
    /// Incremented by every notification (only the server's I/O thread writes it; requests
    /// carry its value at their reception: `ClientId::stamp`).
    stamp: AtomicU64,
    notify: Mutex<Notify>,
    sweeper: std::sync::OnceLock<thread::Thread>,
    counters: DisconnectCounters,
}

impl Disconnects {
    pub(super) fn new() -> Disconnects {
        Disconnects {
            conns: RwLock::default(),
            closes: Mutex::default(),
            closes_waiting: AtomicUsize::new(0),
            countdowns: Mutex::default(),
            counting: AtomicUsize::new(0),
            stamp: AtomicU64::new(0),
            notify: Mutex::new(Notify::Detached),
            sweeper: std::sync::OnceLock::new(),
            counters: DisconnectCounters::default(),
        }
    }

    /// The counters.
    pub(super) fn counters(&self) -> &DisconnectCounters {
        &self.counters
    }

    /// Forgets what was kept for instance `id`, released by the node (a reclaim whose close
    /// was overwritten by a later close of the same routing id would otherwise stay): the
    /// reclaimed entries never outnumber the live instances.
    pub(super) fn forget_instance(&self, id: u64) {
        self.countdowns.lock().reclaimed.remove(&id);
    }

    fn is_closed(&self, identity: &[u8]) -> bool {
        self.conns.read().closed.contains_key(identity)
    }

    fn next_stamp(&self) -> u64 {
        self.stamp.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// Stops the sweeper thread when dropped or stopped.
pub struct DisconnectSweeper {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl DisconnectSweeper {
    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for DisconnectSweeper {
    fn drop(&mut self) {
        self.halt();
    }
}

impl LmFrontend {
    /// The grace after a connection close (ms; 0: closes are ignored).
    pub fn disconnect_grace_ms(&self) -> u64 {
        self.state.limits.worker_disconnect_grace_ms
    }

    /// The countdown of an instance that never pinged: the registration grace (LMCache's rule)
    /// capped at [`UNPROVEN_GRACE_CAP_MS`], and never shorter than the grace. LMCache's main
    /// branch waits the whole registration grace (an hour by default); kvnode caps it because
    /// the engine's workers register at start-up and start their heartbeat only at their first
    /// store or retrieve, so "never pinged" is mostly a worker that died during start-up (an
    /// out-of-memory error while capturing CUDA graphs), and an operator restarting vLLM
    /// wants that registration gone in seconds, not in an hour. The longer countdown still
    /// leaves a worker whose connection was re-established time for its first request.
    pub fn unproven_grace_ms(&self) -> u64 {
        let grace = self.disconnect_grace_ms();
        let registration = self.ctx.config.registration_grace().as_millis() as u64;
        grace.max(registration.min(UNPROVEN_GRACE_CAP_MS))
    }

    /// Counters of connection closes.
    pub fn disconnect_counters(&self) -> &DisconnectCounters {
        &self.state.disconnects.counters
    }

    /// Turns on the ROUTER's connect/disconnect notifications for `router` (not yet bound or
    /// connected) and starts the sweeper thread that ends countdowns. When the grace is 0, or
    /// the linked libzmq refuses the option, instances are released by the timeouts alone (a
    /// warning says why, and status reports it): `None`.
    pub fn attach_router(&self, router: &mut zmq::Socket) -> Option<DisconnectSweeper> {
        use kvnode_hw::zmq_notify::{set_router_notify, ZMQ_NOTIFY_CONNECT, ZMQ_NOTIFY_DISCONNECT};
        let d = &self.state.disconnects;
        if self.disconnect_grace_ms() == 0 {
            *d.notify.lock() =
                Notify::Off("the grace is 0 (--worker-disconnect-grace-seconds)".into());
            return None;
        }
        if let Err(e) = set_router_notify(router, ZMQ_NOTIFY_CONNECT | ZMQ_NOTIFY_DISCONNECT) {
            let why =
                format!("libzmq refused ZMQ_ROUTER_NOTIFY ({e}): built without its DRAFT API");
            tracing::warn!(
                reason = %why,
                "LMCache clients' connection closes cannot be seen: a dead client's instance is \
                 released by the reaper (--worker-reap-timeout-seconds / \
                 --worker-registration-grace-seconds) alone"
            );
            *d.notify.lock() = Notify::Off(why);
            return None;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let f = LmFrontend {
            ctx: self.ctx.clone(),
            state: self.state.clone(),
        };
        let flag = stop.clone();
        let thread = thread::Builder::new()
            .name("kvnode-lmcache-disconnect".into())
            .spawn(move || {
                let _ = f.state.disconnects.sweeper.set(thread::current());
                while !flag.load(Ordering::Acquire) {
                    f.sweep_disconnects();
                    thread::park_timeout(Duration::from_millis(SWEEP_INTERVAL_MS));
                }
            });
        match thread {
            Ok(t) => {
                *d.notify.lock() = Notify::On;
                Some(DisconnectSweeper {
                    stop,
                    thread: Some(t),
                })
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the LMCache disconnect thread: closes are ignored");
                *d.notify.lock() = Notify::Off(format!("no sweeper thread: {e}"));
                None
            }
        }
    }

    /// The stamp a request received now carries (see [`ClientId::with_stamp`]): it orders the
    /// request against the connection notices (the server's I/O thread reads it as it
    /// receives a request, and is the only thread that calls [`LmFrontend::connection_notice`]).
    pub fn connection_stamp(&self) -> u64 {
        self.state.disconnects.stamp.load(Ordering::Relaxed)
    }

    /// A ROUTER notification for `identity` (the server recognised it: two frames, the second
    /// empty, no connection properties). It says nothing of its kind: a close when the id is
    /// known open or remembered untracked, else an open (see `connections`).
    pub fn connection_notice(&self, identity: &[u8]) -> ConnectionEvent {
        let d = &self.state.disconnects;
        let open = d.conns.read().open.contains_key(identity);
        if open {
            self.connection_closed(identity);
            return ConnectionEvent::Closed;
        }
        self.connection_opened(identity)
    }

    /// A connection with routing id `identity` opened, or (when it was opened untracked) closed
    /// (a peer that sets its own routing id may reuse the id of a closed connection: it is no
    /// longer taken as closed; if that close is still waiting for the sweeper, the reopened
    /// connection's requests reclaim its instances, see [`LmFrontend::reclaim`]).
    pub fn connection_opened(&self, identity: &[u8]) -> ConnectionEvent {
        let d = &self.state.disconnects;
        let stamp = d.next_stamp();
        let now = self.ctx.now_ms();
        let r = {
            let mut c = d.conns.write();
            let pending = d.closes.lock().get(identity).map(|p| p.stamp);
            c.not_open(identity, stamp, now, pending)
        };
        match r {
            NotOpen::Opened => {
                d.counters.opened.fetch_add(1, Ordering::Relaxed);
                ConnectionEvent::Opened
            }
            NotOpen::UntrackedClose => {
                d.counters.untracked_closes.fetch_add(1, Ordering::Relaxed);
                self.record_close(identity, stamp);
                ConnectionEvent::Closed
            }
            NotOpen::Untracked { remembered } => {
                d.counters.untracked.fetch_add(1, Ordering::Relaxed);
                if !remembered {
                    d.counters
                        .untracked_unremembered
                        .fetch_add(1, Ordering::Relaxed);
                }
                ConnectionEvent::Untracked
            }
        }
    }

    /// The connection with routing id `identity` closed: recorded at once (cheap, O(1): the
    /// server's I/O thread calls it); the next [`LmFrontend::sweep_disconnects`] (the sweeper
    /// thread, woken now) ends its lookup sessions and starts the countdown of the instances
    /// it owns (see the module docs). Ignored when the grace is 0.
    pub fn connection_closed(&self, identity: &[u8]) {
        let stamp = self.state.disconnects.next_stamp();
        self.record_close(identity, stamp);
    }

    fn record_close(&self, identity: &[u8], stamp: u64) {
        if self.disconnect_grace_ms() == 0 {
            return;
        }
        let d = &self.state.disconnects;
        let now = self.ctx.now_ms();
        // Remembered at least as long as a countdown runs (an adoption looks it up).
        let memory = self.unproven_grace_ms().max(CLOSED_MEMORY_MS);
        d.conns.write().close(identity, now, stamp, memory);
        {
            let mut q = d.closes.lock();
            let close = PendingClose { ms: now, stamp };
            if let Some(p) = q.get_mut(identity) {
                *p = close;
            } else if q.len() < MAX_CLOSED_CONNECTIONS {
                q.insert(identity.into(), close);
                d.closes_waiting.store(q.len(), Ordering::Relaxed);
            } else {
                d.counters.closes_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        d.counters.closed.fetch_add(1, Ordering::Relaxed);
        if let Some(t) = d.sweeper.get() {
            t.unpark();
        }
    }

    /// Processes the closes recorded since the last call (sessions ended, countdowns started),
    /// forgets idle open connections (a bounded number examined), then releases the instances
    /// whose countdown ended; returns how many were released. The sweeper thread calls it
    /// every [`SWEEP_INTERVAL_MS`]; the simulator after its steps.
    pub fn sweep_disconnects(&self) -> usize {
        let d = &self.state.disconnects;
        let batch: Vec<(Arc<[u8]>, PendingClose)> = d
            .closes
            .lock()
            .iter()
            .map(|(id, p)| (id.clone(), *p))
            .collect();
        for (identity, p) in batch {
            let (sessions, instances) = self.forget_connection(&identity, p.ms, p.stamp);
            tracing::info!(
                client = %ClientId::new(&identity, None),
                sessions_ended = sessions,
                instances_counting_down = instances,
                grace_ms = self.disconnect_grace_ms(),
                "LMCache client connection closed"
            );
            self.close_processed(&identity, p.stamp);
        }
        self.expire_idle_connections();
        self.release_disconnected()
    }

    /// The close of `identity` at `stamp` was processed: it no longer waits, a reopened
    /// connection of the id needs no reclaiming for it any more (a countdown it started is
    /// cancelled by the reopened connection's next request for the instance instead).
    fn close_processed(&self, identity: &[u8], stamp: u64) {
        let d = &self.state.disconnects;
        let mut cd = d.countdowns.lock();
        let mut c = d.conns.write();
        let mut q = d.closes.lock();
        if q.get(identity).is_some_and(|p| p.stamp == stamp) {
            q.remove(identity);
            d.closes_waiting.store(q.len(), Ordering::Relaxed);
        }
        if let Some(o) = c.open.get_mut(identity) {
            if o.reopened_from == Some(stamp) {
                o.reopened_from = None;
            }
        }
        cd.reclaimed.retain(|_, s| *s != stamp);
    }

    /// Forgets open connections with no request for [`OPEN_IDLE_EXPIRY_MS`] (at least the
    /// session TTL, so none has a session left) that own no instance: their close was lost.
    /// At most [`EXPIRY_CHECKS_PER_SWEEP`] are examined.
    fn expire_idle_connections(&self) {
        let d = &self.state.disconnects;
        let now = self.ctx.now_ms();
        let idle_ms =
            OPEN_IDLE_EXPIRY_MS.max(self.ctx.config.session_ttl_secs.saturating_mul(1000));
        let idle = d.conns.write().idle(now, idle_ms);
        if idle.is_empty() {
            return;
        }
        let owning: HashSet<Arc<[u8]>> = {
            let owners = self.state.owners.lock();
            idle.iter()
                .filter(|(id, _)| owners.values().any(|o| o.client.identity() == &id[..]))
                .map(|(id, _)| id.clone())
                .collect()
        };
        let mut c = d.conns.write();
        for (id, stamp) in idle {
            if !owning.contains(&id) && c.expire(&id, stamp, now, idle_ms) {
                d.counters.expired.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    client = %ClientId::new(&id, None),
                    "LMCache connection forgotten: no request for an hour and nothing owned \
                     (its close notification was most likely dropped)"
                );
            }
        }
    }

    /// Called after every request of `client`: marks its connection used; when its
    /// connection closed while the request was queued or running, what the request created
    /// for it (a session, a registration) goes the way of the rest. (Paired with
    /// [`LmFrontend::connection_closed`], which marks the connection closed before it looks:
    /// one of the two sees what the request created.)
    pub(super) fn after_request(&self, client: &ClientId) {
        let now = self.ctx.now_ms();
        let closed = {
            let c = self.state.disconnects.conns.read();
            c.touch(client.identity(), now);
            c.closed.get(client.identity()).copied()
        };
        if let Some(at) = closed {
            self.forget_connection(client.identity(), at.ms, at.stamp);
        }
    }

    /// Ends the sessions and drops the per-request state of the clients with routing id
    /// `identity`, and starts the countdown of the instances they own (from the close at
    /// `closed_ms`, stamp `closed_stamp`); returns (sessions ended, countdowns started).
    /// Idempotent.
    fn forget_connection(
        &self,
        identity: &[u8],
        closed_ms: u64,
        closed_stamp: u64,
    ) -> (usize, usize) {
        let s = &self.state;
        let sessions = s.sessions.lock().identity_gone(identity);
        s.prefetch.lock().remove_identity(identity);
        s.hashes.lock().remove_identity(identity);
        let n = sessions.len();
        for (client, request_id, _) in sessions {
            s.disconnects
                .counters
                .sessions_ended
                .fetch_add(1, Ordering::Relaxed);
            self.call(Request::EndSession {
                request_id: session_name(&client, &request_id),
            });
        }
        let owned: Vec<(u64, Owner)> = s
            .owners
            .lock()
            .iter()
            .filter(|(_, o)| o.client.identity() == identity)
            .map(|(id, o)| (*id, o.clone()))
            .collect();
        let mut started = 0;
        for (id, owner) in owned {
            let Some(inst) = self.ctx.instances.get(id) else {
                continue;
            };
            if inst.generation == owner.generation
                && self.start_countdown(&inst, owner.client, closed_ms, closed_stamp)
            {
                started += 1;
            }
        }
        (n, started)
    }
}
