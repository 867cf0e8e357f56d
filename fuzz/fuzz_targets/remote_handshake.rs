//! The node's side of the remote (TCP) handshake: arbitrary client bytes in arbitrary pieces into
//! `ServerHandshake`. The harness and its invariants (never panics, bounded buffering, never
//! authenticated without the key) live in `kvnode::fuzzing::remote_handshake`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvnode::fuzzing::remote_handshake(data));
