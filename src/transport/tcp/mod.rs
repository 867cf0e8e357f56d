//! The TCP transport: remote engines reach the node over a TCP listener. Before any native frame,
//! each connection runs the authenticated handshake of [`handshake`] (versions, fabric, mutual
//! proof of a pre-shared token from [`auth`]); nothing is allocated for a connection before it
//! has authenticated.

pub mod auth;
pub mod handshake;
