//! The node's millisecond clock: real (monotonic, from start-up) in production, manual in the
//! deterministic simulator, where time moves only when the simulator advances it. Every deadline
//! the node keeps (write and read TTLs, session idleness, liveness) is read from one `Clock`, so a
//! simulated run is a pure function of its seed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A shared millisecond clock. Invariant: `now_ms` never goes backwards (the real clock is
/// monotonic; the manual clock only moves forward through [`Clock::advance`]).
#[derive(Clone, Debug)]
pub struct Clock {
    source: Arc<Source>,
}

#[derive(Debug)]
enum Source {
    Real(Instant),
    Manual(AtomicU64),
}

impl Default for Clock {
    fn default() -> Self {
        Clock::real()
    }
}

impl Clock {
    /// A clock that reads real monotonic time, in milliseconds since this call.
    pub fn real() -> Clock {
        Clock {
            source: Arc::new(Source::Real(Instant::now())),
        }
    }

    /// A clock that starts at `start_ms` and moves only through [`Clock::advance`].
    pub fn manual(start_ms: u64) -> Clock {
        Clock {
            source: Arc::new(Source::Manual(AtomicU64::new(start_ms))),
        }
    }

    /// Milliseconds on this clock.
    pub fn now_ms(&self) -> u64 {
        match &*self.source {
            Source::Real(epoch) => epoch.elapsed().as_millis() as u64,
            Source::Manual(ms) => ms.load(Ordering::Acquire),
        }
    }

    /// Whether this is a manual (simulated) clock.
    pub fn is_manual(&self) -> bool {
        matches!(&*self.source, Source::Manual(_))
    }

    /// Moves a manual clock forward by `ms` and returns the new time. A real clock cannot be
    /// moved: the call is refused with `None`.
    pub fn advance(&self, ms: u64) -> Option<u64> {
        match &*self.source {
            Source::Real(_) => None,
            Source::Manual(t) => Some(t.fetch_add(ms, Ordering::AcqRel).saturating_add(ms)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let c = Clock::manual(5);
        let shared = c.clone();
        assert_eq!(c.now_ms(), 5);
        assert_eq!(shared.advance(10), Some(15));
        assert_eq!(c.now_ms(), 15, "clones share one time");
        assert!(c.is_manual());
        let r = Clock::real();
        assert_eq!(r.advance(1), None, "real time cannot be moved");
        assert!(r.now_ms() <= r.now_ms());
    }
}
