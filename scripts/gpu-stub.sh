#!/usr/bin/env bash
# Builds the stand-in CUDA driver (tests/gpu_stub/libcuda_stub.c) into DIR as libcuda.so.1 and
# libcuda.so: with DIR on LD_LIBRARY_PATH, kvnode's real CUDA code path (and the GPU tests and
# bench) runs on a host without a GPU, with "device memory" in host memory. It proves logic,
# never GPU speed. Usage: scripts/gpu-stub.sh DIR [-DSTUB_DMABUF ...]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: scripts/gpu-stub.sh DIR [-DDEFINE ...]}
shift
mkdir -p "$dir"
cc -shared -fPIC -O2 -pthread -Wall -Werror "$@" -o "$dir/libcuda.so.1" tests/gpu_stub/libcuda_stub.c
ln -sf libcuda.so.1 "$dir/libcuda.so"
