#!/usr/bin/env bash
# Paired A/B of two node binaries under the same harness, interleaved run by run, so both see
# the same machine (this VM's syscall and memcpy speeds drift between sessions by 3-4x, which
# makes figures from different days incomparable). Prints, per configuration, the median of each
# binary's ratios to its own same-run baselines, and B/A.
#
# Usage: scripts/bench-ab.sh OLD_KVNODE NEW_KVNODE      RUNS=3 DURATION=3 ONLY="names..."
set -euo pipefail
cd "$(dirname "$0")/.."
A=${1:?old kvnode binary}
B=${2:?new kvnode binary}
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --release --locked -p kvnode-bench >&2
RUNS=${RUNS:-3}
DURATION=${DURATION:-3}
out=target/bench-ab
mkdir -p "$out"
rm -f "$out"/*.json
matrix=(
  "tiny-store-1|--preset tiny --workload store --instances 1 --pool-size 512MiB"
  "tiny-retrieve-1|--preset tiny --workload retrieve --instances 1 --pool-size 512MiB"
  "tiny-multiturn-1|--preset tiny --workload multiturn --instances 1 --pool-size 512MiB"
  "tiny-store-2|--preset tiny --workload store --instances 2 --pool-size 512MiB"
  "qwen-store-1|--preset qwen2.5-0.5b --workload store --instances 1 --pool-size 512MiB --no-verify"
  "qwen-retrieve-1|--preset qwen2.5-0.5b --workload retrieve --instances 1 --pool-size 512MiB --no-verify"
  "llama-store-1|--preset llama3-8b --workload store --instances 1 --pool-size 768MiB --no-verify"
  "llama-retrieve-1|--preset llama3-8b --workload retrieve --instances 1 --pool-size 768MiB --no-verify"
  "llama-retrieve-2|--preset llama3-8b --workload retrieve --instances 2 --pool-size 768MiB --no-verify"
)
for entry in "${matrix[@]}"; do
  name=${entry%%|*}
  args=${entry#*|}
  # ONLY="a b": run just these configurations.
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
  for r in $(seq 1 "$RUNS"); do
    for side in A B; do
      bin=$A; [ "$side" = B ] && bin=$B
      echo "== $name run $r ($side)" >&2
      # shellcheck disable=SC2086
      target/release/kvnode-bench --spawn --node-bin "$bin" $args --duration "$DURATION" \
        --warmup 20 --json "$out/$name.$side.$r.json" > "$out/$name.$side.$r.txt" 2>&1 \
        || { cat "$out/$name.$side.$r.txt" >&2; exit 1; }
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {}
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    name, side, _ = os.path.basename(f).rsplit(".", 3)[:3]
    runs.setdefault(name, {}).setdefault(side, []).append(json.load(open(f)))
def med(rs, f):
    return statistics.median(f(r) for r in rs)
print("| config | metric | A | B | B/A |")
print("|---|---|---|---|---|")
for name, sides in runs.items():
    wl = sides["A"][0]["workload"]
    main = {"store": "store", "retrieve": "retrieve", "multiturn": "lookup"}[wl]
    rows = [
        ("ops/s", lambda r: r["ops_per_sec"]),
        (f"{main} p50 / uds floor", lambda r: r["latency_us"][main]["p50"] / r["uds_pingpong_p50_us"]),
        ("ping p50 / uds floor", lambda r: r["latency_us"]["ping"]["p50"] / r["uds_pingpong_p50_us"]),
    ]
    if sides["A"][0]["chunk_bytes"] >= 1 << 20:
        key = "store_vs_memcpy" if wl == "store" else "retrieve_vs_memcpy"
        rows.append((key, lambda r, k=key: r[k]))
    for label, f in rows:
        a, b = med(sides["A"], f), med(sides["B"], f)
        print(f"| {name} | {label} | {a:.3g} | {b:.3g} | {b / a:.2f} |")
PY
