//! [`parse_op`](crate::lmcache::wire::parse_op): legacy ids, 0.5.6 names, garbage.

use super::*;
use crate::lmcache::wire::op::OP_TABLE;

#[test]
fn parse_op_table() {
    let expected = [
        Op::RegisterKvCache,
        Op::UnregisterKvCache,
        Op::Unsupported, // register_q_cache
        Op::Unsupported, // unregister_q_cache
        Op::Unsupported, // store_q
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
    ];
    for (i, want) in expected.iter().enumerate() {
        let id = i as u64 + 1;
        assert_eq!(parse_op(&encode_uint(id)).unwrap().0, *want, "id {id}");
    }
    for id in (25..=31).chain(33..=39) {
        assert_eq!(
            parse_op(&encode_uint(id)).unwrap().0,
            Op::Unsupported,
            "id {id}"
        );
    }
    assert_eq!(
        parse_op(&encode_uint(40)).unwrap(),
        (Op::GetExperimental, "get_experimental".into())
    );
    assert_eq!(parse_op(&encode_uint(32)).unwrap().0, Op::GetExperimental);
    assert_eq!(
        parse_op(&encode_uint(0)).unwrap(),
        (Op::Unsupported, "op#0".into())
    );
    assert_eq!(parse_op(&encode_uint(41)).unwrap().0, Op::Unsupported);
    assert_eq!(parse_op(&encode_uint(u64::MAX)).unwrap().0, Op::Unsupported);
    assert_eq!(parse_op(&unhex("ff")).unwrap().0, Op::Unsupported);
    // Wide int forms of a valid id.
    assert_eq!(parse_op(&unhex("cc16")).unwrap().0, Op::Ping);
    assert_eq!(parse_op(&unhex("d30000000000000016")).unwrap().0, Op::Ping);
}

#[test]
fn parse_op_names() {
    assert_eq!(
        parse_op(&encode_str("get_chunk_size")).unwrap(),
        (Op::GetChunkSize, "get_chunk_size".into())
    );
    for (op, name, _) in OP_TABLE {
        assert_eq!(parse_op(&encode_str(name)).unwrap(), (op, name.to_string()));
        // encode_op round-trips through parse_op.
        assert_eq!(parse_op(&encode_op(op)).unwrap().0, op);
    }
    assert_eq!(
        parse_op(&encode_op(Op::Unsupported)).unwrap().0,
        Op::Unsupported
    );
    assert_eq!(encode_op(Op::GetExperimental), unhex("20"));
    assert_eq!(
        parse_op(&encode_str("subscribe_kv_events")).unwrap(),
        (Op::Unsupported, "subscribe_kv_events".into())
    );
    assert_eq!(parse_op(&encode_str("store_q")).unwrap().0, Op::Unsupported);
    let (op, name) = parse_op(&encode_str("bad\nname")).unwrap();
    assert_eq!(op, Op::Unsupported);
    assert_eq!(name, "bad\\nname");
    let long = "z".repeat(1000);
    assert!(parse_op(&encode_str(&long)).unwrap().1.chars().count() <= 65);
}

#[test]
fn parse_op_garbage() {
    for bad in [
        "",
        "c0",
        "c3",
        "c40101",
        "90",
        "80",
        "cb3ff0000000000000",
        "c1",
        "cd01",
        "1601",
        "a2ff00",
    ] {
        assert!(parse_op(&unhex(bad)).is_err(), "{bad:?} should fail");
    }
    assert!(matches!(
        parse_op(&[]),
        Err(WireError::Malformed { frame: 1, .. })
    ));
    assert!(matches!(
        parse_op(&unhex("c0")),
        Err(WireError::Field { .. })
    ));
}
