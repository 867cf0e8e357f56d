//! The raw peer's buffers, on the page size the node's pool has (the bench asks for it): the
//! node receives stores into and sends retrieves from its pool, so a raw stream into 4 KiB pages
//! would understate the path's limit next to a node on huge pages (on this VM a receive into
//! 4 KiB pages ran about a third slower than into 2 MiB hugetlb pages, in the same run).
//! Finished buffers are kept for the next connection, so no timed transfer pays page faults.

use std::sync::Mutex;

use memmap2::{Advice, MmapMut, MmapOptions};

/// Huge page size the mappings are rounded to.
const HUGE_BYTES: usize = 2 << 20;
/// Spare buffers kept at most (each at most `rawtcp::MAX_PEER_BUF_BYTES`).
const MAX_SPARES: usize = 8;

/// Page backing of a peer buffer (wire code in the raw-peer header and totals).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// Plain heap memory (4 KiB pages).
    Small = 0,
    /// Anonymous memory advised `MADV_HUGEPAGE` (transparent huge pages when the kernel grants).
    Thp = 1,
    /// 2 MiB hugetlb pages (reserved pages; falls back to `Thp` when none are free).
    Huge2M = 2,
}

impl Pages {
    /// The backing for a node pool reported as `pool_backing` (`hugetlb-*`, `thp`, `4k`).
    pub fn for_pool_backing(backing: &str) -> Pages {
        if backing.starts_with("hugetlb") {
            Pages::Huge2M
        } else if backing == "thp" {
            Pages::Thp
        } else {
            Pages::Small
        }
    }

    /// From the wire code (unknown codes: `Small`).
    pub fn from_code(code: u64) -> Pages {
        match code {
            2 => Pages::Huge2M,
            1 => Pages::Thp,
            _ => Pages::Small,
        }
    }

    /// Its name in the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Pages::Small => "4k",
            Pages::Thp => "thp-advised",
            Pages::Huge2M => "hugetlb-2m",
        }
    }
}

enum Mem {
    Heap(Vec<u8>),
    Map(MmapMut),
}

/// A buffer of exactly `len` bytes, every page written once. Invariant: `pages` is what it
/// got, which may be less than asked; returned to the spares on drop.
pub struct PeerBuf {
    mem: Mem,
    len: usize,
    asked: Pages,
    pages: Pages,
}

static SPARES: Mutex<Vec<PeerBuf>> = Mutex::new(Vec::new());

fn map(len: usize, pages: Pages) -> Option<MmapMut> {
    let rounded = len.div_ceil(HUGE_BYTES) * HUGE_BYTES;
    match pages {
        Pages::Huge2M => MmapOptions::new()
            .len(rounded)
            .huge(Some(21))
            .populate()
            .map_anon()
            .ok(),
        Pages::Thp => {
            let m = MmapMut::map_anon(rounded).ok()?;
            m.advise(Advice::HugePage).ok()?;
            Some(m)
        }
        Pages::Small => None,
    }
}

impl PeerBuf {
    /// A spare buffer of `len` bytes asked with `want`, else a new one (hugetlb falls back to
    /// THP, THP to the heap).
    pub fn take(len: usize, want: Pages) -> PeerBuf {
        let mut spares = SPARES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(i) = spares.iter().position(|b| b.len == len && b.asked == want) {
            return spares.swap_remove(i);
        }
        drop(spares);
        let mut order = vec![want];
        if want == Pages::Huge2M {
            order.push(Pages::Thp);
        }
        let (mem, pages) = order
            .into_iter()
            .find_map(|p| map(len, p).map(|m| (Mem::Map(m), p)))
            .unwrap_or_else(|| (Mem::Heap(vec![0u8; len]), Pages::Small));
        let mut b = PeerBuf {
            mem,
            len,
            asked: want,
            pages,
        };
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8) ^ 0xA5;
        }
        b
    }

    /// What it is on.
    pub fn pages(&self) -> Pages {
        self.pages
    }
}

impl std::ops::Deref for PeerBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.mem {
            Mem::Heap(v) => v,
            Mem::Map(m) => &m[..self.len],
        }
    }
}

impl std::ops::DerefMut for PeerBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Mem::Heap(v) => v,
            Mem::Map(m) => &mut m[..self.len],
        }
    }
}

/// Returns `b` to the spares (dropped when there are [`MAX_SPARES`] already).
pub fn give_back(b: PeerBuf) {
    let mut spares = SPARES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if spares.len() < MAX_SPARES {
        spares.push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_backing_gives_a_written_buffer_of_the_length() {
        for want in [Pages::Small, Pages::Thp, Pages::Huge2M] {
            let b = PeerBuf::take(3 << 20, want);
            assert_eq!(b.len(), 3 << 20);
            assert_eq!(b[1], 1 ^ 0xA5);
            assert!(want != Pages::Small || b.pages() == Pages::Small);
            give_back(b);
        }
        assert_eq!(Pages::for_pool_backing("hugetlb-1g"), Pages::Huge2M);
        assert_eq!(Pages::for_pool_backing("4k"), Pages::Small);
        assert_eq!(Pages::from_code(Pages::Thp as u64), Pages::Thp);
    }
}
