//! Transfers the LMCache frontend handed to workers and has not yet paired with a COMMIT: a
//! FIFO of native transfer ids per LMCache key, per instance registration. LMCache workers pair
//! each COMMIT with their oldest PREPARE of the same key, so a repeated PREPARE never replaces
//! (and never frees or commits) one still in flight. Entries are never evicted: beyond the byte
//! budget a new PREPARE is refused instead, and the caller ends its native transfer at once.

use std::collections::{HashMap, VecDeque};

use crate::hashing::ChunkHash;

/// Identity of an LMCache key for pairing (LMCache compares every field but `request_id`; the
/// last chunk hash stands for the token prefix).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyId {
    /// Model name.
    pub model: String,
    /// KV world size.
    pub world_size: u32,
    /// Worker rank.
    pub worker: Option<u32>,
    /// Cache salt.
    pub salt: String,
    /// Token range start.
    pub start: u64,
    /// Token range end.
    pub end: u64,
    /// Hash of the range's last chunk.
    pub last_hash: Option<ChunkHash>,
}

impl KeyId {
    fn bytes(&self) -> usize {
        std::mem::size_of::<KeyId>() + self.model.len() + self.salt.len() + 64
    }
}

/// Store or retrieve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// PREPARE_STORE / COMMIT_STORE.
    Store,
    /// PREPARE_RETRIEVE / COMMIT_RETRIEVE.
    Retrieve,
}

#[derive(Default)]
struct Queues {
    generation: u64,
    /// Transfers queued for this registration (both kinds).
    count: usize,
    stores: HashMap<KeyId, VecDeque<u64>>,
    retrieves: HashMap<KeyId, VecDeque<u64>>,
}

impl Queues {
    fn of(&mut self, kind: Kind) -> &mut HashMap<KeyId, VecDeque<u64>> {
        match kind {
            Kind::Store => &mut self.stores,
            Kind::Retrieve => &mut self.retrieves,
        }
    }
}

/// Bytes of one queued transfer id beyond its key.
const ID_BYTES: usize = 16;

/// The frontend's pending transfers. Invariant: `bytes` is the estimate of everything held and
/// never exceeds `budget`; every id listed is a native transfer of the registration
/// (`instance`, `generation`) that no COMMIT has been paired with yet.
pub struct PendingTable {
    by_instance: HashMap<u64, Queues>,
    /// Pairing epoch per registered instance, with the registration generation it was started
    /// for: every REGISTER starts a new one (see [`PendingTable::new_epoch`]). Absent = 0;
    /// dropped when that very registration is released (a release of an older generation leaves
    /// a newer registration's epoch alone).
    epochs: HashMap<u64, Epoch>,
    /// The last epoch handed out, node-wide. Invariant: only grows, so an epoch is never handed
    /// out twice (not even to another registration of the same id after a release) and never 0.
    last_epoch: u64,
    bytes: usize,
    budget: usize,
    per_registration: usize,
}

/// A pairing epoch and the registration generation it belongs to.
#[derive(Debug, Clone, Copy)]
struct Epoch {
    generation: u64,
    epoch: u64,
}

/// Why [`PendingTable::push`] refused a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PendingFull {
    /// The byte budget or this registration's share is used up.
    Budget,
    /// A REGISTER started a new pairing epoch while the transfer was being prepared.
    StaleEpoch,
}

impl PendingTable {
    /// An empty table holding at most `budget` estimated bytes, and at most
    /// `per_registration` transfers for any one registration (so a worker that never commits
    /// fills only its own share).
    pub fn new(budget: usize, per_registration: usize) -> PendingTable {
        PendingTable {
            by_instance: HashMap::new(),
            epochs: HashMap::new(),
            last_epoch: 0,
            bytes: 0,
            budget,
            per_registration,
        }
    }

    /// The current pairing epoch of `instance` (0 when it has none).
    pub fn epoch(&self, instance: u64) -> u64 {
        self.epochs.get(&instance).map_or(0, |e| e.epoch)
    }

    /// Starts a new pairing epoch for `instance`, registered as `generation` (a REGISTER of the
    /// id: maybe a new process): everything queued is dropped, and transfers prepared under an
    /// earlier epoch are refused by [`PendingTable::push`] even if their PREPARE completes
    /// later. The epoch comes from a node-wide counter, so it differs from every epoch before.
    pub fn new_epoch(&mut self, instance: u64, generation: u64) {
        self.forget(instance, None);
        self.last_epoch += 1;
        self.epochs.insert(
            instance,
            Epoch {
                generation,
                epoch: self.last_epoch,
            },
        );
    }

    /// Queues transfer `id` of registration (`instance`, `generation`) under `key`, prepared
    /// during pairing epoch `epoch`. Entries of an older registration of the same id are dropped
    /// first. Refused when the epoch moved on meanwhile or a budget is reached.
    pub fn push(
        &mut self,
        instance: u64,
        generation: u64,
        epoch: u64,
        kind: Kind,
        key: KeyId,
        id: u64,
    ) -> Result<(), PendingFull> {
        if self.epoch(instance) != epoch {
            return Err(PendingFull::StaleEpoch);
        }
        if self
            .by_instance
            .get(&instance)
            .is_some_and(|q| q.generation != generation)
        {
            self.forget(instance, None);
        }
        let size = ID_BYTES + key.bytes();
        if self.bytes + size > self.budget
            || self
                .by_instance
                .get(&instance)
                .is_some_and(|q| q.count >= self.per_registration)
        {
            return Err(PendingFull::Budget);
        }
        let q = self.by_instance.entry(instance).or_insert_with(|| Queues {
            generation,
            ..Queues::default()
        });
        q.of(kind).entry(key).or_default().push_back(id);
        q.count += 1;
        self.bytes += size;
        Ok(())
    }

    /// The oldest transfer queued under `key` for registration (`instance`, `generation`).
    pub fn pop(&mut self, instance: u64, generation: u64, kind: Kind, key: &KeyId) -> Option<u64> {
        let q = self.by_instance.get_mut(&instance)?;
        if q.generation != generation {
            return None;
        }
        let map = q.of(kind);
        let fifo = map.get_mut(key)?;
        let id = fifo.pop_front()?;
        if fifo.is_empty() {
            map.remove(key);
        }
        q.count -= 1;
        self.bytes -= ID_BYTES + key.bytes();
        Some(id)
    }

    /// Drops everything of `instance` (of `generation` only, when given: the queued transfers
    /// and the pairing epoch of that registration, never those of a newer one): it was
    /// released and the node already handed its transfers back.
    pub fn forget(&mut self, instance: u64, generation: Option<u64>) {
        if let Some(g) = generation {
            if self
                .epochs
                .get(&instance)
                .is_some_and(|e| e.generation == g)
            {
                self.epochs.remove(&instance);
            }
        }
        let Some(q) = self.by_instance.get(&instance) else {
            return;
        };
        if generation.is_some_and(|g| g != q.generation) {
            return;
        }
        let q = self.by_instance.remove(&instance).expect("present");
        for (k, ids) in q.stores.iter().chain(q.retrieves.iter()) {
            self.bytes -= ids.len() * (ID_BYTES + k.bytes());
        }
    }

    /// The transfer ids queued for `instance` (any registration), sorted.
    pub fn ids(&self, instance: u64) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .by_instance
            .get(&instance)
            .map(|q| {
                q.stores
                    .values()
                    .chain(q.retrieves.values())
                    .flatten()
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// Transfers queued (all instances, both kinds).
    pub fn len(&self) -> usize {
        self.by_instance
            .values()
            .flat_map(|q| q.stores.values().chain(q.retrieves.values()))
            .map(VecDeque::len)
            .sum()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Estimated bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(start: u64) -> KeyId {
        KeyId {
            model: "m".into(),
            world_size: 1,
            worker: Some(0),
            salt: String::new(),
            start,
            end: start + 16,
            last_hash: None,
        }
    }

    #[test]
    fn pairs_commits_with_the_oldest_prepare_of_the_key() {
        let mut t = PendingTable::new(1 << 20, 1 << 20);
        t.push(1, 7, 0, Kind::Store, key(0), 10).unwrap();
        t.push(1, 7, 0, Kind::Store, key(0), 11).unwrap();
        t.push(1, 7, 0, Kind::Retrieve, key(0), 12).unwrap();
        assert_eq!(t.pop(1, 7, Kind::Store, &key(0)), Some(10));
        assert_eq!(t.pop(1, 7, Kind::Store, &key(0)), Some(11));
        assert_eq!(t.pop(1, 7, Kind::Store, &key(0)), None);
        assert_eq!(
            t.pop(1, 8, Kind::Retrieve, &key(0)),
            None,
            "another registration"
        );
        assert_eq!(t.pop(1, 7, Kind::Retrieve, &key(0)), Some(12));
        assert_eq!(t.bytes(), 0);
    }

    #[test]
    fn a_new_registration_or_a_release_drops_the_old_entries() {
        let mut t = PendingTable::new(1 << 20, 1 << 20);
        t.push(1, 7, 0, Kind::Store, key(0), 10).unwrap();
        t.push(1, 8, 0, Kind::Store, key(16), 20).unwrap();
        assert_eq!(t.len(), 1, "generation 7 was dropped");
        t.forget(1, Some(7));
        assert_eq!(t.len(), 1, "a stale release does not touch generation 8");
        t.forget(1, Some(8));
        assert!(t.is_empty());
        assert_eq!(t.bytes(), 0);
    }

    #[test]
    fn refuses_beyond_its_byte_budget_and_never_evicts() {
        let mut t = PendingTable::new(2_000, 1 << 20);
        let mut n = 0;
        while t.push(1, 1, 0, Kind::Store, key(n * 16), n).is_ok() {
            n += 1;
        }
        assert!(n > 0 && t.bytes() <= 2_000);
        assert_eq!(t.len() as u64, n, "nothing was evicted to make room");
        assert_eq!(t.pop(1, 1, Kind::Store, &key(0)), Some(0));
        assert!(
            t.push(1, 1, 0, Kind::Store, key(0), 99).is_ok(),
            "room again"
        );
    }

    #[test]
    fn a_prepare_of_an_older_epoch_is_never_queued() {
        let mut t = PendingTable::new(1 << 20, 1 << 20);
        let seen = t.epoch(1);
        t.push(1, 1, seen, Kind::Store, key(0), 10).unwrap();
        t.new_epoch(1, 1); // a REGISTER while a PREPARE of the old epoch is in flight
        assert!(t.is_empty());
        assert_eq!(
            t.push(1, 1, seen, Kind::Store, key(0), 11),
            Err(PendingFull::StaleEpoch)
        );
        assert!(t.push(1, 1, t.epoch(1), Kind::Store, key(0), 12).is_ok());
        t.forget(1, Some(1)); // released: its epoch goes too
        assert_eq!(t.epoch(1), 0);
    }

    /// The reaper marks generation 1 released, a REGISTER builds generation 2 and starts its
    /// epoch, a PREPARE of generation 2 reads that epoch, and only then does the release of
    /// generation 1 run its hook: the hook must leave generation 2's epoch alone (it used to
    /// reset it to 0, so the PREPARE was refused as stale), and no epoch is ever handed out
    /// twice (a reset to 0 and counting up again could accept a PREPARE of an old epoch).
    #[test]
    fn the_release_of_an_older_generation_keeps_the_new_registrations_epoch() {
        let mut t = PendingTable::new(1 << 20, 1 << 20);
        t.new_epoch(1, 1);
        let first = t.epoch(1);
        // Reaper: generation 1 marked released. REGISTER: generation 2, new epoch.
        t.new_epoch(1, 2);
        let second = t.epoch(1);
        assert_ne!(first, second);
        // The release hook of generation 1 runs late.
        t.forget(1, Some(1));
        assert_eq!(t.epoch(1), second, "generation 2's epoch survives");
        assert!(
            t.push(1, 2, second, Kind::Store, key(0), 10).is_ok(),
            "generation 2's PREPARE is queued"
        );
        // Generation 2 released, generation 3 registered: a fresh epoch, never an old one.
        t.forget(1, Some(2));
        assert!(t.is_empty());
        t.new_epoch(1, 3);
        let third = t.epoch(1);
        assert!(third != first && third != second && third != 0);
        assert_eq!(
            t.push(1, 3, first, Kind::Store, key(0), 11),
            Err(PendingFull::StaleEpoch)
        );
        // Epochs are node-wide: another instance never reuses one either.
        t.new_epoch(2, 1);
        assert!(![0, first, second, third].contains(&t.epoch(2)));
    }

    #[test]
    fn one_registration_fills_only_its_own_share() {
        let mut t = PendingTable::new(1 << 20, 3);
        for i in 0..3 {
            t.push(1, 1, 0, Kind::Store, key(i * 16), i).unwrap();
        }
        assert_eq!(
            t.push(1, 1, 0, Kind::Retrieve, key(0), 9),
            Err(PendingFull::Budget)
        );
        assert!(
            t.push(2, 1, 0, Kind::Store, key(0), 10).is_ok(),
            "another worker is unaffected"
        );
        assert_eq!(t.pop(1, 1, Kind::Store, &key(0)), Some(0));
        assert!(t.push(1, 1, 0, Kind::Store, key(0), 11).is_ok());
    }
}
