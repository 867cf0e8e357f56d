//! The node-wide budget of payload bytes being received (`limits.max_inflight_payload_bytes`).
//!
//! A frame whose payload does not arrive with its header (larger than the read buffer) claims
//! its announced length when the payload starts, then holds budget for its payload buffer as
//! that buffer grows with the bytes that arrive; the frame gives it all back once it has been
//! decoded (or when its connection closes). A growth that does not fit waits: its connection is
//! simply not read meanwhile (back-pressure). The wait ends at the frame's own deadline (the
//! caller's `limits.frame_timeout_ms`), so every frame is received or refused within that time
//! of its first byte, whoever made it late.
//!
//! Waiting never deadlocks. Growth is granted only while the budget stays *safe* (the banker's
//! rule for one resource): there is an order in which every frame being received can grow to
//! its whole claim, each after the ones before it have finished and given their bytes back.
//! Every claim is at most the budget (configuration guarantees `max_inflight_payload_bytes >=`
//! the largest payload), so a frame that holds nothing yet is always safe to admit, and in a
//! safe state at least one frame can always grow: frames whose clients keep sending complete
//! without anyone timing out, however many compete.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// Payload bytes of frames being received, node-wide. Invariants: `held <= cap`; `held` is the
/// sum of the frames' `held`, `claimed` the sum of their claims, and each frame's `held` is at
/// most its claim, which is at most `cap`; the state is safe (see the module notes) after every
/// grant.
pub struct PayloadBudget {
    cap: u64,
    state: Mutex<State>,
    freed: Condvar,
}

#[derive(Default)]
struct State {
    next_id: u64,
    frames: HashMap<u64, Claim>,
    held: u64,
    claimed: u64,
    waits: u64,
}

#[derive(Clone, Copy)]
struct Claim {
    claim: u64,
    held: u64,
}

impl State {
    /// Whether growing frame `id` to `to` bytes leaves a state in which every frame can still
    /// complete (for one resource: sorting frames by what they still need and letting each
    /// finish in turn, every need fits in what is free plus what earlier ones gave back).
    fn safe_after(&self, cap: u64, id: u64, to: u64) -> bool {
        let before = self.frames.get(&id).map_or(0, |c| c.held);
        let held = self.held - before + to;
        if held > cap {
            return false;
        }
        // Every frame could hold its whole claim at once: any state is safe.
        if self.claimed <= cap {
            return true;
        }
        let mut needs: Vec<(u64, u64)> = self
            .frames
            .iter()
            .map(|(k, c)| {
                let h = if *k == id { to } else { c.held };
                (c.claim - h, h)
            })
            .collect();
        needs.sort_unstable();
        let mut free = cap - held;
        for (need, h) in needs {
            if need > free {
                return false;
            }
            free += h;
        }
        true
    }
}

impl PayloadBudget {
    /// A budget of `cap` bytes (> 0).
    pub fn new(cap: u64) -> PayloadBudget {
        PayloadBudget {
            cap: cap.max(1),
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
        }
    }

    /// The budget in bytes.
    pub fn capacity(&self) -> u64 {
        self.cap
    }

    /// Bytes held by frames being received right now.
    pub fn held(&self) -> u64 {
        self.state.lock().held
    }

    /// How many growths had to wait for bytes to be given back so far.
    pub fn waits(&self) -> u64 {
        self.state.lock().waits
    }

    /// Starts a frame that will need at most `claim` bytes (clamped to the budget). Never
    /// waits: a frame holding nothing keeps every state safe.
    pub fn begin(self: &Arc<Self>, claim: u64) -> PayloadCharge {
        let mut st = self.state.lock();
        let id = st.next_id;
        st.next_id += 1;
        let claim = claim.min(self.cap);
        st.claimed += claim;
        st.frames.insert(id, Claim { claim, held: 0 });
        PayloadCharge {
            budget: Arc::clone(self),
            id,
        }
    }
}

/// One frame's share of a [`PayloadBudget`]. Invariant: registered in the budget from
/// [`PayloadBudget::begin`] until dropped; dropping it gives back everything it held.
pub struct PayloadCharge {
    budget: Arc<PayloadBudget>,
    id: u64,
}

impl PayloadCharge {
    /// Raises the bytes this frame holds to `bytes` (clamped to its claim; never lowers them),
    /// waiting while that does not fit or would leave the budget unsafe, until `deadline`
    /// (`None`: as long as it takes). Returns whether the bytes were granted (false: the
    /// deadline passed first, and the frame holds what it held before).
    pub fn grow_to(&mut self, bytes: u64, deadline: Option<Instant>) -> bool {
        let b = &self.budget;
        let mut st = b.state.lock();
        let c = *st.frames.get(&self.id).expect("registered until dropped");
        let to = bytes.min(c.claim);
        if to <= c.held {
            return true;
        }
        let mut counted = false;
        while !st.safe_after(b.cap, self.id, to) {
            if !counted {
                counted = true;
                st.waits += 1;
            }
            match deadline {
                None => b.freed.wait(&mut st),
                Some(d) => {
                    if b.freed.wait_until(&mut st, d).timed_out()
                        && !st.safe_after(b.cap, self.id, to)
                    {
                        return false;
                    }
                }
            }
        }
        st.held += to - c.held;
        st.frames.get_mut(&self.id).expect("registered").held = to;
        true
    }

    /// Bytes this frame holds.
    pub fn held(&self) -> u64 {
        self.budget
            .state
            .lock()
            .frames
            .get(&self.id)
            .map_or(0, |c| c.held)
    }
}

impl Drop for PayloadCharge {
    fn drop(&mut self) {
        let mut st = self.budget.state.lock();
        if let Some(c) = st.frames.remove(&self.id) {
            st.held -= c.held;
            st.claimed -= c.claim;
        }
        drop(st);
        self.budget.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_within_the_budget_and_gives_back_on_drop() {
        let b = Arc::new(PayloadBudget::new(100));
        let mut x = b.begin(60);
        assert!(x.grow_to(30, None));
        assert!(x.grow_to(1000, None), "clamped to the claim");
        assert_eq!((x.held(), b.held()), (60, 60));
        drop(x);
        assert_eq!(b.held(), 0);
    }

    /// Two frames that could each take half and then wait for each other forever: the second
    /// one's growth waits instead, until the first finishes.
    #[test]
    fn growth_that_could_deadlock_waits_for_a_finisher() {
        let b = Arc::new(PayloadBudget::new(100));
        let mut x = b.begin(100);
        let mut y = b.begin(100);
        assert!(x.grow_to(50, None));
        // Granting y 50 would leave nobody able to finish: y waits, here until its deadline.
        let soon = Instant::now() + std::time::Duration::from_millis(10);
        assert!(!y.grow_to(50, Some(soon)));
        assert_eq!((y.held(), b.held()), (0, 50));
        // Without a deadline it waits until x has finished.
        let b2 = Arc::clone(&b);
        let waiter = std::thread::spawn(move || {
            let granted = y.grow_to(50, None);
            (granted, b2.held())
        });
        while b.waits() < 2 {
            std::thread::yield_now();
        }
        assert!(x.grow_to(100, None), "x can always finish");
        drop(x);
        assert_eq!(waiter.join().unwrap(), (true, 50));
        assert_eq!(b.held(), 0, "y dropped with its thread");
    }

    #[test]
    fn a_frame_holding_nothing_is_always_admitted() {
        let b = Arc::new(PayloadBudget::new(10));
        let mut x = b.begin(10);
        assert!(x.grow_to(10, None));
        let _y = b.begin(10);
        assert_eq!(b.held(), 10);
    }
}
