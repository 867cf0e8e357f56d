//! kvnode's CUDA implementation (cudarc, dynamic loading) on a host without a GPU, through a
//! stand-in `libcuda.so.1` built from `tests/gpu_stub/libcuda_stub.c`: the probe's answers for
//! a missing library, a missing function, an old driver and no device (a clear error and exit
//! status 4, never a panic), and the client's device paths end to end with the real node,
//! several instances on their own threads (the context is bound per thread: the stub refuses
//! calls without it). The stub copies with memcpy: this proves the logic, not GPU speed.

mod common;

use std::process::Command;

use common::{
    gpu_stub, kvnode_until_exit, payloads, range, reg, spawn_child, tokens, NodeProc, TestDir,
};
use kvnode::protocol::RegisterRequest;
use kvnode_hw::gpu::{Gpu, GpuUnavailable};

fn probe_with(
    dir: &TestDir,
    lib_dir: Option<&std::path::Path>,
) -> (i32, serde_json::Value, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvnode"));
    cmd.args(["gpu", "probe", "--json"]).current_dir(dir.path());
    match lib_dir {
        Some(d) => cmd.env("LD_LIBRARY_PATH", d),
        None => cmd.env_remove("LD_LIBRARY_PATH"),
    };
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("probe JSON ({e}): {stdout:?} {stderr}"));
    (out.status.code().unwrap_or(-1), v, stderr)
}

#[test]
fn the_probe_names_why_no_gpu_can_be_used() {
    let dir = TestDir::new("gpu-probe");
    if kvnode_hw::gpu::probe() == Err(GpuUnavailable::NoDriverLibrary) {
        let (code, v, stderr) = probe_with(&dir, None);
        assert_eq!(code, 4, "{v} {stderr}");
        assert_eq!(v["available"], false);
        assert!(
            v["reason"]
                .as_str()
                .unwrap()
                .contains("libcuda.so.1) was not found"),
            "{v}"
        );
        assert!(stderr.contains("no GPU:"), "{stderr}");
    }
    let cases: [(&str, &[&str], &str); 3] = [
        (
            "missing",
            &["STUB_MISSING_REGISTER"],
            "has no cuMemHostRegister_v2",
        ),
        (
            "old",
            &["STUB_VERSION=11080"],
            "supports CUDA 11.8; kvnode needs 12.0",
        ),
        ("nodev", &["STUB_NO_DEVICE"], "sees no GPU"),
    ];
    for (name, defines, want) in cases {
        let lib = gpu_stub::build(&dir.join(name), defines);
        let (code, v, _) = probe_with(&dir, Some(&lib));
        assert_eq!(code, 4, "{name}: {v}");
        assert!(v["reason"].as_str().unwrap().contains(want), "{name}: {v}");
    }
    for (name, defines, dma_buf) in [
        ("ok", &[][..], false),
        ("dmabuf", &["STUB_DMABUF"][..], true),
    ] {
        let lib = gpu_stub::build(&dir.join(name), defines);
        let (code, v, _) = probe_with(&dir, Some(&lib));
        assert_eq!(code, 0, "{name}: {v}");
        assert_eq!(v["gpus"][0]["name"], "kvnode stub GPU", "{v}");
        assert_eq!(v["gpus"][0]["driver"], "12.8");
        assert_eq!(v["gpus"][0]["dma_buf"], dma_buf, "{v}");
    }
    // The text form too.
    let out = kvnode_until_exit(&dir, &["gpu", "probe"]);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

/// [2 layers, 2, CHUNK, 1024] float32 = 256 KiB objects.
fn reg_gpu(instance_id: u64) -> RegisterRequest {
    RegisterRequest {
        hidden_dim: 1024,
        ..reg(instance_id)
    }
}

#[test]
fn the_cuda_path_runs_end_to_end_on_the_stub_driver() {
    let dir = TestDir::new("gpu-cuda-stub");
    let lib = gpu_stub::build(&dir.join("lib"), &["STUB_DMABUF"]);
    let node = NodeProc::start("gpu-cuda-node", &["--pool-size", "64MiB"]);
    let mut child = spawn_child(
        "cuda_child_role",
        &[
            ("LD_LIBRARY_PATH", lib.display().to_string()),
            ("KVNODE_TEST_SOCKET", node.socket.display().to_string()),
        ],
    );
    let status = child.wait().unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(status.success(), "child failed: {out}");
    assert!(out.contains("CUDA-CHILD-OK"), "{out}");
    let (ok, problems) = node.client().memcheck().unwrap();
    assert!(ok, "{problems:?}");
}

#[test]
#[ignore = "child role, run by the_cuda_path_runs_end_to_end_on_the_stub_driver"]
fn cuda_child_role() {
    let socket = std::env::var("KVNODE_TEST_SOCKET").expect("run by its parent test");
    let gpu = Gpu::open(0).expect("the stub driver is on LD_LIBRARY_PATH");
    assert_eq!(gpu.info().backend, "cuda");
    assert_eq!(gpu.info().name, "kvnode stub GPU");
    std::thread::scope(|s| {
        for inst in 1..=3u64 {
            let (gpu, socket) = (gpu.clone(), socket.clone());
            s.spawn(move || {
                let mut c = kvnode::client::Client::connect(&socket).unwrap();
                c.register(&reg_gpu(inst)).unwrap();
                c.attach_gpu(&gpu).unwrap();
                assert!(c.gpu().unwrap().pool_pinned());
                let n = c.object_bytes().unwrap();
                let rg = range(&tokens(40 + inst as u32, 4));
                let data = payloads(&rg, n as usize);
                let src = gpu.alloc(4 * n).unwrap();
                src.write(0, &data.concat()).unwrap();
                for _ in 0..3 {
                    c.store_from_device(inst, &rg, &src.chunks(n, 4).unwrap())
                        .unwrap();
                    let dst = gpu.alloc(4 * n).unwrap();
                    assert!(c
                        .retrieve_to_device(inst, &rg, None, &dst.chunks(n, 4).unwrap())
                        .unwrap());
                    let mut got = vec![0u8; (4 * n) as usize];
                    dst.read(0, &mut got).unwrap();
                    assert!(got == data.concat(), "instance {inst}: bytes differ");
                }
                let st = c.gpu().unwrap().stats();
                assert_eq!(st.stores, 1, "later stores were deduplicated");
                assert_eq!(st.retrieves, 3);
            });
        }
    });
    assert_eq!(
        gpu.registered_host_ranges(),
        0,
        "every registration ended with its clients"
    );
    // dma-buf export through the driver.
    let buf = gpu.alloc(3 << 20).unwrap();
    let x = gpu.export_dmabuf(&buf).unwrap();
    assert_eq!((x.iova, x.len, x.offset), (buf.ptr(), 3 << 20, 0));
    println!("CUDA-CHILD-OK");
}
