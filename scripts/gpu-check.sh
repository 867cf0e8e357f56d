#!/usr/bin/env bash
# GPU verification, one prepared run on a machine with an NVIDIA GPU (see PERFORMANCE.md,
# "GPU memory"). Steps, each writing under OUT (default target/gpu-check/out):
#   1. probe.json    `kvnode gpu probe --json` (and nvidia-smi's view when it exists)
#   2. tests.log     the real-GPU tests (tests/gpu_hw.rs) against the real driver
#   3. gpu-*.json    `kvnode-bench --gpu`: llama3-8b chunks with 1, 2 and 4 instances (one CUDA
#                    stream each) and qwen2.5-0.5b chunks with 1, each next to the raw
#                    registered / pageable copies of the same size measured in the same run
#   4. cpu-*.json    the CPU bench matrix on this machine's cores: instances 1, 2, 4, 8
#   5. summary.json  the figures of every run in one object (printed at the end)
# Binaries: built here with cargo (release), or, with --prebuilt DIR, taken from DIR, made on a
# build host by `scripts/gpu-check.sh --prepare DIR` (for a GPU machine without cargo or
# network; DIR also holds the shared libraries they need beyond glibc).
# Options: --out DIR, --prebuilt DIR, --prepare DIR, --quick (shorter runs), --secs N.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-check/out
prebuilt=""
prepare=""
secs=3
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --prebuilt) prebuilt=$2; shift 2 ;;
    --prepare) prepare=$2; shift 2 ;;
    --quick) secs=1; shift ;;
    --secs) secs=$2; shift 2 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
log() { echo "[gpu-check] $*" >&2; }
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi

test_binary() { # prints the path of the release gpu_hw test binary
  cargo test --release --locked --test gpu_hw --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_hw":
        print(m["executable"])' | tail -1
}

if [ -n "$prepare" ]; then
  log "building release binaries and the GPU test binary into $prepare"
  cargo build --release --locked -p kvnode -p kvnode-bench --bins
  t=$(test_binary)
  [ -n "$t" ] || { echo "gpu-check: no gpu_hw test binary" >&2; exit 1; }
  mkdir -p "$prepare/lib"
  cp target/release/kvnode target/release/kvnode-bench "$prepare/"
  cp "$t" "$prepare/gpu_hw"
  strip "$prepare/kvnode" "$prepare/kvnode-bench" "$prepare/gpu_hw"
  # Shared libraries beyond glibc and libgcc (rdma-core, libnl, libstdc++).
  ldd "$prepare/kvnode" "$prepare/gpu_hw" | awk '/=> \//{print $3}' | sort -u \
    | grep -v -E '/(libc|libm|libgcc_s|libpthread|libdl|librt)\.so' \
    | while read -r l; do cp -L "$l" "$prepare/lib/"; done
  du -sh "$prepare"
  exit 0
fi

mkdir -p "$out"
if [ -n "$prebuilt" ]; then
  bin=$(cd "$prebuilt" && pwd)
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$bin/lib"
  kvnode=$bin/kvnode; bench=$bin/kvnode-bench; tests=$bin/gpu_hw
else
  log "building (release)"
  cargo build --release --locked -p kvnode -p kvnode-bench --bins
  kvnode=$PWD/target/release/kvnode; bench=$PWD/target/release/kvnode-bench; tests=$(test_binary)
fi

log "1. probe"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L > "$out/nvidia-smi.txt" 2>&1 || true; fi
if ! "$kvnode" gpu probe --json > "$out/probe.json"; then
  cat "$out/probe.json" >&2
  echo "gpu-check: no usable GPU here (see $out/probe.json)" >&2
  exit 4
fi
cat "$out/probe.json"

log "2. real-GPU tests"
status=0
KVNODE_BIN=$kvnode KVNODE_REQUIRE_GPU=1 "$tests" --ignored --test-threads 1 > "$out/tests.log" 2>&1 \
  || status=$?
tail -5 "$out/tests.log"
[ "$status" = 0 ] || log "GPU tests FAILED (status $status): $out/tests.log"

cores=$(nproc)
pool=$(( $(awk '/MemAvailable/{print $2}' /proc/meminfo) / 1024 / 1024 / 4 ))
[ "$pool" -gt 24 ] && pool=24
[ "$pool" -lt 2 ] && pool=2
log "3. GPU bench (pool ${pool} GiB, ${secs}s per phase)"
gpu_run() { # name preset instances
  "$bench" --spawn --node-bin "$kvnode" --pool-size "${pool}GiB" --gpu --preset "$2" \
    --instances "$3" --gpu-batch 4 --duration "$secs" --warmup 2 --baseline-secs 1 \
    --json "$out/gpu-$1.json" 2>&1 | tee "$out/gpu-$1.log" | tail -5 || status=1
}
gpu_run llama-1 llama3-8b 1
gpu_run llama-2 llama3-8b 2
gpu_run llama-4 llama3-8b 4
gpu_run qwen-1 qwen2.5-0.5b 1

log "4. CPU bench matrix ($cores cores)"
for n in 1 2 4 8; do
  "$bench" --spawn --node-bin "$kvnode" --pool-size "${pool}GiB" --preset llama3-8b \
    --workload mixed --instances "$n" --duration "$secs" --baseline-secs 1 \
    --json "$out/cpu-$n.json" > "$out/cpu-$n.log" 2>&1 || status=1
  tail -3 "$out/cpu-$n.log"
done

log "5. summary"
python3 - "$out" "$cores" <<'PY'
import glob, json, os, sys
out, cores = sys.argv[1], int(sys.argv[2])
s = {"probe": json.load(open(os.path.join(out, "probe.json"))), "cores": cores, "gpu": {}, "cpu": {}}
keys = ["gpu", "instances", "chunk_bytes", "gpu_store_gbps", "gpu_retrieve_gbps",
        "raw_registered_d2h_gbps", "raw_registered_h2d_gbps", "raw_pageable_d2h_gbps",
        "raw_pageable_h2d_gbps", "gpu_store_vs_raw", "gpu_retrieve_vs_raw", "verified"]
for f in sorted(glob.glob(os.path.join(out, "gpu-*.json"))):
    j = json.load(open(f))
    s["gpu"][os.path.basename(f)[4:-5]] = {k: j.get(k) for k in keys}
for f in sorted(glob.glob(os.path.join(out, "cpu-*.json"))):
    j = json.load(open(f))
    s["cpu"][os.path.basename(f)[4:-5]] = {k: j.get(k) for k in [
        "instances", "ops_per_sec", "store_gbps", "retrieve_gbps", "memcpy_gbps",
        "store_vs_memcpy", "retrieve_vs_memcpy", "verified"]}
json.dump(s, open(os.path.join(out, "summary.json"), "w"), indent=1)
for name, g in s["gpu"].items():
    print(f"gpu {name:8} store {g['gpu_store_gbps']:.1f} GB/s ({g['gpu_store_vs_raw']:.3f} of raw "
          f"{g['raw_registered_d2h_gbps']:.1f}), retrieve {g['gpu_retrieve_gbps']:.1f} GB/s "
          f"({g['gpu_retrieve_vs_raw']:.3f} of raw {g['raw_registered_h2d_gbps']:.1f}); pageable "
          f"{g['raw_pageable_d2h_gbps']:.1f}/{g['raw_pageable_h2d_gbps']:.1f}; verified {g['verified']}")
base = s["cpu"].get("1", {}).get("ops_per_sec") or 0
for name, c in sorted(s["cpu"].items(), key=lambda x: int(x[0])):
    scale = (c["ops_per_sec"] or 0) / base if base else 0
    print(f"cpu instances {name:>2}: {c['ops_per_sec']:.0f} ops/s ({scale:.2f}x of 1), store "
          f"{c['store_gbps']:.1f} GB/s, retrieve {c['retrieve_gbps']:.1f} GB/s, verified {c['verified']}")
PY
log "done: $out (status $status)"
exit "$status"
