//! Turning a request's copy items into as few driver copies as possible: neighbouring items
//! whose host and device ranges both continue each other become one copy (consecutive slots of
//! one reservation and consecutive chunks of one device buffer are the common case).

/// One driver copy: `len` bytes between `host_offset` in the host memory and `device_ptr`.
///
/// Invariant: `len > 0`; produced by [`coalesce`] from checked items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlannedCopy {
    pub host_offset: u64,
    pub device_ptr: u64,
    pub len: u64,
}

/// Largest single merged copy (larger ones gain nothing and would hold one DMA engine longer).
pub(crate) const MAX_MERGED_COPY_BYTES: u64 = 256 << 20;

/// Merges each item into the previous copy when both its host offset and device address follow
/// that copy's end exactly and the merged copy stays within `max_merged`. Order is kept; no
/// byte is added, dropped or moved to another address.
pub(crate) fn coalesce(
    items: impl IntoIterator<Item = PlannedCopy>,
    max_merged: u64,
) -> Vec<PlannedCopy> {
    let mut out: Vec<PlannedCopy> = Vec::new();
    for it in items {
        if let Some(last) = out.last_mut() {
            let host_follows = last.host_offset.checked_add(last.len) == Some(it.host_offset);
            let dev_follows = last.device_ptr.checked_add(last.len) == Some(it.device_ptr);
            let fits = last
                .len
                .checked_add(it.len)
                .is_some_and(|l| l <= max_merged);
            if host_follows && dev_follows && fits {
                last.len += it.len;
                continue;
            }
        }
        out.push(it);
    }
    out
}

/// `Some((a, b))` for the first two of `ranges` (start, len) that overlap, in sorted order.
pub(crate) fn first_overlap(ranges: &mut [(u64, u64)]) -> Option<((u64, u64), (u64, u64))> {
    ranges.sort_unstable();
    ranges
        .windows(2)
        .find(|w| w[0].0 + w[0].1 > w[1].0)
        .map(|w| (w[0], w[1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(h: u64, d: u64, l: u64) -> PlannedCopy {
        PlannedCopy {
            host_offset: h,
            device_ptr: d,
            len: l,
        }
    }

    #[test]
    fn contiguous_items_merge_and_gaps_split() {
        let items = [
            c(0, 1000, 10),
            c(10, 1010, 10),
            c(20, 1030, 10),
            c(30, 1040, 10),
        ];
        assert_eq!(
            coalesce(items, u64::MAX),
            vec![c(0, 1000, 20), c(20, 1030, 20)],
            "device gap splits"
        );
        let items = [c(0, 0, 10), c(20, 10, 10)];
        assert_eq!(coalesce(items, u64::MAX).len(), 2, "host gap splits");
        let items = [c(10, 10, 10), c(0, 0, 10)];
        assert_eq!(
            coalesce(items, u64::MAX).len(),
            2,
            "order is kept, no sorting"
        );
    }

    #[test]
    fn merged_copies_respect_the_cap() {
        let items: Vec<_> = (0..10).map(|i| c(i * 4, 100 + i * 4, 4)).collect();
        let out = coalesce(items.clone(), 12);
        assert_eq!(
            out.iter().map(|p| p.len).collect::<Vec<_>>(),
            [12, 12, 12, 4]
        );
        assert_eq!(coalesce(items, u64::MAX), vec![c(0, 100, 40)]);
    }

    /// Property: coalescing preserves every byte's (host, device) pair.
    #[test]
    fn coalescing_preserves_the_byte_mapping() {
        let mut seed = 0x1234_5678_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..500 {
            let n = (next() % 12) as usize;
            let (mut h, mut d) = (0u64, 1u64 << 20);
            let mut items = Vec::new();
            for _ in 0..n {
                let len = 1 + next() % 8;
                items.push(c(h, d, len));
                h += len + if next() % 3 == 0 { 1 + next() % 4 } else { 0 };
                d += len + if next() % 3 == 0 { 1 + next() % 4 } else { 0 };
            }
            let cap = 1 + next() % 20;
            let out = coalesce(items.clone(), cap.max(8));
            let bytes = |v: &[PlannedCopy]| {
                let mut m: Vec<(u64, u64)> = v
                    .iter()
                    .flat_map(|p| (0..p.len).map(move |k| (p.host_offset + k, p.device_ptr + k)))
                    .collect();
                m.sort_unstable();
                m
            };
            assert_eq!(bytes(&items), bytes(&out));
            assert!(out.len() <= items.len());
            assert!(out.iter().all(|p| p.len > 0 && p.len <= cap.max(8).max(8)));
        }
    }

    #[test]
    fn overlaps_are_found_whatever_the_order() {
        assert_eq!(first_overlap(&mut [(10, 5), (0, 10), (15, 1)]), None);
        assert_eq!(
            first_overlap(&mut [(20, 5), (0, 10), (9, 2)]),
            Some(((0, 10), (9, 2)))
        );
        assert_eq!(first_overlap(&mut []), None);
    }
}
