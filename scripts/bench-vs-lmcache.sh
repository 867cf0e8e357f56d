#!/usr/bin/env bash
# Side by side with LMCache: the same client (LMCache's own engine-driven SHM client, through
# shared/peer/lmcache_driver.py), the same workload and pool size, run against LMCache's own
# server and against `kvnode lmcache-server`, one after the other in one invocation (server on
# CPU 0, driver on CPU 1). Working sets stay under 70 % of the 2 GiB pool. Prints per-call
# latency percentiles and GB/s of both and their ratios; raw JSON in target/bench-vs-lmcache/.
#
# Usage: scripts/bench-vs-lmcache.sh [--version 0.5.6] [--reps 3]
# Opt-in (installs LMCache, ~6 GB, on first use via scripts/lmcache-compat.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.5.6
REPS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --version) VERSION=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
out=target/bench-vs-lmcache
mkdir -p "$out"
rm -f "$out"/*.json

# name | driver arguments (chunk = 2 x layers x 256 tokens x hidden x bf16)
configs=(
  "1MiB-x4|--layers 4 --hidden 256 --chunks 4 --requests 40 --warmup 4 --pings 500"
  "32MiB-x2|--layers 32 --hidden 1024 --chunks 2 --requests 16 --warmup 2 --pings 200"
)
for entry in "${configs[@]}"; do
  name=${entry%%|*}
  args=${entry#*|}
  for r in $(seq 1 "$REPS"); do
    for server in lmcache kvnode; do
      echo "== $name $server run $r" >&2
      # shellcheck disable=SC2086
      bash scripts/lmcache-compat.sh --server "$server" --version "$VERSION" --port 5557 --pin -- \
        $args > "$out/$name.$server.$r.log" 2>&1 \
        || { tail -30 "$out/$name.$server.$r.log" >&2; exit 1; }
      cp "target/lmcache-compat/$server-$VERSION-5557.driver.json" "$out/$name.$server.$r.json"
      if [ "$server" = kvnode ]; then
        grep "server-side time" "target/lmcache-compat/kvnode-$VERSION-5557.server.log" \
          | sed 's/\x1b\[[0-9;]*m//g' > "$out/$name.kvnode.$r.servertime" || true
      fi
    done
  done
done

python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {}
for f in glob.glob(os.path.join(out, "*.json")):
    name, server, _ = os.path.basename(f).rsplit(".", 3)[:3]
    runs.setdefault(name, {}).setdefault(server, []).append(json.load(open(f)))
steps = [("noop_rtt", "noop (ping floor)"), ("store_prepare", "prepare_store"), ("store_commit", "commit_store"),
         ("retrieve_lookup_wait", "lookup + wait"), ("retrieve_prepare", "prepare_retrieve"),
         ("retrieve_commit", "commit_retrieve"), ("end_session", "end_session"),
         ("store", "store end to end"), ("retrieve", "retrieve end to end"),
         ("store_copy", "client copy into SHM"), ("retrieve_copy", "client copy out of SHM")]
def med(rs, step, field):
    vals = [r[step][field] for r in rs if r[step].get(field) not in (None, "")]
    return statistics.median(vals) if vals else float("nan")
for name, by in sorted(runs.items()):
    lm, kv = by.get("lmcache", []), by.get("kvnode", [])
    print(f"\n### {name} ({lm[0]['chunk_MiB'] if lm else '?'} MiB chunks x {lm[0]['chunks_per_op'] if lm else '?'} per op), medians of {len(kv)} runs\n")
    print("| call | LMCache p50 / p99 ms | kvnode p50 / p99 ms | p50 ratio | p99 ratio | LMCache GB/s | kvnode GB/s |")
    print("|---|---|---|---|---|---|---|")
    for step, label in steps:
        a50, a99, b50, b99 = med(lm, step, "p50_ms"), med(lm, step, "p99_ms"), med(kv, step, "p50_ms"), med(kv, step, "p99_ms")
        ga, gb = med(lm, step, "GBps"), med(kv, step, "GBps")
        gs = lambda g: "" if g != g else f"{g:.2f}"
        print(f"| {label} | {a50:.3f} / {a99:.3f} | {b50:.3f} / {b99:.3f} | {a50/b50:.1f}x | {a99/b99:.1f}x | {gs(ga)} | {gs(gb)} |")
    ok = all(r["verified"] and r["byte_mismatches"] == 0 for r in lm + kv)
    print(f"\nverified on both servers: {ok}")
    st = sorted(glob.glob(os.path.join(out, f"{name}.kvnode.*.servertime")))
    if st:
        print("\nkvnode's own time per call (server side: decode + execute + queue reply), last run:")
        for line in open(st[-1]):
            parts = dict(p.split("=", 1) for p in line.split() if "=" in p)
            print(f"- {parts.get('op')}: mean {float(parts.get('mean_us', 'nan')):.1f} us, max {float(parts.get('max_us', 'nan')):.1f} us over {parts.get('calls')} calls")
PY
