//! The `op` label values: native opcodes and LMCache operations by name.

use crate::lmcache::wire::Op;

/// Native opcodes (`Request::opcode`) and their label values, in opcode order.
pub const NATIVE_OPS: [(u16, &str); 21] = [
    (1, "noop"),
    (2, "ping"),
    (3, "get_chunk_size"),
    (4, "register"),
    (5, "unregister"),
    (6, "prepare_store"),
    (7, "commit_store"),
    (8, "abort_store"),
    (9, "prepare_retrieve"),
    (10, "commit_retrieve"),
    (11, "lookup"),
    (12, "free_lookup_locks"),
    (13, "end_session"),
    (14, "report_block_allocation"),
    (15, "clear"),
    (16, "status"),
    (17, "memcheck"),
    (18, "write_slots"),
    (19, "read_slots"),
    (20, "register_buffers"),
    (21, "unregister_buffers"),
];

/// Every LMCache operation kvnode tells apart, in `Op as usize` order.
pub const LM_OPS: [Op; 23] = [
    Op::RegisterKvCache,
    Op::UnregisterKvCache,
    Op::Store,
    Op::Retrieve,
    Op::Lookup,
    Op::QueryPrefetchStatus,
    Op::WaitPrefetchStatus,
    Op::QueryPrefetchLookupHits,
    Op::FreeLookupLocks,
    Op::EndSession,
    Op::RegisterEngineDriven,
    Op::UnregisterEngineDriven,
    Op::PrepareStore,
    Op::CommitStore,
    Op::PrepareRetrieve,
    Op::CommitRetrieve,
    Op::Clear,
    Op::GetChunkSize,
    Op::Ping,
    Op::ReportBlockAllocation,
    Op::Noop,
    Op::GetExperimental,
    Op::Unsupported,
];

/// The label value of an LMCache operation: its LMCache 0.5.6 snake_case name (the wire's own
/// table, [`Op::name`]; `unsupported` for every operation kvnode does not serve).
pub fn lm_op_name(op: Op) -> &'static str {
    op.name()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lmcache::server::LM_OP_SLOTS;
    use crate::modules::context::NATIVE_OP_SLOTS;

    #[test]
    fn every_lmcache_op_has_its_slot_and_a_name() {
        assert_eq!(LM_OPS.len(), LM_OP_SLOTS);
        for (i, op) in LM_OPS.iter().enumerate() {
            assert_eq!(*op as usize, i, "{op:?}");
            // The names are the wire's: they parse back to the same op.
            if *op != Op::Unsupported {
                let frame = crate::lmcache::wire::encode_str(lm_op_name(*op));
                assert_eq!(crate::lmcache::wire::parse_op(&frame).unwrap().0, *op);
            }
        }
    }

    #[test]
    fn native_opcodes_fit_their_table() {
        for (i, (code, _)) in NATIVE_OPS.iter().enumerate() {
            assert_eq!(usize::from(*code), i + 1);
            assert!(usize::from(*code) < NATIVE_OP_SLOTS);
        }
        assert_eq!(crate::protocol::Request::Memcheck.opcode(), 17);
        let last = crate::protocol::Request::UnregisterBuffers { ids: Vec::new() };
        assert_eq!(usize::from(last.opcode()), NATIVE_OPS.len());
        assert_eq!(crate::protocol::Request::Noop.opcode(), 1);
    }
}
