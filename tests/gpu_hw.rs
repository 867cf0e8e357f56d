//! The client's GPU paths on a real GPU (CUDA through cudarc) with the real node. Ignored by a
//! plain `cargo test` (they need a GPU and fail without one): `scripts/gpu-check.sh` runs them
//! on a machine with an NVIDIA GPU, and `scripts/test.sh` runs them against the stand-in driver
//! (tests/gpu_stub/) to keep the tests themselves honest on hosts without one. The same paths
//! also run through the simulated GPU (tests/gpu.rs).

mod common;

use common::remote::RemoteNode;
use common::{payloads, range, reg, tokens, NodeProc};
use kvnode::protocol::RegisterRequest;
use kvnode_hw::gpu::{DeviceBuffer, Gpu};

fn gpu() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("this test needs a GPU: {e}"))
}

/// [32 layers, 2, CHUNK, 1024] bfloat16 = 2 MiB objects (llama3-8b's shape per 16 tokens).
fn reg_llama(instance_id: u64) -> RegisterRequest {
    RegisterRequest {
        num_layers: 32,
        hidden_dim: 1024,
        dtype: "bfloat16".into(),
        ..reg(instance_id)
    }
}

fn download(dev: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; dev.len() as usize];
    dev.read(0, &mut out).unwrap();
    out
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh (real) and scripts/test.sh (stand-in driver)"]
fn a_real_gpu_stores_and_retrieves_through_the_node() {
    let gpu = gpu();
    eprintln!("GPU: {:?}", gpu.info());
    let node = NodeProc::start("gpu-hw", &["--pool-size", "1GiB"]);
    std::thread::scope(|s| {
        for inst in 1..=4u64 {
            let (gpu, node) = (gpu.clone(), &node);
            s.spawn(move || {
                let mut c = node.client();
                c.register(&reg_llama(inst)).unwrap();
                c.attach_gpu(&gpu).unwrap();
                assert!(c.gpu().unwrap().pool_pinned());
                let n = c.object_bytes().unwrap();
                for round in 0..4u32 {
                    let rg = range(&tokens(inst as u32 * 100 + round, 8));
                    let data = payloads(&rg, n as usize);
                    let src = gpu.alloc(8 * n).unwrap();
                    src.write(0, &data.concat()).unwrap();
                    assert_eq!(
                        c.store_from_device(inst, &rg, &src.chunks(n, 8).unwrap())
                            .unwrap(),
                        8
                    );
                    let dst = gpu.alloc(8 * n).unwrap();
                    assert!(c
                        .retrieve_to_device(inst, &rg, None, &dst.chunks(n, 8).unwrap())
                        .unwrap());
                    assert!(
                        download(&dst) == data.concat(),
                        "instance {inst} round {round}"
                    );
                }
                assert!(gpu.registered_host_ranges() >= 1);
            });
        }
    });
    assert_eq!(
        gpu.registered_host_ranges(),
        0,
        "registration ended with the clients"
    );
    let (ok, problems) = node.client().memcheck().unwrap();
    assert!(ok, "{problems:?}");
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh (real) and scripts/test.sh (stand-in driver)"]
fn a_real_gpu_stages_remote_transfers_through_pinned_memory() {
    let gpu = gpu();
    let rn = RemoteNode::start("gpu-hw-remote", &["--pool-size", "512MiB"]);
    let mut c = rn.client();
    c.register(&reg_llama(1)).unwrap();
    c.attach_gpu(&gpu).unwrap();
    let n = c.object_bytes().unwrap();
    let rg = range(&tokens(7, 6));
    let data = payloads(&rg, n as usize);
    let src = gpu.alloc(6 * n).unwrap();
    src.write(0, &data.concat()).unwrap();
    assert_eq!(
        c.store_from_device(1, &rg, &src.chunks(n, 6).unwrap())
            .unwrap(),
        6
    );
    let dst = gpu.alloc(6 * n).unwrap();
    assert!(c
        .retrieve_to_device(1, &rg, None, &dst.chunks(n, 6).unwrap())
        .unwrap());
    assert!(download(&dst) == data.concat());
    let mut local = rn.node.client();
    local.register(&reg_llama(2)).unwrap();
    assert!(local.retrieve(2, &rg).unwrap().unwrap() == data);
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh (real) and scripts/test.sh (stand-in driver)"]
fn a_real_gpu_exports_dmabuf_when_it_says_it_can() {
    let gpu = gpu();
    let buf = gpu.alloc(64 << 20).unwrap();
    match gpu.export_dmabuf(&buf) {
        Ok(x) => {
            assert!(gpu.info().dma_buf);
            assert_eq!((x.iova, x.len, x.offset), (buf.ptr(), 64 << 20, 0));
            assert_eq!(x.window_start % 4096, 0);
            eprintln!("dma-buf export: window {} bytes", x.window_len);
            // An allocation whose size is not a page multiple exports too.
            let odd = gpu.alloc((3 << 20) + 100).unwrap();
            let y = gpu.export_dmabuf(&odd).unwrap();
            assert_eq!(y.window_len % 4096, 0);
            assert!(y.window_len >= odd.len());
        }
        Err(e) => {
            assert!(
                !gpu.info().dma_buf,
                "the device claims dma-buf support but: {e}"
            );
            eprintln!("no dma-buf on this device/driver: {e}");
        }
    }
}
