#!/usr/bin/env bash
# Sets everything up and runs the whole test suite: unit tests (state machines, allocator,
# timer wheel, hashing vectors, frame validation, proptests), hw tests (pool backings, fd
# passing), the deterministic simulator's bounded seed runs (local, LMCache and remote workers,
# the L2 tier; src/sim/, a few seconds each in `cargo test`; scripts/simulate.sh runs many),
# integration tests that start the real kvnode binary and client processes, the GPU paths
# (simulated GPU, and kvnode's CUDA code on a stand-in driver), and a smoke run of the load harness (kvnode-bench --spawn, tiny preset, few ops, every workload;
# bench/tests/smoke.rs asserts `verified` and every documented JSON field).
set -euo pipefail
cd "$(dirname "$0")/.."
KVNODE_HUGEPAGES=${KVNODE_HUGEPAGES:-256} bash scripts/setup.sh
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
# The etcd the cluster tests start: one on the PATH, else the copy setup.sh unpacked.
if [ -z "${KVNODE_ETCD_BIN:-}" ] && ! command -v etcd >/dev/null; then
  case "${CARGO_TARGET_DIR:-target}" in /*) t=$CARGO_TARGET_DIR ;; *) t=$PWD/${CARGO_TARGET_DIR:-target} ;; esac
  [ -x "$t/tools/etcd/usr/bin/etcd" ] && export KVNODE_ETCD_BIN="$t/tools/etcd/usr/bin/etcd"
fi
cargo build --locked --workspace --all-targets
cargo test --locked --workspace -- --test-threads "${KVNODE_TEST_THREADS:-4}"
# The real-GPU tests (ignored above: they need a GPU) against the stand-in CUDA driver built
# from tests/gpu_stub/: keeps those tests and the CUDA code path honest on hosts without a GPU
# (scripts/gpu-check.sh runs them on a real one).
gpu_stub=$(mktemp -d)
trap 'rm -rf "$gpu_stub"' EXIT
bash scripts/gpu-stub.sh "$gpu_stub" -DSTUB_DMABUF
LD_LIBRARY_PATH="$gpu_stub" KVNODE_REQUIRE_GPU=1 cargo test --locked --test gpu_hw -- --ignored
echo "[test] all tests passed"
