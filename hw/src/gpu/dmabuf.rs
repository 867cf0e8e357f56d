//! dma-buf export of device memory for GPUDirect RDMA (`ibv_reg_dmabuf_mr`).
//!
//! `cuMemGetHandleForAddressRange` wants an address and a size aligned to the host page size:
//! the exported window is the asked-for range with its start rounded down and its end rounded up
//! to host pages. The start never goes below the allocation's base; the end may pass the
//! allocation's nominal size by less than a page (the driver backs device allocations in units
//! of at least 64 KiB, so those bytes exist and belong to the same allocation). The NIC
//! registration then names the asked-for range by its offset in that window and uses the device
//! address itself as the I/O virtual address, so the node's work requests address GPU memory
//! exactly like host memory.

use std::os::fd::OwnedFd;

/// Granularity of device allocations (the GPU's page), for reference in tests.
pub const GPU_PAGE_BYTES: u64 = 64 << 10;

/// An exported device range.
///
/// Invariant: `fd` is a dma-buf of `[window_start, window_start + window_len)`, which contains
/// `[iova, iova + len)` at `offset = iova - window_start`.
#[derive(Debug)]
pub struct DmaBufExport {
    /// The dma-buf file descriptor (closed on drop).
    pub fd: OwnedFd,
    /// Device address of the window's first byte.
    pub window_start: u64,
    /// Window length (whole GPU pages, or up to the allocation's end).
    pub window_len: u64,
    /// Offset of the asked-for range in the window.
    pub offset: u64,
    /// Length of the asked-for range.
    pub len: u64,
    /// The asked-for range's device address (the registration's I/O virtual address).
    pub iova: u64,
}

/// The window `(start, len)` to export for `[ptr, ptr + len)` inside the allocation
/// `[base, base + alloc_len)`: start rounded down and end rounded up to `page` (the host page).
/// `None` if the range is empty or not inside the allocation, `page` is not a power of two, or
/// rounding the start down would leave the allocation (a base off the page grid).
pub fn dmabuf_window(
    ptr: u64,
    len: u64,
    base: u64,
    alloc_len: u64,
    page: u64,
) -> Option<(u64, u64)> {
    if len == 0 || !page.is_power_of_two() {
        return None;
    }
    let end = ptr.checked_add(len)?;
    let alloc_end = base.checked_add(alloc_len)?;
    if ptr < base || end > alloc_end {
        return None;
    }
    let start = ptr & !(page - 1);
    if start < base {
        return None;
    }
    let stop = end.checked_add(page - 1)? & !(page - 1);
    Some((start, stop - start))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    #[test]
    fn windows_are_page_aligned_around_the_range() {
        let base = 0x7000_0000_0000;
        assert_eq!(
            dmabuf_window(base, 16 * P, base, 16 * P, P),
            Some((base, 16 * P))
        );
        assert_eq!(
            dmabuf_window(base + P + 100, 10, base, 16 * P, P),
            Some((base + P, P))
        );
        assert_eq!(
            dmabuf_window(base + P - 1, 2, base, 16 * P, P),
            Some((base, 2 * P))
        );
        // An allocation whose nominal size is not a page multiple: the end still rounds up.
        assert_eq!(
            dmabuf_window(base, 3 * P + 100, base, 3 * P + 100, P),
            Some((base, 4 * P))
        );
        // 64 KiB host pages (e.g. aarch64).
        let big = 64 << 10;
        assert_eq!(
            dmabuf_window(base + 5, 10, base, 4 * big, big),
            Some((base, big))
        );
    }

    #[test]
    fn bad_ranges_have_no_window() {
        let base = 0x7000_0000_0000;
        assert_eq!(dmabuf_window(base, 0, base, P, P), None);
        assert_eq!(dmabuf_window(base - 1, 2, base, P, P), None);
        assert_eq!(dmabuf_window(base + P - 1, 2, base, P, P), None);
        assert_eq!(dmabuf_window(base, 1, base, P, 3), None);
        assert_eq!(dmabuf_window(u64::MAX, 2, base, P, P), None);
        assert_eq!(
            dmabuf_window(base + 100, 1, base + 50, P, P),
            None,
            "base off the page grid"
        );
    }

    /// Property: the window is page-aligned at both ends, contains the range, starts inside
    /// the allocation and ends less than a page past it.
    #[test]
    fn windows_contain_the_range() {
        let mut x = 99u64;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let base = 0x1_0000_0000 + (x >> 44) * P;
            let alloc_len = 1 + (x >> 20) % (64 * P);
            let off = (x >> 8) % alloc_len;
            let len = 1 + (x >> 3) % (alloc_len - off);
            let (s, l) = dmabuf_window(base + off, len, base, alloc_len, P).unwrap();
            assert!(s <= base + off && base + off + len <= s + l);
            assert!(s >= base && s + l < base + alloc_len + P);
            assert!(s % P == 0 && l % P == 0);
        }
    }
}
