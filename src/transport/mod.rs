//! Transports carry frames between clients and the node. Each one delivers decoded requests to
//! `server::dispatch` and returns responses through a [`ReplySink`]; TCP and RDMA transports plug
//! in behind the same trait (only Unix sockets can pass the pool fd).

pub mod reply;
pub mod tcp;
pub mod uds;

use std::os::fd::BorrowedFd;

use crate::protocol::Response;

/// Where the responses of one connection go. Invariant: `send` never blocks on another
/// connection and never panics; a vanished peer is logged and ignored.
pub trait ReplySink: Send + Sync {
    /// Sends one response frame answering `request_id` of type `opcode`, with the pool fd
    /// attached when `fd` is given and the transport supports it.
    fn send(&self, request_id: u64, opcode: u16, resp: &Response, fd: Option<BorrowedFd<'_>>);
    /// The connection's unique id (instances remember which connection registered them).
    fn connection_id(&self) -> u64;
    /// Whether `send` can attach a file descriptor (SCM_RIGHTS).
    fn can_pass_fd(&self) -> bool;
    /// The peer's kernel-recorded credentials (`SO_PEERCRED`), when the transport knows them.
    /// Instances, transfers and sessions are bound to them.
    fn peer(&self) -> Option<kvnode_hw::PeerCred>;
}
