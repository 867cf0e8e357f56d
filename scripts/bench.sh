#!/usr/bin/env bash
# The benchmark matrix behind PERFORMANCE.md: each configuration runs RUNS times (default 3)
# against a fresh private node (--spawn); the summary prints medians across runs, with the
# same-run baselines (memcpy over the same page backing, bare Unix-socket ping-pong) and the
# ratios. Raw JSON of every run lands in target/bench/.
#
# Goodput rows of the large presets run with --no-verify; the harness excludes its own work
# (verifying retrieved bytes, generating payloads) from the measured time either way, and one
# verified row shows that verifying every byte leaves the figures intact.
#
# Usage: scripts/bench.sh [quick]     RUNS=5 DURATION=5 scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --release --locked -p kvnode -p kvnode-bench
RUNS=${RUNS:-3}
DURATION=${DURATION:-3}
out=target/bench
mkdir -p "$out"
rm -f "$out"/*.json

# name | kvnode-bench arguments
matrix=(
  "tiny-store-1|--preset tiny --workload store --instances 1 --pool-size 512MiB"
  "tiny-retrieve-1|--preset tiny --workload retrieve --instances 1 --pool-size 512MiB"
  "tiny-multiturn-1|--preset tiny --workload multiturn --instances 1 --pool-size 512MiB"
  "tiny-store-2|--preset tiny --workload store --instances 2 --pool-size 512MiB"
  "tiny-store-8|--preset tiny --workload store --instances 8 --pool-size 512MiB"
  "qwen-store-1|--preset qwen2.5-0.5b --workload store --instances 1 --pool-size 512MiB --no-verify"
  "qwen-retrieve-1|--preset qwen2.5-0.5b --workload retrieve --instances 1 --pool-size 512MiB --no-verify"
  "llama-store-1|--preset llama3-8b --workload store --instances 1 --pool-size 768MiB --no-verify"
  "llama-retrieve-1|--preset llama3-8b --workload retrieve --instances 1 --pool-size 768MiB --no-verify"
  "llama-retrieve-2|--preset llama3-8b --workload retrieve --instances 2 --pool-size 768MiB --no-verify"
  "llama-retrieve-1-verified|--preset llama3-8b --workload retrieve --instances 1 --pool-size 768MiB"
  "llama-mixed-1|--preset llama3-8b --workload mixed --hit-ratio 0.5 --instances 1 --pool-size 768MiB --working-set 2.0 --no-verify"
)
if [ "${1:-}" = quick ]; then matrix=("${matrix[@]:0:2}"); RUNS=1; fi

for entry in "${matrix[@]}"; do
  name=${entry%%|*}
  args=${entry#*|}
  for r in $(seq 1 "$RUNS"); do
    echo "== $name run $r" >&2
    # shellcheck disable=SC2086
    target/release/kvnode-bench --spawn $args --duration "$DURATION" --warmup 20 \
      --json "$out/$name.$r.json" > "$out/$name.$r.txt" 2>&1 || { cat "$out/$name.$r.txt" >&2; exit 1; }
  done
done

python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {}
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    name = os.path.basename(f).rsplit(".", 2)[0]
    runs.setdefault(name, []).append(json.load(open(f)))
def med(rs, *path):
    vals = []
    for r in rs:
        v = r
        for p in path:
            v = v[p]
        vals.append(v)
    return statistics.median(vals), (max(vals) - min(vals)) / statistics.median(vals) if statistics.median(vals) else 0.0
print("| config | backing | chunk | ops/s | main op p50 / p99 (us) | ping p50 (us) | uds floor p50 (us) | store GB/s (x memcpy) | retrieve GB/s (x memcpy) | memcpy w/r GB/s | fairness | verified | spread |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for name, rs in runs.items():
    wl = rs[0]["workload"]
    main = {"store": "store", "retrieve": "retrieve", "mixed": "retrieve", "multiturn": "lookup"}[wl]
    ops, spread = med(rs, "ops_per_sec")
    p50, _ = med(rs, "latency_us", main, "p50")
    p99, _ = med(rs, "latency_us", main, "p99")
    ping, _ = med(rs, "latency_us", "ping", "p50")
    floor, _ = med(rs, "uds_pingpong_p50_us")
    sg, _ = med(rs, "store_gbps"); sr, _ = med(rs, "store_vs_memcpy")
    rg, _ = med(rs, "retrieve_gbps"); rr, _ = med(rs, "retrieve_vs_memcpy")
    fair, _ = med(rs, "fairness_min_over_mean")
    chunk = rs[0]["chunk_bytes"]
    chunk_s = f"{chunk >> 20} MiB" if chunk >= 1 << 20 else f"{chunk >> 10} KiB"
    mw, _ = med(rs, "memcpy_gbps"); mr, _ = med(rs, "memcpy_read_gbps")
    ver = all(r["verified"] for r in rs)
    print(f"| {name} | {rs[0]['pool_backing']} | {chunk_s} | {ops:.0f} | {main} {p50:.1f} / {p99:.1f} | {ping:.1f} | {floor:.1f} | {sg:.2f} ({sr:.2f}) | {rg:.2f} ({rr:.2f}) | {mw:.1f} / {mr:.1f} | {fair:.2f} | {'yes' if ver else 'no'} | {100*spread:.0f}% |")
print()
print("Control calls (median of runs, p50 / p99 us):")
for name, rs in runs.items():
    parts = []
    for op in ["prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve", "lookup"]:
        if rs[0]["latency_us"][op]["count"]:
            a, _ = med(rs, "latency_us", op, "p50"); b, _ = med(rs, "latency_us", op, "p99")
            parts.append(f"{op} {a:.1f}/{b:.1f}")
    print(f"- {name}: " + ", ".join(parts))
PY
