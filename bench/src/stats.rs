//! Latency histograms per operation (HDR, nanosecond resolution, reported in microseconds).

use std::time::Duration;

use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;
use serde::Serialize;

/// The timed operations. `Store`/`Retrieve` are end to end (prepare + copy + commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// PREPARE_STORE round trip.
    PrepareStore,
    /// COMMIT_STORE round trip.
    CommitStore,
    /// PREPARE_RETRIEVE round trip.
    PrepareRetrieve,
    /// COMMIT_RETRIEVE round trip.
    CommitRetrieve,
    /// LOOKUP round trip.
    Lookup,
    /// PING round trip.
    Ping,
    /// Whole store: prepare, copy into the pool, commit.
    Store,
    /// Whole retrieve: prepare, copy out of the pool, commit.
    Retrieve,
    /// Remote store's WRITE_SLOTS round trip: the chunks over TCP into the slots, and the
    /// commit (the node publishes in the same call).
    WriteSlots,
    /// Remote retrieve's READ_SLOTS round trip: the chunks over TCP out of the slots, and the
    /// commit (the node releases its read locks in the same call).
    ReadSlots,
}

impl Op {
    /// Every operation, in report order.
    pub const ALL: [Op; 10] = [
        Op::PrepareStore,
        Op::CommitStore,
        Op::PrepareRetrieve,
        Op::CommitRetrieve,
        Op::Lookup,
        Op::Ping,
        Op::Store,
        Op::Retrieve,
        Op::WriteSlots,
        Op::ReadSlots,
    ];

    /// The JSON name.
    pub fn name(self) -> &'static str {
        match self {
            Op::PrepareStore => "prepare_store",
            Op::CommitStore => "commit_store",
            Op::PrepareRetrieve => "prepare_retrieve",
            Op::CommitRetrieve => "commit_retrieve",
            Op::Lookup => "lookup",
            Op::Ping => "ping",
            Op::Store => "store",
            Op::Retrieve => "retrieve",
            Op::WriteSlots => "write_slots",
            Op::ReadSlots => "read_slots",
        }
    }
}

fn new_hist() -> Histogram<u64> {
    // 1 ns .. 100 s, 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid bounds")
}

/// One histogram per operation. Invariant: `hists[i]` belongs to `Op::ALL[i]`.
pub struct OpHistograms {
    hists: Vec<Histogram<u64>>,
}

impl Default for OpHistograms {
    fn default() -> Self {
        OpHistograms {
            hists: Op::ALL.iter().map(|_| new_hist()).collect(),
        }
    }
}

impl std::fmt::Debug for OpHistograms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "OpHistograms({} samples)",
            self.hists.iter().map(Histogram::len).sum::<u64>()
        )
    }
}

fn index(op: Op) -> usize {
    Op::ALL.iter().position(|o| *o == op).expect("listed")
}

/// Percentiles of one operation in microseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
}

impl OpHistograms {
    /// Records one sample (saturating at the histogram's bounds).
    pub fn record(&mut self, op: Op, d: Duration) {
        let ns = (d.as_nanos() as u64).clamp(1, 100_000_000_000);
        self.hists[index(op)].saturating_record(ns);
    }

    /// Adds another set of histograms into this one.
    pub fn merge(&mut self, other: &OpHistograms) {
        for (a, b) in self.hists.iter_mut().zip(&other.hists) {
            a.add(b).expect("same bounds");
        }
    }

    /// The histogram of one operation.
    pub fn get(&self, op: Op) -> &Histogram<u64> {
        &self.hists[index(op)]
    }

    /// Percentiles of one operation (zeros when it has no samples).
    pub fn percentiles(&self, op: Op) -> Percentiles {
        let h = self.get(op);
        if h.is_empty() {
            return Percentiles::default();
        }
        let us = |v: u64| v as f64 / 1000.0;
        Percentiles {
            count: h.len(),
            p50: us(h.value_at_quantile(0.5)),
            p90: us(h.value_at_quantile(0.9)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
        }
    }

    /// The latency curve (percentile, microseconds) of one operation, for plotting.
    pub fn curve(&self, op: Op) -> Vec<(f64, f64)> {
        let h = self.get(op);
        if h.is_empty() {
            return Vec::new();
        }
        [50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99]
            .iter()
            .map(|&p| (p, h.value_at_percentile(p) as f64 / 1000.0))
            .collect()
    }

    /// Serialises every histogram (HDR V2, hex) for a child process to hand back.
    pub fn to_hex(&self) -> Vec<String> {
        self.hists
            .iter()
            .map(|h| {
                let mut buf = Vec::new();
                V2Serializer::new()
                    .serialize(h, &mut buf)
                    .expect("serialise to memory");
                buf.iter().map(|b| format!("{b:02x}")).collect()
            })
            .collect()
    }

    /// Parses what [`OpHistograms::to_hex`] produced.
    pub fn from_hex(parts: &[String]) -> Result<OpHistograms, String> {
        if parts.len() != Op::ALL.len() {
            return Err(format!(
                "expected {} histograms, got {}",
                Op::ALL.len(),
                parts.len()
            ));
        }
        let hists = parts
            .iter()
            .map(|hex| {
                let bytes = (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("zz"), 16))
                    .collect::<Result<Vec<u8>, _>>()
                    .map_err(|e| format!("bad hex: {e}"))?;
                Deserializer::new()
                    .deserialize(&mut bytes.as_slice())
                    .map_err(|e| format!("bad histogram: {e:?}"))
            })
            .collect::<Result<Vec<Histogram<u64>>, String>>()?;
        Ok(OpHistograms { hists })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_round_trip() {
        let mut h = OpHistograms::default();
        for us in 1..=1000u64 {
            h.record(Op::Ping, Duration::from_micros(us));
        }
        let p = h.percentiles(Op::Ping);
        assert_eq!(p.count, 1000);
        assert!((p.p50 - 500.0).abs() < 2.0, "{p:?}");
        assert!((p.p99 - 990.0).abs() < 5.0, "{p:?}");
        assert!(p.max >= p.p999 && p.p999 >= p.p99 && p.p99 >= p.p90 && p.p90 >= p.p50);
        assert_eq!(h.percentiles(Op::Store), Percentiles::default());
        let back = OpHistograms::from_hex(&h.to_hex()).unwrap();
        assert_eq!(back.percentiles(Op::Ping), p);
        let mut merged = OpHistograms::default();
        merged.merge(&back);
        merged.merge(&h);
        assert_eq!(merged.percentiles(Op::Ping).count, 2000);
        assert!(OpHistograms::from_hex(&["zz".into()]).is_err());
    }
}
