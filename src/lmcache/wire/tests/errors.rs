//! Decode errors: frame counts, wrong types, invalid keys and malformed msgpack.

use super::*;

#[test]
fn frame_count_errors() {
    let key = unhex(KEY_HEX);
    let one = encode_uint(1);
    let s = encode_str("r");
    let cases: Vec<(Op, Vec<&[u8]>, &str)> = vec![
        (Op::GetChunkSize, vec![&one], "0"),
        (Op::GetExperimental, vec![&one], "0"),
        (Op::Noop, vec![&one], "0"),
        (Op::Ping, vec![], "1"),
        (Op::Ping, vec![&one, &one], "1"),
        (Op::RegisterEngineDriven, vec![], "1"),
        (Op::UnregisterEngineDriven, vec![], "1"),
        (Op::PrepareStore, vec![&key], "2"),
        (Op::PrepareRetrieve, vec![&key, &one, &one], "2"),
        (Op::CommitRetrieve, vec![], "2"),
        (Op::CommitStore, vec![&key], "2 or 3"),
        (Op::CommitStore, vec![&key, &one, &one, &one], "2 or 3"),
        (Op::Lookup, vec![&key], "2"),
        (Op::FreeLookupLocks, vec![&key, &one, &one], "2"),
        (Op::QueryPrefetchStatus, vec![], "1"),
        (Op::QueryPrefetchLookupHits, vec![&s, &s], "1"),
        (Op::WaitPrefetchStatus, vec![&s], "2"),
        (Op::EndSession, vec![], "1"),
        (Op::ReportBlockAllocation, vec![&one, &s], "3"),
        (Op::Clear, vec![&one, &one], "0 or 1"),
    ];
    for (op, payload, expected) in cases {
        let got = decode_request(op, "nm", &payload);
        assert_eq!(
            got,
            Err(WireError::FrameCount {
                op: "nm".into(),
                expected: expected.into(),
                got: payload.len()
            }),
            "{op:?}"
        );
    }
}

fn field_of(r: Result<LmRequest>) -> String {
    match r {
        Err(WireError::Field { field, .. }) => field,
        other => panic!("expected Field error, got {other:?}"),
    }
}

#[test]
fn wrong_types() {
    let key = unhex(KEY_HEX);
    let s = encode_str("5");
    let one = encode_uint(1);
    assert_eq!(field_of(dec(Op::PrepareStore, &[&key, &s])), "instance_id");
    assert_eq!(field_of(dec(Op::Ping, &[&s])), "instance_id");
    assert_eq!(field_of(dec(Op::Ping, &[&unhex("ff")])), "instance_id");
    assert_eq!(
        field_of(dec(Op::Lookup, &[&key, &unhex("cf0000000100000000")])),
        "tp_size"
    );
    assert_eq!(field_of(dec(Op::Lookup, &[&key, &unhex("c3")])), "tp_size");
    assert_eq!(
        field_of(dec(Op::QueryPrefetchStatus, &[&one])),
        "request_id"
    );
    assert_eq!(
        field_of(dec(Op::QueryPrefetchStatus, &[&unhex("c403616263")])),
        "request_id"
    );
    assert_eq!(
        field_of(dec(Op::EndSession, &[&unhex("a2ff00")])),
        "request_id"
    );
    assert_eq!(field_of(dec(Op::WaitPrefetchStatus, &[&s, &s])), "timeout");
    assert_eq!(
        field_of(dec(
            Op::WaitPrefetchStatus,
            &[&s, &unhex("cb7ff8000000000000")]
        )),
        "timeout"
    );
    assert_eq!(field_of(dec(Op::Clear, &[&one])), "force");
    assert_eq!(
        field_of(dec(Op::CommitStore, &[&key, &one, &s])),
        "cpu_data"
    );
    assert_eq!(
        field_of(dec(Op::RegisterEngineDriven, &[&key])),
        "payload.instance_id"
    );
    assert_eq!(field_of(dec(Op::RegisterEngineDriven, &[&one])), "payload");
    assert_eq!(field_of(dec(Op::PrepareStore, &[&one, &one])), "key");
    assert_eq!(
        field_of(dec(Op::ReportBlockAllocation, &[&one, &one, &unhex("90")])),
        "model_name"
    );
    assert_eq!(
        field_of(dec(Op::ReportBlockAllocation, &[&one, &s, &unhex("9180")])),
        "records[0].req_id"
    );
    assert_eq!(
        field_of(dec(
            Op::ReportBlockAllocation,
            &[&one, &s, &unhex("9181ad6e65775f626c6f636b5f69647391ff")]
        )),
        "records[0].new_block_ids"
    );
    // Negative instance id.
    assert_eq!(
        field_of(dec(Op::UnregisterEngineDriven, &[&unhex("d0ff")])),
        "instance_id"
    );
    // Register payload with a str use_mla.
    let mut reg = unhex(REG_HEX);
    let n = reg.len();
    reg[n - 1] = 0xa0;
    assert_eq!(
        field_of(dec(Op::RegisterEngineDriven, &[&reg])),
        "payload.use_mla"
    );
    // Missing field in register payload.
    let mut short = unhex("87");
    short.extend(&unhex(REG_HEX)[1..unhex(REG_HEX).len() - 9]);
    assert_eq!(
        field_of(dec(Op::RegisterEngineDriven, &[&short])),
        "payload.use_mla"
    );
}

fn key_with(f: impl FnOnce(&mut IpcKey)) -> Vec<u8> {
    let mut k = golden_key();
    f(&mut k);
    encode_key(&k, false)
}

#[test]
fn key_errors() {
    let one = encode_uint(1);
    // token id 2^32 (replace the last token 03 with a uint64 form).
    let mut raw = unhex(KEY_HEX);
    let pos = hex(&raw).find("93010203").unwrap() / 2;
    raw.splice(pos + 3..pos + 4, unhex("cf0000000100000000"));
    let err = dec(Op::PrepareStore, &[&raw, &one]).unwrap_err();
    assert_eq!(
        err,
        WireError::Field {
            field: "key.token_ids".into(),
            detail: "token id 4294967296 at index 2 is not below 2^32".into()
        }
    );
    // 2^32 - 1 is fine.
    let mut ok = unhex(KEY_HEX);
    ok.splice(pos + 3..pos + 4, unhex("ceffffffff"));
    assert!(dec(Op::PrepareStore, &[&ok, &one]).is_ok());
    // Negative token / str token.
    let mut neg = unhex(KEY_HEX);
    neg[pos + 3] = 0xff;
    assert_eq!(
        field_of(dec(Op::PrepareStore, &[&neg, &one])),
        "key.token_ids"
    );
    let mut st = unhex(KEY_HEX);
    st[pos + 3] = 0xa0;
    assert_eq!(
        field_of(dec(Op::PrepareStore, &[&st, &one])),
        "key.token_ids"
    );
    // world_size as str.
    let mut ws = unhex(KEY_HEX);
    let p = hex(&ws).find("73697a6501").unwrap() / 2 + 4;
    ws[p] = 0xa0;
    assert_eq!(
        field_of(dec(Op::PrepareStore, &[&ws, &one])),
        "key.world_size"
    );
    // Missing required fields: drop the "end" entry.
    let mut no_end = unhex("87");
    let full = unhex(KEY_HEX);
    let e = hex(&full).find("a3656e6403").unwrap() / 2;
    no_end.extend(&full[1..e]);
    no_end.extend(&full[e + 5..]);
    assert_eq!(field_of(dec(Op::PrepareStore, &[&no_end, &one])), "key.end");
    // Non-str map key.
    let mut nk = unhex(KEY_HEX);
    nk[0] = 0x89;
    nk.extend(unhex("01c0"));
    assert_eq!(field_of(dec(Op::PrepareStore, &[&nk, &one])), "key");
    // Validation of model_name and cache_salt.
    let bad_model = key_with(|k| k.model_name = "a@b".into());
    assert_eq!(
        field_of(dec(Op::PrepareStore, &[&bad_model, &one])),
        "key.model_name"
    );
    let bad_salt = key_with(|k| k.cache_salt = "a/b".into());
    assert_eq!(
        field_of(dec(Op::PrepareStore, &[&bad_salt, &one])),
        "key.cache_salt"
    );
    let long_salt = key_with(|k| k.cache_salt = "s".repeat(129));
    assert_eq!(
        field_of(dec(Op::PrepareStore, &[&long_salt, &one])),
        "key.cache_salt"
    );
    let ok_salt = key_with(|k| k.cache_salt = "é".repeat(128));
    assert!(dec(Op::PrepareStore, &[&ok_salt, &one]).is_ok());
    // worker_id out of u32 range.
    let mut wid = unhex(KEY_HEX);
    let p = hex(&wid).find("776f726b65725f6964").unwrap() / 2 + 9;
    wid.splice(p..p + 1, unhex("cf0000000100000000"));
    assert_eq!(
        field_of(dec(Op::PrepareStore, &[&wid, &one])),
        "key.worker_id"
    );
}

#[test]
fn malformed_errors() {
    let one = encode_uint(1);
    let key = unhex(KEY_HEX);
    // Truncated key at every length: Malformed on frame 2, never a panic.
    for cut in 0..key.len() {
        let err = dec(Op::PrepareStore, &[&key[..cut], &one]).unwrap_err();
        assert!(
            matches!(err, WireError::Malformed { frame: 2, .. }),
            "cut {cut}: {err:?}"
        );
    }
    // Trailing bytes on the second payload frame.
    let err = dec(Op::PrepareStore, &[&key, &unhex("0101")]).unwrap_err();
    assert!(
        matches!(err, WireError::Malformed { frame: 3, .. }),
        "{err:?}"
    );
    // Reserved marker.
    assert!(matches!(
        dec(Op::Ping, &[&unhex("c1")]),
        Err(WireError::Malformed { frame: 2, .. })
    ));
    // Empty frame.
    assert!(matches!(
        dec(Op::EndSession, &[&[]]),
        Err(WireError::Malformed { frame: 2, .. })
    ));
    // Huge claimed lengths with no data.
    for bad in [
        "dbffffffff",
        "c6ffffffff",
        "ddffffffff",
        "dfffffffff",
        "c9ffffffff01",
    ] {
        assert!(dec(Op::EndSession, &[&unhex(bad)]).is_err());
    }
    let mut huge_tokens = unhex(KEY_HEX);
    let pos = hex(&huge_tokens).find("93010203").unwrap() / 2;
    huge_tokens.splice(pos..pos + 1, unhex("ddffffffff"));
    // The following key bytes are read as tokens until the "start" str: a typed error.
    assert_eq!(
        field_of(dec(Op::PrepareStore, &[&huge_tokens, &one])),
        "key.token_ids"
    );
    // Cut right after the huge header: truncation, without allocating 4G entries.
    assert!(matches!(
        dec(Op::PrepareStore, &[&huge_tokens[..pos + 7], &one]),
        Err(WireError::Malformed { frame: 2, .. })
    ));
    // Deeply nested unknown value is skipped iteratively (no stack overflow).
    let mut deep = unhex("81a178");
    deep.extend(std::iter::repeat_n(0x91u8, 1_000_000));
    deep.push(0xc0);
    assert!(matches!(
        dec(Op::PrepareStore, &[&deep, &one]),
        Err(WireError::Field { .. })
    ));
    let mut deep_trunc = unhex("81a178");
    deep_trunc.extend(std::iter::repeat_n(0x91u8, 1_000_000));
    assert!(matches!(
        dec(Op::PrepareStore, &[&deep_trunc, &one]),
        Err(WireError::Malformed { .. })
    ));
}
