//! [`FakeFabric`]: an in-process fabric with fault injection and a manual clock.
//!
//! Remote memory is a [`FakePeer`] (regions of plain bytes with RDMA-style addresses and keys),
//! checked like a NIC checks it. Completions become pollable at seeded virtual times
//! ([`FakeFabric::advance_to`]); every random choice comes from one seeded generator drawn in call
//! order, so the same seed and the same calls give the same completions and the same bytes.
//!
//! Data moves when an op becomes due, not when it is posted: a caller that frees and reuses a
//! slot while its op is in flight gets its new bytes overwritten later, which byte checks catch.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::fake_peer::Rng;
use super::fake_peer::{FakeOptions, FakePeer, INJECTED_OP_ERR, REM_ACCESS_ERR};
use super::types::{
    Completion, ConnId, ConnSetup, Dir, FabricError, FabricKind, FabricStats, LocalRange, OpId,
    PendingQp, PostBatch, PostError, RdmaEndpoint, RegionId, RemoteSeg, WorkItem,
};
use super::Fabric;
use crate::{HwError, HwResult, SharedPool};

/// An in-process [`Fabric`] with fault injection and a manual clock, for deterministic tests.
///
/// Invariant: safe code only; every accepted op is returned by `poll` exactly once; bytes move
/// only while the op is in flight (when it becomes due); a `post` whose local range overlaps a
/// range in flight panics (a caller bug the upper layers must never have).
pub struct FakeFabric {
    opts: FakeOptions,
    pool: Arc<SharedPool>,
    state: Mutex<State>,
    ready_cv: Condvar,
}

/// What will happen to an op when it becomes due.
#[derive(Debug, Clone, Copy)]
enum Fate {
    Ok,
    Deadline,
    Error { prefix: usize },
    Death { prefix: usize },
}

struct Pending {
    op: OpId,
    conn: ConnId,
    dir: Dir,
    items: Vec<WorkItem>,
    fate: Fate,
}

struct ConnState {
    peer: FakePeer,
    broken: bool,
}

struct InflightOp {
    ranges: Vec<LocalRange>,
    conn: ConnId,
}

#[derive(Default)]
struct State {
    rng: Option<Rng>,
    now_ms: u64,
    regions: Vec<(RegionId, u64, u64)>,
    next_conn: u64,
    conns: HashMap<ConnId, ConnState>,
    /// Keyed by (due ms, tie-break, post sequence).
    pending: BTreeMap<(u64, u64, u64), Pending>,
    ready: VecDeque<Completion>,
    inflight: HashMap<OpId, InflightOp>,
    /// In-flight local ranges by start offset: (end, op). Pairwise disjoint.
    by_offset: BTreeMap<u64, (u64, OpId)>,
    seq: u64,
    last_due: u64,
    stats: FabricStats,
}

impl State {
    fn rng(&mut self) -> &mut Rng {
        self.rng.as_mut().expect("rng set at construction")
    }
}

impl FakeFabric {
    /// A fake fabric over `pool` (which `register` must be given).
    ///
    /// Invariant: `Invalid` when the options break [`FakeOptions`]' invariant.
    pub fn new(opts: FakeOptions, pool: Arc<SharedPool>) -> HwResult<FakeFabric> {
        if opts.delay_ms.0 > opts.delay_ms.1 {
            return Err(HwError::Invalid(format!(
                "fake fabric: delay_ms ({}, {}) has min > max",
                opts.delay_ms.0, opts.delay_ms.1
            )));
        }
        for (name, v) in [
            ("drop_pct", opts.drop_pct),
            ("error_pct", opts.error_pct),
            ("peer_death_pct", opts.peer_death_pct),
        ] {
            if v > 100 {
                return Err(HwError::Invalid(format!(
                    "fake fabric: {name} = {v} is over 100"
                )));
            }
        }
        if opts.region_bytes == 0 || opts.max_inflight_ops == 0 {
            return Err(HwError::Invalid(
                "fake fabric: region_bytes and max_inflight_ops must be > 0".into(),
            ));
        }
        let state = State {
            rng: Some(Rng(opts.seed)),
            ..State::default()
        };
        Ok(FakeFabric {
            opts,
            pool,
            state: Mutex::new(state),
            ready_cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The virtual clock in ms.
    pub fn now_ms(&self) -> u64 {
        self.lock().now_ms
    }

    /// Moves the virtual clock to `ms` (never backwards) and runs every op due by then, in due
    /// order: their completions become pollable.
    pub fn advance_to(&self, ms: u64) {
        let mut st = self.lock();
        st.now_ms = st.now_ms.max(ms);
        self.settle(&mut st);
        drop(st);
        self.ready_cv.notify_all();
    }

    /// Every local range in flight (posted, completion not yet returned by `poll`), sorted by
    /// offset, with its op and connection: for checkers of the slot-safety invariant.
    pub fn inflight_ranges(&self) -> Vec<(OpId, ConnId, LocalRange)> {
        let st = self.lock();
        st.by_offset
            .iter()
            .map(|(&offset, &(end, op))| {
                let conn = st.inflight.get(&op).map(|o| o.conn).unwrap_or(ConnId(0));
                (
                    op,
                    conn,
                    LocalRange {
                        offset,
                        len: end - offset,
                    },
                )
            })
            .collect()
    }

    /// A copy of the peer region with key `rkey` of `conn` (until its teardown ends), for tests.
    pub fn peer_region(&self, conn: ConnId, rkey: u32) -> Option<Vec<u8>> {
        let st = self.lock();
        let c = st.conns.get(&conn)?;
        c.peer
            .regions
            .iter()
            .find(|r| r.rkey == rkey)
            .map(|r| r.bytes.clone())
    }

    /// Whether `conn` is known and broken (peer death or a remote access error).
    pub fn is_broken(&self, conn: ConnId) -> bool {
        self.lock().conns.get(&conn).is_some_and(|c| c.broken)
    }

    /// Runs every pending op with `due <= now`.
    fn settle(&self, st: &mut State) {
        while let Some(entry) = st.pending.first_entry() {
            if entry.key().0 > st.now_ms {
                break;
            }
            let p = entry.remove();
            self.execute(st, p);
        }
    }

    fn execute(&self, st: &mut State, p: Pending) {
        let Some(conn) = st.conns.get_mut(&p.conn) else {
            // Unreachable: ops of a torn-down connection were flushed by teardown.
            st.ready.push_back(Completion {
                op: p.op,
                conn: p.conn,
                result: Err(FabricError::Flushed),
            });
            return;
        };
        let mut peer = std::mem::take(&mut conn.peer);
        let stop = match p.fate {
            Fate::Ok => None,
            Fate::Deadline => Some((0, FabricError::Deadline)),
            Fate::Error { prefix } => {
                Some((prefix, FabricError::Remote(INJECTED_OP_ERR.to_owned())))
            }
            Fate::Death { prefix } => Some((prefix, FabricError::PeerGone)),
        };
        let mut result: Result<u64, FabricError> = Ok(0);
        let mut done = 0usize;
        let mut breaks = matches!(p.fate, Fate::Death { .. });
        for (i, item) in p.items.iter().enumerate() {
            if let Some((at, err)) = &stop {
                if i == *at {
                    result = Err(err.clone());
                    break;
                }
            }
            match self.move_item(&mut peer, p.dir, item) {
                Ok(()) => {
                    done += 1;
                    match p.dir {
                        Dir::Pull => st.stats.bytes_pulled += item.local.len,
                        Dir::Push => st.stats.bytes_pushed += item.local.len,
                    }
                    if let Ok(n) = &mut result {
                        *n += item.local.len;
                    }
                }
                Err(e) => {
                    if matches!(e, FabricError::Remote(_)) {
                        breaks = true;
                    }
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_err() {
            self.garbage(st, &mut peer, p.dir, &p.items[done..]);
        }
        st.conns.get_mut(&p.conn).expect("checked").peer = peer;
        st.ready.push_back(Completion {
            op: p.op,
            conn: p.conn,
            result,
        });
        if breaks {
            self.break_conn(st, p.conn);
        }
    }

    /// Moves one item; `Remote(REM_ACCESS_ERR)` for a bad key or bounds.
    fn move_item(&self, peer: &mut FakePeer, dir: Dir, item: &WorkItem) -> Result<(), FabricError> {
        let RemoteSeg::Rdma { addr, rkey } = item.remote else {
            return Err(FabricError::Local(
                "stream segment on the fake fabric".into(),
            ));
        };
        let Some((idx, start)) = peer.locate(addr, rkey, item.local.len) else {
            return Err(FabricError::Remote(REM_ACCESS_ERR.to_owned()));
        };
        let len = item.local.len as usize;
        let bytes = &mut peer.regions[idx].bytes[start..start + len];
        let region = self.pool.region();
        let r = match dir {
            Dir::Pull => region.write_at(item.local.offset, bytes),
            Dir::Push => region.read_at(item.local.offset, bytes),
        };
        r.map_err(|e| FabricError::Local(e.to_string()))
    }

    /// Seeded garbage where `items` would have written, if `partial_garbage`.
    fn garbage(&self, st: &mut State, peer: &mut FakePeer, dir: Dir, items: &[WorkItem]) {
        if !self.opts.partial_garbage {
            return;
        }
        for item in items {
            let mut buf = vec![0u8; item.local.len as usize];
            st.rng().fill(&mut buf);
            match dir {
                Dir::Pull => {
                    // In bounds: validated by post against the registered regions.
                    let _ = self.pool.region().write_at(item.local.offset, &buf);
                }
                Dir::Push => {
                    if let RemoteSeg::Rdma { addr, rkey } = item.remote {
                        if let Some((idx, start)) = peer.locate(addr, rkey, item.local.len) {
                            peer.regions[idx].bytes[start..start + buf.len()].copy_from_slice(&buf);
                        }
                    }
                }
            }
        }
    }

    /// Marks `conn` broken and flushes every op of it still pending (in post order).
    fn break_conn(&self, st: &mut State, conn: ConnId) {
        if let Some(c) = st.conns.get_mut(&conn) {
            c.broken = true;
        }
        self.flush_conn(st, conn);
    }

    fn flush_conn(&self, st: &mut State, conn: ConnId) {
        let mut keys: Vec<(u64, u64, u64)> = st
            .pending
            .iter()
            .filter(|(_, p)| p.conn == conn)
            .map(|(k, _)| *k)
            .collect();
        keys.sort_by_key(|k| k.2);
        for k in keys {
            let p = st.pending.remove(&k).expect("key listed");
            if let Some(mut peer) = st.conns.get_mut(&conn).map(|c| std::mem::take(&mut c.peer)) {
                self.garbage(st, &mut peer, p.dir, &p.items);
                st.conns.get_mut(&conn).expect("present").peer = peer;
            }
            st.ready.push_back(Completion {
                op: p.op,
                conn,
                result: Err(FabricError::Flushed),
            });
        }
    }

    fn validate(&self, st: &State, batch: &PostBatch<'_>) -> Result<(), PostError> {
        let invalid = |m: String| Err(PostError::Invalid(m));
        if batch.op == OpId::TEARDOWN_DONE {
            return invalid("op id TEARDOWN_DONE is reserved".into());
        }
        if batch.items.is_empty() {
            return invalid("batch has no items".into());
        }
        if st.regions.is_empty() {
            return invalid("no pool region registered".into());
        }
        for (i, item) in batch.items.iter().enumerate() {
            if item.local.len == 0 {
                return invalid(format!("item {i}: empty local range"));
            }
            let Some(end) = item.local.end() else {
                return invalid(format!("item {i}: local range overflows"));
            };
            let inside = st
                .regions
                .iter()
                .any(|&(_, start, len)| item.local.offset >= start && end <= start + len);
            if !inside {
                return invalid(format!(
                    "item {i}: local range [{}, {end}) is not inside one registered region",
                    item.local.offset
                ));
            }
            if item.remote == RemoteSeg::Stream {
                return invalid(format!(
                    "item {i}: stream segments are not supported by the fake fabric"
                ));
            }
        }
        super::types::check_disjoint(batch.items)?;
        Ok(())
    }

    /// Panics if any range overlaps a range in flight (a caller bug).
    fn assert_no_inflight_overlap(st: &State, op: OpId, items: &[WorkItem]) {
        for item in items {
            let r = item.local;
            let end = r.offset + r.len; // no overflow: validated
            if let Some((&start, &(prev_end, other))) = st.by_offset.range(..end).next_back() {
                if prev_end > r.offset {
                    panic!(
                        "fake fabric: op {} posts local range [{}, {end}) overlapping \
                         [{start}, {prev_end}) of op {} still in flight",
                        op.0, r.offset, other.0
                    );
                }
            }
        }
    }
}

impl Fabric for FakeFabric {
    fn kind(&self) -> FabricKind {
        FabricKind::Fake
    }

    fn register(&self, pool: &Arc<SharedPool>) -> HwResult<Vec<RegionId>> {
        if !Arc::ptr_eq(pool, &self.pool) {
            return Err(HwError::Invalid(
                "fake fabric: register given another pool than the one it was built with".into(),
            ));
        }
        let mut st = self.lock();
        if st.regions.is_empty() {
            let total = self.pool.len();
            let mut start = 0u64;
            let mut id = 0u32;
            while start < total {
                let len = self.opts.region_bytes.min(total - start);
                st.regions.push((RegionId(id), start, len));
                start += len;
                id += 1;
            }
        }
        Ok(st.regions.iter().map(|r| r.0).collect())
    }

    fn prepare_endpoint(&self) -> HwResult<Option<(PendingQp, RdmaEndpoint)>> {
        Ok(None)
    }

    fn connect(&self, setup: ConnSetup) -> HwResult<ConnId> {
        let ConnSetup::Fake(peer) = setup else {
            return Err(HwError::Invalid(
                "fake fabric accepts only ConnSetup::Fake".into(),
            ));
        };
        let mut st = self.lock();
        st.next_conn += 1;
        let id = ConnId(st.next_conn);
        st.conns.insert(
            id,
            ConnState {
                peer,
                broken: false,
            },
        );
        Ok(id)
    }

    fn post(&self, batch: PostBatch<'_>) -> Result<(), PostError> {
        let mut st = self.lock();
        self.validate(&st, &batch)?;
        match st.conns.get(&batch.conn) {
            Some(c) if !c.broken => {}
            _ => return Err(PostError::ConnGone),
        }
        if st.inflight.contains_key(&batch.op) {
            return Err(PostError::Invalid(format!(
                "op id {} is already in flight",
                batch.op.0
            )));
        }
        if st.inflight.len() >= self.opts.max_inflight_ops {
            return Err(PostError::Full);
        }
        Self::assert_no_inflight_overlap(&st, batch.op, batch.items);

        let left = batch
            .deadline
            .saturating_duration_since(Instant::now())
            .as_millis();
        let deadline_ms = st
            .now_ms
            .saturating_add(u64::try_from(left).unwrap_or(u64::MAX));
        let (lo, hi) = self.opts.delay_ms;
        let n = batch.items.len() as u64;
        let rng = st.rng();
        let delay = lo + rng.below(hi - lo + 1);
        let dropped = rng.pct(self.opts.drop_pct);
        let dies = rng.pct(self.opts.peer_death_pct);
        let fails = rng.pct(self.opts.error_pct);
        let prefix = rng.below(n) as usize;
        let tie = if self.opts.reorder { rng.next() } else { 0 };

        let mut due = st.now_ms.saturating_add(delay);
        if !self.opts.reorder {
            due = due.max(st.last_due);
            st.last_due = due;
        }
        let mut fate = if dropped {
            Fate::Deadline
        } else if dies {
            Fate::Death { prefix }
        } else if fails {
            Fate::Error { prefix }
        } else {
            Fate::Ok
        };
        if dropped || due > deadline_ms {
            fate = Fate::Deadline;
            due = deadline_ms;
        }
        let seq = st.seq;
        st.seq += 1;
        let ranges: Vec<LocalRange> = batch.items.iter().map(|w| w.local).collect();
        for r in &ranges {
            st.by_offset.insert(r.offset, (r.offset + r.len, batch.op));
        }
        st.inflight.insert(
            batch.op,
            InflightOp {
                ranges,
                conn: batch.conn,
            },
        );
        st.stats.posted_ops += 1;
        st.stats.inflight_wr += n;
        st.pending.insert(
            (due, tie, seq),
            Pending {
                op: batch.op,
                conn: batch.conn,
                dir: batch.dir,
                items: batch.items.to_vec(),
                fate,
            },
        );
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize, timeout: Duration) -> usize {
        if max == 0 {
            return 0;
        }
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            self.settle(&mut st);
            if !st.ready.is_empty() {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return 0;
            }
            st = self
                .ready_cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let mut n = 0;
        while n < max {
            let Some(c) = st.ready.pop_front() else { break };
            if c.op != OpId::TEARDOWN_DONE {
                if let Some(rec) = st.inflight.remove(&c.op) {
                    for r in &rec.ranges {
                        st.by_offset.remove(&r.offset);
                    }
                    st.stats.inflight_wr -= rec.ranges.len() as u64;
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
        let mut st = self.lock();
        if !st.conns.contains_key(&conn) {
            return;
        }
        self.flush_conn(&mut st, conn);
        st.conns.remove(&conn);
        st.ready.push_back(Completion {
            op: OpId::TEARDOWN_DONE,
            conn,
            result: Ok(0),
        });
        drop(st);
        self.ready_cv.notify_all();
    }

    fn stats(&self) -> FabricStats {
        let st = self.lock();
        let mut s = st.stats;
        s.inflight_ops = s.posted_ops - s.completed_ops;
        s
    }
}
