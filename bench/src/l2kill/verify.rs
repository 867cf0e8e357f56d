//! The last phase of an iteration: after the restart, every key ever handed out is retrieved
//! and its bytes checked, STATUS and MEMCHECK are read, and the iteration is judged.

use std::collections::HashSet;

use super::node::Node;
use super::report::Iter;
use super::{connect, l2, object_bytes, range, register, Key, Loop, MODELS};
use crate::payload::Payload;

impl Loop<'_> {
    /// Retrieves every key ever handed out; checks bytes and CLEARs.
    pub(super) fn verify(
        &mut self,
        node: &Node,
        n: u32,
        committed: &HashSet<Key>,
        it: &mut Iter,
    ) -> Result<(), String> {
        let mut c = connect(&node.socket)?;
        let s = c
            .status()
            .map_err(|e| format!("STATUS after restart: {e}"))?;
        if s["l2"].is_null() {
            return Err(format!("the restarted node has no L2 tier: {s}"));
        }
        if s["l2"]["failed_devices"]
            .as_array()
            .is_some_and(|d| !d.is_empty())
        {
            return Err(format!(
                "the restarted node left out its device: {}",
                s["l2"]
            ));
        }
        self.engine_used = s["l2"]["engine"].as_str().unwrap_or("?").to_owned();
        it.recovered = l2(&s, "recovered");
        let hidden = self.a.hidden;
        let ids = register(&mut c, u64::from(n) * 8 + 5, hidden)?;
        let payloads = [
            Payload::new(object_bytes(hidden, 0)),
            Payload::new(object_bytes(hidden, 1)),
        ];
        let (epochs, counts): (u32, Vec<u64>) = {
            let keys = self.keys.keys.lock().unwrap();
            (keys.epoch, keys.issued.clone())
        };
        for epoch in 0..=epochs {
            for idx in 0..counts[epoch as usize] {
                let key = Key { epoch, idx };
                let (h, m) = (key.hash(self.nonce), key.model());
                let Some(data) = c
                    .retrieve(ids[m], &range(h, m))
                    .map_err(|e| format!("retrieve of {key:?}: {e}"))?
                else {
                    continue;
                };
                it.served += 1;
                if committed.contains(&key) {
                    it.served_committed += 1;
                }
                if data.len() != 1 || !payloads[m].check(&h, &data[0]) {
                    it.wrong += 1;
                    let first = data.first().map(|d| {
                        let mut want = vec![0u8; object_bytes(hidden, m)];
                        payloads[m].fill(&h, &mut want);
                        d.iter().zip(&want).position(|(a, b)| a != b)
                    });
                    self.note(format!(
                        "iteration {n}: {key:?} ({}) served with wrong bytes (first differing byte {first:?})",
                        MODELS[m].0
                    ));
                }
                if epoch < self.forbidden_below {
                    it.resurrected += 1;
                    self.note(format!(
                        "iteration {n}: {key:?} served although a CLEAR after it returned \
                         (epochs below {} are cleared)",
                        self.forbidden_below
                    ));
                }
            }
        }
        it.cleared = committed
            .iter()
            .filter(|k| k.epoch < self.forbidden_below)
            .count() as u64;
        it.missing = committed.len() as u64 - it.served_committed - it.cleared;
        let s = c
            .status()
            .map_err(|e| format!("STATUS after the retrieves: {e}"))?;
        it.corrupt = l2(&s, "corrupt");
        it.torn_counted = l2(&s, "torn");
        it.errors = l2(&s, "errors");
        it.stalled = l2(&s, "stalled");
        it.hits = l2(&s, "hits");
        it.objects_after = l2(&s, "objects");
        let (ok, problems) = c.memcheck().map_err(|e| format!("MEMCHECK: {e}"))?;
        it.memcheck_ok = ok && s["memcheck_ok"] == true;
        it.memcheck_problems = problems;
        for id in ids {
            let _ = c.unregister(id);
        }
        Ok(())
    }

    pub(super) fn judge(&mut self, n: u32, it: &Iter) {
        if it.wrong > 0 {
            self.fail(format!(
                "iteration {n}: {} objects served with wrong bytes",
                it.wrong
            ));
        }
        if it.resurrected > 0 {
            self.fail(format!(
                "iteration {n}: {} objects stored before a CLEAR that returned were served",
                it.resurrected
            ));
        }
        if !it.memcheck_ok {
            self.fail(format!(
                "iteration {n}: MEMCHECK failed: {:?}",
                it.memcheck_problems
            ));
        }
        // Every restart follows a SIGKILL, and nothing damages the device but the kill (and a
        // sabotage): every checksum failure is the kill's doing, none the medium's.
        if it.corrupt > 0 && self.a.sabotage.is_none() {
            self.fail(format!(
                "iteration {n}: {} checksum failures counted as media corruption after a kill \
                 (they are torn: the node restarted after an unclean stop)",
                it.corrupt
            ));
        }
        // L1 starts empty after a restart: whatever is served came from the recovered objects.
        if it.served > it.recovered {
            self.fail(format!(
                "iteration {n}: {} objects served but only {} recovered",
                it.served, it.recovered
            ));
        }
    }
}
