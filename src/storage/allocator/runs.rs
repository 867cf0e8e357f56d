//! The free page runs: two ordered maps (`start -> len` and `(len, start)`) giving best-fit
//! run allocation and neighbour coalescing.

use super::SlabAllocator;

impl SlabAllocator {
    pub(super) fn insert_run(&mut self, start: u64, len: u64) {
        self.runs.insert(start, len);
        self.runs_by_len.insert((len, start));
    }

    fn remove_run(&mut self, start: u64, len: u64) {
        self.runs.remove(&start);
        self.runs_by_len.remove(&(len, start));
    }

    /// Best fit: the smallest free run of at least `p` pages (lowest start
    /// among equals); its first `p` pages are taken.
    pub(super) fn take_run(&mut self, p: u64) -> Option<u64> {
        let (len, start) = *self.runs_by_len.range((p, 0)..).next()?;
        self.remove_run(start, len);
        if len > p {
            self.insert_run(start + p, len - p);
        }
        Some(start)
    }

    /// Returns pages to the free runs, coalescing with both neighbours.
    pub(super) fn release_run(&mut self, start: u64, len: u64) {
        let (mut s, mut l) = (start, len);
        if let Some((&ps, &pl)) = self.runs.range(..start).next_back() {
            if ps + pl == start {
                self.remove_run(ps, pl);
                s = ps;
                l += pl;
            }
        }
        if let Some(&nl) = self.runs.get(&(start + len)) {
            self.remove_run(start + len, nl);
            l += nl;
        }
        self.insert_run(s, l);
    }
}
