//! The table of lookup sessions: per (owner uid, request id), bounded in count
//! (`limits.max_sessions`) and in bytes (`limits.max_session_bytes`). A session keeps only the
//! read locks of its hit prefix (a complete miss keeps nothing, and has no session at all).
//! When a new session would not fit, the table makes room by evicting sessions, largest owner
//! first and least recently used first within an owner; the caller releases their locks.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::storage::{NamespaceId, StorageKey};

/// One key's share of a lookup's read locks.
#[derive(Debug, Clone, Copy)]
pub(super) struct HeldLock {
    pub(super) key: StorageKey,
    pub(super) lease: u64,
    /// Locks this session still holds on the key (starts at `1 + extra`; each retrieve that
    /// relies on the session uses one up; FREE_LOOKUP_LOCKS releases the rest).
    pub(super) remaining: u32,
}

/// What a lookup remembers for its request. Invariants: `locked` holds `world_size` entries per
/// chunk of the hit prefix (chunk `c` is `locked[c * world_size..(c + 1) * world_size]`), so
/// its length is the hit length times `world_size` and never 0; every `HeldLock` with
/// `remaining > 0` is backed by that many read locks taken by this session and not yet released
/// by anyone; `bytes` is [`Session::heap_bytes`] of this session under its request id.
#[derive(Debug, Clone)]
pub struct Session {
    pub(super) namespace: NamespaceId,
    pub(super) world_size: u32,
    pub(super) locked: Vec<HeldLock>,
    pub(super) last_used_ms: u64,
    /// The connection whose LOOKUP created it: only that connection may free, end or replace
    /// it (retrieves of the same user may adopt its locks), and its close ends it.
    pub(super) connection: u64,
    bytes: usize,
}

/// Bytes charged per session for its slot in the table: a hash table keeps up to 16/7 slots per
/// entry (load factor 7/8, doubling), each the entry plus a control byte; 3 entries' worth is an
/// upper bound that also covers the allocator's rounding.
const SLOT_BYTES: usize = 3 * (std::mem::size_of::<(SessionKey, Session)>() + 1);

impl Session {
    /// A session over `locked` (chunk-major, `world_size` keys per chunk; not empty).
    pub(super) fn new(
        namespace: NamespaceId,
        world_size: u32,
        locked: Vec<HeldLock>,
        request_id: &str,
        now_ms: u64,
        connection: u64,
    ) -> Session {
        debug_assert!(!locked.is_empty() && locked.len().is_multiple_of(world_size as usize));
        let mut s = Session {
            namespace,
            world_size,
            locked,
            last_used_ms: now_ms,
            connection,
            bytes: 0,
        };
        s.bytes = s.heap_bytes(request_id);
        s
    }

    /// An upper bound of the memory this session takes under request id `request_id`: its table
    /// slot ([`SLOT_BYTES`]), the key's copy of the request id and the lock list's capacity.
    pub fn heap_bytes(&self, request_id: &str) -> usize {
        SLOT_BYTES + request_id.len() + self.locked.capacity() * std::mem::size_of::<HeldLock>()
    }

    /// Bytes charged to this session (see [`Session::heap_bytes`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Hit length in chunks.
    pub fn hit_chunks(&self) -> usize {
        self.locked.len() / self.world_size as usize
    }

    /// The locks of chunk `c` of the hit prefix (empty beyond it).
    pub(super) fn chunk_mut(&mut self, c: usize) -> &mut [HeldLock] {
        let ws = self.world_size as usize;
        let start = c.saturating_mul(ws).min(self.locked.len());
        let end = start.saturating_add(ws).min(self.locked.len());
        &mut self.locked[start..end]
    }
}

const SESSION_SHARDS: usize = 16;

/// Who a session belongs to: the uid of the peer that ran the LOOKUP (or, above the range of
/// uids, a remote token's trust domain). Request ids are the
/// clients' own names, so each user has its own name space: another user's LOOKUP, FREE, END or
/// retrieve never sees (or replaces) a session it did not create.
pub type SessionOwner = u64;

/// The owner used for a peer whose credentials are unknown (never matches a real user's).
pub const UNKNOWN_OWNER: SessionOwner = u64::MAX;

pub(super) type SessionKey = (SessionOwner, String);

/// One owner's bytes and its sessions as eviction candidates: `(last used, request id, bytes)`.
type OwnerSessions = (usize, Vec<(u64, String, usize)>);

/// Sessions by (owner, request id). Invariants: `count` is the number of sessions and `bytes`
/// the sum of their [`Session::bytes`] (both updated under the shard lock that inserts or
/// removes); at most `limit` sessions once [`SessionTable::make_room`] has run for each insert.
/// Hash maps with randomly keyed SipHash (clients choose request ids: no hash flooding); every
/// walk over them that acts on sessions (expiry, eviction) sorts first, so it runs in a
/// deterministic order.
pub struct SessionTable {
    shards: Vec<Mutex<HashMap<SessionKey, Session>>>,
    count: AtomicUsize,
    bytes: AtomicUsize,
    evicted: AtomicU64,
    pub(super) limit: usize,
}

impl SessionTable {
    /// An empty table holding at most `limit` sessions.
    pub fn new(limit: usize) -> SessionTable {
        SessionTable {
            shards: (0..SESSION_SHARDS).map(|_| Mutex::default()).collect(),
            count: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            evicted: AtomicU64::new(0),
            limit,
        }
    }

    fn shard_index(id: &str) -> usize {
        let h = blake3::hash(id.as_bytes());
        h.as_bytes()[0] as usize % SESSION_SHARDS
    }

    pub(super) fn shard(&self, id: &str) -> &Mutex<HashMap<SessionKey, Session>> {
        &self.shards[Self::shard_index(id)]
    }

    pub(super) fn key(owner: SessionOwner, id: &str) -> SessionKey {
        (owner, id.to_owned())
    }

    /// Number of live sessions.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether there are no sessions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes charged to the live sessions (the sum of their [`Session::bytes`]).
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Sessions evicted so far to keep the table within its count and byte limits.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    fn added(&self, s: &Session) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(s.bytes, Ordering::Relaxed);
    }

    fn removed(&self, s: &Session) {
        self.count.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(s.bytes, Ordering::Relaxed);
    }

    /// Inserts `s` unless a session of the same `(owner, id)` created over another connection
    /// is there (then `s` comes back as `Err`, for the caller to release); returns the session
    /// it replaced (the caller releases its locks).
    pub(super) fn insert_unless_foreign(
        &self,
        owner: SessionOwner,
        id: &str,
        s: Session,
    ) -> Result<Option<Session>, Session> {
        let mut m = self.shard(id).lock();
        let key = Self::key(owner, id);
        if m.get(&key).is_some_and(|o| o.connection != s.connection) {
            return Err(s);
        }
        self.added(&s);
        let old = m.insert(key, s);
        if let Some(o) = &old {
            self.removed(o);
        }
        Ok(old)
    }

    /// Inserts `s`; returns the session it replaced (the caller releases its locks).
    #[cfg(test)]
    pub(super) fn insert(&self, owner: SessionOwner, id: &str, s: Session) -> Option<Session> {
        let mut m = self.shard(id).lock();
        self.added(&s);
        let old = m.insert(Self::key(owner, id), s);
        if let Some(o) = &old {
            self.removed(o);
        }
        old
    }

    /// Removes and returns the session `(owner, id)`, if any.
    #[cfg(test)]
    pub(super) fn remove(&self, owner: SessionOwner, id: &str) -> Option<Session> {
        let old = self.shard(id).lock().remove(&Self::key(owner, id));
        if let Some(o) = &old {
            self.removed(o);
        }
        old
    }

    /// Removes and returns the session `(owner, id)` if it was created over `connection`
    /// (checked and removed under one shard lock); `Err(())` when it exists and belongs to
    /// another connection (left in place).
    pub(super) fn remove_if_created_by(
        &self,
        owner: SessionOwner,
        id: &str,
        connection: u64,
    ) -> Result<Option<Session>, ()> {
        let mut m = self.shard(id).lock();
        let key = Self::key(owner, id);
        match m.get(&key) {
            Some(s) if s.connection != connection => return Err(()),
            None => return Ok(None),
            Some(_) => {}
        }
        let old = m.remove(&key);
        drop(m);
        if let Some(o) = &old {
            self.removed(o);
        }
        Ok(old)
    }

    /// Every lock the sessions hold: `("owner:request id", key, lease, locks remaining)`, sorted
    /// (the simulator's lock-ownership check). O(sessions x keys): never on a request path.
    pub fn held_locks(&self) -> Vec<(String, StorageKey, u64, u32)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            for ((owner, id), s) in shard.lock().iter() {
                for h in &s.locked {
                    out.push((format!("{owner}:{id}"), h.key, h.lease, h.remaining));
                }
            }
        }
        out.sort_unstable();
        out
    }

    /// The namespace of every live session (the namespace reclaimer keeps them).
    pub fn namespaces(&self) -> Vec<NamespaceId> {
        let mut out: Vec<NamespaceId> = self
            .shards
            .iter()
            .flat_map(|s| s.lock().values().map(|v| v.namespace).collect::<Vec<_>>())
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Checks the table's books against its sessions: none is empty (a miss keeps no session),
    /// each is charged its [`Session::heap_bytes`], the count and byte totals match, and they are
    /// within the count limit and `max_bytes`. For checkers (the simulator, tests), on a quiet
    /// table: O(sessions), every shard locked in turn.
    pub fn audit(&self, max_bytes: usize) -> Result<(), String> {
        let (mut count, mut bytes) = (0, 0);
        for shard in &self.shards {
            for ((owner, id), s) in shard.lock().iter() {
                if s.locked.is_empty() || !s.locked.len().is_multiple_of(s.world_size as usize) {
                    return Err(format!(
                        "session {owner}:{id} holds {} locks for world size {}",
                        s.locked.len(),
                        s.world_size
                    ));
                }
                if s.bytes != s.heap_bytes(id) {
                    return Err(format!(
                        "session {owner}:{id} is charged {} bytes but takes {}",
                        s.bytes,
                        s.heap_bytes(id)
                    ));
                }
                count += 1;
                bytes += s.bytes;
            }
        }
        if (count, bytes) != (self.len(), self.bytes()) {
            return Err(format!(
                "session table counts {} sessions and {} bytes but holds {count} and {bytes}",
                self.len(),
                self.bytes()
            ));
        }
        if count > self.limit || bytes > max_bytes {
            return Err(format!(
                "{count} sessions of {bytes} bytes exceed the limits ({} sessions, {max_bytes} \
                 bytes)",
                self.limit
            ));
        }
        Ok(())
    }

    /// Removes sessions idle since before `cutoff_ms` and returns them, so the caller releases
    /// the locks they still hold (a retrieve that used them has already consumed its share).
    pub fn expire(&self, cutoff_ms: u64) -> Vec<Session> {
        self.remove_where(|v| v.last_used_ms < cutoff_ms)
    }

    /// Removes the sessions created over `connection` (it closed) and returns them, so the caller
    /// releases their locks. O(sessions): runs once per closed connection.
    pub fn remove_of_connection(&self, connection: u64) -> Vec<Session> {
        self.remove_where(|v| v.connection == connection)
    }

    /// Removes (in key order per shard) and returns every session `doomed` selects.
    fn remove_where(&self, doomed: impl Fn(&Session) -> bool) -> Vec<Session> {
        let mut out = Vec::new();
        for s in &self.shards {
            let mut m = s.lock();
            let mut stale: Vec<SessionKey> = m
                .iter()
                .filter(|(_, v)| doomed(v))
                .map(|(k, _)| k.clone())
                .collect();
            stale.sort_unstable();
            for k in &stale {
                if let Some(v) = m.remove(k) {
                    self.removed(&v);
                    out.push(v);
                }
            }
            // A table emptied after a burst gives its slots back.
            if m.capacity() > 4 * m.len() + 64 {
                m.shrink_to_fit();
            }
        }
        out
    }

    /// Makes room for one more session of `incoming` bytes owned by `owner` within `max_bytes`
    /// and the count limit; returns the evicted sessions (the caller releases their locks).
    /// When it has to evict, it goes down to 7/8 of both limits, so the walk over the table runs
    /// once per eighth of the budget, not once per LOOKUP. Victims are taken from the owner
    /// holding the most bytes (counting `incoming` as theirs), least recently used first: a
    /// user flooding the table evicts its own sessions before anyone else's. Sessions are
    /// checked again under their shard lock, so one used after the walk began is kept and the
    /// next candidate is taken.
    pub(super) fn make_room(
        &self,
        owner: SessionOwner,
        incoming: usize,
        max_bytes: usize,
    ) -> Vec<Session> {
        if self.bytes().saturating_add(incoming) <= max_bytes && self.len() < self.limit {
            return Vec::new();
        }
        let byte_goal = max_bytes.saturating_sub(incoming + max_bytes / 8);
        let count_goal = self.limit.saturating_sub(1 + self.limit / 8);
        let done = |t: &SessionTable| t.bytes() <= byte_goal && t.len() <= count_goal;
        // Candidates per owner, least recently used first.
        let mut by_owner: BTreeMap<SessionOwner, OwnerSessions> = BTreeMap::new();
        for shard in &self.shards {
            for ((o, id), s) in shard.lock().iter() {
                let e = by_owner.entry(*o).or_default();
                e.0 += s.bytes;
                e.1.push((s.last_used_ms, id.clone(), s.bytes));
            }
        }
        by_owner.entry(owner).or_default().0 += incoming;
        for (_, list) in by_owner.values_mut() {
            // Reversed, so the least recently used is popped first.
            list.sort_unstable_by(|a, b| b.cmp(a));
        }
        let mut out = Vec::new();
        while !done(self) {
            // The owner with the most bytes that still has a session to give (ties: lowest uid).
            let Some((&victim, _)) = by_owner
                .iter()
                .filter(|(_, (_, l))| !l.is_empty())
                .max_by(|a, b| a.1 .0.cmp(&b.1 .0).then(b.0.cmp(a.0)))
            else {
                break;
            };
            let entry = by_owner.get_mut(&victim).expect("chosen above");
            let (used, id, bytes) = entry.1.pop().expect("not empty");
            entry.0 -= bytes;
            let mut m = self.shard(&id).lock();
            let key = (victim, id);
            if m.get(&key).is_some_and(|s| s.last_used_ms == used) {
                let s = m.remove(&key).expect("present");
                self.removed(&s);
                out.push(s);
            }
        }
        self.evicted.fetch_add(out.len() as u64, Ordering::Relaxed);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(chunks: usize, id: &str, now: u64) -> Session {
        let key = StorageKey {
            chunk_hash: [1; 32],
            kv_rank: 0,
            object_group: 0,
            namespace: NamespaceId(1),
        };
        let locked = vec![
            HeldLock {
                key,
                lease: 1,
                remaining: 0
            };
            chunks
        ];
        Session::new(NamespaceId(1), 1, locked, id, now, 1)
    }

    #[test]
    fn bytes_follow_inserts_removals_and_expiry() {
        let t = SessionTable::new(100);
        let a = session(10, "a", 1);
        let (ab, bb) = (a.bytes(), session(1000, "b", 2).bytes());
        assert!(ab >= 10 * std::mem::size_of::<HeldLock>() + SLOT_BYTES);
        t.insert(1, "a", a);
        t.insert(1, "b", session(1000, "b", 2));
        assert_eq!((t.len(), t.bytes()), (2, ab + bb));
        // Replacing a session swaps its charge.
        let old = t.insert(1, "a", session(1, "a", 3)).unwrap();
        assert_eq!(old.bytes(), ab);
        assert_eq!(t.bytes(), session(1, "a", 3).bytes() + bb);
        t.remove(1, "b").unwrap();
        assert_eq!(t.expire(10).len(), 1);
        assert_eq!((t.len(), t.bytes()), (0, 0));
    }

    #[test]
    fn room_is_made_from_the_largest_owner_least_recently_used_first() {
        let t = SessionTable::new(100);
        let one = session(100, "x", 0).bytes();
        // Owner 7 holds three sessions, owner 8 one (used long ago).
        t.insert(8, "o", session(100, "o", 0));
        for (i, id) in ["p", "q", "r"].iter().enumerate() {
            t.insert(7, id, session(100, id, 10 + i as u64));
        }
        // Room for one more session of owner 9 within 4 sessions' bytes, down to 7/8 of them:
        // two must go, both owner 7's least recently used ("p", "q"), not owner 8's older one.
        let gone = t.make_room(9, one, 4 * one);
        let used: Vec<u64> = gone.iter().map(|s| s.last_used_ms).collect();
        assert_eq!(used, [10, 11]);
        assert!(t.shard("o").lock().contains_key(&(8, "o".into())));
        assert_eq!((t.len(), t.bytes(), t.evicted()), (2, 2 * one, 2));
        // Room that is there costs nothing.
        assert!(t.make_room(9, one, 4 * one).is_empty());
        // The count limit makes room the same way.
        let small = SessionTable::new(2);
        small.insert(1, "a", session(1, "a", 5));
        small.insert(2, "b", session(1, "b", 6));
        let gone = small.make_room(3, 1, usize::MAX);
        assert_eq!((gone.len(), small.len()), (1, 1));
    }
}
