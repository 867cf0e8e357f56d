//! Counted slots per user: how many connections each client user holds open, so one allowed
//! tenant cannot take every connection of the node.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// Per-uid counters bounded by one limit. Invariant: a uid's count equals the number of live
/// [`UserSlot`]s taken for it, never above `limit`; uids at 0 are not kept.
pub struct UserSlots {
    counts: Mutex<HashMap<u32, usize>>,
    limit: usize,
}

/// One taken slot; dropping it gives the slot back.
pub struct UserSlot {
    slots: Arc<UserSlots>,
    uid: u32,
}

impl UserSlots {
    /// Counters allowing `limit` slots per uid.
    pub fn new(limit: usize) -> UserSlots {
        UserSlots {
            counts: Mutex::new(HashMap::new()),
            limit,
        }
    }

    /// Takes a slot for `uid`, or `None` when it holds `limit` already.
    pub fn take(self: &Arc<Self>, uid: u32) -> Option<UserSlot> {
        let mut m = self.counts.lock();
        let n = m.entry(uid).or_insert(0);
        if *n >= self.limit {
            if *n == 0 {
                m.remove(&uid);
            }
            return None;
        }
        *n += 1;
        Some(UserSlot {
            slots: Arc::clone(self),
            uid,
        })
    }

    /// Slots `uid` holds now.
    pub fn held(&self, uid: u32) -> usize {
        self.counts.lock().get(&uid).copied().unwrap_or(0)
    }
}

impl Drop for UserSlot {
    fn drop(&mut self) {
        let mut m = self.slots.counts.lock();
        if let Some(n) = m.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_holds_at_most_its_limit_and_dropping_gives_back() {
        let s = Arc::new(UserSlots::new(2));
        let a = s.take(7).unwrap();
        let _b = s.take(7).unwrap();
        assert!(s.take(7).is_none());
        assert!(s.take(8).is_some(), "another user is not affected");
        drop(a);
        assert_eq!(s.held(7), 1);
        assert!(s.take(7).is_some());
    }
}
