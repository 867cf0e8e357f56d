//! Memory registration: the node's pool (local access only) and an engine's buffers (remote
//! read/write, on the engine's side).
//!
//! The pool is registered with `IBV_ACCESS_LOCAL_WRITE` only: RDMA READ writes into it, RDMA
//! WRITE reads from it, both initiated by the node. It is never remotely accessible and its keys
//! never leave the node. It is registered in pieces of at most [`MAX_MR_REGION_BYTES`] (the
//! registration pins and maps every page: pieces go in parallel, at most
//! [`MAX_MR_THREADS`] threads).
//!
//! **Untested on hardware** (no RDMA on the development machine); `split_pieces` is tested.

use std::io;
use std::sync::Arc;

use rdma_sys::{ibv_access_flags, ibv_dereg_mr, ibv_mr, ibv_reg_dmabuf_mr, ibv_reg_mr};

use super::device::Device;
use crate::{HwError, HwResult, SharedPool};

/// Largest pool piece one `ibv_reg_mr` covers (and the default piece size).
pub const MAX_MR_REGION_BYTES: u64 = 1 << 30;

/// Smallest allowed piece size (a page).
pub const MIN_MR_REGION_BYTES: u64 = 4096;

/// Most threads registering pool pieces at once (and the default).
pub const MAX_MR_THREADS: usize = 8;

/// One registered memory region.
///
/// Invariant: `raw` is a live MR of `dev`'s PD until drop (deregistered exactly once there).
pub(super) struct Mr {
    raw: *mut ibv_mr,
    _dev: Arc<Device>,
}

// SAFETY: an MR handle may be used and deregistered from any thread (verbs are thread-safe);
// the pointer is only read (lkey/rkey) and freed in `Drop`.
unsafe impl Send for Mr {}
// SAFETY: `&Mr` only reads the immutable lkey/rkey fields.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers `[addr, addr + len)` with `access`.
    ///
    /// # Safety
    /// The range must stay mapped until the returned `Mr` is dropped.
    unsafe fn register(dev: &Arc<Device>, addr: *mut u8, len: usize, access: u32) -> HwResult<Mr> {
        // SAFETY: the PD is live (held by `dev`); the caller keeps the range mapped.
        let raw = unsafe { ibv_reg_mr(dev.pd(), addr.cast(), len, access as libc::c_int) };
        if raw.is_null() {
            return Err(HwError::os("ibv_reg_mr", io::Error::last_os_error()));
        }
        Ok(Mr {
            raw,
            _dev: dev.clone(),
        })
    }

    /// Registers `len` bytes at `offset` of the dma-buf `fd` (device memory exported by the GPU
    /// driver), addressed by the peer as `[iova, iova + len)`, with `access`.
    ///
    /// # Safety
    /// The exported memory must stay allocated until the returned `Mr` is dropped (the fd may
    /// be closed after registration; the MR holds its own reference to the dma-buf).
    unsafe fn register_dmabuf(
        dev: &Arc<Device>,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: u32,
    ) -> HwResult<Mr> {
        use std::os::fd::AsRawFd;
        // SAFETY: the PD is live (held by `dev`); `fd` is an open dma-buf; the caller keeps the
        // exported memory allocated.
        let raw = unsafe {
            ibv_reg_dmabuf_mr(
                dev.pd(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                access as libc::c_int,
            )
        };
        if raw.is_null() {
            return Err(HwError::os("ibv_reg_dmabuf_mr", io::Error::last_os_error()));
        }
        Ok(Mr {
            raw,
            _dev: dev.clone(),
        })
    }

    /// The local key (used in the node's scatter/gather entries).
    pub fn lkey(&self) -> u32 {
        // SAFETY: `raw` is live until drop; the field is set once by the provider.
        unsafe { (*self.raw).lkey }
    }

    /// The remote key (engine buffers only: the pool's never leaves the node).
    pub fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { (*self.raw).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by `Mr::register`, deregistered once. The owner guarantees no WR
        // uses it any more (the fabric's connections are gone before its MRs).
        let rc = unsafe { ibv_dereg_mr(self.raw) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dereg_mr failed (registration leaked)");
        }
    }
}

/// The pool's pieces: `(start offset, length)`, each at most `piece` bytes, covering `[0, total)`.
pub(super) fn split_pieces(total: u64, piece: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    if piece == 0 {
        return out;
    }
    let mut start = 0;
    while start < total {
        let len = piece.min(total - start);
        out.push((start, len));
        start += len;
    }
    out
}

/// The registered pool.
///
/// Invariant: `pieces[i]` covers `[start, start + len)` of the pool; the MRs are dropped before
/// the pool (field order), so the mapping outlives every registration.
pub(super) struct PoolMrs {
    /// `(start, len, mr)` in pool order.
    pub pieces: Vec<(u64, u64, Mr)>,
    /// Keeps the mapping alive while registered.
    pub pool: Arc<SharedPool>,
}

impl PoolMrs {
    /// The piece holding `[offset, offset + len)` entirely: `(index, lkey)`.
    pub fn find(&self, offset: u64, len: u64) -> Option<(usize, u32)> {
        let i = find_piece(self.pieces.iter().map(|p| (p.0, p.1)), offset, len)?;
        Some((i, self.pieces[i].2.lkey()))
    }
}

/// The index of the piece (sorted, contiguous `(start, len)`) holding `[offset, offset + len)`
/// entirely; `None` for an empty, overflowing, out-of-pool or piece-spanning range.
pub(super) fn find_piece(
    pieces: impl IntoIterator<Item = (u64, u64)>,
    offset: u64,
    len: u64,
) -> Option<usize> {
    let end = offset.checked_add(len)?;
    if len == 0 {
        return None;
    }
    pieces
        .into_iter()
        .position(|(start, plen)| offset >= start && end <= start + plen)
}

/// Registers the pool in pieces of `piece_bytes`, `threads` pieces at a time, with local
/// access only. All or nothing: on any failure every piece already registered is released.
pub(super) fn register_pool(
    dev: &Arc<Device>,
    pool: &Arc<SharedPool>,
    piece_bytes: u64,
    threads: usize,
) -> HwResult<PoolMrs> {
    let pieces = split_pieces(pool.len(), piece_bytes);
    let base = pool.region().as_ptr() as usize;
    let threads = threads.clamp(1, MAX_MR_THREADS).min(pieces.len().max(1));
    let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    let mut results: Vec<Option<HwResult<Mr>>> = (0..pieces.len()).map(|_| None).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let pieces = &pieces;
                s.spawn(move || {
                    let mut got = Vec::new();
                    for (i, &(start, len)) in pieces.iter().enumerate().skip(t).step_by(threads) {
                        let addr = (base + start as usize) as *mut u8;
                        // SAFETY: `[start, start + len)` lies inside the pool's mapping (split of
                        // `pool.len()`), which `PoolMrs::pool` keeps alive while registered.
                        let r = unsafe { Mr::register(dev, addr, len as usize, access) };
                        got.push((i, r));
                    }
                    got
                })
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(got) => {
                    for (i, r) in got {
                        results[i] = Some(r);
                    }
                }
                Err(_) => tracing::error!("an MR registration thread panicked"),
            }
        }
    });
    let mut out = Vec::with_capacity(pieces.len());
    for (i, r) in results.into_iter().enumerate() {
        let (start, len) = pieces[i];
        match r {
            Some(Ok(mr)) => out.push((start, len, mr)),
            Some(Err(e)) => {
                return Err(HwError::Invalid(format!(
                    "registering pool piece {i} ([{start}, {}) of {} bytes) failed: {e} \
                     (is the memlock limit, ulimit -l, large enough?)",
                    start + len,
                    pool.len()
                )))
            }
            None => {
                return Err(HwError::Invalid(format!(
                    "registering pool piece {i} did not finish (thread panicked)"
                )))
            }
        }
    }
    Ok(PoolMrs {
        pieces: out,
        pool: pool.clone(),
    })
}

/// An engine buffer registered for the node's RDMA READ and WRITE (engine side).
///
/// Invariant: while this value lives, the node's queue pair may read and write
/// `[addr, addr + len)` at any time it is asked to (with `rkey`); dropping it deregisters the
/// buffer (the NIC then refuses further access with `REM_ACCESS_ERR`).
pub struct EngineMr {
    mr: Mr,
    addr: u64,
    len: u64,
}

impl std::fmt::Debug for EngineMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineMr")
            .field("len", &self.len)
            .field("rkey", &self.rkey())
            .finish_non_exhaustive()
    }
}

impl EngineMr {
    /// Registers `[addr, addr + len)` with `LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE`.
    ///
    /// # Safety
    /// The range must stay mapped until the `EngineMr` is dropped, and the caller accepts that
    /// the peer's NIC may write it concurrently while it is registered (only into ranges the
    /// node was asked to fill).
    pub(super) unsafe fn register(dev: &Arc<Device>, addr: *mut u8, len: usize) -> HwResult<Self> {
        if len == 0 {
            return Err(HwError::Invalid(
                "cannot register an empty engine buffer".into(),
            ));
        }
        let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        // SAFETY: forwarded from the caller's contract.
        let mr = unsafe { Mr::register(dev, addr, len, access)? };
        Ok(EngineMr {
            mr,
            addr: addr as u64,
            len: len as u64,
        })
    }

    /// Registers exported device memory (GPUDirect RDMA through dma-buf) with the same access as
    /// [`EngineMr::register`]; the node addresses it as `[iova, iova + len)`.
    ///
    /// # Safety
    /// As for [`Mr::register_dmabuf`]; the caller accepts that the peer's NIC reads and writes
    /// the device memory while it is registered.
    pub(super) unsafe fn register_dmabuf(
        dev: &Arc<Device>,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
    ) -> HwResult<Self> {
        if len == 0 {
            return Err(HwError::Invalid(
                "cannot register empty device memory".into(),
            ));
        }
        let access = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        // SAFETY: forwarded from the caller's contract.
        let mr = unsafe { Mr::register_dmabuf(dev, fd, offset, len, iova, access)? };
        Ok(EngineMr {
            mr,
            addr: iova,
            len: len as u64,
        })
    }

    /// The buffer's virtual address (what the node's WRs name as remote address).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The buffer's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (empty buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The remote key the node's WRs must carry.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_pool_exactly() {
        const G: u64 = 1 << 30;
        assert_eq!(split_pieces(0, G), vec![]);
        assert_eq!(split_pieces(G, G), vec![(0, G)]);
        assert_eq!(split_pieces(G + 4096, G), vec![(0, G), (G, 4096)]);
        let p = split_pieces(10 * G + 7, G);
        assert_eq!(p.len(), 11);
        assert_eq!(p.iter().map(|x| x.1).sum::<u64>(), 10 * G + 7);
        assert!(p.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
        assert_eq!(split_pieces(5, 0), vec![]);
    }

    #[test]
    fn a_range_must_lie_inside_one_piece() {
        const G: u64 = 1 << 30;
        let p = split_pieces(2 * G + 4096, G);
        assert_eq!(find_piece(p.iter().copied(), 0, 4096), Some(0));
        assert_eq!(find_piece(p.iter().copied(), G - 4096, 4096), Some(0));
        assert_eq!(find_piece(p.iter().copied(), G, G), Some(1));
        assert_eq!(find_piece(p.iter().copied(), 2 * G, 4096), Some(2));
        assert_eq!(
            find_piece(p.iter().copied(), G - 4096, 8192),
            None,
            "spans two pieces"
        );
        assert_eq!(
            find_piece(p.iter().copied(), 2 * G, 4097),
            None,
            "past the pool"
        );
        assert_eq!(find_piece(p.iter().copied(), 10, 0), None, "empty");
        assert_eq!(find_piece(p.iter().copied(), u64::MAX, 2), None, "overflow");
    }
}
