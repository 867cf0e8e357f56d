//! Storage: keys, layouts, the pool allocator, the sharded index and the L1 state machine.
//!
//! Data flow: a transfer module turns a request into [`StorageKey`]s, asks [`StorageCore`] to
//! reserve/publish/lock them, and hands the resulting [`Slot`] offsets to the client, which copies
//! the bytes itself. The core never touches KV bytes.

pub mod allocator;
pub mod core;
pub mod index;
pub mod key;
pub mod layout;

#[cfg(test)]
mod tests;

pub use self::allocator::{SlabAllocator, Slot};
pub use self::core::{
    Grant, KeyError, MemcheckReport, Moving, ObjectCounts, StorageConfig, StorageCore,
};
pub use self::key::{pack_kv_rank, NamespaceId, Namespaces, ObjectKey, StorageKey};
pub use self::layout::{Dtype, Layout};
