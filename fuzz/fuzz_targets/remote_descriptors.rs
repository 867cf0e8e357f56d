//! Remote descriptors from arbitrary bytes: regions registered and per-slot buffers turned into
//! fabric work items. The harness and its invariants (never panics, every accepted item inside
//! its region, no overlap) live in `kvnode::fuzzing::remote_descriptors`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvnode::fuzzing::remote_descriptors(data));
