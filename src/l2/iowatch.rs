//! [`IoWatch`]: the device calls of a tier that have not returned yet, so a device that stops
//! answering is noticed (the tier is *stuck*) while its calls are still blocked in the kernel.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Device calls in progress. Invariant: holds exactly the calls whose [`IoCall`] guard is alive
/// (each registered at its start, removed when it returns); at most one entry per thread in a
/// device call, so its size is bounded by the tier's threads.
#[derive(Default)]
pub struct IoWatch {
    /// (id, start, time the call's bytes may take at [`SLOWEST_RATE`]).
    calls: Mutex<Vec<(u64, Instant, Duration)>>,
    next: std::sync::atomic::AtomicU64,
    /// Set when the node gave up on the device (left out at start-up): the tier starts no
    /// more I/O through the pool or to the device.
    abandoned: std::sync::atomic::AtomicBool,
}

/// The slowest transfer rate (bytes per second) a working device is granted before a call
/// counts as stuck: a call moving `b` bytes may take the timeout plus `b / SLOWEST_RATE`.
pub const SLOWEST_RATE: u64 = 64 << 20;

/// A device call in progress; deregisters itself when dropped.
pub struct IoCall<'a> {
    watch: &'a IoWatch,
    id: u64,
}

impl IoWatch {
    /// Registers a device call moving `bytes` bytes, starting now.
    pub fn start(&self, bytes: u64) -> IoCall<'_> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let allowance = Duration::from_secs_f64(bytes as f64 / SLOWEST_RATE as f64);
        self.calls.lock().push((id, Instant::now(), allowance));
        IoCall { watch: self, id }
    }

    /// Gives up on the device: every later I/O of its tier fails at once (see `abandoned`).
    pub fn abandon(&self) {
        self.abandoned
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether [`IoWatch::abandon`] was called.
    pub fn abandoned(&self) -> bool {
        self.abandoned.load(std::sync::atomic::Ordering::Acquire)
    }

    /// How long the oldest call in progress has been running (zero when none is).
    pub fn oldest(&self) -> Duration {
        self.calls
            .lock()
            .iter()
            .map(|(_, t, _)| t.elapsed())
            .max()
            .unwrap_or_default()
    }

    /// Whether a call has run longer than `timeout` plus the time its bytes may take.
    pub fn overdue(&self, timeout: Duration) -> bool {
        self.calls
            .lock()
            .iter()
            .any(|(_, t, allowance)| t.elapsed() > timeout.saturating_add(*allowance))
    }
}

impl Drop for IoCall<'_> {
    fn drop(&mut self) {
        self.watch.calls.lock().retain(|(id, _, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_exactly_the_calls_in_progress() {
        let w = IoWatch::default();
        assert_eq!(w.oldest(), Duration::ZERO);
        let a = w.start(0);
        std::thread::sleep(Duration::from_millis(5));
        let b = w.start(1 << 40);
        assert!(w.oldest() >= Duration::from_millis(5));
        assert!(
            w.overdue(Duration::from_millis(1)),
            "a's zero bytes allow nothing extra"
        );
        drop(a);
        assert!(
            !w.overdue(Duration::from_millis(1)),
            "b's terabyte may take hours"
        );
        assert_eq!(w.calls.lock().len(), 1);
        drop(b);
        assert_eq!(w.oldest(), Duration::ZERO);
    }
}
