//! Native frame decoder: bytes -> `FrameReader` -> header -> payload -> `decode_request`.
//! The harness and its invariants live in `kvnode::fuzzing::native_frame`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvnode::fuzzing::native_frame(data));
