//! Request handlers grouped by job, as LMCache's server modules: engine-driven transfers (run on
//! instance shards), lookup sessions and management (run inline), plus the shared context, the
//! instance registry, the shard worker pool, the event bus and the status report.

pub mod caller;
pub mod cluster_link;
pub mod context;
pub mod events;
pub mod instances;
pub mod layouts;
pub mod lookup;
pub mod management;
pub mod sessions;
pub mod shards;
pub mod status;
pub mod transfer;
pub mod transfer_ids;
pub mod user_slots;

pub use self::caller::Caller;
pub use self::context::NodeContext;

#[cfg(test)]
mod tests;
