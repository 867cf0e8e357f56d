//! The fuzz corpora as regular tests: every file in `fuzz/corpus/<target>/` and
//! `fuzz/regressions/<target>/` runs through the same harness as the cargo-fuzz target of that
//! name (`kvnode::fuzzing`), and the seed files generated here from the golden vectors and the
//! encoders must match the committed ones.
//!
//! Regenerate the seeds after changing the generator or the wire formats:
//! `KVNODE_WRITE_FUZZ_SEEDS=1 cargo test --test fuzz_corpus`.

use std::fs;
use std::path::{Path, PathBuf};

use kvnode::fuzzing;
use kvnode::lmcache::wire::{self, BlockRecord, IpcKey, Op, RegisterPayload};
use kvnode::protocol::frame::{encode_request, encode_response};
use kvnode::protocol::messages::{
    BlockAllocationRecord, ChunkRange, RegisterReply, RegisterRequest, Request, Response,
    WireLayout, WireSlot,
};
use kvnode::transport::tcp::handshake::{
    codec::ClientAuth, ClientHandshake, ClientOffer, FrameRange, FABRIC_RDMA, FABRIC_TCP,
};

/// The harness of a fuzz target, by the target's (and its corpus directory's) name.
fn harness(target: &str) -> Option<fn(&[u8])> {
    match target {
        "native_frame" => Some(fuzzing::native_frame),
        "lmcache_request" => Some(fuzzing::lmcache_request),
        "remote_handshake" => Some(fuzzing::remote_handshake),
        "remote_descriptors" => Some(fuzzing::remote_descriptors),
        _ => None,
    }
}

const TARGETS: [&str; 4] = [
    "native_frame",
    "lmcache_request",
    "remote_handshake",
    "remote_descriptors",
];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

/// Input files of `<kind>/<target>/`, sorted; dotfiles and READMEs are not inputs.
fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join(kind).join(target);
    let Ok(rd) = fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = rd
        .map(|e| e.expect("directory entry").path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            p.is_file() && !name.starts_with('.') && !name.starts_with("README")
        })
        .collect();
    files.sort();
    files
}

#[test]
fn corpus_and_regressions_pass_the_harnesses() {
    for kind in ["corpus", "regressions"] {
        // Every directory must belong to a target, so nothing is silently skipped.
        for e in fs::read_dir(fuzz_dir().join(kind)).expect("fuzz directory") {
            let p = e.expect("directory entry").path();
            if p.is_dir() {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                assert!(
                    harness(name).is_some(),
                    "{kind}/{name}: no such fuzz target"
                );
            }
        }
        for target in TARGETS {
            let run = harness(target).expect("known target");
            let files = inputs(kind, target);
            // (While the seeds are being rewritten, the other test may see an empty directory.)
            if kind == "corpus" && std::env::var_os("KVNODE_WRITE_FUZZ_SEEDS").is_none() {
                assert!(!files.is_empty(), "fuzz/corpus/{target} is empty");
            }
            eprintln!("fuzz/{kind}/{target}: {} inputs", files.len());
            for f in files {
                let data = fs::read(&f).expect("readable input");
                let r = std::panic::catch_unwind(|| run(&data));
                assert!(r.is_ok(), "{} fails the {target} harness", f.display());
            }
        }
    }
}

#[test]
fn seeds_are_committed_and_pass() {
    let write = std::env::var_os("KVNODE_WRITE_FUZZ_SEEDS").is_some();
    for (target, seeds) in [
        ("native_frame", native_seeds()),
        ("lmcache_request", lmcache_seeds()),
        ("remote_handshake", handshake_seeds()),
        ("remote_descriptors", descriptor_seeds()),
    ] {
        let run = harness(target).expect("known target");
        let dir = fuzz_dir().join("corpus").join(target);
        for (name, data) in seeds {
            run(&data);
            let path = dir.join(format!("seed-{name}"));
            if write {
                fs::create_dir_all(&dir).expect("corpus directory");
                fs::write(&path, &data).expect("seed written");
            } else {
                let committed = fs::read(&path).unwrap_or_else(|e| {
                    panic!(
                        "{}: {e}; regenerate with KVNODE_WRITE_FUZZ_SEEDS=1",
                        path.display()
                    )
                });
                assert!(
                    committed == data,
                    "{} is stale; regenerate with KVNODE_WRITE_FUZZ_SEEDS=1",
                    path.display()
                );
            }
        }
    }
}

// ---- native seeds: one frame of every request and response type, and pipelined streams ----

fn range(worker_id: Option<u32>, chunks: u8) -> ChunkRange {
    ChunkRange {
        model: "m".into(),
        world_size: 2,
        worker_id,
        cache_salt: "salt".into(),
        first_chunk: 1,
        chunk_hashes: (0..chunks).map(|i| [i; 32]).collect(),
    }
}

fn all_requests() -> Vec<(&'static str, Request)> {
    vec![
        ("noop", Request::Noop),
        ("ping", Request::Ping { instance_id: None }),
        (
            "ping-id",
            Request::Ping {
                instance_id: Some(7),
            },
        ),
        ("get-chunk-size", Request::GetChunkSize),
        (
            "register",
            Request::Register(RegisterRequest {
                instance_id: 7,
                model: "m".into(),
                world_size: 1,
                block_size: 16,
                num_layers: 2,
                hidden_dim: 16,
                dtype: "float32".into(),
                use_mla: false,
                physical_slots: None,
            }),
        ),
        ("unregister", Request::Unregister { instance_id: 7 }),
        (
            "prepare-store",
            Request::PrepareStore {
                instance_id: 7,
                range: range(Some(0), 2),
            },
        ),
        (
            "commit-store",
            Request::CommitStore {
                instance_id: 7,
                transfer_id: 3,
            },
        ),
        (
            "abort-store",
            Request::AbortStore {
                instance_id: 7,
                transfer_id: 3,
            },
        ),
        (
            "prepare-retrieve",
            Request::PrepareRetrieve {
                instance_id: 7,
                range: range(Some(1), 3),
                lookup_session: Some("req-1".into()),
            },
        ),
        (
            "commit-retrieve",
            Request::CommitRetrieve {
                instance_id: 7,
                transfer_id: 4,
            },
        ),
        (
            "lookup",
            Request::Lookup {
                request_id: "req-1".into(),
                range: range(None, 4),
                tp_size: 2,
                readers: 0,
            },
        ),
        (
            "free-lookup-locks",
            Request::FreeLookupLocks {
                request_id: "req-1".into(),
                start_chunk: 0,
                end_chunk: 2,
            },
        ),
        (
            "end-session",
            Request::EndSession {
                request_id: "req-1".into(),
            },
        ),
        (
            "report-block-allocation",
            Request::ReportBlockAllocation {
                instance_id: 9,
                model: "m".into(),
                records: vec![
                    BlockAllocationRecord {
                        req_id: "r".into(),
                        new_block_ids: vec![1, 2],
                        new_token_ids: vec![3],
                    },
                    BlockAllocationRecord {
                        req_id: "a-longer-request-id".into(),
                        new_block_ids: vec![],
                        new_token_ids: vec![4, 5, 6],
                    },
                ],
            },
        ),
        ("clear", Request::Clear),
        ("status", Request::Status),
        ("memcheck", Request::Memcheck),
        (
            "write-slots",
            Request::WriteSlots {
                instance_id: 7,
                transfer_id: 9,
                data: kvnode::protocol::DataPath::Inline,
                commit: true,
            },
        ),
        (
            "read-slots-remote",
            Request::ReadSlots {
                instance_id: 7,
                transfer_id: 9,
                data: kvnode::protocol::DataPath::Remote(vec![kvnode::protocol::RemoteBuf {
                    region: 1,
                    offset: 4096,
                    len: 16384,
                }]),
                commit: false,
            },
        ),
        (
            "register-buffers",
            Request::RegisterBuffers {
                regions: vec![kvnode::protocol::RemoteRegion {
                    id: 1,
                    addr: 0x7f00_0000_0000,
                    len: 1 << 30,
                    rkey: 0x1234,
                }],
            },
        ),
        (
            "unregister-buffers",
            Request::UnregisterBuffers { ids: vec![1, 2] },
        ),
    ]
}

fn layout() -> WireLayout {
    WireLayout {
        shape: vec![2, 2, 256, 8],
        dtype: "bfloat16".into(),
    }
}

fn all_responses() -> Vec<(&'static str, u16, bool, Response)> {
    let slot = WireSlot {
        offset: 4096,
        length: 16384,
    };
    vec![
        ("ok", 2, false, Response::Ok),
        ("text", 1, false, Response::Text("OK".into())),
        ("number", 3, false, Response::Number(256)),
        (
            "registered",
            4,
            true,
            Response::Registered(RegisterReply {
                pool_bytes: 1 << 30,
                pool_backing: "4k".into(),
                shm_name: "lmcache_l1_pool_x".into(),
                chunk_tokens: 256,
                layout: layout(),
                object_bytes: 16384,
                fd_attached: true,
            }),
        ),
        (
            "unregistered",
            5,
            false,
            Response::Unregistered {
                released_writes: 1,
                released_reads: 2,
            },
        ),
        (
            "store-prepared",
            6,
            false,
            Response::StorePrepared {
                transfer_id: 3,
                slots: vec![slot, slot],
                chunk_indices: vec![0, 1],
                layout: layout(),
            },
        ),
        (
            "store-committed",
            7,
            false,
            Response::StoreCommitted { published: 2 },
        ),
        (
            "store-aborted",
            8,
            false,
            Response::StoreAborted { freed: 2 },
        ),
        (
            "retrieve-prepared",
            9,
            false,
            Response::RetrievePrepared {
                hit: true,
                transfer_id: 4,
                slots: vec![slot],
                layout: layout(),
            },
        ),
        ("lookup-hits", 11, false, Response::LookupHits { chunks: 3 }),
        (
            "cleared",
            15,
            false,
            Response::Cleared {
                deleted: 5,
                deferred: 1,
            },
        ),
        (
            "memcheck",
            17,
            false,
            Response::Memcheck {
                ok: false,
                problems: vec!["p1".into(), "a longer problem description".into()],
            },
        ),
        (
            "error",
            6,
            false,
            Response::Error {
                kind: 3,
                message: "invalid request".into(),
            },
        ),
        (
            "slots-written",
            18,
            false,
            Response::SlotsWritten {
                bytes: 32768,
                published: Some(2),
            },
        ),
        (
            "slots-read",
            19,
            false,
            Response::SlotsRead { bytes: 32768 },
        ),
        (
            "buffers-registered",
            20,
            false,
            Response::BuffersRegistered { count: 1 },
        ),
    ]
}

fn native_seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stream = Vec::new();
    for (i, (name, req)) in all_requests().into_iter().enumerate() {
        let frame = encode_request(i as u64 + 1, &req).expect("encodes");
        out.push((
            format!("req-{name}"),
            fuzzing::native_frame_input(0, &frame),
        ));
        stream.extend(frame);
    }
    // The whole set pipelined: delivered at once, in small chunks, and with interruptions.
    out.push((
        "stream-requests".into(),
        fuzzing::native_frame_input(0, &stream),
    ));
    out.push((
        "stream-requests-chunked".into(),
        fuzzing::native_frame_input(5, &stream),
    ));
    out.push((
        "stream-requests-interrupted".into(),
        fuzzing::native_frame_input(0x80 | 40, &stream),
    ));
    for (name, opcode, fd, resp) in all_responses() {
        let frame = encode_response(1, opcode, fd, &resp).expect("encodes");
        out.push((
            format!("resp-{name}"),
            fuzzing::native_frame_input(0, &frame),
        ));
    }
    out
}

// ---- LMCache seeds: the golden vectors of wire/tests (lmcache-mp.md Appendix A) per op ----

/// `wire/tests/mod.rs`' KEY_HEX / REG_HEX / RECORDS_HEX (LMCache 0.5.4 client captures).
const KEY_HEX: &str = "88aa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501a9776f726b65725f696400a9746f6b656e5f69647393010203a5737461727400a3656e6403aa726571756573745f6964a3726571aa63616368655f73616c74a0";
const REG_HEX: &str = "88ab696e7374616e63655f696407aa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501aa626c6f636b5f73697a6510aa6e756d5f6c617965727302af68696464656e5f64696d5f73697a6510a964747970655f737472a7666c6f61743332a77573655f6d6c61c2";
const RECORDS_HEX: &str =
    "9183a67265715f6964a172ad6e65775f626c6f636b5f6964739101ad6e65775f746f6b656e5f6964739102";

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

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
        num_kv_readers: 1,
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

fn op_name(op: Op) -> String {
    wire::parse_op(&wire::encode_op(op)).expect("parses").1
}

fn lmcache_seeds() -> Vec<(String, Vec<u8>)> {
    // The copies of the golden vectors must still be what the encoders produce.
    let key054 = unhex(KEY_HEX);
    assert_eq!(wire::encode_key(&golden_key(), false), key054);
    assert_eq!(wire::encode_register_payload(&golden_reg()), unhex(REG_HEX));
    let key056 = wire::encode_key(&golden_key(), true);
    let scheduler_key = wire::encode_key(
        &IpcKey {
            worker_id: None,
            token_ids: (0..40).map(|t| t * 1000).collect(),
            end: 40,
            cache_salt: "tenant-a".into(),
            ..golden_key()
        },
        true,
    );
    let mut reg056 = unhex(REG_HEX);
    reg056[0] = 0x89;
    reg056.extend(wire::encode_str("num_physical_slots"));
    reg056.extend(wire::encode_uint(256));
    let records = unhex(RECORDS_HEX);
    assert!(matches!(
        wire::decode_request(
            Op::ReportBlockAllocation,
            "x",
            &[&wire::encode_uint(1), &wire::encode_str("m"), &records]
        ),
        Ok(wire::LmRequest::ReportBlockAllocation { ref records, .. })
            if records == &[BlockRecord { req_id: "r".into(), new_block_ids: vec![1], new_token_ids: vec![2] }]
    ));
    let uint = wire::encode_uint;
    let rid = wire::encode_str("rt-1");
    let cases: Vec<(&str, Op, Vec<Vec<u8>>)> = vec![
        ("get-chunk-size", Op::GetChunkSize, vec![]),
        ("get-experimental", Op::GetExperimental, vec![]),
        ("noop", Op::Noop, vec![]),
        ("ping-nil", Op::Ping, vec![vec![0xc0]]),
        ("ping-id", Op::Ping, vec![uint(1234567890123)]),
        ("register", Op::RegisterEngineDriven, vec![unhex(REG_HEX)]),
        ("register-056", Op::RegisterEngineDriven, vec![reg056]),
        ("unregister", Op::UnregisterEngineDriven, vec![uint(0x3729)]),
        (
            "prepare-store",
            Op::PrepareStore,
            vec![key054.clone(), uint(5)],
        ),
        (
            "prepare-store-056",
            Op::PrepareStore,
            vec![key056.clone(), uint(5)],
        ),
        (
            "commit-store",
            Op::CommitStore,
            vec![key056.clone(), uint(0x3729), vec![0xc4, 0]],
        ),
        (
            "commit-store-2-frames",
            Op::CommitStore,
            vec![key054.clone(), uint(0x3729)],
        ),
        (
            "commit-store-pickle",
            Op::CommitStore,
            vec![key056.clone(), uint(5), vec![0xc4, 4, 0x80, 4, 0x95, 0x2e]],
        ),
        (
            "prepare-retrieve",
            Op::PrepareRetrieve,
            vec![key056.clone(), uint(5)],
        ),
        (
            "commit-retrieve",
            Op::CommitRetrieve,
            vec![key054.clone(), uint(9)],
        ),
        ("lookup", Op::Lookup, vec![scheduler_key.clone(), uint(2)]),
        (
            "free-lookup-locks",
            Op::FreeLookupLocks,
            vec![scheduler_key, uint(1)],
        ),
        (
            "query-prefetch-status",
            Op::QueryPrefetchStatus,
            vec![rid.clone()],
        ),
        (
            "query-prefetch-lookup-hits",
            Op::QueryPrefetchLookupHits,
            vec![rid.clone()],
        ),
        (
            "wait-prefetch-status-float",
            Op::WaitPrefetchStatus,
            vec![rid.clone(), unhex("cb403e000000000000")],
        ),
        (
            "wait-prefetch-status-int",
            Op::WaitPrefetchStatus,
            vec![rid.clone(), uint(30)],
        ),
        ("end-session", Op::EndSession, vec![rid]),
        (
            "report-block-allocation",
            Op::ReportBlockAllocation,
            vec![uint(4242), wire::encode_str("m"), records],
        ),
        ("clear", Op::Clear, vec![]),
        ("clear-force", Op::Clear, vec![vec![0xc3]]),
        ("store-gpu", Op::Store, vec![key056, uint(5)]),
    ];
    let mut out = Vec::new();
    for (name, op, frames) in cases {
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        // Every seed is a request the decoder accepts.
        wire::decode_request(op, "seed", &refs).expect("seed decodes");
        // The type frame as a legacy int id (0.5.4/0.5.5 clients) and as a name (0.5.6).
        out.push((
            format!("{name}-id"),
            fuzzing::lmcache_request_input(&wire::encode_op(op), &refs),
        ));
        out.push((
            format!("{name}-name"),
            fuzzing::lmcache_request_input(&wire::encode_str(&op_name(op)), &refs),
        ));
    }
    // 0.5.4's GET_EXPERIMENTAL id and ops kvnode does not serve.
    out.push((
        "get-experimental-id40".into(),
        fuzzing::lmcache_request_input(&uint(40), &[]),
    ));
    out.push((
        "unsupported-cb".into(),
        fuzzing::lmcache_request_input(&uint(25), &[&[0x90]]),
    ));
    out.push((
        "unsupported-name".into(),
        fuzzing::lmcache_request_input(&wire::encode_str("poll_kv_events"), &[]),
    ));
    out
}

// ---- remote handshake seeds: honest clients of every kind, and the refusals ----

fn handshake_seeds() -> Vec<(String, Vec<u8>)> {
    use fuzzing::{
        remote_handshake_input as input, HS_MODE_ADMIN as ADMIN, HS_MODE_FABRICS_SHIFT as FAB,
        HS_MODE_GENUINE as GENUINE, HS_MODE_INSECURE as INSECURE, HS_MODE_RAW as RAW,
    };
    let hello = |min: u16, max: u16, fabrics: u16, name: &str| {
        let offer = ClientOffer {
            frames: FrameRange { min, max },
            fabrics,
        };
        let (_, h) = ClientHandshake::new(None, name, &offer, [0xc1; 32]).expect("valid offer");
        h.as_bytes().to_vec()
    };
    // A ClientAuth whose MAC is zeros (the harness patches in the genuine one in GENUINE mode).
    let auth = |fabric: u16| {
        ClientAuth {
            fabric,
            mac: [0; 32],
        }
        .encode()
        .as_bytes()
        .to_vec()
    };
    // The client's RdmaOffer (QP number 0 is malformed).
    let rdma_offer = |qpn: u32| {
        let mut o = vec![0u8, 5, 0, 0];
        o.extend_from_slice(&qpn.to_le_bytes());
        o.extend_from_slice(&0x00ab_cdefu32.to_le_bytes());
        o.extend_from_slice(&[0x20; 16]);
        o
    };
    let both = FABRIC_TCP | FABRIC_RDMA;
    let tcp_node = (FABRIC_TCP as u8) << FAB;
    let both_node = (both as u8) << FAB;
    let full = |h: Vec<u8>, a: Vec<u8>| [h, a].concat();
    let std_hello = hello(2, 3, both, "engine-0");
    let mut long_name = hello(2, 3, both, "x")[..45].to_vec();
    long_name[44] = 65;
    let mut hs_v2 = std_hello.clone();
    hs_v2[4] = 2;
    vec![
        (
            "genuine-client",
            input(
                0,
                GENUINE | tcp_node,
                &full(std_hello.clone(), auth(FABRIC_TCP)),
            ),
        ),
        (
            "genuine-admin",
            input(
                0,
                GENUINE | ADMIN | tcp_node,
                &full(std_hello.clone(), auth(FABRIC_TCP)),
            ),
        ),
        (
            "genuine-rdma-chunked",
            input(
                5,
                GENUINE | both_node,
                &full(std_hello.clone(), auth(FABRIC_RDMA)),
            ),
        ),
        (
            "genuine-rdma-exchange",
            input(
                3,
                GENUINE | both_node,
                &[
                    full(std_hello.clone(), auth(FABRIC_RDMA)),
                    rdma_offer(0x1234),
                    vec![0],
                ]
                .concat(),
            ),
        ),
        (
            "genuine-rdma-bad-offer",
            input(
                0,
                GENUINE | both_node,
                &[full(std_hello.clone(), auth(FABRIC_RDMA)), rdma_offer(0)].concat(),
            ),
        ),
        (
            "genuine-interleaved",
            input(
                0x80 | 3,
                GENUINE | tcp_node,
                &full(std_hello.clone(), auth(FABRIC_TCP)),
            ),
        ),
        (
            "genuine-fabric-not-offered",
            input(
                0,
                GENUINE | tcp_node,
                &full(std_hello.clone(), auth(FABRIC_RDMA)),
            ),
        ),
        (
            "wrong-mac",
            input(0, tcp_node, &full(std_hello.clone(), auth(FABRIC_TCP))),
        ),
        (
            "insecure",
            input(
                0,
                INSECURE | tcp_node,
                &full(std_hello.clone(), auth(FABRIC_TCP)),
            ),
        ),
        (
            "insecure-chunked",
            input(
                1,
                INSECURE | tcp_node,
                &full(hello(1, 9, FABRIC_TCP, ""), auth(FABRIC_TCP)),
            ),
        ),
        (
            "raw-early-auth",
            input(
                0,
                RAW | GENUINE | tcp_node,
                &full(std_hello.clone(), auth(FABRIC_TCP)),
            ),
        ),
        (
            "version-mismatch",
            input(0, tcp_node, &hello(4, 9, both, "future")),
        ),
        ("handshake-v2", input(0, tcp_node, &hs_v2)),
        ("name-too-long", input(0, tcp_node, &long_name)),
        ("truncated-hello", input(7, tcp_node, &std_hello[..30])),
        (
            "http-probe",
            input(0, tcp_node, b"GET / HTTP/1.1\r\nHost: node\r\n\r\n"),
        ),
    ]
    .into_iter()
    .map(|(n, d)| (n.to_string(), d))
    .collect()
}

/// Descriptor seeds: accepted buffers, each refusal the checker knows, and edge addresses.
fn descriptor_seeds() -> Vec<(String, Vec<u8>)> {
    use fuzzing::remote_descriptors_input as input;
    let hi = u64::MAX - 65_535;
    vec![
        (
            "two-buffers-ok".into(),
            input(
                &[(1, 0x10000, 65_536, 7)],
                &[(1, 0, 4096, false), (1, 4096, 4096, false)],
            ),
        ),
        (
            "overlap".into(),
            input(
                &[(1, 0x10000, 65_536, 7)],
                &[(1, 0, 4096, false), (1, 2048, 4096, false)],
            ),
        ),
        (
            "past-region".into(),
            input(&[(1, 0x10000, 8192, 7)], &[(1, 8000, 4096, false)]),
        ),
        (
            "unknown-region".into(),
            input(&[(1, 0, 8192, 7)], &[(2, 0, 16, false)]),
        ),
        (
            "length-mismatch".into(),
            input(&[(1, 0, 8192, 7)], &[(1, 0, 16, true)]),
        ),
        (
            "wrapping-region".into(),
            input(&[(1, u64::MAX - 10, 100, 7)], &[]),
        ),
        (
            "high-region".into(),
            input(&[(1, hi, 65_535, 1)], &[(1, 65_000, 535, false)]),
        ),
        (
            "duplicate-id".into(),
            input(&[(3, 0, 16, 1), (3, 64, 16, 2)], &[(3, 0, 16, false)]),
        ),
        (
            "offset-overflow".into(),
            input(&[(1, 0, 8192, 7)], &[(1, u64::MAX, 16, false)]),
        ),
        ("empty".into(), Vec::new()),
    ]
}
