//! Builds the stand-in CUDA driver (`tests/gpu_stub/libcuda_stub.c`) so tests run kvnode's real
//! CUDA code on hosts without a GPU.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Compiles the stub with `defines` (e.g. `"STUB_DMABUF"`) into `dir` as `libcuda.so.1` (and
/// `libcuda.so`); returns `dir`, to put on `LD_LIBRARY_PATH`.
pub fn build(dir: &Path, defines: &[&str]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gpu_stub/libcuda_stub.c");
    let lib = dir.join("libcuda.so.1");
    let mut cc = Command::new("cc");
    cc.args([
        "-shared", "-fPIC", "-O1", "-pthread", "-Wall", "-Werror", "-o",
    ])
    .arg(&lib)
    .arg(&src);
    for d in defines {
        cc.arg(format!("-D{d}"));
    }
    let out = cc
        .output()
        .expect("cc (scripts/setup.sh installs build-essential)");
    assert!(
        out.status.success(),
        "building the stub driver failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let link = dir.join("libcuda.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("libcuda.so.1", &link).unwrap();
    dir.to_path_buf()
}
