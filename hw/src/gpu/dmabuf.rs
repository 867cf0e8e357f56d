//! dma-buf export of device memory for GPUDirect RDMA (`ibv_reg_dmabuf_mr`).
//!
//! The driver exports whole pages: the window handed to `cuMemGetHandleForAddressRange` must
//! start and end on a page boundary (kvnode uses the GPU's 64 KiB page) and stay inside the
//! allocation. The NIC registration then names the asked-for range by its offset in that window
//! and uses the device address itself as the I/O virtual address, so the node's work requests
//! address GPU memory exactly like host memory.

use std::os::fd::OwnedFd;

/// GPU page size used to align dma-buf windows.
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

/// The page-aligned window `(start, len)` to export for `[ptr, ptr + len)` inside the
/// allocation `[base, base + alloc_len)`: start rounded down and end rounded up to `page`, then
/// clamped to the allocation. `None` if the range is empty or not inside the allocation, or
/// `page` is not a power of two.
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
    let start = (ptr & !(page - 1)).max(base);
    let aligned_end = end.checked_add(page - 1).map(|e| e & !(page - 1))?;
    let stop = aligned_end.min(alloc_end);
    Some((start, stop - start))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = GPU_PAGE_BYTES;

    #[test]
    fn windows_are_page_aligned_and_inside_the_allocation() {
        let base = 0x7000_0000_0000;
        // Whole allocation.
        assert_eq!(
            dmabuf_window(base, 4 * P, base, 4 * P, P),
            Some((base, 4 * P))
        );
        // A middle range rounds out to pages.
        assert_eq!(
            dmabuf_window(base + P + 100, 10, base, 4 * P, P),
            Some((base + P, P))
        );
        // Spanning a page boundary takes both pages.
        assert_eq!(
            dmabuf_window(base + P - 1, 2, base, 4 * P, P),
            Some((base, 2 * P))
        );
        // The end clamps to an allocation that is not a whole number of pages.
        assert_eq!(
            dmabuf_window(base + P, 100, base, P + 100, P),
            Some((base + P, 100))
        );
        // An allocation starting off a page boundary clamps the start.
        assert_eq!(
            dmabuf_window(base + 4096, 10, base + 4096, P, P),
            Some((base + 4096, P - 4096))
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
    }

    /// Property: the window contains the range, lies in the allocation, and starts on a page
    /// boundary unless clamped to the allocation's start.
    #[test]
    fn windows_contain_the_range() {
        let mut x = 99u64;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let base = 0x1_0000_0000 + (x >> 40) * 512;
            let alloc_len = 1 + (x >> 20) % (8 * P);
            let off = (x >> 8) % alloc_len;
            let len = 1 + (x >> 3) % (alloc_len - off);
            let (s, l) = dmabuf_window(base + off, len, base, alloc_len, P).unwrap();
            assert!(s <= base + off && base + off + len <= s + l);
            assert!(s >= base && s + l <= base + alloc_len);
            assert!(s % P == 0 || s == base);
            assert!((s + l) % P == 0 || s + l == base + alloc_len);
        }
    }
}
