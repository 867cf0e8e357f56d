//! Per-operation request counters and fixed-bucket latency histograms on atomics, for the hot
//! path of every frontend (the native dispatcher, the LMCache handlers). A leaf: it imports
//! nothing from the crate, so any layer may keep an [`OpTable`] and `crate::metrics` (the top
//! layer) reads them at scrape time.
//!
//! Recording is three relaxed atomic adds (request count, bucket, time sum) plus one for an
//! error: no lock, no allocation. Readers see each counter exact at some instant; a scrape
//! taken while requests run may show a bucket a request was added to before the count was (a
//! histogram's `_count` is read first and its buckets clamped to it, so the exposition stays
//! monotonic within one sample).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Upper bounds (inclusive, in microseconds) of the latency buckets; one more bucket, `+Inf`,
/// takes the rest. From 10 us (a PING) to 10 s (a store stuck behind a full pool).
pub const LATENCY_BUCKETS_US: [u64; 19] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// Buckets kept per histogram: the bounded ones and `+Inf`.
const SLOTS: usize = LATENCY_BUCKETS_US.len() + 1;

/// A latency histogram with the fixed bounds [`LATENCY_BUCKETS_US`]. Invariant: `buckets[i]`
/// counts observations in `(bound[i-1], bound[i]]` (not cumulative); `count` is their sum once
/// every recording in flight has finished.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; SLOTS],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

/// A consistent-enough copy of a [`LatencyHistogram`] for an exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Observations.
    pub count: u64,
    /// Sum of the observations in seconds.
    pub sum_secs: f64,
    /// `(upper bound in seconds, observations <= bound)`, cumulative, ending with `+Inf` whose
    /// count is `count`. Never decreasing.
    pub cumulative: Vec<(f64, u64)>,
}

impl LatencyHistogram {
    /// Records one observation of `ns` nanoseconds.
    pub fn observe_ns(&self, ns: u64) {
        let us = ns / 1_000;
        let i = LATENCY_BUCKETS_US.partition_point(|&b| b < us);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// The histogram as an exposition wants it: cumulative buckets, clamped to the count read
    /// first, so no bucket exceeds `+Inf` even while recordings run.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let count = self.count.load(Ordering::Relaxed);
        let sum_ns = self.sum_ns.load(Ordering::Relaxed);
        let mut acc = 0u64;
        let mut cumulative = Vec::with_capacity(SLOTS);
        for (i, b) in self.buckets.iter().enumerate().take(SLOTS - 1) {
            acc = acc.saturating_add(b.load(Ordering::Relaxed)).min(count);
            cumulative.push((LATENCY_BUCKETS_US[i] as f64 / 1e6, acc));
        }
        cumulative.push((f64::INFINITY, count));
        HistogramSnapshot {
            count,
            sum_secs: sum_ns as f64 / 1e9,
            cumulative,
        }
    }
}

/// One operation's counters.
#[derive(Debug, Default)]
pub struct OpCounters {
    /// Requests answered (successes and errors).
    pub requests: AtomicU64,
    /// Requests answered with an error (or, for LMCache, the operation's negative answer
    /// because the request was refused or failed).
    pub errors: AtomicU64,
    /// Time from receiving the request to queueing its answer, for the requests that were
    /// timed (see the frontend's documentation of which).
    pub latency: LatencyHistogram,
}

/// Counters for operations `0..N`, indexed by the frontend's operation number. Invariant: an
/// index `>= N` is ignored (never a panic), so a frontend with more operations than its table
/// only loses their figures.
#[derive(Debug)]
pub struct OpTable<const N: usize> {
    ops: [OpCounters; N],
}

impl<const N: usize> Default for OpTable<N> {
    fn default() -> Self {
        OpTable {
            ops: std::array::from_fn(|_| OpCounters::default()),
        }
    }
}

impl<const N: usize> OpTable<N> {
    /// Counts one answered request of operation `op`, an error if `error`, timed from
    /// `started` to now.
    pub fn record(&self, op: usize, error: bool, started: Instant) {
        self.record_ns(
            op,
            error,
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
        );
    }

    /// [`OpTable::record`] with the latency already measured (`ns`), for callers that read the
    /// clock once for several uses.
    pub fn record_ns(&self, op: usize, error: bool, ns: u64) {
        if let Some(c) = self.ops.get(op) {
            c.requests.fetch_add(1, Ordering::Relaxed);
            if error {
                c.errors.fetch_add(1, Ordering::Relaxed);
            }
            c.latency.observe_ns(ns);
        }
    }

    /// Counts one request of operation `op` that was answered without being timed (answered
    /// on an I/O thread: trivial requests and refusals), an error if `error`.
    pub fn count(&self, op: usize, error: bool) {
        if let Some(c) = self.ops.get(op) {
            c.requests.fetch_add(1, Ordering::Relaxed);
            if error {
                c.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The counters of operation `op` (`None` beyond the table).
    pub fn get(&self, op: usize) -> Option<&OpCounters> {
        self.ops.get(op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_their_bucket_and_snapshots_are_cumulative() {
        let h = LatencyHistogram::default();
        h.observe_ns(5_000); // 5 us -> <= 10 us
        h.observe_ns(10_000); // 10 us -> <= 10 us (bounds are inclusive)
        h.observe_ns(30_000); // 30 us -> <= 50 us
        h.observe_ns(60_000_000_000); // 60 s -> +Inf
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert_eq!(s.cumulative[0], (10e-6, 2));
        assert_eq!(s.cumulative[1].1, 2);
        assert_eq!(s.cumulative[2].1, 3);
        assert_eq!(s.cumulative[SLOTS - 2].1, 3);
        assert_eq!(*s.cumulative.last().unwrap(), (f64::INFINITY, 4));
        assert!((s.sum_secs - 60.000045).abs() < 1e-9);
        assert!(s.cumulative.windows(2).all(|w| w[0].1 <= w[1].1));
    }

    #[test]
    fn out_of_range_operations_are_ignored() {
        let t = OpTable::<2>::default();
        t.record(1, true, Instant::now());
        t.record(7, false, Instant::now());
        t.count(0, false);
        t.count(9, true);
        let c = t.get(1).unwrap();
        assert_eq!(c.requests.load(Ordering::Relaxed), 1);
        assert_eq!(c.errors.load(Ordering::Relaxed), 1);
        assert_eq!(c.latency.count(), 1);
        assert_eq!(t.get(0).unwrap().requests.load(Ordering::Relaxed), 1);
        assert_eq!(t.get(0).unwrap().latency.count(), 0);
        assert!(t.get(2).is_none());
    }
}
