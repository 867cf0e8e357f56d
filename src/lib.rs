//! kvnode: a KV-cache storage node for LLM inference engines.
//!
//! Data flow, one folder per layer:
//! `client` (engine side) -> `protocol` (frames) -> `transport` (Unix socket) -> `server`
//! (connections, dispatch) -> `modules` (transfers on instance shards, lookup, management) ->
//! `storage` (index, allocator, state machine) over the shared pool from `kvnode-hw`;
//! `liveness` reaps silent instances. Engines copy KV bytes into and out of the pool themselves.
#![warn(missing_docs)]

pub mod access;
pub mod client;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod error;
pub mod fuzzing;
pub mod hashing;
pub mod l2;
pub mod liveness;
pub mod lmcache;
pub mod metrics;
pub mod modules;
pub mod op_stats;
pub mod protocol;
pub mod remote;
pub mod server;
pub mod sim;
pub mod storage;
pub mod transport;

pub use error::{Error, ErrorKind, Result};
