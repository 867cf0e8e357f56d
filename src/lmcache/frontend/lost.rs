//! Instances the node released while their worker may still be using them (reaped, or released
//! because their connections closed), so that worker can learn it and register again.
//!
//! An LMCache worker only registers at start-up and when its heartbeat sees the server come
//! back: its heartbeat thread PINGs every few seconds, and on a failed PING followed by a
//! successful one it runs its recovery callback, which sends REGISTER again. Without a signal a
//! reaped worker keeps sending requests for an instance nobody knows, and every store of it is
//! lost. So the first PING of such an instance (from its user) is answered `false`, the next one
//! `true`: the worker re-registers itself. Requests naming an unregistered instance are counted
//! and logged, and a PREPARE_STORE for one is answered without slots (the client's "could not
//! reserve"), never with the empty slot list that means "already cached".

use std::collections::{HashMap, VecDeque};

use super::ClientId;

/// Most released instances remembered (oldest forgotten first): 4,096 entries of about
/// 100 bytes each.
pub const MAX_LOST_INSTANCES: usize = 4096;

/// Released instances awaiting their worker's next PING. Invariant: `by_id` and `order` hold
/// the same ids (`order` oldest first, possibly with stale duplicates skipped on eviction),
/// and `by_id.len() <= MAX_LOST_INSTANCES`.
#[derive(Default)]
pub(super) struct LostInstances {
    /// Instance id -> (insertion number, the connection that owned it).
    by_id: HashMap<u64, (u64, ClientId)>,
    /// (insertion number, id), oldest first.
    order: VecDeque<(u64, u64)>,
    next: u64,
}

impl LostInstances {
    /// Remembers that `id`, owned by `owner`, was released by the node.
    pub(super) fn insert(&mut self, id: u64, owner: ClientId) {
        let n = self.next;
        self.next += 1;
        self.by_id.insert(id, (n, owner));
        self.order.push_back((n, id));
        while self.by_id.len() > MAX_LOST_INSTANCES {
            let Some((n, id)) = self.order.pop_front() else {
                break;
            };
            if self.by_id.get(&id).is_some_and(|(m, _)| *m == n) {
                self.by_id.remove(&id);
            }
        }
        // Stale entries (ids inserted again or removed) never outnumber the live ones twice.
        if self.order.len() > 2 * MAX_LOST_INSTANCES.max(self.by_id.len()) {
            let live = &self.by_id;
            self.order
                .retain(|(n, id)| live.get(id).is_some_and(|(m, _)| m == n));
        }
        debug_assert!(self.by_id.len() <= MAX_LOST_INSTANCES);
    }

    /// Forgets `id` (registered again, or unregistered by its worker).
    pub(super) fn remove(&mut self, id: u64) {
        self.by_id.remove(&id);
    }

    /// Whether `id` is remembered as released under the same user as `client` (or the same
    /// connection); if so it is forgotten, so only one PING gets the failure.
    pub(super) fn take_for(&mut self, id: u64, client: &ClientId) -> bool {
        let hit = self
            .by_id
            .get(&id)
            .is_some_and(|(_, owner)| owner == client || owner.same_user(client));
        if hit {
            self.by_id.remove(&id);
        }
        hit
    }

    /// Whether `id` is remembered.
    #[cfg(test)]
    pub(super) fn contains(&self, id: u64) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Number of remembered instances.
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(uid: Option<u32>, tag: u8) -> ClientId {
        ClientId::from_shared(std::sync::Arc::from(vec![tag]), uid)
    }

    #[test]
    fn one_ping_per_release_and_only_for_the_same_user() {
        let mut l = LostInstances::default();
        l.insert(7, client(Some(1000), 1));
        assert!(!l.take_for(7, &client(Some(1001), 2)), "another user");
        assert!(!l.take_for(7, &client(None, 2)), "a remote peer");
        assert!(
            l.take_for(7, &client(Some(1000), 3)),
            "same user, new connection"
        );
        assert!(!l.take_for(7, &client(Some(1000), 3)), "only once");
        l.insert(8, client(None, 4));
        assert!(
            l.take_for(8, &client(None, 4)),
            "the same remote connection"
        );
    }

    #[test]
    fn bounded_with_oldest_forgotten() {
        let mut l = LostInstances::default();
        for id in 0..(MAX_LOST_INSTANCES as u64 + 10) {
            l.insert(id, client(Some(1), 0));
            l.insert(id, client(Some(1), 0)); // re-inserted: stale order entries
        }
        assert_eq!(l.len(), MAX_LOST_INSTANCES);
        assert!(!l.contains(0));
        assert!(l.contains(MAX_LOST_INSTANCES as u64 + 9));
        assert!(l.order.len() <= 2 * MAX_LOST_INSTANCES + 2);
    }
}
