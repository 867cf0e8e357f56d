//! Pure planning of RDMA posts: slicing a batch into work requests, chaining them, encoding
//! their ids, bounding the WRs outstanding on a device (credits + FIFO) and tracking each op's
//! progress. No FFI here: `fabric.rs` turns the plans into `ibv_send_wr` chains.
//!
//! How the pieces keep the [`Fabric`](crate::fabric::Fabric) invariant:
//! * A batch becomes chains of at most [`MAX_CHAIN_WRS`] WRs; only the **last** WR of a chain
//!   is signalled. A reliable-connected send queue completes its WRs in order, so the CQE of a
//!   chain's last WR (success, error or flush — an error/flush CQE is produced for a signalled WR
//!   in every case) means every WR of the chain is done with its local range.
//! * An op is finished ([`OpProgress::is_done`]) only when every chain that was handed to the
//!   device has returned that last CQE, and every chain that was never handed over was cancelled.
//!   Only then is its completion returned, so no local range is touched after it.
//! * [`Admission`] hands out chains in FIFO order while the device's outstanding-WR credit lasts
//!   (the incast bound): excess batches wait, never fail.

use std::collections::VecDeque;

use crate::fabric::types::{FabricError, RemoteSeg, WorkItem};

/// Largest work request: items longer than this are sliced.
pub const MAX_WR_BYTES: u64 = 1 << 20;

/// Most WRs in one `ibv_post_send` chain (only the last is signalled).
pub const MAX_CHAIN_WRS: usize = 32;

/// Default bound on WRs outstanding on one device (posted, chain CQE not yet seen): the incast
/// bound, below the queue pair's `max_send_wr` and the CQ size.
pub const DEFAULT_MAX_OUTSTANDING_WR: u32 = 256;

/// Most WRs one batch may need (32 GiB at 1 MiB per WR; bounds the plan's memory).
pub const MAX_BATCH_WRS: usize = 32 * 1024;

const WR_BITS: u32 = 6;
const CHAIN_BITS: u32 = 16;
/// Largest op sequence number a [`WrId`] can carry (42 bits).
pub const MAX_WR_SEQ: u64 = (1 << (64 - WR_BITS - CHAIN_BITS)) - 1;

/// One RDMA READ/WRITE work request: a slice of one work item.
///
/// Invariant: `len > 0`, `len <= max_wr_bytes`; `local_offset + len` and `remote_addr + len`
/// do not overflow (checked by [`build_chains`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrPlan {
    /// Index of the item in the batch.
    pub item: u32,
    /// Pool offset of the first byte.
    pub local_offset: u64,
    /// Remote virtual address of the first byte.
    pub remote_addr: u64,
    /// The remote key of the engine's region.
    pub rkey: u32,
    /// Bytes.
    pub len: u32,
}

/// WRs posted with one `ibv_post_send`.
///
/// Invariant: `1..=chain_wrs` WRs; only the last is signalled ([`ChainPlan::signalled`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainPlan {
    /// The WRs, in post order.
    pub wrs: Vec<WrPlan>,
}

impl ChainPlan {
    /// Whether WR `i` of the chain asks for a completion (only the last one does).
    pub fn signalled(&self, i: usize) -> bool {
        i + 1 == self.wrs.len()
    }

    /// The chain's bytes.
    pub fn bytes(&self) -> u64 {
        self.wrs.iter().map(|w| u64::from(w.len)).sum()
    }
}

/// Slices `items` into WRs of at most `max_wr_bytes` and groups them into chains of at most
/// `chain_wrs`, keeping the items' order.
///
/// Errors (the batch is refused whole): no item, an empty or overflowing local range, a remote
/// range whose end overflows, a `Stream` segment, a bad parameter, more than
/// [`MAX_BATCH_WRS`] WRs.
pub fn build_chains(
    items: &[WorkItem],
    max_wr_bytes: u64,
    chain_wrs: usize,
) -> Result<Vec<ChainPlan>, String> {
    if max_wr_bytes == 0 || max_wr_bytes > u64::from(u32::MAX) {
        return Err(format!(
            "max_wr_bytes {max_wr_bytes} must be in 1..={}",
            u32::MAX
        ));
    }
    if chain_wrs == 0 || chain_wrs >= (1 << WR_BITS) {
        return Err(format!(
            "chain length {chain_wrs} must be in 1..={}",
            (1 << WR_BITS) - 1
        ));
    }
    if items.is_empty() {
        return Err("batch has no items".into());
    }
    if items.len() > u32::MAX as usize {
        return Err("batch has too many items".into());
    }
    let mut total_wrs = 0usize;
    for (i, it) in items.iter().enumerate() {
        let RemoteSeg::Rdma { addr, .. } = it.remote else {
            return Err(format!(
                "item {i}: stream segments are not supported by the RDMA fabric"
            ));
        };
        if it.local.len == 0 {
            return Err(format!("item {i}: empty local range"));
        }
        if it.local.end().is_none() {
            return Err(format!("item {i}: local range overflows"));
        }
        if addr.checked_add(it.local.len).is_none() {
            return Err(format!("item {i}: remote range at {addr:#x} overflows"));
        }
        let n = it.local.len.div_ceil(max_wr_bytes);
        total_wrs = total_wrs.saturating_add(usize::try_from(n).unwrap_or(usize::MAX));
        if total_wrs > MAX_BATCH_WRS {
            return Err(format!(
                "batch needs more than {MAX_BATCH_WRS} work requests (MAX_BATCH_WRS) of at most \
                 {max_wr_bytes} bytes"
            ));
        }
    }
    let mut chains: Vec<ChainPlan> = Vec::with_capacity(total_wrs.div_ceil(chain_wrs));
    let mut cur: Vec<WrPlan> = Vec::with_capacity(chain_wrs.min(total_wrs));
    for (i, it) in items.iter().enumerate() {
        let RemoteSeg::Rdma { addr, rkey } = it.remote else {
            unreachable!("checked above");
        };
        let mut done = 0u64;
        while done < it.local.len {
            let len = (it.local.len - done).min(max_wr_bytes);
            cur.push(WrPlan {
                item: i as u32,
                local_offset: it.local.offset + done,
                remote_addr: addr + done,
                rkey,
                len: len as u32,
            });
            done += len;
            if cur.len() == chain_wrs {
                chains.push(ChainPlan {
                    wrs: std::mem::replace(&mut cur, Vec::with_capacity(chain_wrs)),
                });
            }
        }
    }
    if !cur.is_empty() {
        chains.push(ChainPlan { wrs: cur });
    }
    Ok(chains)
}

/// The 64-bit `wr_id` of a WR: which op (sequence number), which chain, which WR of the chain.
///
/// Invariant: `seq <= MAX_WR_SEQ`, `chain < 2^16`, `wr < 2^6`; [`WrId::decode`] inverts
/// [`WrId::encode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrId {
    /// The fabric's internal op sequence number.
    pub seq: u64,
    /// Chain index in the op.
    pub chain: u32,
    /// WR index in the chain.
    pub wr: u8,
}

impl WrId {
    /// Packs the id (`None` if a field is out of range).
    pub fn encode(self) -> Option<u64> {
        if self.seq > MAX_WR_SEQ
            || self.chain >= (1 << CHAIN_BITS)
            || u32::from(self.wr) >= (1 << WR_BITS)
        {
            return None;
        }
        Some(
            (self.seq << (WR_BITS + CHAIN_BITS))
                | (u64::from(self.chain) << WR_BITS)
                | u64::from(self.wr),
        )
    }

    /// Unpacks an id.
    pub fn decode(v: u64) -> WrId {
        WrId {
            seq: v >> (WR_BITS + CHAIN_BITS),
            chain: ((v >> WR_BITS) & ((1 << CHAIN_BITS) - 1)) as u32,
            wr: (v & ((1 << WR_BITS) - 1)) as u8,
        }
    }
}

struct Queued<K> {
    key: K,
    /// WR count of each chain not yet handed out, in order.
    chains: VecDeque<u32>,
    /// Index of the next chain to hand out.
    next: usize,
}

/// Credit accounting for the WRs outstanding on one device, with a FIFO of waiting ops.
///
/// Invariant: `outstanding() <= limit` at all times; chains are handed out strictly in
/// enqueue order (an op's chains in order, ops in FIFO order: the head blocks the rest, so a
/// big batch is never starved by small ones); every chain length is `<= limit` (checked by
/// [`Admission::push`]), so the head always fits once enough credit has returned.
pub struct Admission<K> {
    limit: u32,
    outstanding: u32,
    queue: VecDeque<Queued<K>>,
}

impl<K: Copy + Eq> Admission<K> {
    /// An empty admission with `limit` WRs of credit (`> 0`).
    pub fn new(limit: u32) -> Result<Admission<K>, String> {
        if limit == 0 {
            return Err("max_outstanding_wr must be > 0".into());
        }
        Ok(Admission {
            limit,
            outstanding: 0,
            queue: VecDeque::new(),
        })
    }

    /// Queues the chains (their WR counts) of op `key` at the tail. Refused (nothing queued)
    /// when a chain is empty or longer than the limit.
    pub fn push(&mut self, key: K, chain_wrs: impl IntoIterator<Item = u32>) -> Result<(), String> {
        let chains: VecDeque<u32> = chain_wrs.into_iter().collect();
        if chains.is_empty() {
            return Err("op has no chain".into());
        }
        if let Some(bad) = chains.iter().find(|&&n| n == 0 || n > self.limit) {
            return Err(format!(
                "chain of {bad} WRs cannot fit the outstanding-WR limit {}",
                self.limit
            ));
        }
        self.queue.push_back(Queued {
            key,
            chains,
            next: 0,
        });
        Ok(())
    }

    /// Hands out the head's next chain if its WRs fit the remaining credit: takes the credit
    /// and returns `(op, chain index, wrs)`. `None`: nothing queued, or the head must wait.
    pub fn next_ready(&mut self) -> Option<(K, usize, u32)> {
        let head = self.queue.front_mut()?;
        let need = *head.chains.front()?;
        if self.outstanding + need > self.limit {
            return None;
        }
        head.chains.pop_front();
        let idx = head.next;
        head.next += 1;
        let key = head.key;
        if head.chains.is_empty() {
            self.queue.pop_front();
        }
        self.outstanding += need;
        Some((key, idx, need))
    }

    /// Returns the credit of a finished chain (its WR count).
    pub fn release(&mut self, wrs: u32) {
        debug_assert!(
            wrs <= self.outstanding,
            "release of more WRs than outstanding"
        );
        self.outstanding = self.outstanding.saturating_sub(wrs);
    }

    /// Drops every chain of `key` not yet handed out; returns how many were dropped.
    pub fn cancel(&mut self, key: K) -> usize {
        let mut dropped = 0;
        self.queue.retain(|q| {
            if q.key == key {
                dropped += q.chains.len();
                false
            } else {
                true
            }
        });
        dropped
    }

    /// WRs handed out and not yet released.
    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }

    /// Ops with chains waiting.
    pub fn queued_ops(&self) -> usize {
        self.queue.len()
    }

    /// The credit limit.
    pub fn limit(&self) -> u32 {
        self.limit
    }
}

/// Progress of one op (a posted batch) through its chains.
///
/// Invariant: `finished <= posted <= chains`; [`OpProgress::is_done`] only when no chain handed
/// to the device is still out and no chain can still be handed out; the first recorded error
/// wins (a deadline recorded before the teardown it causes stays the op's error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpProgress {
    chains: u32,
    posted: u32,
    finished: u32,
    cancelled: bool,
    error: Option<FabricError>,
}

impl OpProgress {
    /// An op of `chains` chains, none posted.
    pub fn new(chains: u32) -> OpProgress {
        OpProgress {
            chains,
            posted: 0,
            finished: 0,
            cancelled: false,
            error: None,
        }
    }

    /// A chain was handed to the device.
    pub fn posted_one(&mut self) {
        debug_assert!(self.posted < self.chains);
        self.posted = (self.posted + 1).min(self.chains);
    }

    /// A handed-over chain returned its last CQE.
    pub fn finished_one(&mut self) {
        debug_assert!(self.finished < self.posted);
        self.finished = (self.finished + 1).min(self.posted);
    }

    /// Records an error (kept only if none was recorded before).
    pub fn record(&mut self, e: FabricError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    /// No further chain will be handed out (teardown, broken connection, post failure).
    pub fn cancel_unposted(&mut self) {
        self.cancelled = true;
    }

    /// Chains handed to the device whose last CQE has not come yet.
    pub fn outstanding_chains(&self) -> u32 {
        self.posted - self.finished
    }

    /// Whether the op may complete: nothing out on the device, nothing left to hand out.
    pub fn is_done(&self) -> bool {
        self.finished == self.posted && (self.posted == self.chains || self.cancelled)
    }

    /// The op's result once done: the first error, else `Ok(bytes)` if every chain ran, else
    /// `Flushed` (cancelled without a recorded reason).
    pub fn result(&self, bytes: u64) -> Result<u64, FabricError> {
        match &self.error {
            Some(e) => Err(e.clone()),
            None if self.finished == self.chains => Ok(bytes),
            None => Err(FabricError::Flushed),
        }
    }
}

#[cfg(test)]
#[path = "post_tests.rs"]
mod tests;
