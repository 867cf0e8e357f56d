//! Hostile input never panics the decoders, and every encoder writes one valid msgpack document.

use super::*;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const ALL_OPS: [Op; 23] = [
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

fn mutate(rng: &mut Rng, base: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    let interesting: [&[u8]; 10] = [
        &[0xc1],
        &[0xdd, 0xff, 0xff, 0xff, 0xff],
        &[0xdf, 0xff, 0xff, 0xff, 0xff],
        &[0xdb, 0xff, 0xff, 0xff, 0xff],
        &[0xc6, 0x7f, 0xff, 0xff, 0xff],
        &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
        &[0xcb, 0x7f, 0xf0, 0, 0, 0, 0, 0, 0],
        &[0x9f],
        &[0xc7, 0x03, 0x01],
    ];
    for _ in 0..1 + rng.below(4) {
        match rng.below(6) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            2 => {
                let cut = rng.below(v.len() + 1);
                v.truncate(cut);
            }
            3 => {
                let i = rng.below(v.len() + 1);
                let ins = interesting[rng.below(interesting.len())];
                v.splice(i..i, ins.iter().copied());
            }
            4 => {
                let i = rng.below(v.len() + 1);
                v.insert(i, rng.next() as u8);
            }
            _ if !v.is_empty() => {
                let i = rng.below(v.len());
                v.remove(i);
            }
            _ => {}
        }
    }
    v
}

#[test]
fn fuzz_never_panics() {
    let key8 = unhex(KEY_HEX);
    let key10 = encode_key(&golden_key(), true);
    let corpus: Vec<Vec<u8>> = vec![
        key8.clone(),
        key10.clone(),
        unhex(REG_HEX),
        unhex(RECORDS_HEX),
        unhex("cf0000011f71fb04cb"),
        unhex("c400"),
        unhex("c3"),
        unhex("cb403e000000000000"),
        encode_str("get_chunk_size"),
        encode_str("req-123"),
        unhex(PREP_STORE_HEX),
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut ok = 0usize;
    for iter in 0..20_000 {
        let a = if iter % 5 == 0 {
            let len = rng.below(40);
            (0..len).map(|_| rng.next() as u8).collect()
        } else {
            {
                let i = rng.below(corpus.len());
                mutate(&mut rng, &corpus[i])
            }
        };
        let b = {
            let i = rng.below(corpus.len());
            mutate(&mut rng, &corpus[i])
        };
        let c = if rng.below(2) == 0 {
            key10.clone()
        } else {
            mutate(&mut rng, &key8)
        };
        let _ = parse_op(&a);
        for op in ALL_OPS {
            let payloads: [&[&[u8]]; 5] = [&[], &[&a], &[&c, &a], &[&a, &b], &[&a, &b, &a]];
            for p in payloads {
                if decode_request(op, "fuzz", p).is_ok() {
                    ok += 1;
                }
            }
        }
    }
    // Sanity: some mutated inputs still decode.
    assert!(ok > 0);
}

#[test]
fn rmpv_agrees_on_encoders() {
    // Every encoder output is a single valid msgpack document.
    let slot = SlotDesc {
        offset: u64::MAX,
        length: 70000,
        shape: (0..20).collect(),
        dtype: "x".repeat(300),
    };
    let slots = vec![slot; 17];
    let idx: Vec<u32> = (0..70000).collect();
    let big_key = IpcKey {
        model_name: "m".repeat(40),
        world_size: u32::MAX,
        worker_id: None,
        token_ids: (0..70000).map(|i| i * 60000).collect(),
        start: 1 << 40,
        end: u64::MAX,
        request_id: "r".repeat(70000),
        cache_salt: "s".repeat(100),
        num_kv_readers: 1,
    };
    let docs = [
        encode_prepare_store_reply(Some((&slots, &idx))),
        encode_prepare_retrieve_reply(Some(&slots)),
        encode_key(&big_key, true),
        encode_bin_bool(&vec![7u8; 70000], true),
        encode_str_list(&["a"; 20]),
    ];
    for d in &docs {
        let mut rd = &d[..];
        rmpv::decode::read_value(&mut rd).unwrap();
        assert!(rd.is_empty());
    }
    // Big key round-trips through our decoder.
    let tp = encode_uint(8);
    assert_eq!(
        dec(Op::Lookup, &[&docs[2], &tp]).unwrap(),
        LmRequest::Lookup {
            key: big_key,
            tp_size: 8
        }
    );
    // Int boundaries are the smallest forms.
    for (v, h) in [
        (127u64, "7f"),
        (128, "cc80"),
        (255, "ccff"),
        (256, "cd0100"),
        (65535, "cdffff"),
        (65536, "ce00010000"),
        (u32::MAX as u64, "ceffffffff"),
    ] {
        assert_eq!(hex(&encode_uint(v)), h);
    }
    assert_eq!(&encode_str(&"a".repeat(31))[..1], &[0xbf]);
    assert_eq!(&encode_str(&"a".repeat(32))[..2], &[0xd9, 32]);
    assert_eq!(&encode_str(&"a".repeat(256))[..3], &[0xda, 1, 0]);
    assert_eq!(&encode_str_list(&["a"; 16])[..3], &[0xdc, 0, 16]);
}
