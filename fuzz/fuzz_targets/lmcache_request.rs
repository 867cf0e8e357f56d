//! LMCache msgpack request decoder: type frame -> `parse_op`, payload frames ->
//! `decode_request`. The harness and its invariants live in `kvnode::fuzzing::lmcache_request`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvnode::fuzzing::lmcache_request(data));
