//! Unit tests of the LMCache wire codec: shared helpers and the golden vectors here; `op` (the
//! type frame), `errors` (decode errors) and `fuzz` (never panic, encoders valid msgpack).

use super::*;

mod errors;
mod fuzz;
mod op;

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

const KEY_HEX: &str = "88aa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501a9776f726b65725f696400a9746f6b656e5f69647393010203a5737461727400a3656e6403aa726571756573745f6964a3726571aa63616368655f73616c74a0";
const REG_HEX: &str = "88ab696e7374616e63655f696407aa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501aa626c6f636b5f73697a6510aa6e756d5f6c617965727302af68696464656e5f64696d5f73697a6510a964747970655f737472a7666c6f61743332a77573655f6d6c61c2";
const REG_REPLY_HEX: &str =
    "82a873686d5f6e616d65b16c6d63616368655f6c315f706f6f6c5f78a9706f6f6c5f73697a65ce40000000";
const PREP_STORE_HEX: &str = "81a7636f6e7465787482a5736c6f74739184a66f666673657400a66c656e67746810a57368617065920202a56474797065a7666c6f61743332ad6368756e6b5f696e64696365739100";
const RECORDS_HEX: &str =
    "9183a67265715f6964a172ad6e65775f626c6f636b5f6964739101ad6e65775f746f6b656e5f6964739102";

fn golden_key() -> IpcKey {
    IpcKey {
        model_name: "m".into(),
        world_size: 1,
        worker_id: Some(0),
        token_ids: vec![1, 2, 3],
        start: 0,
        end: 3,
        request_id: "req".into(),
        cache_salt: String::new(),
        num_kv_readers: 0, // the 0.5.4 form carries none
    }
}

fn golden_reg() -> RegisterPayload {
    RegisterPayload {
        instance_id: 7,
        model_name: "m".into(),
        world_size: 1,
        block_size: 16,
        num_layers: 2,
        hidden_dim_size: 16,
        dtype_str: "float32".into(),
        use_mla: false,
        num_physical_slots: None,
    }
}

fn dec(op: Op, payload: &[&[u8]]) -> Result<LmRequest> {
    decode_request(op, "test", payload)
}

// ---- golden vectors (lmcache-mp.md Appendix A, lmcache-peer.md §5) ----

#[test]
fn golden_ping() {
    assert_eq!(encode_uint(0), unhex("00"));
    assert_eq!(encode_op(Op::Ping), unhex("16"));
    assert_eq!(parse_op(&unhex("16")).unwrap(), (Op::Ping, "ping".into()));
    let nil = unhex("c0");
    assert_eq!(
        dec(Op::Ping, &[&nil]).unwrap(),
        LmRequest::Ping { instance_id: None }
    );
    let id = unhex("cf0000011f71fb04cb");
    assert_eq!(encode_uint(1234567890123), id);
    assert_eq!(
        dec(Op::Ping, &[&id]).unwrap(),
        LmRequest::Ping {
            instance_id: Some(1234567890123)
        }
    );
    assert_eq!(encode_bool(true), unhex("c3"));
    assert_eq!(encode_bool(false), unhex("c2"));
}

#[test]
fn golden_simple_replies() {
    assert_eq!(encode_uint(256), unhex("cd0100"));
    assert_eq!(encode_str("OK"), unhex("a24f4b"));
    assert_eq!(encode_str_list(&[]), unhex("90"));
    assert_eq!(
        encode_str_list(&["transfer_query"]),
        unhex("91ae7472616e736665725f7175657279")
    );
    assert_eq!(encode_bin_bool(&[], false), unhex("92c400c2"));
    assert_eq!(encode_bin_bool(&[1, 2], true), unhex("92c4020102c3"));
}

#[test]
fn golden_key_roundtrip() {
    let raw = unhex(KEY_HEX);
    let inst = encode_uint(5);
    let got = dec(Op::PrepareStore, &[&raw, &inst]).unwrap();
    assert_eq!(
        got,
        LmRequest::PrepareStore {
            key: golden_key(),
            instance_id: 5
        }
    );
    assert_eq!(hex(&encode_key(&golden_key(), false)), KEY_HEX);
}

#[test]
fn key_v056_form_decodes() {
    let k = IpcKey {
        num_kv_readers: 1,
        ..golden_key()
    };
    let enc = encode_key(&k, true);
    assert_eq!(enc[0], 0x8a);
    // Appended fields: request_configs nil, num_kv_readers 1.
    assert!(
        hex(&enc).ends_with("af726571756573745f636f6e66696773c0ae6e756d5f6b765f7265616465727301")
    );
    let tp = encode_uint(1);
    assert_eq!(
        dec(Op::Lookup, &[&enc, &tp]).unwrap(),
        LmRequest::Lookup { key: k, tp_size: 1 }
    );
    // request_configs as a map is ignored; num_kv_readers is read (0.5.4 keys have none: 0).
    let mut custom = unhex(KEY_HEX);
    custom[0] = 0x8a;
    custom.extend(encode_str("request_configs"));
    custom.extend(unhex("81a178a179"));
    custom.extend(encode_str("num_kv_readers"));
    custom.extend(encode_uint(3));
    let inst = encode_uint(9);
    match dec(Op::CommitRetrieve, &[&custom, &inst]).unwrap() {
        LmRequest::CommitRetrieve {
            instance_id: 9,
            key,
        } => assert_eq!(key.num_kv_readers, 3),
        other => panic!("{other:?}"),
    }
    // A reader count that is not a u32 is refused, naming the field.
    let n = custom.len();
    custom.truncate(n - 1);
    custom.extend(encode_uint(1 << 40));
    let e = dec(Op::CommitRetrieve, &[&custom, &inst]).unwrap_err();
    assert!(e.to_string().contains("key.num_kv_readers"), "{e}");
}

#[test]
fn key_defaults_nil_worker_and_unknown_keys() {
    // 6-field map without request_id / cache_salt, worker_id nil, an unknown nested field,
    // big token ids in u32 form and keys in a different order.
    let mut m = unhex("87");
    m.extend(encode_str("token_ids"));
    m.extend(unhex("92ceffffffff00"));
    m.extend(encode_str("future"));
    m.extend(unhex("929191c0a178"));
    m.extend(encode_str("worker_id"));
    m.extend(unhex("c0"));
    m.extend(encode_str("model_name"));
    m.extend(encode_str("x/y"));
    m.extend(encode_str("world_size"));
    m.extend(unhex("d30000000000000004")); // int64 form of 4
    m.extend(encode_str("start"));
    m.extend(unhex("00"));
    m.extend(encode_str("end"));
    m.extend(unhex("cd0200"));
    let tp = unhex("02");
    let got = dec(Op::FreeLookupLocks, &[&m, &tp]).unwrap();
    assert_eq!(
        got,
        LmRequest::FreeLookupLocks {
            key: IpcKey {
                model_name: "x/y".into(),
                world_size: 4,
                worker_id: None,
                token_ids: vec![u32::MAX, 0],
                start: 0,
                end: 512,
                request_id: String::new(),
                cache_salt: String::new(),
                num_kv_readers: 0,
            },
            tp_size: 2
        }
    );
}

#[test]
fn golden_register_payload() {
    let raw = unhex(REG_HEX);
    let got = dec(Op::RegisterEngineDriven, &[&raw]).unwrap();
    assert_eq!(got, LmRequest::RegisterEngineDriven(golden_reg()));
    assert_eq!(hex(&encode_register_payload(&golden_reg())), REG_HEX);

    // 0.5.6 adds num_physical_slots (nil: as absent; 0: refused, as LMCache does).
    let mut v056 = raw.clone();
    v056[0] = 0x89;
    v056.extend(encode_str("num_physical_slots"));
    let with = |v: &[u8]| [v056.as_slice(), v].concat();
    let slots = RegisterPayload {
        num_physical_slots: Some(256),
        ..golden_reg()
    };
    assert_eq!(
        dec(Op::RegisterEngineDriven, &[&with(&encode_uint(256))]).unwrap(),
        LmRequest::RegisterEngineDriven(slots.clone())
    );
    assert_eq!(encode_register_payload(&slots), with(&encode_uint(256)));
    assert_eq!(
        dec(Op::RegisterEngineDriven, &[&with(&[0xc0])]).unwrap(),
        LmRequest::RegisterEngineDriven(golden_reg())
    );
    let e = dec(Op::RegisterEngineDriven, &[&with(&encode_uint(0))]).unwrap_err();
    assert!(e.to_string().contains("num_physical_slots"), "{e}");
}

#[test]
fn golden_register_reply() {
    assert_eq!(
        hex(&encode_register_reply("lmcache_l1_pool_x", 1 << 30)),
        REG_REPLY_HEX
    );
    assert_eq!(
        encode_register_reply("", 0),
        unhex("82a873686d5f6e616d65a0a9706f6f6c5f73697a6500")
    );
}

#[test]
fn golden_prepare_store_reply() {
    let slot = SlotDesc {
        offset: 0,
        length: 16,
        shape: vec![2, 2],
        dtype: "float32".into(),
    };
    assert_eq!(
        hex(&encode_prepare_store_reply(Some((
            std::slice::from_ref(&slot),
            &[0]
        )))),
        PREP_STORE_HEX
    );
    assert_eq!(
        hex(&encode_prepare_store_reply(None)),
        "81a7636f6e7465787480"
    );
    // All cached: slots and chunk_indices present but empty.
    assert_eq!(
        hex(&encode_prepare_store_reply(Some((&[], &[])))),
        "81a7636f6e7465787482a5736c6f747390ad6368756e6b5f696e646963657390"
    );
}

#[test]
fn prepare_retrieve_reply_shapes() {
    let slot = SlotDesc {
        offset: 16384,
        length: 16384,
        shape: vec![2, 2, 256, 8],
        dtype: "bfloat16".into(),
    };
    let hit = encode_prepare_retrieve_reply(Some(std::slice::from_ref(&slot)));
    assert_eq!(
        hex(&hit),
        concat!(
            "83a773756363657373c3a464617461c400a7636f6e74657874",
            "81a5736c6f74739184a66f6666736574cd4000a66c656e677468cd4000",
            "a57368617065940202cd010008a56474797065a862666c6f61743136"
        )
    );
    let v = rmpv::decode::read_value(&mut &hit[..]).unwrap();
    assert_eq!(v["success"], rmpv::Value::Boolean(true));
    assert_eq!(v["data"], rmpv::Value::Binary(vec![]));
    assert_eq!(v["context"]["slots"][0]["shape"][2].as_u64(), Some(256));
    let miss = encode_prepare_retrieve_reply(None);
    assert_eq!(
        hex(&miss),
        "83a773756363657373c2a464617461c400a7636f6e7465787480"
    );
}

#[test]
fn golden_block_records() {
    let records = unhex(RECORDS_HEX);
    let inst = encode_uint(4242);
    let model = encode_str("m");
    let got = dec(Op::ReportBlockAllocation, &[&inst, &model, &records]).unwrap();
    assert_eq!(
        got,
        LmRequest::ReportBlockAllocation {
            instance_id: 4242,
            model_name: "m".into(),
            records: vec![BlockRecord {
                req_id: "r".into(),
                new_block_ids: vec![1],
                new_token_ids: vec![2],
            }],
        }
    );
}

#[test]
fn golden_capture_056() {
    // lmcache-peer.md §5 captured frames.
    assert_eq!(
        parse_op(&unhex("15")).unwrap(),
        (Op::GetChunkSize, "get_chunk_size".into())
    );
    assert_eq!(dec(Op::GetChunkSize, &[]).unwrap(), LmRequest::GetChunkSize);
    assert_eq!(parse_op(&unhex("14")).unwrap().0, Op::Clear);
    assert_eq!(
        dec(Op::Clear, &[&unhex("c3")]).unwrap(),
        LmRequest::Clear { force: Some(true) }
    );
    assert_eq!(
        dec(Op::Clear, &[]).unwrap(),
        LmRequest::Clear { force: None }
    );
    assert_eq!(parse_op(&unhex("18")).unwrap().0, Op::Noop);
    assert_eq!(parse_op(&unhex("0e")).unwrap().0, Op::RegisterEngineDriven);
    assert_eq!(parse_op(&unhex("10")).unwrap().0, Op::PrepareStore);
    assert_eq!(parse_op(&unhex("11")).unwrap().0, Op::CommitStore);
    assert_eq!(parse_op(&unhex("0d")).unwrap().0, Op::EndSession);
    assert_eq!(parse_op(&unhex("08")).unwrap().0, Op::Lookup);
    assert_eq!(parse_op(&unhex("0a")).unwrap().0, Op::WaitPrefetchStatus);
    assert_eq!(parse_op(&unhex("12")).unwrap().0, Op::PrepareRetrieve);
    assert_eq!(parse_op(&unhex("13")).unwrap().0, Op::CommitRetrieve);
    assert_eq!(
        parse_op(&unhex("0f")).unwrap().0,
        Op::UnregisterEngineDriven
    );

    let key = encode_key(&golden_key(), true);
    let inst = unhex("cd3729");
    let empty = unhex("c400");
    assert_eq!(
        dec(Op::CommitStore, &[&key, &inst, &empty]).unwrap(),
        LmRequest::CommitStore {
            key: golden_key(),
            instance_id: 0x3729,
            cpu_data: vec![]
        }
    );
    // Missing third frame reads as empty.
    assert_eq!(
        dec(Op::CommitStore, &[&key, &inst]).unwrap(),
        dec(Op::CommitStore, &[&key, &inst, &empty]).unwrap()
    );
    let rid = encode_str("rt-1");
    let timeout = unhex("cb403e000000000000");
    assert_eq!(
        dec(Op::WaitPrefetchStatus, &[&rid, &timeout]).unwrap(),
        LmRequest::WaitPrefetchStatus {
            request_id: "rt-1".into(),
            timeout_secs: 30.0
        }
    );
    assert_eq!(
        dec(Op::WaitPrefetchStatus, &[&rid, &unhex("1e")]).unwrap(),
        LmRequest::WaitPrefetchStatus {
            request_id: "rt-1".into(),
            timeout_secs: 30.0
        }
    );
    assert_eq!(
        dec(Op::EndSession, &[&rid]).unwrap(),
        LmRequest::EndSession {
            request_id: "rt-1".into()
        }
    );
    assert_eq!(
        dec(Op::UnregisterEngineDriven, &[&inst]).unwrap(),
        LmRequest::UnregisterEngineDriven {
            instance_id: 0x3729
        }
    );
    assert_eq!(encode_uint(4294967296), unhex("cf0000000100000000"));
    assert_eq!(encode_uint(2), unhex("02"));
}

#[test]
fn other_requests_decode() {
    let rid = encode_str("q");
    assert_eq!(
        dec(Op::QueryPrefetchStatus, &[&rid]).unwrap(),
        LmRequest::QueryPrefetchStatus {
            request_id: "q".into()
        }
    );
    assert_eq!(
        dec(Op::QueryPrefetchLookupHits, &[&rid]).unwrap(),
        LmRequest::QueryPrefetchLookupHits {
            request_id: "q".into()
        }
    );
    assert_eq!(
        dec(Op::GetExperimental, &[]).unwrap(),
        LmRequest::GetExperimental
    );
    assert_eq!(dec(Op::Noop, &[]).unwrap(), LmRequest::Noop);
    // Negative timeout clamps to 0; f32 accepted.
    assert_eq!(
        dec(Op::WaitPrefetchStatus, &[&rid, &unhex("ff")]).unwrap(),
        LmRequest::WaitPrefetchStatus {
            request_id: "q".into(),
            timeout_secs: 0.0
        }
    );
    assert_eq!(
        dec(Op::WaitPrefetchStatus, &[&rid, &unhex("ca3f000000")]).unwrap(),
        LmRequest::WaitPrefetchStatus {
            request_id: "q".into(),
            timeout_secs: 0.5
        }
    );
    // Unsupported ops are not decoded at all.
    let junk = unhex("c1");
    for op in [
        Op::RegisterKvCache,
        Op::UnregisterKvCache,
        Op::Store,
        Op::Retrieve,
        Op::Unsupported,
    ] {
        assert_eq!(
            decode_request(op, "x", &[&junk, &junk]).unwrap(),
            LmRequest::Unsupported {
                op,
                name: "x".into()
            }
        );
    }
    // Clear with a nil frame.
    assert_eq!(
        dec(Op::Clear, &[&unhex("c0")]).unwrap(),
        LmRequest::Clear { force: None }
    );
}
