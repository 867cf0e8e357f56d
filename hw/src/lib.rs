//! OS and hardware access for kvnode: the shared (hugepage-backed) memory
//! pool and fd passing over Unix sockets.
//!
//! This is the only kvnode crate allowed to contain `unsafe` code / FFI.
//! Every `unsafe` block carries a `// SAFETY:` comment, and the public types
//! wrap all raw pointers so that the rest of the node stays safe Rust:
//!
//! * [`SharedPool`] creates the node's pool (memfd or POSIX shm, `MAP_SHARED`)
//!   with the page-size fallback chain 1G -> 2M hugetlb -> THP -> 4K.
//! * [`PoolRegion`] is a bounds-checked view of a mapped pool.
//! * [`PoolMapping`] maps a pool on the client side from a received fd.
//! * [`send_with_fd`] / [`recv_with_fd`] move the pool fd over `SCM_RIGHTS`.
//! * [`MemoryAvailable`] tells whether a pool of a given size can fit before it is created.
//! * [`interface_addresses`] lists a network interface's addresses (for binding it by name).
//! * [`socket_inode`] / [`tcp_socket_addresses`] tell which socket is open at a descriptor
//!   number another library owns (libzmq's connections, for the LMCache endpoint's access check);
//!   [`tcp_socket_owner`] asks the kernel who owns a TCP socket (netlink `sock_diag`).
//! * [`gpu`]: device buffers, copy streams, host registration and dma-buf export (CUDA through
//!   cudarc with the `gpu` feature, or a simulated GPU for tests).
//! * [`zmq_notify::set_router_notify`] turns on a ZMQ ROUTER's connect/disconnect notifications.

#![cfg_attr(not(target_os = "linux"), allow(unused))]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(
    missing_docs,
    clippy::undocumented_unsafe_blocks,
    clippy::missing_safety_doc
)]

#[cfg(not(target_os = "linux"))]
compile_error!("kvnode-hw only supports Linux");

mod block;
mod data_file;
mod error;
pub mod fabric;
mod fdpass;
pub mod gpu;
mod meminfo;
mod netif;
mod peer;
mod pool;
mod pread_engine;
mod region;
mod segment_mount;
mod shm;
mod sockaddr;
mod sockdiag;
mod sys;
mod uring;
pub mod zmq_notify;

#[cfg(test)]
mod block_tests;

pub use block::{
    lock_exclusive, open_block_device, open_direct, open_engine, BlockEngine, BlockIo, EngineKind,
    BLOCK_ALIGN,
};
pub use data_file::{
    grow_data_file, open_data_file_locked, read_direct, scan_for_data, DataScan, OpenedDataFile,
};
pub use error::{HwError, HwResult};
pub use fdpass::{recv_with_fd, send_with_fd};
pub use meminfo::{human_bytes, MemoryAvailable};
pub use netif::interface_addresses;
pub use peer::{
    effective_gid, effective_uid, find_socket_owner, tcp_peer_uid, unix_peer_credentials,
    user_groups, PeerCred, MAX_USER_GROUPS,
};
pub use pool::{PagePreference, PoolBacking, PoolOptions, SharedPool};
pub use pread_engine::PreadEngine;
pub use region::{PoolMapping, PoolRegion};
pub use sockaddr::{socket_inode, tcp_socket_addresses};
pub use sockdiag::tcp_socket_owner;
pub use sys::{heap_in_use, hugepages_free_2m, process_cpu_seconds};
pub use uring::UringEngine;

/// Serializes tests that create hugetlb-capable pools or change
/// `nr_hugepages`, so that one test's reservation cannot skew another's
/// expectations.
#[cfg(test)]
pub(crate) static HUGEPAGE_TEST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes [`HUGEPAGE_TEST_LOCK`], ignoring poisoning from a failed test.
#[cfg(test)]
pub(crate) fn hugepage_test_lock() -> std::sync::MutexGuard<'static, ()> {
    HUGEPAGE_TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner())
}
