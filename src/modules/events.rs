//! A bounded in-process event bus: publishers never block; when the queue is full the event is
//! dropped and counted. A drain thread hands events to the log (and later to metrics exporters).

use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_queue::ArrayQueue;
use serde::Serialize;

/// Something that happened, for observers (never on the data path's critical section).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// vLLM block-allocation report (`mp.vllm.block_allocation`).
    BlockAllocation {
        /// Reporting instance.
        instance_id: u64,
        /// Model name.
        model: String,
        /// Number of records in the report.
        records: usize,
        /// Total new blocks across records.
        new_blocks: usize,
    },
    /// An instance was reaped or disconnected.
    InstanceReleased {
        /// The instance.
        instance_id: u64,
        /// Why.
        reason: &'static str,
    },
}

/// Publication counters. Invariant: `published + dropped` = every `publish` call;
/// `drained <= published`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EventBusStats {
    /// Events accepted into the queue.
    pub published: u64,
    /// Events dropped because the queue was full.
    pub dropped: u64,
    /// Events handed to subscribers.
    pub drained: u64,
    /// Events waiting now.
    pub queued: u64,
    /// Queue capacity.
    pub capacity: u64,
}

/// The bus. Invariant: holds at most `capacity` events.
pub struct EventBus {
    queue: ArrayQueue<Event>,
    published: AtomicU64,
    dropped: AtomicU64,
    drained: AtomicU64,
}

impl EventBus {
    /// A bus holding at most `capacity` (> 0) undrained events.
    pub fn new(capacity: usize) -> EventBus {
        EventBus {
            queue: ArrayQueue::new(capacity.max(1)),
            published: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            drained: AtomicU64::new(0),
        }
    }

    /// Enqueues an event, or drops and counts it when the queue is full. Never blocks.
    pub fn publish(&self, e: Event) -> bool {
        match self.queue.push(e) {
            Ok(()) => {
                self.published.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(_) => {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed);
                if n.is_power_of_two() {
                    tracing::warn!(dropped = n + 1, "event bus full: dropping events");
                }
                false
            }
        }
    }

    /// Drains up to `max` events into `f`; returns how many.
    pub fn drain(&self, max: usize, mut f: impl FnMut(Event)) -> usize {
        let mut n = 0;
        while n < max {
            let Some(e) = self.queue.pop() else { break };
            f(e);
            n += 1;
        }
        self.drained.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Current counters.
    pub fn stats(&self) -> EventBusStats {
        EventBusStats {
            published: self.published.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            drained: self.drained.load(Ordering::Relaxed),
            queued: self.queue.len() as u64,
            capacity: self.queue.capacity() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(i: u64) -> Event {
        Event::InstanceReleased {
            instance_id: i,
            reason: "test",
        }
    }

    #[test]
    fn full_bus_drops_and_counts() {
        let bus = EventBus::new(2);
        assert!(bus.publish(ev(1)));
        assert!(bus.publish(ev(2)));
        assert!(!bus.publish(ev(3)));
        let s = bus.stats();
        assert_eq!((s.published, s.dropped, s.queued), (2, 1, 2));
        let mut got = vec![];
        assert_eq!(bus.drain(10, |e| got.push(e)), 2);
        assert_eq!(got, vec![ev(1), ev(2)]);
        assert!(bus.publish(ev(4)));
        assert_eq!(bus.stats().drained, 2);
    }
}
