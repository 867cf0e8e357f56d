//! Liveness: a hierarchical timer wheel holds one deadline per registered instance; the hot path
//! only stores "last seen" in an atomic. When a timer fires, the reaper compares the deadline with
//! last-seen and either re-arms (the instance was active) or reaps it. Disconnects of local
//! clients are handled by the transport at once (no timer involved).

pub mod reaper;
pub mod timer_wheel;

pub use self::reaper::Liveness;
