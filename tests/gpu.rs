//! The client's GPU paths end to end with the real `kvnode` binary and the simulated GPU
//! (`Gpu::fake`: device memory in host memory, copies deferred to the stream's wait, faults
//! injected): every byte verified, one wait per request, the pool registered once per process,
//! a failed copy never published and never leaving locks behind. The CUDA implementation of
//! the same paths runs on a machine with a GPU (`scripts/gpu-check.sh`).

mod common;

use common::remote::RemoteNode;
use common::{payloads, range, reg, tokens, NodeProc};
use kvnode::client::{ChunkRangeBuilder, Client};
use kvnode::protocol::RegisterRequest;
use kvnode_hw::gpu::{DeviceBuffer, Gpu};

const MIB: u64 = 1 << 20;

/// [2 layers, 2, CHUNK, 1024] float32 = 256 KiB objects.
fn reg_gpu(instance_id: u64) -> RegisterRequest {
    RegisterRequest {
        hidden_dim: 1024,
        ..reg(instance_id)
    }
}

/// A device buffer holding `data` back to back.
fn upload(gpu: &Gpu, data: &[Vec<u8>]) -> DeviceBuffer {
    let len: usize = data.iter().map(Vec::len).sum();
    let dev = gpu.alloc(len as u64).unwrap();
    dev.write(0, &data.concat()).unwrap();
    dev
}

fn download(dev: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; dev.len() as usize];
    dev.read(0, &mut out).unwrap();
    out
}

/// Chunks of `toks` published on the node (LOOKUP over all ranks, its locks released again).
fn published<T: kvnode::client::ClientTransport>(c: &mut Client<T>, toks: &[u32]) -> u32 {
    let all = ChunkRangeBuilder::all_ranks(common::MODEL, 1).tokens(toks, common::CHUNK);
    let hits = c.lookup("gpu-test-probe", &all, 1).unwrap();
    c.end_session("gpu-test-probe").unwrap();
    hits
}

fn assert_clean(node: &NodeProc) {
    let st = node.status();
    assert_eq!(st["pending_writes"], 0, "{st:#}");
    assert_eq!(st["pending_reads"], 0, "{st:#}");
    let (ok, problems) = node.client().memcheck().unwrap();
    assert!(ok, "memcheck: {problems:?}");
}

#[test]
fn local_store_from_device_and_retrieve_to_device_move_every_byte() {
    let node = NodeProc::start("gpu-local", &["--pool-size", "64MiB"]);
    let (gpu, ctl) = Gpu::fake(256 * MIB, true);
    let mut c = node.client();
    c.attach_gpu(&gpu).unwrap();
    assert!(
        !c.gpu().unwrap().pool_pinned(),
        "nothing to pin before register"
    );
    let r = c.register(&reg_gpu(1)).unwrap();
    assert!(c.gpu().unwrap().pool_pinned());
    let n = r.object_bytes;
    let rg = range(&tokens(1, 6));
    let data = payloads(&rg, n as usize);
    let src = upload(&gpu, &data);
    let spans = src.chunks(n, 6).unwrap();
    let syncs = ctl.counters().synchronizations;
    assert_eq!(c.store_from_device(1, &rg, &spans).unwrap(), 6);
    assert_eq!(
        ctl.counters().synchronizations,
        syncs + 1,
        "one wait per request"
    );
    assert_eq!(
        c.store_from_device(1, &rg, &spans).unwrap(),
        0,
        "cached: no copy"
    );
    assert_eq!(ctl.counters().synchronizations, syncs + 1);
    let c1 = ctl.counters();
    assert_eq!(
        c1.pageable_copies, 0,
        "every copy touched the registered pool"
    );
    assert!(c1.registered_copies >= 1 && c1.registered_copies <= 6);

    // A host engine reads the same bytes from the pool.
    let mut host = node.client();
    host.register(&reg_gpu(2)).unwrap();
    assert!(host.retrieve(2, &rg).unwrap().unwrap() == data);

    // Back into device memory, in another order of buffers.
    let dst = gpu.alloc(6 * n).unwrap();
    let out = dst.chunks(n, 6).unwrap();
    assert!(c.retrieve_to_device(1, &rg, None, &out).unwrap());
    assert!(download(&dst) == data.concat(), "retrieved bytes differ");
    let st = c.gpu().unwrap().stats();
    assert_eq!((st.stores, st.retrieves), (1, 1));
    assert_eq!(st.device_to_host_bytes, 6 * n);
    assert_eq!(st.host_to_device_bytes, 6 * n);

    // A partial prefix misses whole: device memory untouched.
    let mut miss_tokens = tokens(1, 6);
    miss_tokens.extend(tokens(99, 1));
    let rg_miss = range(&miss_tokens);
    let dst2 = gpu.alloc(7 * n).unwrap();
    let before = download(&dst2);
    assert!(!c
        .retrieve_to_device(1, &rg_miss, None, &dst2.chunks(n, 7).unwrap())
        .unwrap());
    assert!(download(&dst2) == before);
    assert_clean(&node);
}

#[test]
fn a_failed_copy_is_never_published_and_leaves_no_lock() {
    let node = NodeProc::start("gpu-faults", &["--pool-size", "64MiB"]);
    let (gpu, ctl) = Gpu::fake(256 * MIB, false);
    let mut c = node.client();
    c.register(&reg_gpu(1)).unwrap();
    c.attach_gpu(&gpu).unwrap();
    let n = c.object_bytes().unwrap();
    let rg = range(&tokens(2, 4));
    let data = payloads(&rg, n as usize);
    let src = upload(&gpu, &data);
    let spans = src.chunks(n, 4).unwrap();

    // Store: the first driver copy fails to enqueue.
    ctl.fail_enqueue_after(1);
    let e = c.store_from_device(1, &rg, &spans).unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    assert_clean(&node);
    assert_eq!(published(&mut c, &tokens(2, 4)), 0, "nothing published");

    // Store: the wait itself fails.
    ctl.fail_next_sync();
    assert!(c.store_from_device(1, &rg, &spans).is_err());
    assert_clean(&node);
    assert_eq!(published(&mut c, &tokens(2, 4)), 0);

    // Now it works, and a failing retrieve releases its locks.
    assert_eq!(c.store_from_device(1, &rg, &spans).unwrap(), 4);
    let dst = gpu.alloc(4 * n).unwrap();
    let out = dst.chunks(n, 4).unwrap();
    ctl.fail_next_sync();
    assert!(c.retrieve_to_device(1, &rg, None, &out).is_err());
    assert_clean(&node);
    assert_eq!(c.clear().unwrap().1, 0, "no retrieve still holds an object");
    // Spans of another GPU handle or of the wrong size are refused before any request.
    let (other, _) = Gpu::fake(64 * MIB, false);
    let foreign = other.alloc(4 * n).unwrap();
    let e = c
        .store_from_device(1, &rg, &foreign.chunks(n, 4).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("another GPU handle"), "{e}");
    let e = c
        .store_from_device(1, &rg, &src.chunks(n / 2, 4).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("the layout needs"), "{e}");
    assert_clean(&node);
}

#[test]
fn clients_of_one_process_share_one_pool_registration() {
    let node = NodeProc::start("gpu-shared", &["--pool-size", "64MiB"]);
    let (gpu, ctl) = Gpu::fake(256 * MIB, false);
    let mut clients: Vec<Client> = (1..=4)
        .map(|i| {
            let mut c = node.client();
            c.attach_gpu(&gpu).unwrap();
            c.register(&reg_gpu(i)).unwrap();
            c
        })
        .collect();
    assert_eq!(
        ctl.counters().registrations,
        1,
        "one registration for four clients"
    );
    assert_eq!(ctl.counters().streams, 4, "one stream per instance");
    // All four store and retrieve concurrently on their own streams.
    let n = clients[0].object_bytes().unwrap();
    std::thread::scope(|s| {
        for (i, c) in clients.iter_mut().enumerate() {
            let gpu = gpu.clone();
            s.spawn(move || {
                let inst = i as u64 + 1;
                let rg = range(&tokens(10 + inst as u32, 3));
                let data = payloads(&rg, n as usize);
                let src = upload(&gpu, &data);
                for _ in 0..5 {
                    c.store_from_device(inst, &rg, &src.chunks(n, 3).unwrap())
                        .unwrap();
                    let dst = gpu.alloc(3 * n).unwrap();
                    assert!(c
                        .retrieve_to_device(inst, &rg, None, &dst.chunks(n, 3).unwrap())
                        .unwrap());
                    assert!(download(&dst) == data.concat());
                }
            });
        }
    });
    drop(clients.drain(..2));
    assert_eq!(
        ctl.counters().unregistrations,
        0,
        "still used by two clients"
    );
    drop(clients);
    assert_eq!(ctl.counters().unregistrations, 1);
    assert_eq!(ctl.registered_ranges(), 0);
    assert_clean(&node);
}

#[test]
fn remote_engines_stage_device_memory_through_a_pinned_buffer() {
    let rn = RemoteNode::start("gpu-remote", &["--pool-size", "64MiB"]);
    let (gpu, ctl) = Gpu::fake(256 * MIB, false);
    let mut c = rn.client();
    c.register(&reg_gpu(1)).unwrap();
    c.attach_gpu(&gpu).unwrap();
    let n = c.object_bytes().unwrap();
    let rg = range(&tokens(3, 5));
    let data = payloads(&rg, n as usize);
    let src = upload(&gpu, &data);
    assert_eq!(
        c.store_from_device(1, &rg, &src.chunks(n, 5).unwrap())
            .unwrap(),
        5
    );
    assert!(c.gpu().unwrap().staging_bytes() >= 5 * n);
    assert_eq!(
        ctl.counters().registrations,
        1,
        "the staging buffer is pinned"
    );
    // A local engine reads the same bytes.
    let mut local = rn.node.client();
    local.register(&reg_gpu(2)).unwrap();
    assert!(local.retrieve(2, &rg).unwrap().unwrap() == data);
    // And back into device memory over TCP.
    let dst = gpu.alloc(5 * n).unwrap();
    assert!(c
        .retrieve_to_device(1, &rg, None, &dst.chunks(n, 5).unwrap())
        .unwrap());
    assert!(download(&dst) == data.concat());
    assert_eq!(ctl.counters().pageable_copies, 0);
    // A failed device copy aborts the remote store.
    let rg2 = range(&tokens(4, 2));
    let src2 = upload(&gpu, &payloads(&rg2, n as usize));
    ctl.fail_next_sync();
    assert!(c
        .store_from_device(1, &rg2, &src2.chunks(n, 2).unwrap())
        .is_err());
    assert_eq!(published(&mut local, &tokens(4, 2)), 0);
    // A miss leaves device memory untouched.
    let dst2 = gpu.alloc(2 * n).unwrap();
    let before = download(&dst2);
    assert!(!c
        .retrieve_to_device(1, &rg2, None, &dst2.chunks(n, 2).unwrap())
        .unwrap());
    assert!(download(&dst2) == before);
    assert_clean(&rn.node);
}

#[test]
fn device_paths_without_an_attached_gpu_say_so() {
    let node = NodeProc::start("gpu-none", &["--pool-size", "64MiB"]);
    let (gpu, _) = Gpu::fake(64 * MIB, false);
    let mut c = node.client();
    c.register(&reg_gpu(1)).unwrap();
    let n = c.object_bytes().unwrap();
    let src = gpu.alloc(n).unwrap();
    let rg = range(&tokens(5, 1));
    let e = c
        .store_from_device(1, &rg, &src.chunks(n, 1).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("attach_gpu"), "{e}");
    assert_clean(&node);
}

/// Chunks that are not contiguous in device memory (a paged KV cache: per-layer blocks):
/// gathered into their slots and scattered back, locally and over TCP.
#[test]
fn chunks_made_of_scattered_pieces_are_gathered_and_scattered() {
    let rn = RemoteNode::start("gpu-pieces", &["--pool-size", "64MiB"]);
    let (gpu, _) = Gpu::fake(256 * MIB, false);
    let mut local = rn.node.client();
    local.attach_gpu(&gpu).unwrap();
    local.register(&reg_gpu(1)).unwrap();
    let n = local.object_bytes().unwrap();
    let q = n / 4; // four pieces per chunk
    let rg = range(&tokens(6, 3));
    let data = payloads(&rg, n as usize);
    // Device layout: piece p of chunk c at ((p * 3 + c) * q), i.e. "layer-major".
    let src = gpu.alloc(3 * n).unwrap();
    for (c, d) in data.iter().enumerate() {
        for p in 0..4 {
            let at = (p * 3 + c as u64) * q;
            src.write(at, &d[(p * q) as usize..((p + 1) * q) as usize])
                .unwrap();
        }
    }
    let sp = pieces(&src, q);
    let refs: Vec<&[_]> = sp.iter().map(Vec::as_slice).collect();
    assert_eq!(local.store_from_device_pieces(1, &rg, &refs).unwrap(), 3);
    // The pool holds the chunks contiguous and byte-exact.
    let mut host = rn.node.client();
    host.register(&reg_gpu(2)).unwrap();
    assert!(host.retrieve(2, &rg).unwrap().unwrap() == data);
    // Scattered back (locally and over TCP) into the same layout.
    let mut remote = rn.client();
    remote.register(&reg_gpu(3)).unwrap();
    remote.attach_gpu(&gpu).unwrap();
    for (who, dst) in [
        ("local", gpu.alloc(3 * n).unwrap()),
        ("remote", gpu.alloc(3 * n).unwrap()),
    ] {
        let dp = pieces(&dst, q);
        let refs: Vec<&[_]> = dp.iter().map(Vec::as_slice).collect();
        let hit = if who == "local" {
            local
                .retrieve_to_device_pieces(1, &rg, None, &refs)
                .unwrap()
        } else {
            remote
                .retrieve_to_device_pieces(3, &rg, None, &refs)
                .unwrap()
        };
        assert!(hit);
        assert!(
            download(&dst) == download(&src),
            "{who}: scattered bytes differ"
        );
    }
    // Pieces that do not add up to a chunk are refused before any request.
    let short: Vec<&[_]> = sp.iter().map(|v| &v[..3]).collect();
    let e = local.store_from_device_pieces(1, &rg, &short).unwrap_err();
    assert!(e.to_string().contains("the layout needs"), "{e}");
    // A remote store from pieces, read back locally.
    let rg2 = range(&tokens(8, 3));
    let data2 = payloads(&rg2, n as usize);
    for (c, d) in data2.iter().enumerate() {
        for p in 0..4 {
            src.write(
                (p * 3 + c as u64) * q,
                &d[(p * q) as usize..((p + 1) * q) as usize],
            )
            .unwrap();
        }
    }
    let sp = pieces(&src, q);
    let refs: Vec<&[_]> = sp.iter().map(Vec::as_slice).collect();
    assert_eq!(remote.store_from_device_pieces(3, &rg2, &refs).unwrap(), 3);
    assert!(host.retrieve(2, &rg2).unwrap().unwrap() == data2);
    assert_clean(&rn.node);
}

/// Four pieces per chunk, three chunks, "layer-major": piece p of chunk c at (p * 3 + c) * q.
fn pieces(buf: &DeviceBuffer, q: u64) -> Vec<Vec<kvnode_hw::gpu::DeviceSpan<'_>>> {
    (0..3u64)
        .map(|c| {
            (0..4u64)
                .map(|p| buf.span((p * 3 + c) * q, q).unwrap())
                .collect()
        })
        .collect()
}

/// A wait that cannot even be issued leaves the copies possibly running: the client sends
/// neither abort nor commit (the slots stay reserved, the read locks held) until it is released.
#[test]
fn copies_that_could_not_be_waited_for_keep_their_slots_until_release() {
    let node = NodeProc::start("gpu-poison", &["--pool-size", "64MiB"]);
    let (gpu, ctl) = Gpu::fake(256 * MIB, false);
    let mut c = node.client();
    c.register(&reg_gpu(1)).unwrap();
    c.attach_gpu(&gpu).unwrap();
    let n = c.object_bytes().unwrap();
    let rg = range(&tokens(12, 2));
    let src = upload(&gpu, &payloads(&rg, n as usize));
    ctl.fail_next_wait_issue();
    let e = c
        .store_from_device(1, &rg, &src.chunks(n, 2).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("stay reserved"), "{e}");
    let st = node.status();
    assert_eq!(st["pending_writes"], 1, "the reservation is kept: {st:#}");
    let e = c.store_from_device(1, &range(&tokens(13, 1)), &src.chunks(n, 1).unwrap());
    assert!(e.unwrap_err().to_string().contains("unusable"));
    // A fresh attachment works; a retrieve whose wait cannot be issued keeps its locks.
    c.attach_gpu(&gpu).unwrap();
    let rg2 = range(&tokens(14, 2));
    assert_eq!(
        c.store_from_device(1, &rg2, &src.chunks(n, 2).unwrap())
            .unwrap(),
        2
    );
    let dst = gpu.alloc(2 * n).unwrap();
    ctl.fail_next_wait_issue();
    assert!(c
        .retrieve_to_device(1, &rg2, None, &dst.chunks(n, 2).unwrap())
        .is_err());
    assert_eq!(node.status()["pending_reads"], 1);
    // Releasing the client releases both.
    drop(c);
    node.wait_status("released", |s| {
        s["pending_writes"] == 0 && s["pending_reads"] == 0
    });
    assert_clean(&node);
}
