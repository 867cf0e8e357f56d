//! The completion queue (with its event channel) and reliable-connected queue pairs.
//!
//! A QP is created in INIT by `prepare_endpoint`, moved to RTR then RTS by `connect` with the
//! peer's [`RdmaEndpoint`], and moved to ERR by teardown: every WR still posted then completes
//! with `IBV_WC_WR_FLUSH_ERR`, which is how teardown drains (see `fabric.rs`).
//!
//! **Untested on hardware** (no RDMA on the development machine): compiled only; `wc_error` is
//! tested.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::{
    ibv_access_flags, ibv_ack_cq_events, ibv_comp_channel, ibv_cq, ibv_create_comp_channel,
    ibv_create_cq, ibv_create_qp, ibv_destroy_comp_channel, ibv_destroy_cq, ibv_destroy_qp,
    ibv_get_cq_event, ibv_gid, ibv_modify_qp, ibv_poll_cq, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask,
    ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_req_notify_cq, ibv_send_flags, ibv_send_wr,
    ibv_sge, ibv_wc, ibv_wc_status, ibv_wr_opcode, rdma_t,
};

use super::device::{Device, LinkLayer};
use super::post::WrPlan;
use crate::fabric::types::{Dir, FabricError, RdmaEndpoint};
use crate::{HwError, HwResult};

/// Send queue depth of a QP (above the device's outstanding-WR bound).
pub const QP_MAX_SEND_WR: u32 = 512;
/// Scatter/gather entries per WR (one pool range per WR).
pub const QP_MAX_SGE: u32 = 1;
/// Completion queue entries (one CQ per fabric; above every outstanding WR).
pub const CQ_ENTRIES: u32 = 4096;
/// Local ACK timeout exponent: 4.096 µs * 2^14 ≈ 67 ms per try.
pub const QP_TIMEOUT: u8 = 14;
/// Transport retries before `RETRY_EXC_ERR` (the peer is gone).
pub const QP_RETRY_CNT: u8 = 7;
/// RNR retries (7 = infinite; the node never receives, the peer never sends: unused).
pub const QP_RNR_RETRY: u8 = 7;
/// Minimal RNR NAK timer (12 = 0.64 ms).
const MIN_RNR_TIMER: u8 = 12;
/// GRH hop limit on RoCE v2 (routed).
const HOP_LIMIT: u8 = 64;
/// Largest value of a 24-bit QP number / PSN.
const MAX_24BIT: u32 = 0x00ff_ffff;

/// The fabric's completion queue and its event channel.
///
/// Invariant: `cq` belongs to `channel`; every event taken is acked at once (so destroying the
/// CQ never waits); dropped after every QP using it (each QP holds an `Arc<Cq>`).
pub(super) struct Cq {
    cq: *mut ibv_cq,
    channel: *mut ibv_comp_channel,
    dev: Arc<Device>,
}

// SAFETY: CQ polling and notification are thread-safe in libibverbs (provider locks); the
// pointers are freed only in `Drop`.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: no QP uses the CQ any more (they hold an Arc to it); all events were acked.
        unsafe { ibv_destroy_cq(self.cq) };
        // SAFETY: the channel's only CQ is gone.
        unsafe { ibv_destroy_comp_channel(self.channel) };
    }
}

/// One completion, copied out of `ibv_wc`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub vendor_err: u32,
}

impl Cq {
    /// Creates the channel (non-blocking fd) and a CQ of [`CQ_ENTRIES`], armed.
    pub fn new(dev: &Arc<Device>) -> HwResult<Arc<Cq>> {
        // SAFETY: valid context.
        let channel = unsafe { ibv_create_comp_channel(dev.ctx()) };
        if channel.is_null() {
            return Err(HwError::last_os("ibv_create_comp_channel"));
        }
        // SAFETY: `channel` is live; its fd is owned by libibverbs, we only add O_NONBLOCK.
        let fd = unsafe { (*channel).fd };
        // SAFETY: F_GETFL/F_SETFL on a valid fd.
        let ok = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
        };
        if !ok {
            let e = io::Error::last_os_error();
            // SAFETY: created above, nothing uses it.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(HwError::os(
                "fcntl(O_NONBLOCK) on the completion channel",
                e,
            ));
        }
        // SAFETY: valid context and channel; no CQ context pointer.
        let cq = unsafe {
            ibv_create_cq(
                dev.ctx(),
                CQ_ENTRIES as libc::c_int,
                std::ptr::null_mut(),
                channel,
                0,
            )
        };
        if cq.is_null() {
            let e = io::Error::last_os_error();
            // SAFETY: created above, no CQ on it.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(HwError::os("ibv_create_cq", e));
        }
        let cq = Arc::new(Cq {
            cq,
            channel,
            dev: dev.clone(),
        });
        cq.arm()?;
        Ok(cq)
    }

    fn arm(&self) -> HwResult<()> {
        // SAFETY: live CQ.
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 {
            return Err(HwError::os(
                "ibv_req_notify_cq",
                io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// Appends up to `max` completions to `out`; `Err` if the CQ is broken (overrun, device
    /// removed).
    pub fn poll(&self, out: &mut Vec<Wc>, max: usize) -> HwResult<usize> {
        const BATCH: usize = 64;
        // SAFETY: all-zero is a valid `ibv_wc` (integers and a plain union).
        let mut wcs: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        let mut total = 0;
        while total < max {
            let want = (max - total).min(BATCH);
            // SAFETY: live CQ; `wcs` has room for `want` entries.
            let n = unsafe { ibv_poll_cq(self.cq, want as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(HwError::os("ibv_poll_cq", io::Error::from_raw_os_error(-n)));
            }
            let n = n as usize;
            for wc in &wcs[..n] {
                out.push(Wc {
                    wr_id: wc.wr_id,
                    status: wc.status,
                    vendor_err: wc.vendor_err,
                });
            }
            total += n;
            if n < want {
                break;
            }
        }
        Ok(total)
    }

    /// Waits up to `timeout` for a completion event; on one, acks it and re-arms the CQ. The
    /// caller polls the CQ afterwards (re-arm then poll: no completion is missed).
    pub fn wait(&self, timeout: Duration) {
        // SAFETY: live channel.
        let fd = unsafe { (*self.channel).fd };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc <= 0 {
            return;
        }
        let mut ev_cq: *mut ibv_cq = std::ptr::null_mut();
        let mut ev_ctx: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: live channel (non-blocking: EAGAIN if another waiter took the event).
        let rc = unsafe { ibv_get_cq_event(self.channel, &mut ev_cq, &mut ev_ctx) };
        if rc == 0 {
            // SAFETY: the event is for our only CQ; ack it at once.
            unsafe { ibv_ack_cq_events(ev_cq, 1) };
            if let Err(e) = self.arm() {
                tracing::warn!(error = %e, "re-arming the RDMA completion queue failed");
            }
        }
    }
}

/// A reliable-connected queue pair.
///
/// Invariant: `raw` is a live QP on `cq` until drop; `psn` is its initial send PSN (24 bits).
/// Dropping it destroys the QP: the owner does so only when no WR of it is outstanding (or the
/// fabric itself is being dropped).
pub(crate) struct Qp {
    raw: *mut ibv_qp,
    psn: u32,
    cq: Arc<Cq>,
}

// SAFETY: posting and modifying a QP are thread-safe in libibverbs; the pointer is freed only
// in `Drop`.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Qp({} qpn {})", self.cq.dev.name, self.qpn())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by `create_init`, destroyed once.
        let rc = unsafe { ibv_destroy_qp(self.raw) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_qp failed (leaked)");
        }
    }
}

fn random_psn() -> u32 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(0x6b76_6e6f_6465); // any input: the keys are random per RandomState
    (h.finish() as u32) & MAX_24BIT
}

fn modify(
    qp: *mut ibv_qp,
    attr: &mut ibv_qp_attr,
    mask: ibv_qp_attr_mask,
    step: &'static str,
) -> HwResult<()> {
    // SAFETY: live QP, valid attribute struct with the masked fields set.
    let rc = unsafe { ibv_modify_qp(qp, attr, mask.0 as libc::c_int) };
    if rc != 0 {
        return Err(HwError::os(step, io::Error::from_raw_os_error(rc)));
    }
    Ok(())
}

fn zeroed_attr() -> ibv_qp_attr {
    // SAFETY: all-zero is a valid `ibv_qp_attr` (integers, enums with a 0 value, plain unions).
    unsafe { std::mem::zeroed() }
}

impl Qp {
    /// Creates an RC QP on `cq` and moves it to INIT. `remote_access`: the peer may READ and
    /// WRITE our memory through it (engine side); the node's QPs allow no remote access.
    pub(super) fn create_init(cq: &Arc<Cq>, remote_access: bool) -> HwResult<Qp> {
        let dev = &cq.dev;
        // SAFETY: all-zero is a valid `ibv_qp_init_attr` (pointers NULL, integers 0).
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq;
        init.recv_cq = cq.cq;
        init.cap.max_send_wr = QP_MAX_SEND_WR;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = QP_MAX_SGE;
        init.cap.max_recv_sge = 1;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // SAFETY: live PD and CQ, valid init attributes.
        let raw = unsafe { ibv_create_qp(dev.pd(), &mut init) };
        if raw.is_null() {
            return Err(HwError::last_os("ibv_create_qp"));
        }
        let qp = Qp {
            raw,
            psn: random_psn(),
            cq: cq.clone(),
        };
        let mut a = zeroed_attr();
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = dev.port;
        a.qp_access_flags = if remote_access {
            (ibv_access_flags::IBV_ACCESS_REMOTE_READ | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE).0
        } else {
            0
        };
        modify(
            qp.raw,
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        Ok(qp)
    }

    /// The QP number.
    pub(super) fn qpn(&self) -> u32 {
        // SAFETY: live QP; `qp_num` is set at creation and never changes.
        unsafe { (*self.raw).qp_num }
    }

    /// The CQ this QP completes on.
    pub(super) fn cq(&self) -> &Arc<Cq> {
        &self.cq
    }

    /// What the peer needs to connect to this QP.
    pub(super) fn endpoint(&self) -> RdmaEndpoint {
        let dev = &self.cq.dev;
        RdmaEndpoint {
            qpn: self.qpn(),
            psn: self.psn,
            gid: dev.gid.gid,
            lid: dev.lid,
            mtu: dev.mtu as u8,
        }
    }

    /// INIT -> RTR -> RTS towards `remote` (untrusted: checked first).
    pub(super) fn connect(&self, remote: &RdmaEndpoint) -> HwResult<()> {
        let dev = &self.cq.dev;
        check_endpoint(remote, dev.link)?;
        let mut a = zeroed_attr();
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = dev.mtu.min(u32::from(remote.mtu));
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = dev.rd_atomic;
        a.min_rnr_timer = MIN_RNR_TIMER;
        a.ah_attr.port_num = dev.port;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        if dev.link == LinkLayer::Ethernet || remote.lid == 0 {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = dev.gid.index;
            a.ah_attr.grh.hop_limit = HOP_LIMIT;
        }
        modify(
            self.raw,
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;
        let mut a = zeroed_attr();
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = QP_TIMEOUT;
        a.retry_cnt = QP_RETRY_CNT;
        a.rnr_retry = QP_RNR_RETRY;
        a.sq_psn = self.psn;
        a.max_rd_atomic = dev.rd_atomic;
        modify(
            self.raw,
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Moves the QP to ERR: every posted WR completes (`IBV_WC_WR_FLUSH_ERR` if not done).
    pub(super) fn to_err(&self) -> HwResult<()> {
        let mut a = zeroed_attr();
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        modify(
            self.raw,
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(ERR)",
        )
    }

    /// Posts one chain: `wrs[i]` with `ids[i]`, lkey `lkeys[i]`, local address
    /// `base + local_offset`; only the last is signalled. `Err((posted, errno))`: the first
    /// `posted` WRs were posted, the rest were not.
    pub(super) fn post_chain(
        &self,
        dir: Dir,
        base: u64,
        wrs: &[WrPlan],
        ids: &[u64],
        lkeys: &[u32],
    ) -> Result<(), (usize, i32)> {
        debug_assert!(!wrs.is_empty() && wrs.len() == ids.len() && wrs.len() == lkeys.len());
        let opcode = match dir {
            Dir::Pull => ibv_wr_opcode::IBV_WR_RDMA_READ,
            Dir::Push => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        };
        let mut sges: Vec<ibv_sge> = wrs
            .iter()
            .zip(lkeys)
            .map(|(w, &lkey)| ibv_sge {
                addr: base + w.local_offset,
                length: w.len,
                lkey,
            })
            .collect();
        // SAFETY: all-zero is a valid `ibv_send_wr` (NULL pointers, integers, plain unions).
        let mut sends: Vec<ibv_send_wr> =
            wrs.iter().map(|_| unsafe { std::mem::zeroed() }).collect();
        let n = wrs.len();
        let sge_ptr = sges.as_mut_ptr();
        let send_ptr = sends.as_mut_ptr();
        for (i, (s, w)) in sends.iter_mut().zip(wrs).enumerate() {
            s.wr_id = ids[i];
            // SAFETY: `i < n`: inside `sges` (not reallocated after this point).
            s.sg_list = unsafe { sge_ptr.add(i) };
            s.num_sge = 1;
            s.opcode = opcode;
            s.send_flags = if i + 1 == n {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            s.wr.rdma = rdma_t {
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            };
            s.next = if i + 1 < n {
                // SAFETY: `i + 1 < n`: inside `sends` (not reallocated after this point).
                unsafe { send_ptr.add(i + 1) }
            } else {
                std::ptr::null_mut()
            };
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP in RTS (or ERR: the provider refuses); the chain and its SGEs are
        // valid for the call (the provider copies them into the send queue).
        let rc = unsafe { rdma_sys::ibv_post_send(self.raw, send_ptr, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let posted = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into `sends` (the provider returns the first WR not posted).
            usize::try_from(unsafe { bad.offset_from(send_ptr) })
                .unwrap_or(0)
                .min(n)
        };
        Err((posted, rc))
    }
}

/// Checks an untrusted peer endpoint.
pub(super) fn check_endpoint(remote: &RdmaEndpoint, link: LinkLayer) -> HwResult<()> {
    let bad = |m: String| Err(HwError::Invalid(format!("peer RDMA endpoint: {m}")));
    if remote.qpn == 0 || remote.qpn > MAX_24BIT {
        return bad(format!("QP number {} is not in 1..=0xffffff", remote.qpn));
    }
    if remote.psn > MAX_24BIT {
        return bad(format!("PSN {:#x} is over 24 bits", remote.psn));
    }
    if !(1..=5).contains(&remote.mtu) {
        return bad(format!(
            "MTU enum {} is not in 1..=5 (IBV_MTU_256..4096)",
            remote.mtu
        ));
    }
    let zero = remote.gid == [0u8; 16];
    if (link == LinkLayer::Ethernet || remote.lid == 0) && zero {
        return bad("zero GID".into());
    }
    Ok(())
}

/// The error of a failed work completion.
pub(super) fn wc_error(status: u32, vendor_err: u32) -> FabricError {
    use ibv_wc_status::*;
    let name = match status {
        IBV_WC_WR_FLUSH_ERR => return FabricError::Flushed,
        IBV_WC_RETRY_EXC_ERR | IBV_WC_RNR_RETRY_EXC_ERR | IBV_WC_RESP_TIMEOUT_ERR => {
            return FabricError::PeerGone
        }
        IBV_WC_REM_ACCESS_ERR => return FabricError::Remote("REM_ACCESS_ERR".into()),
        IBV_WC_REM_INV_REQ_ERR => return FabricError::Remote("REM_INV_REQ_ERR".into()),
        IBV_WC_REM_OP_ERR => return FabricError::Remote("REM_OP_ERR".into()),
        IBV_WC_REM_INV_RD_REQ_ERR => return FabricError::Remote("REM_INV_RD_REQ_ERR".into()),
        IBV_WC_REM_ABORT_ERR => return FabricError::Remote("REM_ABORT_ERR".into()),
        IBV_WC_LOC_LEN_ERR => "LOC_LEN_ERR",
        IBV_WC_LOC_QP_OP_ERR => "LOC_QP_OP_ERR",
        IBV_WC_LOC_PROT_ERR => "LOC_PROT_ERR",
        IBV_WC_LOC_ACCESS_ERR => "LOC_ACCESS_ERR",
        IBV_WC_BAD_RESP_ERR => "BAD_RESP_ERR",
        IBV_WC_FATAL_ERR => "FATAL_ERR",
        IBV_WC_GENERAL_ERR => "GENERAL_ERR",
        _ => "unexpected work completion status",
    };
    FabricError::Local(format!(
        "{name} (status {status}, vendor_err {vendor_err:#x})"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wc_errors_map_like_the_fake() {
        use ibv_wc_status::*;
        assert_eq!(wc_error(IBV_WC_WR_FLUSH_ERR, 0), FabricError::Flushed);
        assert_eq!(
            wc_error(IBV_WC_REM_ACCESS_ERR, 0),
            FabricError::Remote(crate::fabric::REM_ACCESS_ERR.into())
        );
        assert_eq!(wc_error(IBV_WC_RETRY_EXC_ERR, 0), FabricError::PeerGone);
        let FabricError::Local(m) = wc_error(IBV_WC_LOC_PROT_ERR, 0x33) else {
            panic!("local")
        };
        assert!(m.contains("LOC_PROT_ERR") && m.contains("0x33"), "{m}");
        assert!(matches!(wc_error(999, 0), FabricError::Local(_)));
    }

    #[test]
    fn untrusted_endpoints_are_checked() {
        let ok = RdmaEndpoint {
            qpn: 0x1234,
            psn: 0xabcdef,
            gid: std::net::Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0x0a00, 5]).octets(),
            lid: 0,
            mtu: 5,
        };
        assert!(check_endpoint(&ok, LinkLayer::Ethernet).is_ok());
        for (bad, what) in [
            (RdmaEndpoint { qpn: 0, ..ok }, "QP number"),
            (RdmaEndpoint { qpn: 1 << 24, ..ok }, "QP number"),
            (RdmaEndpoint { psn: 1 << 24, ..ok }, "PSN"),
            (RdmaEndpoint { mtu: 0, ..ok }, "MTU"),
            (RdmaEndpoint { mtu: 6, ..ok }, "MTU"),
            (RdmaEndpoint { gid: [0; 16], ..ok }, "zero GID"),
        ] {
            let e = check_endpoint(&bad, LinkLayer::Ethernet)
                .unwrap_err()
                .to_string();
            assert!(e.contains(what), "{e}");
        }
        // InfiniBand with a LID needs no GID.
        let ib = RdmaEndpoint {
            gid: [0; 16],
            lid: 7,
            ..ok
        };
        assert!(check_endpoint(&ib, LinkLayer::InfiniBand).is_ok());
        assert!(random_psn() <= MAX_24BIT);
    }
}
