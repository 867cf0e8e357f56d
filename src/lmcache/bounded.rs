//! State the LMCache frontend may lose at a cost, kept per client and bounded in bytes, with a
//! time to live: inserting beyond a budget forgets the least recently used entries (of that
//! client first, then node-wide), and entries unused for the TTL expire. Used for the
//! rolling-hash cache (lost = recomputed), the prefetch results (lost = QUERY_PREFETCH_STATUS
//! answers 0, a miss) and the lookup-session index (lost = the session is ended). Never for
//! promises made to a client (see `pending`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::lmcache::frontend::ClientId;

/// Per-entry bookkeeping bytes added to each estimate (map slot, two order slots, allocation).
pub const ENTRY_OVERHEAD_BYTES: usize = 160;

/// The budgets of one [`ClientMap`].
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Estimated bytes held, all clients together.
    pub total: usize,
    /// Estimated bytes held for one client.
    pub per_client: usize,
    /// Entries not used for this long are dropped (milliseconds).
    pub ttl_ms: u64,
}

struct Entry<V> {
    value: V,
    bytes: usize,
    /// Sequence number of its latest use; order-list items with another one are stale.
    seq: u64,
    used_ms: u64,
}

struct ClientState<V> {
    bytes: usize,
    entries: HashMap<Arc<str>, Entry<V>>,
    /// (key, sequence) by last use, oldest first; stale items are skipped.
    order: VecDeque<(Arc<str>, u64)>,
}

impl<V> Default for ClientState<V> {
    fn default() -> Self {
        ClientState {
            bytes: 0,
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

/// An entry dropped to stay within a budget or because it expired.
pub type Dropped<V> = (ClientId, Arc<str>, V);

/// A map from (client, string key) to values whose estimated size stays within a node-wide
/// and a per-client byte budget. Invariant: `bytes` is the sum of the estimates of the
/// entries, each client's `bytes` the sum of its own, and after every call `bytes <=
/// budget.total` and each client's `bytes <= budget.per_client`; a client without entries has
/// no state; order lists hold every entry once under its current sequence (plus stale items,
/// compacted when they dominate).
pub struct ClientMap<V> {
    clients: HashMap<ClientId, ClientState<V>>,
    /// (client, key, sequence) by last use, oldest first.
    order: VecDeque<(ClientId, Arc<str>, u64)>,
    len: usize,
    next_seq: u64,
    bytes: usize,
    budget: Budget,
    evicted: u64,
    expired: u64,
}

impl<V> ClientMap<V> {
    /// An empty map with `budget`.
    pub fn new(budget: Budget) -> ClientMap<V> {
        ClientMap {
            clients: HashMap::new(),
            order: VecDeque::new(),
            len: 0,
            next_seq: 0,
            bytes: 0,
            budget,
            evicted: 0,
            expired: 0,
        }
    }

    /// Inserts (or replaces) `key` of `client` with an entry of `value_bytes` estimated bytes,
    /// used at `now_ms`. Entries that expired, then the client's least recently used ones, then
    /// the node's, are dropped until it fits; they are returned (a replaced value is not). An
    /// entry larger than a budget is not kept (`false`).
    pub fn insert(
        &mut self,
        client: &ClientId,
        key: &str,
        value: V,
        value_bytes: usize,
        now_ms: u64,
    ) -> (bool, Vec<Dropped<V>>) {
        let mut dropped = self.expire(now_ms);
        self.remove(client, key);
        let size = value_bytes + key.len() + client.bytes() + ENTRY_OVERHEAD_BYTES;
        if size > self.budget.per_client || size > self.budget.total {
            self.evicted += 1;
            return (false, dropped);
        }
        let before = dropped.len();
        while self.client_bytes(client) + size > self.budget.per_client {
            match self.pop_oldest_of(client) {
                Some(d) => dropped.push(d),
                None => break,
            }
        }
        while self.bytes + size > self.budget.total {
            match self.pop_oldest() {
                Some(d) => dropped.push(d),
                None => break,
            }
        }
        self.evicted += (dropped.len() - before) as u64;
        let key: Arc<str> = key.into();
        let seq = self.bump();
        self.order.push_back((client.clone(), key.clone(), seq));
        let c = self.clients.entry(client.clone()).or_default();
        c.order.push_back((key.clone(), seq));
        c.bytes += size;
        c.entries.insert(
            key,
            Entry {
                value,
                bytes: size,
                seq,
                used_ms: now_ms,
            },
        );
        self.bytes += size;
        self.len += 1;
        self.compact(client);
        debug_assert!(self.bytes <= self.budget.total);
        (true, dropped)
    }

    fn bump(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// The live entry `key` of `client` (an expired one is treated as absent).
    pub fn get(&self, client: &ClientId, key: &str, now_ms: u64) -> Option<&V> {
        let e = self.clients.get(client)?.entries.get(key)?;
        (now_ms.saturating_sub(e.used_ms) < self.budget.ttl_ms).then_some(&e.value)
    }

    /// Marks `key` of `client` used at `now_ms` (it is then the last to be dropped); `false`
    /// when absent.
    pub fn touch(&mut self, client: &ClientId, key: &str, now_ms: u64) -> bool {
        self.next_seq += 1;
        let seq = self.next_seq;
        let Some(c) = self.clients.get_mut(client) else {
            return false;
        };
        let Some(k) = c.entries.get_key_value(key).map(|(k, _)| k.clone()) else {
            return false;
        };
        let e = c.entries.get_mut(key).expect("checked");
        e.seq = seq;
        e.used_ms = e.used_ms.max(now_ms);
        c.order.push_back((k.clone(), seq));
        self.order.push_back((client.clone(), k, seq));
        self.compact(client);
        true
    }

    /// Removes and returns `key` of `client`.
    pub fn remove(&mut self, client: &ClientId, key: &str) -> Option<V> {
        let c = self.clients.get_mut(client)?;
        let e = c.entries.remove(key)?;
        c.bytes -= e.bytes;
        if c.entries.is_empty() {
            self.clients.remove(client);
        }
        self.bytes -= e.bytes;
        self.len -= 1;
        Some(e.value)
    }

    /// Removes and returns every entry of the clients whose ZMQ routing id is `identity` (its
    /// connection closed). O(clients).
    pub fn remove_identity(&mut self, identity: &[u8]) -> Vec<Dropped<V>> {
        let gone: Vec<ClientId> = self
            .clients
            .keys()
            .filter(|c| c.identity() == identity)
            .cloned()
            .collect();
        let mut out = Vec::new();
        for c in gone {
            let Some(st) = self.clients.remove(&c) else {
                continue;
            };
            self.bytes -= st.bytes;
            self.len -= st.entries.len();
            out.extend(st.entries.into_iter().map(|(k, e)| (c.clone(), k, e.value)));
        }
        out
    }

    /// Removes `key` of `client` if its current sequence is `seq` (the item is not stale).
    fn take_if_current(&mut self, client: &ClientId, key: &Arc<str>, seq: u64) -> Option<V> {
        let current = self
            .clients
            .get(client)
            .and_then(|c| c.entries.get(&**key))
            .is_some_and(|e| e.seq == seq);
        if current {
            self.remove(client, key)
        } else {
            None
        }
    }

    /// Drops the entries unused for the TTL (oldest first) and returns them.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Dropped<V>> {
        let mut out = Vec::new();
        while let Some((client, key, seq)) = self.order.front() {
            let used = self
                .clients
                .get(client)
                .and_then(|c| c.entries.get(&**key))
                .filter(|e| e.seq == *seq)
                .map(|e| e.used_ms);
            if used.is_some_and(|u| now_ms.saturating_sub(u) < self.budget.ttl_ms) {
                break;
            }
            let (client, key, seq) = self.order.pop_front().expect("front");
            if let Some(v) = self.take_if_current(&client, &key, seq) {
                self.expired += 1;
                out.push((client, key, v));
            }
        }
        out
    }

    fn pop_oldest(&mut self) -> Option<Dropped<V>> {
        while let Some((client, key, seq)) = self.order.pop_front() {
            if let Some(v) = self.take_if_current(&client, &key, seq) {
                return Some((client, key, v));
            }
        }
        None
    }

    fn pop_oldest_of(&mut self, client: &ClientId) -> Option<Dropped<V>> {
        loop {
            let (key, seq) = self.clients.get_mut(client)?.order.pop_front()?;
            if let Some(v) = self.take_if_current(client, &key, seq) {
                return Some((client.clone(), key, v));
            }
        }
    }

    /// Drops stale order items once they outnumber the live entries.
    fn compact(&mut self, client: &ClientId) {
        if self.order.len() > 2 * self.len + 64 {
            let clients = &self.clients;
            self.order.retain(|(c, k, seq)| {
                clients
                    .get(c)
                    .and_then(|c| c.entries.get(&**k))
                    .is_some_and(|e| e.seq == *seq)
            });
        }
        if let Some(c) = self.clients.get_mut(client) {
            if c.order.len() > 2 * c.entries.len() + 16 {
                let entries = &c.entries;
                c.order
                    .retain(|(k, seq)| entries.get(&**k).is_some_and(|e| e.seq == *seq));
            }
        }
    }

    /// Entries held (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Estimated bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Estimated bytes held for `client`.
    pub fn client_bytes(&self, client: &ClientId) -> usize {
        self.clients.get(client).map_or(0, |c| c.bytes)
    }

    /// Clients with entries.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// Entries dropped to stay within a budget so far.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Entries dropped because they expired so far.
    pub fn expired(&self) -> u64 {
        self.expired
    }

    /// The budgets.
    pub fn budget(&self) -> Budget {
        self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(n: u8) -> ClientId {
        ClientId::new(&[0, n], None)
    }

    fn entry_size(key: &str, value: usize) -> usize {
        value + key.len() + client(0).bytes() + ENTRY_OVERHEAD_BYTES
    }

    #[test]
    fn each_client_stays_within_its_budget_and_the_node_within_its_own() {
        let one = entry_size("k00", 100);
        let mut m = ClientMap::new(Budget {
            total: 10 * one,
            per_client: 4 * one,
            ttl_ms: 1_000_000,
        });
        for i in 0..20 {
            m.insert(&client(1), &format!("k{i:02}"), i, 100, 0);
            assert!(m.client_bytes(&client(1)) <= 4 * one);
        }
        assert_eq!(m.len(), 4, "client 1 keeps its newest four");
        assert!(m.get(&client(1), "k19", 0).is_some());
        assert!(m.get(&client(1), "k00", 0).is_none());
        assert!(m.get(&client(2), "k19", 0).is_none(), "keys are per client");
        for c in 2..6 {
            for i in 0..4 {
                m.insert(&client(c), &format!("k{i:02}"), i, 100, 0);
            }
        }
        assert!(m.bytes() <= 10 * one);
        assert_eq!(m.len(), 10);
        assert!(
            m.get(&client(1), "k19", 0).is_none(),
            "the node's oldest went first"
        );
        assert!(m.get(&client(5), "k03", 0).is_some());
        let (kept, _) = m.insert(&client(9), "huge", 0, 5 * one, 0);
        assert!(!kept, "an entry beyond the per-client budget is not kept");
    }

    #[test]
    fn entries_expire_unless_used_and_touching_keeps_them() {
        let mut m = ClientMap::new(Budget {
            total: 1 << 20,
            per_client: 1 << 20,
            ttl_ms: 100,
        });
        m.insert(&client(1), "a", 1, 10, 0);
        m.insert(&client(1), "b", 2, 10, 50);
        assert!(m.touch(&client(1), "a", 90));
        assert_eq!(m.get(&client(1), "b", 149), Some(&2));
        assert_eq!(
            m.get(&client(1), "b", 150),
            None,
            "expired, even before it is dropped"
        );
        let gone = m.expire(160);
        assert_eq!(gone.len(), 1);
        assert_eq!(&*gone[0].1, "b");
        assert_eq!(m.get(&client(1), "a", 160), Some(&1), "touched at 90");
        assert_eq!(m.expire(200).len(), 1);
        assert!(m.is_empty());
        assert_eq!(m.bytes(), 0);
        assert_eq!(m.clients(), 0, "no state kept for clients without entries");
        assert_eq!(m.expired(), 2);
    }

    #[test]
    fn a_closed_connections_entries_go_and_the_accounting_follows() {
        let mut m = ClientMap::new(Budget {
            total: 1 << 20,
            per_client: 1 << 20,
            ttl_ms: 1000,
        });
        let other_user = ClientId::new(&[0, 1], Some(9));
        m.insert(&client(1), "a", 1u32, 10, 0);
        m.insert(&client(1), "b", 2, 10, 0);
        m.insert(&other_user, "a", 3, 10, 0);
        m.insert(&client(2), "a", 4, 10, 0);
        let before = m.bytes();
        let mut gone = m.remove_identity(&[0, 1]);
        gone.sort_by_key(|d| d.2);
        assert_eq!(gone.iter().map(|d| d.2).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(m.len(), 1);
        assert_eq!(m.bytes(), before - 3 * entry_size("a", 10));
        assert_eq!(m.get(&client(2), "a", 0), Some(&4));
        assert!(m.remove_identity(&[0, 1]).is_empty());
        // Stale order items of the removed entries are skipped.
        assert!(m.expire(5_000).iter().all(|d| d.2 == 4));
        assert!(m.is_empty());
    }

    #[test]
    fn replacing_and_removing_keep_the_accounting_and_order_lists_stay_compact() {
        let mut m = ClientMap::new(Budget {
            total: 1 << 20,
            per_client: 1 << 20,
            ttl_ms: u64::MAX,
        });
        for i in 0..10_000u64 {
            m.insert(&client(1), "a", i, 10, i);
            m.touch(&client(1), "a", i);
        }
        assert_eq!(m.get(&client(1), "a", 0), Some(&9_999));
        assert!(m.order.len() <= 2 * m.len() + 65);
        assert!(m.clients[&client(1)].order.len() <= 2 + 17);
        assert_eq!(m.len(), 1);
        assert_eq!(m.remove(&client(1), "a"), Some(9_999));
        assert_eq!(m.bytes(), 0);
    }
}
