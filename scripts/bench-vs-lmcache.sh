#!/usr/bin/env bash
# Side by side with LMCache: the same client (LMCache's own engine-driven SHM client, through
# shared/peer/lmcache_driver.py), the same workload and pool size, run against LMCache's own
# server and against `kvnode lmcache-server`, one after the other in one invocation (server on
# CPU 0, driver on CPU 1). Working sets stay under 70 % of the 2 GiB pool. Prints per-call
# latency percentiles and GB/s of both and their ratios; raw JSON in target/bench-vs-lmcache/.
# Then the same two servers again under the Rust LMCache-wire load generator (`kvnode-bench
# lmcache`: a DEALER with the real client's frames, no Python overhead), alternating servers in
# every repetition: per call the server cost (wire time minus the NOOP wire floor) at p50 and p99,
# LMCache's over kvnode's, and whether issue 12's target (kvnode at least 5x lower) is met;
# store/retrieve GB/s. JSON in target/bench-vs-lmcache/rust.*.json.
#
# Usage: scripts/bench-vs-lmcache.sh [--version 0.5.6] [--reps 3] [--rust-only] [--rust-ops 1000]
#                                  [--venv DIR]   (default target/lmcache-venv-VERSION)
# Opt-in (installs LMCache, ~6 GB, on first use via scripts/lmcache-compat.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.5.6
VENV=""
REPS=3
RUST_ONLY=0
RUST_OPS=1000
while [ $# -gt 0 ]; do
  case "$1" in
    --version) VERSION=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --rust-only) RUST_ONLY=1; shift ;;
    --rust-ops) RUST_OPS=$2; shift 2 ;;
    --venv) VENV=$2; shift 2 ;;
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
[ "$RUST_ONLY" = 1 ] && configs=()
for entry in "${configs[@]}"; do
  name=${entry%%|*}
  args=${entry#*|}
  for r in $(seq 1 "$REPS"); do
    for server in lmcache kvnode; do
      echo "== $name $server run $r" >&2
      # shellcheck disable=SC2086
      bash scripts/lmcache-compat.sh --server "$server" --version "$VERSION" --port 5557 --pin \
        ${VENV:+--venv "$VENV"} -- \
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

[ "$RUST_ONLY" = 1 ] || python3 - "$out" <<'PY'
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

# ---------------------------------------------------------------------------------------------
# The Rust LMCache-wire load generator against both servers (server on CPU 0, bench on CPU 1).
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
TARGET=${CARGO_TARGET_DIR:-target}
cargo build --release --locked -p kvnode -p kvnode-bench >&2
VENV=${VENV:-target/lmcache-venv-$VERSION}
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PYTHONWARNINGS=ignore
PIN_S=(); PIN_B=()
if command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then PIN_S=(taskset -c 0); PIN_B=(taskset -c 1); fi
RPORT=5567
SPID=""
stop_rust_server() {
  [ -n "$SPID" ] || return 0
  kill -TERM "$SPID" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$SPID" 2>/dev/null || true
  wait "$SPID" 2>/dev/null || true
  SPID=""
}
trap 'stop_rust_server' EXIT
start_rust_server() { # $1 = lmcache|kvnode, log in $out/rust.$1.server.log
  if [ "$1" = lmcache ]; then
    "${PIN_S[@]}" "$VENV/bin/python" -m lmcache.v1.multiprocess.server --host 127.0.0.1 --port "$RPORT" \
      --chunk-size 256 --supported-transfer-mode engine_driven --l1-size-gb 2 --eviction-policy LRU \
      --shm-name "rust$RPORT" --no-l1-use-lazy --prometheus-port $((RPORT + 1000)) --disable-metrics \
      > "$out/rust.lmcache.server.log" 2>&1 &
  else
    rm -f "$out/rust.sock"
    "${PIN_S[@]}" "$TARGET/release/kvnode" lmcache-server --host 127.0.0.1 --port "$RPORT" \
      --chunk-size 256 --l1-size-gb 2 --shm-name "rust$RPORT" --supported-transfer-mode engine_driven \
      --socket "$out/rust.sock" >> "$out/rust.kvnode.server.log" 2>&1 &
  fi
  SPID=$!
  for _ in $(seq 1 1200); do
    (echo > /dev/tcp/127.0.0.1/$RPORT) 2>/dev/null && return 0
    kill -0 "$SPID" 2>/dev/null || { tail -20 "$out/rust.$1.server.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "$1 server not listening on $RPORT" >&2; exit 1
}
: > "$out/rust.kvnode.server.log"
# preset | bench arguments: small chunks for many control calls, llama3-8b (32 MiB chunks x 4,
# as the Python side) for GB/s; both stay under 70 % of the 2 GiB pool.
rust_configs=(
  "tiny|--preset tiny --ops $RUST_OPS --warmup 20 --pings 2000"
  "llama3-8b|--preset llama3-8b --ops 8 --warmup 2 --pings 200"
)
for entry in "${rust_configs[@]}"; do
  name=${entry%%|*}
  args=${entry#*|}
  for r in $(seq 1 "$REPS"); do
    for server in lmcache kvnode; do
      echo "== rust bench $name $server run $r" >&2
      start_rust_server "$server"
      # shellcheck disable=SC2086
      "${PIN_B[@]}" "$TARGET/release/kvnode-bench" lmcache --url "tcp://127.0.0.1:$RPORT" $args \
        --json "$out/rust.$name.$server.$r.json" > "$out/rust.$name.$server.$r.log" 2>&1 \
        || { tail -30 "$out/rust.$name.$server.$r.log" >&2; exit 1; }
      stop_rust_server
    done
  done
done

python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {}
for f in glob.glob(os.path.join(out, "rust.*.json")):
    name, server, _ = os.path.basename(f)[5:-5].rsplit(".", 2)
    runs.setdefault(name, {}).setdefault(server, []).append(json.load(open(f)))
calls = ["ping", "prepare_store", "commit_store", "lookup", "wait_prefetch", "lookup_wait",
         "prepare_retrieve", "commit_retrieve", "end_session"]
def med(rs, *path):
    vals = []
    for r in rs:
        v = r
        for p in path:
            v = v.get(p, {}) if isinstance(v, dict) else {}
        if isinstance(v, (int, float)):
            vals.append(v)
    return statistics.median(vals) if vals else float("nan")
def ratio(a, b):
    if b != b or a != a:
        return "?", False
    if b <= 1.0:  # at the NOOP floor (within 1 us, or below it: noise)
        return f"kvnode at floor ({b:.1f} us)", a >= 5.0
    return f"{a / b:.1f}x", a >= 5 * b
for name, by in sorted(runs.items()):
    lm, kv = by.get("lmcache", []), by.get("kvnode", [])
    if not lm or not kv:
        continue
    print(f"\n### Rust LMCache-wire bench, {name} ({lm[0]['chunk_bytes'] >> 10} KiB chunks x {lm[0]['chunks_per_op']} per op, "
          f"{lm[0]['ops']} ops), medians of {len(lm)} / {len(kv)} runs\n")
    print(f"NOOP wire floor p50 / p99: LMCache {med(lm, 'noop_floor_us', 'p50'):.1f} / {med(lm, 'noop_floor_us', 'p99'):.1f} us, "
          f"kvnode {med(kv, 'noop_floor_us', 'p50'):.1f} / {med(kv, 'noop_floor_us', 'p99'):.1f} us\n")
    if lm[0]["ops"] < 100:
        print("(too few calls for percentiles: this preset is for GB/s)")
    else:
        print("| call | LMCache cost p50 / p99 us | kvnode cost p50 / p99 us | ratio p50 | ratio p99 | target 5x |")
        print("|---|---|---|---|---|---|")
    for c in (calls if lm[0]["ops"] >= 100 else []):
        a50, a99 = med(lm, "server_cost_us", c, "p50"), med(lm, "server_cost_us", c, "p99")
        b50, b99 = med(kv, "server_cost_us", c, "p50"), med(kv, "server_cost_us", c, "p99")
        r50, ok50 = ratio(a50, b50)
        r99, ok99 = ratio(a99, b99)
        verdict = "met" if ok50 and ok99 else ("missed (p99)" if ok50 else ("missed (p50)" if ok99 else "missed"))
        print(f"| {c} | {a50:.1f} / {a99:.1f} | {b50:.1f} / {b99:.1f} | {r50} | {r99} | {verdict} |")
    print(f"\nstore GB/s: LMCache {med(lm, 'store_GBps'):.2f}, kvnode {med(kv, 'store_GBps'):.2f}; "
          f"retrieve GB/s: LMCache {med(lm, 'retrieve_GBps'):.2f}, kvnode {med(kv, 'retrieve_GBps'):.2f}")
    print(f"verified on both servers: {all(r['verified'] for r in lm + kv)}")
PY
