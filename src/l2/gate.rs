//! [`ClearGate`]: lets any number of L2 operations (write-behind batches, loads) run at once,
//! and CLEAR run alone. Unlike a read-write lock, an operation's [`GateToken`] can be handed
//! to another thread (a write batch is prepared on the writer thread and completed on the I/O
//! thread), and CLEAR, once waiting, holds new operations back so it cannot be starved.

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
struct State {
    /// Operations inside the gate.
    inside: usize,
    /// A CLEAR is waiting for them or running.
    clearing: bool,
}

/// The gate. Invariant: while an exclusive section runs, `inside == 0` and no operation enters.
#[derive(Default)]
pub struct ClearGate {
    state: Mutex<State>,
    changed: Condvar,
}

/// Proof that an operation is inside the gate; leaving happens on drop (on any thread).
pub struct GateToken<'a> {
    gate: &'a ClearGate,
}

impl ClearGate {
    /// Enters (waits while a CLEAR is pending or running).
    pub fn enter(&self) -> GateToken<'_> {
        let mut s = self.state.lock();
        while s.clearing {
            self.changed.wait(&mut s);
        }
        s.inside += 1;
        GateToken { gate: self }
    }

    /// Runs `f` alone: waits for a CLEAR in progress, bars new operations, waits until every
    /// operation inside has left, runs `f`, opens the gate again.
    pub fn exclusive<T>(&self, f: impl FnOnce() -> T) -> T {
        let mut s = self.state.lock();
        while s.clearing {
            self.changed.wait(&mut s);
        }
        s.clearing = true;
        while s.inside > 0 {
            self.changed.wait(&mut s);
        }
        drop(s);
        // Reopen even if `f` panics, so the node does not wedge.
        struct Reopen<'a>(&'a ClearGate);
        impl Drop for Reopen<'_> {
            fn drop(&mut self) {
                self.0.state.lock().clearing = false;
                self.0.changed.notify_all();
            }
        }
        let _reopen = Reopen(self);
        f()
    }
}

impl Drop for GateToken<'_> {
    fn drop(&mut self) {
        let mut s = self.gate.state.lock();
        s.inside -= 1;
        if s.inside == 0 {
            self.gate.changed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    #[test]
    fn exclusive_waits_for_tokens_held_on_other_threads_and_bars_new_ones() {
        let gate = ClearGate::default();
        let inside = AtomicUsize::new(0);
        let cleared = AtomicBool::new(false);
        let (gate, inside, cleared) = (&gate, &inside, &cleared);
        std::thread::scope(|s| {
            let token = gate.enter();
            inside.fetch_add(1, Ordering::SeqCst);
            let (tx, rx) = std::sync::mpsc::channel();
            // The token moves to another thread, which leaves the gate later.
            s.spawn(move || {
                let t = rx.recv().unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
                inside.fetch_sub(1, Ordering::SeqCst);
                drop::<GateToken>(t);
            });
            tx.send(token).unwrap();
            s.spawn(move || {
                gate.exclusive(|| {
                    assert_eq!(inside.load(Ordering::SeqCst), 0, "no operation inside");
                    cleared.store(true, Ordering::SeqCst);
                })
            });
        });
        assert!(cleared.load(Ordering::SeqCst));
        // Open again afterwards.
        drop(gate.enter());
        gate.exclusive(|| ());
    }
}
