//! Options, peer memory and the seeded generator of [`FakeFabric`](super::FakeFabric)(super::FakeFabric).

/// Default size of one registered piece of the pool (like the RDMA fabric's MR pieces).
pub const FAKE_DEFAULT_REGION_BYTES: u64 = 1 << 30;

/// Default bound on ops in flight (beyond it `post` answers `Full`).
pub const FAKE_DEFAULT_MAX_INFLIGHT_OPS: usize = 4096;

/// The NIC's answer to a bad remote key or an out-of-bounds remote access.
pub const REM_ACCESS_ERR: &str = "REM_ACCESS_ERR";

/// The error of an injected (`error_pct`) failure.
pub const INJECTED_OP_ERR: &str = "REM_OP_ERR (injected)";

/// Faults and timing of a [`FakeFabric`](super::FakeFabric).
///
/// Invariant: validated by [`FakeFabric::new`](super::FakeFabric::new): `delay_ms.0 <= delay_ms.1`, every `*_pct <= 100`,
/// `region_bytes > 0`, `max_inflight_ops > 0`.
#[derive(Debug, Clone)]
pub struct FakeOptions {
    /// Seed of every random choice.
    pub seed: u64,
    /// Each op becomes due `lo..=hi` virtual ms after it was posted.
    pub delay_ms: (u64, u64),
    /// Percent of ops whose completion never comes on its own: they complete with `Deadline` at
    /// their deadline, or `Flushed` at teardown; no item is moved.
    pub drop_pct: u8,
    /// Whether ops may complete out of post order (else completions keep post order).
    pub reorder: bool,
    /// Percent of ops that fail with `Remote(INJECTED_OP_ERR)` after a seeded prefix of their
    /// items; the connection stays usable.
    pub error_pct: u8,
    /// Percent of ops during which the peer dies: a seeded prefix of the items is moved, the op
    /// completes with `PeerGone`, every other op of the connection with `Flushed`, and the
    /// connection is broken (posts answer `ConnGone`; `teardown` still ends it).
    pub peer_death_pct: u8,
    /// Whether a failed op leaves seeded garbage where its unmoved items would have written
    /// (Pull: the local ranges; Push: the peer's memory where in bounds).
    pub partial_garbage: bool,
    /// The pool is registered in pieces of this many bytes; a local range may not span two.
    pub region_bytes: u64,
    /// Bound on ops in flight (posted, not yet returned by `poll`).
    pub max_inflight_ops: usize,
}

impl Default for FakeOptions {
    fn default() -> Self {
        FakeOptions {
            seed: 0,
            delay_ms: (0, 20),
            drop_pct: 0,
            reorder: true,
            error_pct: 0,
            peer_death_pct: 0,
            partial_garbage: true,
            region_bytes: FAKE_DEFAULT_REGION_BYTES,
            max_inflight_ops: FAKE_DEFAULT_MAX_INFLIGHT_OPS,
        }
    }
}

/// One registered memory region of a fake peer.
///
/// Invariant: plain data; bytes `[addr, addr + bytes.len())` are accessible with `rkey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeRegion {
    /// Remote virtual address of `bytes[0]`.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// The memory.
    pub bytes: Vec<u8>,
}

/// A fake peer's registered memory.
///
/// Invariant: an access is allowed only inside one region with the matching key (the first
/// region with that key is used).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakePeer {
    /// The peer's regions.
    pub regions: Vec<FakeRegion>,
}

impl FakePeer {
    /// The region index and offset of `[addr, addr + len)` under `rkey`, or `None` (a NIC's
    /// `REM_ACCESS_ERR`).
    pub(super) fn locate(&self, addr: u64, rkey: u32, len: u64) -> Option<(usize, usize)> {
        let (idx, r) = self
            .regions
            .iter()
            .enumerate()
            .find(|(_, r)| r.rkey == rkey)?;
        let start = addr.checked_sub(r.addr)?;
        let end = start.checked_add(len)?;
        if end > r.bytes.len() as u64 {
            return None;
        }
        Some((idx, start as usize))
    }
}

/// splitmix64: small, seedable, deterministic.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(super) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    pub(super) fn pct(&mut self, pct: u8) -> bool {
        self.below(100) < u64::from(pct)
    }

    pub(super) fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}
