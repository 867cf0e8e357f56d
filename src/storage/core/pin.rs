//! Pins: a data op that moves bytes into a write reservation or out of read-locked objects
//! (a remote engine's store or retrieve, moved by the node's fabric) pins them first, so the TTL
//! safety net cannot free or unlock them while the fabric may still touch the slot.

use super::StorageCore;
use crate::storage::index::ObjectState;
use crate::storage::key::StorageKey;

/// One object a data op moves: its key, the lease its transfer got, and its slot's offset.
pub type Moving = (StorageKey, u64, u64);

impl StorageCore {
    /// Pins `items` for a move: each must still be held exactly as its transfer got it — a write
    /// reservation (`WriteReserved`) when `write`, else a read lock (`Ready`, `readers > 0`) —
    /// with the same lease and slot (a lock that expired, was dropped or whose slot now holds
    /// another object fails). All or nothing: on failure nothing is pinned and the index of the
    /// first item no longer held is returned.
    pub fn pin_for_move(&self, items: &[Moving], write: bool) -> Result<(), usize> {
        let _g = self.gate.read();
        for (i, (key, lease, offset)) in items.iter().enumerate() {
            let si = Self::shard_index(key);
            let mut shard = self.shards[si].lock();
            let held = shard.map.get_mut(key).filter(|e| {
                e.lease == *lease
                    && e.slot.offset == *offset
                    && if write {
                        e.state == ObjectState::WriteReserved
                    } else {
                        e.state == ObjectState::Ready && e.readers > 0
                    }
            });
            match held {
                Some(e) => e.pins = e.pins.checked_add(1).expect("pins bounded by transfers"),
                None => {
                    drop(shard);
                    self.unpin_moved(&items[..i], write);
                    return Err(i);
                }
            }
        }
        Ok(())
    }

    /// Unpins what [`StorageCore::pin_for_move`] pinned (the move completed, or was refused).
    /// An entry whose pin is already gone is skipped (it cannot be: pins block every path that
    /// removes the entry or changes its lease, which the assertion checks in tests).
    pub fn unpin_moved(&self, items: &[Moving], write: bool) {
        let _g = self.gate.read();
        for (key, lease, _) in items {
            let si = Self::shard_index(key);
            let mut shard = self.shards[si].lock();
            match shard
                .map
                .get_mut(key)
                .filter(|e| e.lease == *lease && e.pins > 0)
            {
                Some(e) => e.pins -= 1,
                None => debug_assert!(
                    false,
                    "unpin of a {} not pinned",
                    if write { "reservation" } else { "read lock" }
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::core::StorageConfig;
    use crate::storage::key::NamespaceId;

    fn key(i: u8) -> StorageKey {
        StorageKey {
            chunk_hash: [i; 32],
            kv_rank: 0x0100_0100,
            object_group: 0,
            namespace: NamespaceId(0),
        }
    }

    /// A pinned write reservation and pinned read locks survive their TTL; unpinned, they
    /// expire as before; a stale lease cannot be pinned, and a failed pin pins nothing.
    #[test]
    fn pins_hold_locks_past_their_ttl() {
        let c = StorageCore::new(64 << 20, StorageConfig::default());
        let (a, b) = (key(1), key(2));
        let g = c.reserve_write(&[a], 4096, false).remove(0).unwrap();
        let w = [(a, g.lease, g.slot.offset)];
        c.pin_for_move(&w, true).unwrap();
        assert_eq!(
            c.pin_for_move(&[(a, g.lease + 1, g.slot.offset)], true),
            Err(0)
        );
        assert_eq!(c.expire_locks(u64::MAX), (0, 0), "pinned: kept");
        c.unpin_moved(&w, true);
        assert_eq!(c.expire_locks(u64::MAX), (1, 0), "unpinned: expires");
        assert_eq!(c.pin_for_move(&w, true), Err(0), "gone");

        let g = c.reserve_write(&[b], 4096, false).remove(0).unwrap();
        assert!(c.finish_write(&[(b, g)]).iter().all(Result::is_ok));
        let r = c.reserve_read(&[b], 0).remove(0).unwrap();
        let rd = [(b, r.lease, r.slot.offset)];
        // All or nothing: the second item is not held, the first stays unpinned.
        assert_eq!(c.pin_for_move(&[rd[0], (a, 1, 0)], false), Err(1));
        c.pin_for_move(&rd, false).unwrap();
        assert_eq!(c.expire_locks(u64::MAX), (0, 0), "pinned read lock kept");
        assert_eq!(c.counts().read_locked, 1);
        c.unpin_moved(&rd, false);
        assert_eq!(
            c.expire_locks(u64::MAX),
            (0, 1),
            "unpinned read lock expires"
        );
    }
}
