//! The `[limits]` table: every bound the node enforces, with its default.

use serde::Deserialize;

/// Hard limits the node enforces. Invariant: every field is > 0, except `idle_timeout_secs`
/// (0 = no idle deadline); `max_inflight_payload_bytes` is at least
/// [`crate::protocol::MAX_PAYLOAD_BYTES`].
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Registered instances at once.
    pub max_instances: usize,
    /// Open client connections at once.
    pub max_connections: usize,
    /// Queued (not yet executed) requests per instance.
    pub max_queued_per_instance: usize,
    /// Prepared, uncommitted transfers per instance.
    pub max_pending_transfers: usize,
    /// Chunks in one request.
    pub max_chunks_per_request: usize,
    /// Lookup sessions kept at once.
    pub max_sessions: usize,
    /// Objects in the index.
    pub max_objects: usize,
    /// Distinct `(model, cache_salt)` namespaces held at once (unused ones are reclaimed).
    pub max_namespaces: usize,
    /// Event-bus queue length (events beyond it are dropped and counted).
    pub event_bus_capacity: usize,
    /// Instances one user (peer uid) may hold registered at once.
    pub max_instances_per_user: usize,
    /// Instances one connection may register.
    pub max_instances_per_connection: usize,
    /// Open native connections of one client user (admins — the node's user, root and
    /// `[access]` admins — are bounded by `max_connections` only).
    pub max_connections_per_client_user: usize,
    /// Share of the pool one instance may hold reserved by prepared, uncommitted stores
    /// (0 < x <= 1).
    pub max_reserved_fraction_per_instance: f64,
    /// Share of the pool the instances of one user may hold reserved by prepared, uncommitted
    /// stores (0 < x <= 1).
    pub max_reserved_fraction_per_user: f64,
    // Native protocol budgets in bytes and deadlines (issue 11), validated by
    // `Limits::validate_native_budgets`.
    /// Bytes all lookup sessions may hold together, counted by an upper bound per session
    /// (its table slot, request id and the locks of its hit prefix). A new session evicts
    /// others to fit (the largest owner's least recently used first); one larger than the
    /// whole budget is refused with `LimitExceeded`.
    pub max_session_bytes: u64,
    /// Milliseconds a native frame may take to arrive once its first byte has: a client that
    /// sends part of a header or payload and stalls is answered `LimitExceeded` and
    /// disconnected (1 ..= 3 600 000). This includes any time the frame waits for room in
    /// `max_inflight_payload_bytes`: every frame is received or refused within this time.
    pub frame_timeout_ms: u64,
    /// Seconds a native connection may stay silent between frames before it is closed, unless
    /// an instance registered over it is still registered (those are watched by liveness:
    /// `reap_timeout_secs` and `registration_grace_secs`). 0 = no idle deadline.
    pub idle_timeout_secs: u64,
    /// Payload bytes native connections may hold in receive buffers at once, node-wide, for
    /// frames larger than the read buffer (64 KiB). A frame whose next bytes do not fit waits
    /// (its connection is not read meanwhile) instead of failing, up to its frame deadline;
    /// the waits never deadlock. At least the largest frame payload (16 MiB), so every frame
    /// can complete.
    pub max_inflight_payload_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_instances: 1024,
            max_connections: 1024,
            max_queued_per_instance: 256,
            max_pending_transfers: 1024,
            max_chunks_per_request: 65_536,
            max_sessions: 65_536,
            max_objects: 16 << 20,
            max_namespaces: crate::storage::key::MAX_NAMESPACES,
            event_bus_capacity: 10_000,
            max_instances_per_user: 256,
            max_instances_per_connection: 64,
            max_connections_per_client_user: 256,
            max_reserved_fraction_per_instance: 0.5,
            max_reserved_fraction_per_user: 0.75,
            max_session_bytes: 256 << 20,
            frame_timeout_ms: 10_000,
            idle_timeout_secs: 600,
            max_inflight_payload_bytes: 256 << 20,
        }
    }
}
