//! LOOKUP, the prefetch queries, FREE_LOOKUP_LOCKS and END_SESSION, with each client's
//! lookup sessions kept apart.
//!
//! A LOOKUP of request id `R` from client `C` opens (or replaces) the node session named
//! [`session_name`]`(C, R)`: no other client can replace, free or end it. Its answer is kept
//! under (`C`, `R`) for `C`'s QUERY_PREFETCH_STATUS, exactly once. A retrieve of `R` from
//! another client (vLLM's worker; the scheduler looked up) may take over the locks of one such
//! session whose locked prefix covers the retrieved chunks with the same hashes (so two
//! schedulers that reuse a request id by accident each keep their own): its own client's
//! first, otherwise the most recent one of a client of the same user. The node adopts a lock
//! only on the identical key, so a retrieve never gets more than its own tokens hash to.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::{ClientId, LmFrontend};
use crate::hashing::{chunk_hashes, ChunkHash};
use crate::lmcache::bounded::{Budget, ClientMap, Dropped};
use crate::lmcache::wire::IpcKey;
use crate::protocol::{ChunkRange, Request, Response};

/// Clients remembered per request id as holders of a session a retrieve may take locks over
/// from (beyond: the oldest is forgotten there; its session stays its own client's).
pub const MAX_SESSION_HOLDERS: usize = 8;

/// The node-side name of `client`'s lookup session for `request_id` (unique per client).
pub(super) fn session_name(client: &ClientId, request_id: &str) -> String {
    format!("lmcache:{}:{request_id}", client.tag())
}

/// The lookup sessions the clients opened, each with the hashes of the chunks it locked.
/// Invariant: `holders[R]` lists (at most [`MAX_SESSION_HOLDERS`], most recent last) clients
/// that have an entry for `R` in `map`; the node has a session for an entry unless it expired
/// there first.
pub(super) struct LookupSessions {
    map: ClientMap<Vec<ChunkHash>>,
    holders: HashMap<String, Vec<ClientId>>,
}

/// A session dropped from the bookkeeping (the caller ends it on the node).
pub(super) type DroppedSession = Dropped<Vec<ChunkHash>>;

impl LookupSessions {
    pub(super) fn new(budget: Budget) -> LookupSessions {
        LookupSessions {
            map: ClientMap::new(budget),
            holders: HashMap::new(),
        }
    }

    /// Records that `client` opened a session for `request_id` over `looked_up` chunks, which
    /// locked the chunks hashed `locked`; returns the sessions dropped to stay within the
    /// budgets or because they expired (the caller ends them on the node).
    fn opened(
        &mut self,
        client: &ClientId,
        request_id: &str,
        looked_up: usize,
        locked: Vec<ChunkHash>,
        now_ms: u64,
    ) -> Vec<DroppedSession> {
        // Bytes: what the node keeps for the session (at most every hash looked up), the locked
        // hashes kept here, and the holders list's copy of the id and of the client.
        let extra = (looked_up + locked.len()) * 32 + request_id.len() + client.bytes() + 48;
        let (kept, dropped) = self.map.insert(client, request_id, locked, extra, now_ms);
        for (c, r, _) in &dropped {
            self.forget_holder(c, r);
        }
        self.forget_holder(client, request_id);
        let mut dropped = dropped;
        if kept {
            let h = self.holders.entry(request_id.to_owned()).or_default();
            h.push(client.clone());
            if h.len() > MAX_SESSION_HOLDERS {
                h.remove(0);
            }
        } else {
            dropped.push((client.clone(), request_id.into(), Vec::new()));
        }
        dropped
    }

    fn forget_holder(&mut self, client: &ClientId, request_id: &str) {
        if let Some(h) = self.holders.get_mut(request_id) {
            h.retain(|c| c != client);
            if h.is_empty() {
                self.holders.remove(request_id);
            }
        }
    }

    /// Forgets `client`'s session for `request_id`; whether there was one.
    fn closed(&mut self, client: &ClientId, request_id: &str) -> bool {
        self.forget_holder(client, request_id);
        self.map.remove(client, request_id).is_some()
    }

    /// Forgets every session of the clients whose routing id is `identity` (their connection
    /// closed) and returns them (the caller ends them on the node).
    pub(super) fn identity_gone(&mut self, identity: &[u8]) -> Vec<DroppedSession> {
        let gone = self.map.remove_identity(identity);
        for (c, r, _) in &gone {
            self.forget_holder(c, r);
        }
        gone
    }

    /// Marks `client`'s session for `request_id` used; whether it has a live one.
    fn touch(&mut self, client: &ClientId, request_id: &str, now_ms: u64) -> bool {
        self.map.get(client, request_id, now_ms).is_some()
            && self.map.touch(client, request_id, now_ms)
    }

    /// The client whose session for `request_id` a retrieve of `worker` of the chunks
    /// `first..` hashed `hashes` may take locks over from (see the module docs).
    fn for_retrieve(
        &mut self,
        worker: &ClientId,
        request_id: &str,
        first: usize,
        hashes: &[ChunkHash],
        now_ms: u64,
    ) -> Option<ClientId> {
        let last = first + hashes.len();
        let covers =
            |locked: &Vec<ChunkHash>| !hashes.is_empty() && locked.get(last - 1) == hashes.last();
        let others = self.holders.get(request_id).into_iter().flatten().rev();
        let holder = std::iter::once(worker)
            .chain(others.filter(|c| c.same_user(worker)))
            .find(|c| self.map.get(c, request_id, now_ms).is_some_and(covers))
            .cloned()?;
        self.map.touch(&holder, request_id, now_ms);
        Some(holder)
    }

    /// Estimated bytes held.
    pub(super) fn bytes(&self) -> usize {
        self.map.bytes()
    }
}

impl LmFrontend {
    /// Ends on the node the sessions the bookkeeping dropped (budget or TTL).
    fn end_dropped(&self, dropped: Vec<DroppedSession>) {
        for (client, request_id, _) in dropped {
            self.state
                .counters
                .sessions_dropped
                .fetch_add(1, Ordering::Relaxed);
            self.call(Request::EndSession {
                request_id: session_name(&client, &request_id),
            });
        }
    }

    pub(super) fn lookup(&self, client: &ClientId, key: &IpcKey, tp_size: u32) {
        let name = session_name(client, &key.request_id);
        let now = self.ctx.now_ms();
        // LMCache answers 0 when no worker of this (model, world size) registered a layout.
        let hits = if self
            .ctx
            .layouts
            .get(&key.model_name, key.world_size)
            .is_none()
        {
            // Like any LOOKUP, it replaces the client's session of its request id: release that
            // one's locks now rather than at its idle expiry.
            if self.state.sessions.lock().closed(client, &key.request_id) {
                self.call(Request::EndSession { request_id: name });
            }
            0
        } else {
            // LMCache 0.5.6 looks up the full chunks of `token_ids[..end]`: a client that leaves
            // chunks out of its LOOKUP gets no locks on them. (0.5.4 ignored `end`; an `end` of
            // 0 or past the tokens means all of them, as there.)
            let end = usize::try_from(key.end).unwrap_or(usize::MAX);
            let upto = if end == 0 {
                key.token_ids.len()
            } else {
                end.min(key.token_ids.len())
            };
            let hashes = chunk_hashes(&key.token_ids[..upto], self.ctx.config.chunk_tokens);
            if hashes.is_empty() {
                0
            } else {
                let range = ChunkRange {
                    model: key.model_name.clone(),
                    world_size: key.world_size,
                    worker_id: None,
                    cache_salt: key.cache_salt.clone(),
                    first_chunk: 0,
                    chunk_hashes: hashes.clone(),
                };
                match self.call(Request::Lookup {
                    request_id: name,
                    range,
                    tp_size,
                    readers: key.num_kv_readers,
                }) {
                    Response::LookupHits { chunks } => {
                        let looked_up = hashes.len();
                        let mut locked = hashes;
                        locked.truncate(chunks as usize);
                        let dropped = self.state.sessions.lock().opened(
                            client,
                            &key.request_id,
                            looked_up,
                            locked,
                            now,
                        );
                        self.end_dropped(dropped);
                        chunks
                    }
                    other => {
                        tracing::warn!(%client, response = ?other, "LOOKUP failed");
                        0
                    }
                }
            }
        };
        self.state
            .prefetch
            .lock()
            .insert(client, &key.request_id, hits, 4, now);
    }

    /// QUERY_PREFETCH_STATUS / WAIT_PREFETCH_STATUS: `client`'s LOOKUP result for
    /// `request_id`, handed out once (0 when there is none).
    pub(super) fn take_prefetch(&self, client: &ClientId, request_id: &str) -> u32 {
        let now = self.ctx.now_ms();
        let mut p = self.state.prefetch.lock();
        let live = p.get(client, request_id, now).is_some();
        let hits = p.remove(client, request_id).filter(|_| live).unwrap_or(0);
        drop(p);
        self.state.sessions.lock().touch(client, request_id, now);
        hits
    }

    /// QUERY_PREFETCH_LOOKUP_HITS: `client`'s LOOKUP result for `request_id`, kept.
    pub(super) fn peek_prefetch(&self, client: &ClientId, request_id: &str) -> u32 {
        let now = self.ctx.now_ms();
        let p = self.state.prefetch.lock();
        p.get(client, request_id, now).copied().unwrap_or(0)
    }

    /// The node session name a retrieve of `client` for `request_id` of the chunks `first..`
    /// hashed `hashes` relies on, if any.
    pub(super) fn retrieve_session(
        &self,
        client: &ClientId,
        request_id: &str,
        first: u32,
        hashes: &[ChunkHash],
    ) -> Option<String> {
        let now = self.ctx.now_ms();
        let holder = self.state.sessions.lock().for_retrieve(
            client,
            request_id,
            first as usize,
            hashes,
            now,
        )?;
        Some(session_name(&holder, request_id))
    }

    pub(super) fn free_lookup_locks(&self, client: &ClientId, key: &IpcKey) {
        let now = self.ctx.now_ms();
        if !self
            .state
            .sessions
            .lock()
            .touch(client, &key.request_id, now)
        {
            return;
        }
        let c = self.chunk();
        // Both ends round down, like LMCache: vLLM frees up to its own block-aligned hit,
        // and the chunk straddling that boundary stays locked for the retrieve.
        let clamp = |v: u64| (v / c).min(u64::from(u32::MAX)) as u32;
        self.call(Request::FreeLookupLocks {
            request_id: session_name(client, &key.request_id),
            start_chunk: clamp(key.start),
            end_chunk: clamp(key.end),
        });
    }

    pub(super) fn end_session(&self, client: &ClientId, request_id: &str) {
        self.state.hashes.lock().remove(client, request_id);
        self.state.prefetch.lock().remove(client, request_id);
        if self.state.sessions.lock().closed(client, request_id) {
            self.call(Request::EndSession {
                request_id: session_name(client, request_id),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Budget {
        Budget {
            total: 1 << 20,
            per_client: 1 << 20,
            ttl_ms: 1000,
        }
    }

    #[test]
    fn a_retrieve_takes_over_its_own_clients_session_first_then_the_same_users_latest() {
        let sched_a = ClientId::new(b"sa", Some(1));
        let sched_b = ClientId::new(b"sb", Some(1));
        let stranger = ClientId::new(b"x", Some(2));
        let worker = ClientId::new(b"w", Some(1));
        let h = |b: u8| [b; 32];
        let t = vec![h(1), h(2), h(3)];
        let mut s = LookupSessions::new(budget());
        assert!(s.opened(&sched_a, "r", 3, t.clone(), 0).is_empty());
        assert!(s.opened(&stranger, "r", 3, t.clone(), 1).is_empty());
        let retrieve = |s: &mut LookupSessions, first: usize, hs: &[[u8; 32]], now| {
            s.for_retrieve(&worker, "r", first, hs, now)
        };
        assert_eq!(
            retrieve(&mut s, 0, &t, 2),
            Some(sched_a.clone()),
            "not another user's"
        );
        assert_eq!(
            retrieve(&mut s, 1, &t[1..2], 2),
            Some(sched_a.clone()),
            "a sub-range"
        );
        assert_eq!(
            retrieve(&mut s, 0, &[h(1), h(2), h(3), h(4)], 2),
            None,
            "beyond the hit"
        );
        assert_eq!(retrieve(&mut s, 0, &[h(1), h(9)], 2), None, "other tokens");
        // Another scheduler reused the id for other tokens: each retrieve finds its own.
        s.opened(&sched_b, "r", 2, vec![h(7), h(8)], 3);
        assert_eq!(retrieve(&mut s, 0, &t[..2], 4), Some(sched_a.clone()));
        assert_eq!(retrieve(&mut s, 0, &[h(7), h(8)], 4), Some(sched_b.clone()));
        s.opened(&sched_b, "r", 3, t.clone(), 5);
        assert_eq!(
            retrieve(&mut s, 0, &t, 5),
            Some(sched_b.clone()),
            "the latest"
        );
        s.opened(&worker, "r", 3, t.clone(), 5);
        assert_eq!(retrieve(&mut s, 0, &t, 6), Some(worker.clone()), "its own");
        assert!(s.closed(&worker, "r"));
        assert!(!s.closed(&worker, "r"));
        assert!(s.closed(&sched_b, "r"));
        assert_eq!(retrieve(&mut s, 0, &t, 7), Some(sched_a.clone()));
        assert_eq!(s.for_retrieve(&worker, "other", 0, &t, 7), None);
        // Expired: nobody's.
        assert_eq!(retrieve(&mut s, 0, &t, 2_000), None);
    }

    #[test]
    fn sessions_beyond_a_clients_budget_are_returned_to_be_ended() {
        let c = ClientId::new(b"c", None);
        let one =
            2 * ("r00".len() + c.bytes()) + 48 + crate::lmcache::bounded::ENTRY_OVERHEAD_BYTES;
        let mut s = LookupSessions::new(Budget {
            total: 100 * one,
            per_client: 3 * one,
            ttl_ms: 1000,
        });
        let mut dropped = Vec::new();
        for i in 0..10 {
            dropped.extend(s.opened(&c, &format!("r{i:02}"), 0, Vec::new(), 0));
        }
        assert_eq!(dropped.len(), 7);
        assert_eq!(&*dropped[0].1, "r00", "the least recently used first");
        assert!(s.holders.len() == 3, "holders follow the map");
    }
}
