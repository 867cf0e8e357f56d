//! The LMCache frontend's budgets (`[lmcache]` in the node's TOML): what one request may carry,
//! and how many bytes of requests and per-request state the frontend keeps, node-wide and per
//! client connection. Every budget is enforced with a well-typed negative answer (LMCache's
//! protocol has no error channel) and a log line naming the budget.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Default [`LmLimits::max_tokens_per_request`]: 2 Mi tokens (8 MiB decoded), above the longest
/// contexts served today.
pub const DEFAULT_MAX_TOKENS_PER_REQUEST: usize = 1 << 21;
/// Default [`LmLimits::max_request_id_bytes`] (vLLM's ids are about 50 bytes).
pub const DEFAULT_MAX_REQUEST_ID_BYTES: usize = 4096;
/// Default [`LmLimits::queued_bytes_per_client`]: one request of the largest size the socket
/// accepts ([`crate::lmcache::server::MAX_REQUEST_BYTES`]).
pub const DEFAULT_QUEUED_BYTES_PER_CLIENT: usize = 64 << 20;
/// Default [`LmLimits::queued_bytes_per_handler`].
pub const DEFAULT_QUEUED_BYTES_PER_HANDLER: usize = 256 << 20;
/// Default [`LmLimits::queued_bytes_total`]: two handlers' worth, whatever the handler count.
pub const DEFAULT_QUEUED_BYTES_TOTAL: usize = 512 << 20;
/// Default [`LmLimits::hash_cache_bytes`].
pub const DEFAULT_HASH_CACHE_BYTES: usize = 64 << 20;
/// Default [`LmLimits::hash_cache_bytes_per_client`].
pub const DEFAULT_HASH_CACHE_BYTES_PER_CLIENT: usize = 16 << 20;
/// Default [`LmLimits::prefetch_bytes`].
pub const DEFAULT_PREFETCH_BYTES: usize = 8 << 20;
/// Default [`LmLimits::prefetch_bytes_per_client`].
pub const DEFAULT_PREFETCH_BYTES_PER_CLIENT: usize = 1 << 20;
/// Default [`LmLimits::session_bytes`].
pub const DEFAULT_SESSION_BYTES: usize = 64 << 20;
/// Default [`LmLimits::session_bytes_per_client`] (e.g. 512 open lookups of 128k-token
/// prompts at 256-token chunks).
pub const DEFAULT_SESSION_BYTES_PER_CLIENT: usize = 16 << 20;
/// Default [`LmLimits::state_ttl_secs`] (LMCache's session TTL).
pub const DEFAULT_STATE_TTL_SECS: u64 = 600;
/// Longest [`LmLimits::state_ttl_secs`] accepted (30 days).
pub const MAX_STATE_TTL_SECS: u64 = 30 * 24 * 3600;
/// Default [`LmLimits::worker_disconnect_grace_ms`]: a second, so a dead client's instance is
/// released about a second after its connection closes.
pub const DEFAULT_WORKER_DISCONNECT_GRACE_MS: u64 = 1_000;
/// Longest [`LmLimits::worker_disconnect_grace_ms`] accepted (a day; LMCache's own bound is the
/// reap timeout, and the reaper releases a silent worker first anyway).
pub const MAX_WORKER_DISCONNECT_GRACE_MS: u64 = 24 * 3600 * 1000;

/// Budgets of the LMCache frontend. A "client" is one ZMQ connection (one LMCache
/// `MessageQueueClient`). Invariant after [`LmLimits::validate`]: every value is > 0, each
/// per-client budget is at most its node-wide one, and the TTL is at most
/// [`MAX_STATE_TTL_SECS`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LmLimits {
    /// Tokens in one request's key (and block-allocation entries in one report); beyond it
    /// the request is refused while it is decoded, before the tokens are allocated.
    pub max_tokens_per_request: usize,
    /// Bytes of a request id; a longer one is refused.
    pub max_request_id_bytes: usize,
    /// Bytes of requests one client may have waiting for its handler thread (a larger request
    /// is refused unread).
    pub queued_bytes_per_client: usize,
    /// Bytes of requests waiting for one handler thread, all clients together.
    pub queued_bytes_per_handler: usize,
    /// Bytes of requests waiting for all handler threads together (the node-wide bound,
    /// whatever the number of handlers).
    pub queued_bytes_total: usize,
    /// Bytes of cached rolling hashes, node-wide (beyond: the oldest are forgotten and
    /// recomputed when needed).
    pub hash_cache_bytes: usize,
    /// Bytes of cached rolling hashes of one client.
    pub hash_cache_bytes_per_client: usize,
    /// Bytes of unqueried LOOKUP results, node-wide (beyond: the oldest are forgotten; their
    /// query answers 0, a miss).
    pub prefetch_bytes: usize,
    /// Bytes of unqueried LOOKUP results of one client.
    pub prefetch_bytes_per_client: usize,
    /// Bytes of lookup sessions (the hashes the node keeps for them and the frontend's
    /// bookkeeping), node-wide (beyond: the least recently used session is ended, releasing
    /// its locks).
    pub session_bytes: usize,
    /// Bytes of lookup sessions of one client.
    pub session_bytes_per_client: usize,
    /// Cached hashes, unqueried LOOKUP results and lookup sessions unused this long are
    /// dropped (seconds).
    pub state_ttl_secs: u64,
    /// Milliseconds an instance is kept after the connection that owns it closed, for the
    /// client to come back over a new connection (`--worker-disconnect-grace-seconds`); an
    /// instance that never pinged gets the longer unproven countdown (see
    /// `frontend::disconnect`). 0 = connection closes are ignored (the reaper alone releases).
    pub worker_disconnect_grace_ms: u64,
}

impl Default for LmLimits {
    fn default() -> Self {
        LmLimits {
            max_tokens_per_request: DEFAULT_MAX_TOKENS_PER_REQUEST,
            max_request_id_bytes: DEFAULT_MAX_REQUEST_ID_BYTES,
            queued_bytes_per_client: DEFAULT_QUEUED_BYTES_PER_CLIENT,
            queued_bytes_per_handler: DEFAULT_QUEUED_BYTES_PER_HANDLER,
            queued_bytes_total: DEFAULT_QUEUED_BYTES_TOTAL,
            hash_cache_bytes: DEFAULT_HASH_CACHE_BYTES,
            hash_cache_bytes_per_client: DEFAULT_HASH_CACHE_BYTES_PER_CLIENT,
            prefetch_bytes: DEFAULT_PREFETCH_BYTES,
            prefetch_bytes_per_client: DEFAULT_PREFETCH_BYTES_PER_CLIENT,
            session_bytes: DEFAULT_SESSION_BYTES,
            session_bytes_per_client: DEFAULT_SESSION_BYTES_PER_CLIENT,
            state_ttl_secs: DEFAULT_STATE_TTL_SECS,
            worker_disconnect_grace_ms: DEFAULT_WORKER_DISCONNECT_GRACE_MS,
        }
    }
}

impl LmLimits {
    /// Checks the invariants listed on the type; the error names the offending key.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("max_tokens_per_request", self.max_tokens_per_request),
            ("max_request_id_bytes", self.max_request_id_bytes),
            ("queued_bytes_per_client", self.queued_bytes_per_client),
            ("queued_bytes_per_handler", self.queued_bytes_per_handler),
            ("queued_bytes_total", self.queued_bytes_total),
            ("hash_cache_bytes", self.hash_cache_bytes),
            (
                "hash_cache_bytes_per_client",
                self.hash_cache_bytes_per_client,
            ),
            ("prefetch_bytes", self.prefetch_bytes),
            ("prefetch_bytes_per_client", self.prefetch_bytes_per_client),
            ("session_bytes", self.session_bytes),
            ("session_bytes_per_client", self.session_bytes_per_client),
        ] {
            if v == 0 {
                return Err(Error::invalid(format!("lmcache.{name} must be > 0")));
            }
        }
        for (client, node, c, n) in [
            (
                "queued_bytes_per_client",
                "queued_bytes_per_handler",
                self.queued_bytes_per_client,
                self.queued_bytes_per_handler,
            ),
            (
                "queued_bytes_per_handler",
                "queued_bytes_total",
                self.queued_bytes_per_handler,
                self.queued_bytes_total,
            ),
            (
                "hash_cache_bytes_per_client",
                "hash_cache_bytes",
                self.hash_cache_bytes_per_client,
                self.hash_cache_bytes,
            ),
            (
                "prefetch_bytes_per_client",
                "prefetch_bytes",
                self.prefetch_bytes_per_client,
                self.prefetch_bytes,
            ),
            (
                "session_bytes_per_client",
                "session_bytes",
                self.session_bytes_per_client,
                self.session_bytes,
            ),
        ] {
            if c > n {
                return Err(Error::invalid(format!(
                    "lmcache.{client} = {c} exceeds lmcache.{node} = {n}"
                )));
            }
        }
        if !(1..=MAX_STATE_TTL_SECS).contains(&self.state_ttl_secs) {
            return Err(Error::invalid(format!(
                "lmcache.state_ttl_secs = {} is outside 1..={MAX_STATE_TTL_SECS}",
                self.state_ttl_secs
            )));
        }
        if self.worker_disconnect_grace_ms > MAX_WORKER_DISCONNECT_GRACE_MS {
            return Err(Error::invalid(format!(
                "lmcache.worker_disconnect_grace_ms = {} exceeds {MAX_WORKER_DISCONNECT_GRACE_MS} \
                 (a day)",
                self.worker_disconnect_grace_ms
            )));
        }
        Ok(())
    }

    /// [`LmLimits::state_ttl_secs`] in milliseconds.
    pub fn state_ttl_ms(&self) -> u64 {
        self.state_ttl_secs.saturating_mul(1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_name_their_key() {
        assert!(LmLimits::default().validate().is_ok());
        let e = LmLimits {
            hash_cache_bytes_per_client: 2 * DEFAULT_HASH_CACHE_BYTES,
            ..LmLimits::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("hash_cache_bytes_per_client"), "{e}");
        let e = LmLimits {
            max_tokens_per_request: 0,
            ..LmLimits::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("max_tokens_per_request"), "{e}");
        let e = LmLimits {
            state_ttl_secs: 0,
            ..LmLimits::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("state_ttl_secs"), "{e}");
        let e = LmLimits {
            worker_disconnect_grace_ms: MAX_WORKER_DISCONNECT_GRACE_MS + 1,
            ..LmLimits::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("worker_disconnect_grace_ms"), "{e}");
        let parsed: LmLimits = toml::from_str("queued_bytes_per_client = 1024").unwrap();
        assert_eq!(parsed.queued_bytes_per_client, 1024);
        assert_eq!(parsed.hash_cache_bytes, DEFAULT_HASH_CACHE_BYTES);
        assert!(toml::from_str::<LmLimits>("no_such_budget = 1").is_err());
    }
}
