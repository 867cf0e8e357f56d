//! State the LMCache frontend may lose at a cost, bounded in bytes: inserting beyond the budget
//! forgets the oldest entries. Used for the rolling-hash cache (lost = recomputed) and the
//! prefetch results (lost = QUERY_PREFETCH_STATUS answers 0, a miss). Never for promises made
//! to a client (see `pending`).

use std::collections::{HashMap, VecDeque};

/// Per-entry bookkeeping bytes added to each estimate (map slot, order slot, allocation).
pub const ENTRY_OVERHEAD_BYTES: usize = 96;

/// An insertion-ordered string-keyed map whose estimated size never exceeds its budget.
/// Invariant: `bytes` is the sum of the estimates of the entries in `map`, and `bytes <=
/// budget` after every call.
pub struct ByteBoundedMap<V> {
    map: HashMap<String, (V, usize, u64)>,
    /// (key, sequence) in insertion order; entries whose sequence no longer matches the map's
    /// are stale and skipped.
    order: VecDeque<(String, u64)>,
    next_seq: u64,
    bytes: usize,
    budget: usize,
    evicted: u64,
}

impl<V> ByteBoundedMap<V> {
    /// An empty map holding at most `budget` estimated bytes.
    pub fn new(budget: usize) -> ByteBoundedMap<V> {
        ByteBoundedMap {
            map: HashMap::new(),
            order: VecDeque::new(),
            next_seq: 0,
            bytes: 0,
            budget,
            evicted: 0,
        }
    }

    /// Inserts (or replaces) `key` with an entry of `value_bytes` estimated bytes, forgetting the
    /// oldest entries until it fits. An entry larger than the whole budget is not kept.
    pub fn insert(&mut self, key: String, value: V, value_bytes: usize) {
        self.remove(&key);
        let size = value_bytes + key.len() * 2 + ENTRY_OVERHEAD_BYTES;
        if size > self.budget {
            self.evicted += 1;
            return;
        }
        while self.bytes + size > self.budget {
            let Some((k, seq)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&k).is_some_and(|e| e.2 == seq) {
                let (_, b, _) = self.map.remove(&k).expect("present");
                self.bytes -= b;
                self.evicted += 1;
            }
        }
        self.next_seq += 1;
        self.order.push_back((key.clone(), self.next_seq));
        self.map.insert(key, (value, size, self.next_seq));
        self.bytes += size;
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order
                .retain(|(k, seq)| map.get(k).is_some_and(|e| e.2 == *seq));
        }
        debug_assert!(self.bytes <= self.budget);
    }

    /// The entry under `key`.
    pub fn get(&self, key: &str) -> Option<&V> {
        self.map.get(key).map(|e| &e.0)
    }

    /// Removes and returns the entry under `key`.
    pub fn remove(&mut self, key: &str) -> Option<V> {
        let (v, b, _) = self.map.remove(key)?;
        self.bytes -= b;
        Some(v)
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Estimated bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries forgotten to stay within the budget so far.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_its_byte_budget_forgetting_the_oldest() {
        let mut m = ByteBoundedMap::new(1_000);
        for i in 0..100 {
            m.insert(format!("k{i}"), i, 100);
            assert!(m.bytes() <= 1_000);
        }
        assert!(m.len() < 10, "about budget / entry size entries kept");
        assert!(m.get("k99").is_some(), "the newest is kept");
        assert!(m.get("k0").is_none(), "the oldest is forgotten");
        assert_eq!(m.evicted(), 100 - m.len() as u64);
        m.insert("huge".into(), 0, 5_000);
        assert!(
            m.get("huge").is_none(),
            "an entry beyond the budget is not kept"
        );
        let before = m.bytes();
        assert_eq!(m.remove("k99"), Some(99));
        assert!(m.bytes() < before);
        // Replacing keeps one entry and its accounting.
        m.insert("a".into(), 1, 10);
        m.insert("a".into(), 2, 10);
        assert_eq!(m.get("a"), Some(&2));
        for i in 0..10_000 {
            m.insert("b".into(), i, 10);
        }
        assert!(
            m.order.len() <= 2 * m.len() + 65,
            "the order list is compacted"
        );
    }
}
