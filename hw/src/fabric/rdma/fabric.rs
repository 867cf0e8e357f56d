//! [`RdmaFabric`]: the [`Fabric`] over RDMA verbs (RC queue pairs, READ = Pull, WRITE = Push).
//!
//! **Untested on hardware** (no RDMA on the development machine): everything past
//! [`RdmaFabric::open`] is compiled only; the planning it relies on (`post.rs`) is unit-tested.
//!
//! How the trait's invariant holds by construction:
//! * A batch is accepted only after every item was checked (inside one registered pool piece,
//!   `len > 0`, no overflow, pairwise disjoint, an RDMA segment) and planned into chains; then
//!   its chains go to the device in FIFO order as the outstanding-WR credit allows.
//! * Only the last WR of a chain is signalled; the send queue completes in order, so that WR's
//!   CQE (success, error or flush) means the whole chain is done with its local ranges. An op is
//!   returned by `poll` only when every chain handed to the device has produced that CQE and
//!   every chain not handed over was cancelled (`OpProgress::is_done`). Nothing touches the
//!   ranges after that.
//! * Teardown, an error CQE and a missed deadline all *break* the connection: QP -> ERR (the
//!   device flushes every posted WR with a CQE), unposted chains are cancelled. So every op of
//!   the connection completes once its flush CQEs are in; `TEARDOWN_DONE` is pushed after the
//!   connection's last op (and only for `teardown`), then the QP is destroyed.
//! * If the device never flushes (dead NIC), the ops stay in flight forever: their ranges leak,
//!   they are never reused early. The same holds for the (credit-prevented) case of a chain
//!   only partly accepted by `ibv_post_send`: its unsignalled prefix may never report.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rdma_sys::ibv_wc_status;

use super::device::{self, Device};
use super::mr::{register_pool, EngineMr, PoolMrs};
use super::post::{
    build_chains, Admission, ChainPlan, OpProgress, WrId, MAX_CHAIN_WRS, MAX_WR_BYTES, MAX_WR_SEQ,
};
use super::qp::{wc_error, Cq, Qp, Wc};
use super::{PendingInner, RdmaOptions};
use crate::fabric::types::{
    Completion, ConnId, ConnSetup, Dir, FabricError, FabricKind, FabricStats, OpId, PendingQp,
    PostBatch, PostError, RdmaEndpoint, RegionId,
};
use crate::fabric::Fabric;
use crate::{HwError, HwResult, SharedPool};

/// Longest single wait on the completion channel inside `poll` (teardowns and deadlines from
/// other threads are seen at least this often).
const POLL_SLICE: Duration = Duration::from_millis(10);

/// Completions taken from the CQ per round.
const CQ_POLL_BATCH: usize = 256;

/// A connection: its queue pair and the ops in flight on it.
struct Conn {
    qp: Qp,
    ops: BTreeSet<u64>,
    /// QP in ERR (teardown, error CQE, missed deadline): posts answer `ConnGone`.
    broken: bool,
    /// `teardown` was called: `TEARDOWN_DONE` follows the last op.
    tearing: bool,
}

/// An accepted batch.
struct OpEntry {
    op: OpId,
    conn: ConnId,
    dir: Dir,
    chains: Vec<ChainPlan>,
    /// lkey of each item's pool piece.
    item_lkeys: Vec<u32>,
    /// Per chain: WRs handed to the device whose chain CQE has not come (0: none).
    out: Vec<u32>,
    progress: OpProgress,
    bytes: u64,
    wrs: u64,
    deadline: Instant,
}

#[derive(Default)]
struct State {
    next_conn: u64,
    next_seq: u64,
    conns: HashMap<ConnId, Conn>,
    ops: HashMap<u64, OpEntry>,
    op_ids: HashSet<OpId>,
    admission: Option<Admission<u64>>,
    deadlines: BTreeSet<(Instant, u64)>,
    /// Completions not yet returned, with the op's WR count.
    ready: VecDeque<(Completion, u64)>,
    stats: FabricStats,
    wcs: Vec<Wc>,
}

impl State {
    fn admission(&mut self) -> &mut Admission<u64> {
        self.admission.as_mut().expect("set at open")
    }
}

/// The RDMA verbs [`Fabric`] of one device.
///
/// Invariant: the trait's (see the module doc for how it holds). Field order is drop order:
/// queue pairs (in `state`) before the pool registrations, before the CQ, before the device.
pub struct RdmaFabric {
    opts: RdmaOptions,
    state: Mutex<State>,
    mrs: OnceLock<PoolMrs>,
    reg_lock: Mutex<()>,
    cq: Arc<Cq>,
    dev: Arc<Device>,
    poll_lock: Mutex<()>,
}

impl std::fmt::Debug for RdmaFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaFabric")
            .field("device", &self.dev.describe())
            .finish_non_exhaustive()
    }
}

impl RdmaFabric {
    /// Opens the device of `opts` and creates the completion queue.
    ///
    /// Errors: bad options (`Invalid`, naming the value); no RDMA here (`Os { op: "rdma" }`
    /// whose message is the reason: `"no RDMA kernel support (ibv_get_device_list: ENOSYS)"`,
    /// `"no RDMA device"`, no active port or usable GID, ...).
    pub fn open(opts: RdmaOptions) -> HwResult<RdmaFabric> {
        opts.check()?;
        let dev = Arc::new(device::open(&opts)?);
        let cq = Cq::new(&dev)?;
        let admission = Admission::new(opts.max_outstanding_wr).map_err(HwError::Invalid)?;
        tracing::info!(device = %dev.describe(), "RDMA fabric open");
        Ok(RdmaFabric {
            state: Mutex::new(State {
                admission: Some(admission),
                ..State::default()
            }),
            mrs: OnceLock::new(),
            reg_lock: Mutex::new(()),
            cq,
            dev,
            poll_lock: Mutex::new(()),
            opts,
        })
    }

    /// `"mlx5_0 port 1 gid 3 (RoCEv2 ::ffff:10.0.0.5 on eth0)"`.
    pub fn describe(&self) -> String {
        self.dev.describe()
    }

    /// Engine side: registers `[addr, addr + len)` for the peer's READ and WRITE; the returned
    /// value carries `addr`, `len` and the `rkey` to send to the node.
    ///
    /// # Safety
    /// The range must stay mapped until the [`EngineMr`] is dropped, and the caller accepts that
    /// the peer's NIC may write into it while it is registered.
    pub unsafe fn register_engine_buffer(&self, addr: *mut u8, len: usize) -> HwResult<EngineMr> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { EngineMr::register(&self.dev, addr, len) }
    }

    /// Engine side: registers exported GPU memory (dma-buf `fd`, `len` bytes at `offset`,
    /// addressed as `iova`) for the peer's READ and WRITE (GPUDirect RDMA).
    ///
    /// # Safety
    /// The exported device memory must stay allocated until the [`EngineMr`] is dropped, and
    /// the caller accepts that the peer's NIC may read and write it while it is registered.
    pub unsafe fn register_engine_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> HwResult<EngineMr> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { EngineMr::register_dmabuf(&self.dev, fd, offset, len, iova) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands queued chains to the device while the credit lasts.
    fn pump(&self, st: &mut State) {
        while let Some((seq, idx, n)) = st.admission().next_ready() {
            self.post_chain(st, seq, idx, n);
        }
    }

    fn post_chain(&self, st: &mut State, seq: u64, idx: usize, n: u32) {
        let Some(mrs) = self.mrs.get() else {
            return; // unreachable: ops are accepted only after registration
        };
        let base = mrs.pool.region().as_ptr() as u64;
        let Some(op) = st.ops.get(&seq) else {
            st.admission().release(n);
            return;
        };
        let conn_id = op.conn;
        let Some(conn) = st.conns.get(&conn_id) else {
            st.admission().release(n);
            if let Some(op) = st.ops.get_mut(&seq) {
                op.progress.cancel_unposted();
            }
            self.maybe_complete(st, seq);
            return;
        };
        let chain = &op.chains[idx];
        let ids: Vec<u64> = (0..chain.wrs.len())
            .map(|i| {
                let id = WrId {
                    seq,
                    chain: idx as u32,
                    wr: i as u8,
                };
                id.encode().expect("seq, chain and wr bounded at post")
            })
            .collect();
        let lkeys: Vec<u32> = chain
            .wrs
            .iter()
            .map(|w| op.item_lkeys[w.item as usize])
            .collect();
        let res = conn.qp.post_chain(op.dir, base, &chain.wrs, &ids, &lkeys);
        let op = st.ops.get_mut(&seq).expect("present above");
        match res {
            Ok(()) => {
                op.out[idx] = n;
                op.progress.posted_one();
            }
            Err((posted, rc)) => {
                let e = std::io::Error::from_raw_os_error(rc);
                tracing::warn!(conn = conn_id.0, error = %e, posted, "ibv_post_send failed");
                op.progress
                    .record(FabricError::Local(format!("ibv_post_send: {e}")));
                if posted > 0 {
                    // The unsignalled prefix is on the device: it completes only through its
                    // flush CQE (module doc).
                    op.out[idx] = posted as u32;
                    op.progress.posted_one();
                }
                op.progress.cancel_unposted();
                st.admission().release(n - posted as u32);
                self.break_conn(st, conn_id);
                self.maybe_complete(st, seq);
            }
        }
    }

    /// QP -> ERR and cancel every unposted chain of the connection; idempotent.
    fn break_conn(&self, st: &mut State, conn_id: ConnId) {
        let Some(conn) = st.conns.get_mut(&conn_id) else {
            return;
        };
        if !conn.broken {
            conn.broken = true;
            if let Err(e) = conn.qp.to_err() {
                tracing::warn!(conn = conn_id.0, error = %e, "moving a QP to ERR failed");
            }
        }
        let seqs: Vec<u64> = conn.ops.iter().copied().collect();
        for seq in seqs {
            st.admission().cancel(seq);
            if let Some(op) = st.ops.get_mut(&seq) {
                op.progress.cancel_unposted();
            }
            self.maybe_complete(st, seq);
        }
    }

    /// Returns op `seq` to the caller if nothing of it is on the device any more.
    fn maybe_complete(&self, st: &mut State, seq: u64) {
        if !st.ops.get(&seq).is_some_and(|o| o.progress.is_done()) {
            return;
        }
        let op = st.ops.remove(&seq).expect("checked");
        st.deadlines.remove(&(op.deadline, seq));
        st.op_ids.remove(&op.op);
        let result = op.progress.result(op.bytes);
        if result.is_ok() {
            match op.dir {
                Dir::Pull => st.stats.bytes_pulled += op.bytes,
                Dir::Push => st.stats.bytes_pushed += op.bytes,
            }
        }
        st.ready.push_back((
            Completion {
                op: op.op,
                conn: op.conn,
                result,
            },
            op.wrs,
        ));
        if let Some(conn) = st.conns.get_mut(&op.conn) {
            conn.ops.remove(&seq);
        }
        self.maybe_end_teardown(st, op.conn);
    }

    fn maybe_end_teardown(&self, st: &mut State, conn_id: ConnId) {
        if !st
            .conns
            .get(&conn_id)
            .is_some_and(|c| c.tearing && c.ops.is_empty())
        {
            return;
        }
        // Every signalled CQE of the QP is in: destroying it cannot cut a transfer short.
        st.conns.remove(&conn_id);
        st.ready.push_back((
            Completion {
                op: OpId::TEARDOWN_DONE,
                conn: conn_id,
                result: Ok(0),
            },
            0,
        ));
    }

    fn on_wc(&self, st: &mut State, wc: Wc) {
        let id = WrId::decode(wc.wr_id);
        let Some(op) = st.ops.get_mut(&id.seq) else {
            tracing::debug!(wr_id = wc.wr_id, "completion of an unknown op ignored");
            return;
        };
        let conn_id = op.conn;
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
            op.progress.record(wc_error(wc.status, wc.vendor_err));
        }
        let chain = id.chain as usize;
        let finished = op
            .out
            .get(chain)
            .is_some_and(|&n| n > 0 && u32::from(id.wr) + 1 == n);
        let mut released = 0;
        if finished {
            released = op.out[chain];
            op.out[chain] = 0;
            op.progress.finished_one();
        }
        if released > 0 {
            st.admission().release(released);
        }
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
            // The QP is in ERR: nothing more of this connection can run.
            self.break_conn(st, conn_id);
        }
        self.maybe_complete(st, id.seq);
    }

    /// Drains the CQ, fires missed deadlines, hands queued chains to the device.
    fn progress(&self, st: &mut State) {
        loop {
            let mut wcs = std::mem::take(&mut st.wcs);
            wcs.clear();
            let n = match self.cq.poll(&mut wcs, CQ_POLL_BATCH) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(error = %e, "polling the RDMA completion queue failed");
                    0
                }
            };
            for wc in wcs.drain(..) {
                self.on_wc(st, wc);
            }
            st.wcs = wcs;
            if n < CQ_POLL_BATCH {
                break;
            }
        }
        let now = Instant::now();
        while let Some(&(when, seq)) = st.deadlines.first() {
            if when > now {
                break;
            }
            st.deadlines.pop_first();
            let Some(op) = st.ops.get_mut(&seq) else {
                continue;
            };
            op.progress.record(FabricError::Deadline);
            let conn = op.conn;
            tracing::warn!(
                conn = conn.0,
                op = op.op.0,
                "RDMA op missed its deadline: QP to ERR"
            );
            self.break_conn(st, conn);
        }
        self.pump(st);
    }

    fn validate(
        &self,
        batch: &PostBatch<'_>,
    ) -> Result<(Vec<ChainPlan>, Vec<u32>, u64), PostError> {
        let invalid = |m: String| Err(PostError::Invalid(m));
        if batch.op == OpId::TEARDOWN_DONE {
            return invalid("op id TEARDOWN_DONE is reserved".into());
        }
        let Some(mrs) = self.mrs.get() else {
            return invalid("no pool region registered".into());
        };
        let chains =
            build_chains(batch.items, MAX_WR_BYTES, MAX_CHAIN_WRS).map_err(PostError::Invalid)?;
        let mut lkeys = Vec::with_capacity(batch.items.len());
        let mut bytes = 0u64;
        for (i, item) in batch.items.iter().enumerate() {
            let Some((_, lkey)) = mrs.find(item.local.offset, item.local.len) else {
                return invalid(format!(
                    "item {i}: local range [{}, +{}) is not inside one registered region",
                    item.local.offset, item.local.len
                ));
            };
            lkeys.push(lkey);
            bytes = bytes.saturating_add(item.local.len);
        }
        crate::fabric::types::check_disjoint(batch.items)?;
        Ok((chains, lkeys, bytes))
    }
}

impl Fabric for RdmaFabric {
    fn kind(&self) -> FabricKind {
        FabricKind::Rdma
    }

    fn register(&self, pool: &Arc<SharedPool>) -> HwResult<Vec<RegionId>> {
        let _g = self.reg_lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.mrs.get().is_none() {
            let mrs = register_pool(
                &self.dev,
                pool,
                self.opts.mr_region_bytes,
                self.opts.mr_threads,
            )?;
            tracing::info!(
                pieces = mrs.pieces.len(),
                bytes = pool.len(),
                "pool registered for RDMA"
            );
            let _ = self.mrs.set(mrs);
        }
        let mrs = self.mrs.get().expect("set above");
        if !Arc::ptr_eq(&mrs.pool, pool) {
            return Err(HwError::Invalid(
                "rdma fabric: register given another pool than the one registered".into(),
            ));
        }
        Ok((0..mrs.pieces.len() as u32).map(RegionId).collect())
    }

    fn prepare_endpoint(&self) -> HwResult<Option<(PendingQp, RdmaEndpoint)>> {
        let qp = Qp::create_init(&self.cq, self.opts.remote_access)?;
        let ep = qp.endpoint();
        Ok(Some((PendingQp::from_rdma(PendingInner(qp)), ep)))
    }

    fn connect(&self, setup: ConnSetup) -> HwResult<ConnId> {
        let ConnSetup::Rdma { local, remote } = setup else {
            return Err(HwError::Invalid(
                "rdma fabric accepts only ConnSetup::Rdma".into(),
            ));
        };
        let qp = local.into_rdma().0;
        if !Arc::ptr_eq(qp.cq(), &self.cq) {
            return Err(HwError::Invalid(
                "rdma fabric: the pending queue pair was prepared by another fabric".into(),
            ));
        }
        qp.connect(&remote)?;
        let mut st = self.lock();
        st.next_conn += 1;
        let id = ConnId(st.next_conn);
        st.conns.insert(
            id,
            Conn {
                qp,
                ops: BTreeSet::new(),
                broken: false,
                tearing: false,
            },
        );
        Ok(id)
    }

    fn post(&self, batch: PostBatch<'_>) -> Result<(), PostError> {
        let (chains, item_lkeys, bytes) = self.validate(&batch)?;
        let mut st = self.lock();
        match st.conns.get(&batch.conn) {
            Some(c) if !c.broken => {}
            _ => return Err(PostError::ConnGone),
        }
        if st.op_ids.contains(&batch.op) {
            return Err(PostError::Invalid(format!(
                "op id {} is already in flight",
                batch.op.0
            )));
        }
        if st.ops.len() + st.ready.len() >= self.opts.max_inflight_ops {
            return Err(PostError::Full);
        }
        let seq = st.next_seq;
        if seq > MAX_WR_SEQ {
            return Err(PostError::Invalid("op sequence numbers exhausted".into()));
        }
        st.admission()
            .push(seq, chains.iter().map(|c| c.wrs.len() as u32))
            .map_err(PostError::Invalid)?;
        st.next_seq += 1;
        let wrs: u64 = chains.iter().map(|c| c.wrs.len() as u64).sum();
        let n = chains.len();
        st.ops.insert(
            seq,
            OpEntry {
                op: batch.op,
                conn: batch.conn,
                dir: batch.dir,
                progress: OpProgress::new(n as u32),
                out: vec![0; n],
                chains,
                item_lkeys,
                bytes,
                wrs,
                deadline: batch.deadline,
            },
        );
        st.op_ids.insert(batch.op);
        st.deadlines.insert((batch.deadline, seq));
        st.conns
            .get_mut(&batch.conn)
            .expect("checked")
            .ops
            .insert(seq);
        st.stats.posted_ops += 1;
        st.stats.inflight_wr += wrs;
        self.pump(&mut st);
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize, timeout: Duration) -> usize {
        if max == 0 {
            return 0;
        }
        let end = Instant::now() + timeout;
        let _g = self.poll_lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let next_deadline = {
                let mut st = self.lock();
                self.progress(&mut st);
                let mut n = 0;
                while n < max {
                    let Some((c, wrs)) = st.ready.pop_front() else {
                        break;
                    };
                    if c.op != OpId::TEARDOWN_DONE {
                        st.stats.completed_ops += 1;
                        st.stats.inflight_wr -= wrs;
                        if c.result.is_err() {
                            st.stats.errors += 1;
                        }
                    }
                    out.push(c);
                    n += 1;
                }
                if n > 0 {
                    return n;
                }
                st.deadlines.first().map(|d| d.0)
            };
            let now = Instant::now();
            if now >= end {
                return 0;
            }
            let mut wait = (end - now).min(POLL_SLICE);
            if let Some(d) = next_deadline {
                wait = wait.min(d.saturating_duration_since(now));
            }
            self.cq.wait(wait);
        }
    }

    fn teardown(&self, conn: ConnId) {
        let mut st = self.lock();
        let Some(c) = st.conns.get_mut(&conn) else {
            return;
        };
        if c.tearing {
            return;
        }
        c.tearing = true;
        self.break_conn(&mut st, conn);
        self.maybe_end_teardown(&mut st, conn);
    }

    fn stats(&self) -> FabricStats {
        let st = self.lock();
        let mut s = st.stats;
        s.inflight_ops = s.posted_ops - s.completed_ops;
        s
    }
}
