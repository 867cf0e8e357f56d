//! [`IoWatch`]: the device calls of a tier that have not returned yet, so a device that stops
//! answering is noticed (the tier is *stuck*) while its calls are still blocked in the kernel.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Device calls in progress. Invariant: holds exactly the calls whose [`IoCall`] guard is alive
/// (each registered at its start, removed when it returns); at most one entry per thread in a
/// device call, so its size is bounded by the tier's threads.
#[derive(Default)]
pub struct IoWatch {
    calls: Mutex<Vec<(u64, Instant)>>,
    next: std::sync::atomic::AtomicU64,
}

/// A device call in progress; deregisters itself when dropped.
pub struct IoCall<'a> {
    watch: &'a IoWatch,
    id: u64,
}

impl IoWatch {
    /// Registers a device call starting now.
    pub fn start(&self) -> IoCall<'_> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.calls.lock().push((id, Instant::now()));
        IoCall { watch: self, id }
    }

    /// How long the oldest call in progress has been running (zero when none is).
    pub fn oldest(&self) -> Duration {
        self.calls
            .lock()
            .iter()
            .map(|(_, t)| t.elapsed())
            .max()
            .unwrap_or_default()
    }
}

impl Drop for IoCall<'_> {
    fn drop(&mut self) {
        self.watch.calls.lock().retain(|(id, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_exactly_the_calls_in_progress() {
        let w = IoWatch::default();
        assert_eq!(w.oldest(), Duration::ZERO);
        let a = w.start();
        std::thread::sleep(Duration::from_millis(5));
        let b = w.start();
        assert!(w.oldest() >= Duration::from_millis(5));
        drop(a);
        assert_eq!(w.calls.lock().len(), 1);
        drop(b);
        assert_eq!(w.oldest(), Duration::ZERO);
    }
}
