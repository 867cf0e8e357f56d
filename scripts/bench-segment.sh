#!/usr/bin/env bash
# The LMCache segment's page backing, measured with LMCache's own engine-driven SHM client
# (shared/peer/lmcache_driver.py): for each backing `kvnode lmcache-server` can give its segment
#   4k          --pages 4k: 4 KiB pages of /dev/shm (what a node without root gets)
#   thp         --pages thp --segment-bind-mount: a private huge=within_size tmpfs file
#               bind-mounted at the name (root; the same pages as /dev/shm remounted
#               huge=within_size)
#   hugetlb-2m  --pages 2m --segment-bind-mount with 2 MiB hugepages reserved for the run (root)
# it prints store and retrieve GB/s end to end, the client's copy into / out of the segment,
# and, in the same run, the client's own memcpy (torch copy_ between two private, pre-touched
# buffers of one chunk's size): the ceiling a copy into the segment could reach.
# Every op touches fresh pool pages (2 GiB pool, 32 MiB chunks x 4 x 14 ops < 70 %).
#
# Usage: scripts/bench-segment.sh [--venv DIR] [--reps N] [--modes "4k thp hugetlb-2m"]
# Root only for thp and hugetlb-2m; the hugepages it reserves are taken off again at exit.
# Each run uses a free port, its own segment name and socket, no metrics endpoint, and writes
# to target/bench-segment/run-<pid>, so that runs in parallel do not collide.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-target/lmcache-venv-0.5.6}
REPS=3
MODES="4k thp hugetlb-2m"
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --modes) MODES=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "no LMCache venv at $VENV (scripts/lmcache-compat.sh installs one)" >&2; exit 2; }
DRIVER=""
for d in "$ROOT/shared/peer/lmcache_driver.py" "$ROOT/../shared/peer/lmcache_driver.py"; do
  [ -f "$d" ] && DRIVER=$d && break
done
[ -n "$DRIVER" ] || { echo "lmcache_driver.py not found" >&2; exit 2; }
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --release --locked -p kvnode >&2
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/kvnode"
OUT=$ROOT/target/bench-segment/run-$$
mkdir -p "$OUT"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
SOCK=$OUT/native.sock
NR=/proc/sys/vm/nr_hugepages
ADDED=0
PID=""
cleanup() {
  if [ -n "$PID" ]; then kill -TERM "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; PID=""; fi
  if [ "$ADDED" -gt 0 ]; then echo $(( $(cat $NR) - ADDED )) > $NR || true; ADDED=0; fi
}
trap cleanup EXIT

for mode in $MODES; do
  case $mode in
    4k) pages=4k; mount_flag="" ;;
    thp) pages=thp; mount_flag=--segment-bind-mount ;;
    hugetlb-2m)
      pages=2m; mount_flag=--segment-bind-mount
      if [ "$ADDED" = 0 ] && [ -w $NR ]; then
        before=$(cat $NR); echo $(( before + 1040 )) > $NR; ADDED=$(( $(cat $NR) - before ))
      fi ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
  for r in $(seq 1 "$REPS"); do
    rm -f "$SOCK"
    taskset -c 0 "$BIN" lmcache-server --host 127.0.0.1 --port $PORT --chunk-size 256 \
      --l1-size-gb 2 --shm-name "segbench$$" --supported-transfer-mode engine_driven \
      --disable-metrics --socket "$SOCK" --pages "$pages" $mount_flag > "$OUT/$mode.$r.server.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 600); do "$BIN" status --json --socket "$SOCK" > "$OUT/$mode.$r.status.json" 2>/dev/null && break; sleep 0.2; done
    taskset -c 1 "$PY" "$DRIVER" --url tcp://127.0.0.1:$PORT --clear --layers 32 --hidden 1024 \
      --chunks 4 --requests 12 --warmup 2 --pings 20 --timeout 30 \
      --json-out "$OUT/$mode.$r.driver.json" > "$OUT/$mode.$r.driver.log" 2>&1 \
      || { tail -20 "$OUT/$mode.$r.driver.log" >&2; exit 1; }
    # The client's own memcpy, same process type, same CPU, same chunk size (32 MiB).
    taskset -c 1 "$PY" - > "$OUT/$mode.$r.memcpy.json" <<'PY'
import json, time, torch
n = 32 << 20
src = torch.ones(n // 2, dtype=torch.bfloat16); dst = torch.empty_like(src); dst.fill_(0)
for _ in range(3): dst.copy_(src)
t = []
for _ in range(20):
    t0 = time.perf_counter(); dst.copy_(src); t.append(time.perf_counter() - t0)
t.sort()
print(json.dumps({"memcpy_GBps_p50": round(n / t[len(t) // 2] / 1e9, 2)}))
PY
    kill -TERM "$PID"; wait "$PID" 2>/dev/null || true; PID=""
  done
  if [ "$ADDED" -gt 0 ]; then echo $(( $(cat $NR) - ADDED )) > $NR || true; ADDED=0; fi
done

"$PY" - "$OUT" $MODES <<'PY'
import json, statistics, sys, glob
out, modes = sys.argv[1], sys.argv[2:]
print("| backing (status) | store GB/s | client copy into segment GB/s | retrieve GB/s | client copy out GB/s | client memcpy GB/s | store copy / memcpy |")
print("|---|---|---|---|---|---|---|")
for m in modes:
    ds = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{m}.*.driver.json"))]
    ss = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{m}.*.status.json"))]
    mc = [json.load(open(f))["memcpy_GBps_p50"] for f in sorted(glob.glob(f"{out}/{m}.*.memcpy.json"))]
    med = lambda k: statistics.median(d[k]["GBps"] for d in ds)
    backing = ",".join(sorted({s["pool_backing"] for s in ss}))
    print(f"| {m} ({backing}) | {med('store'):.2f} | {med('store_copy'):.2f} | {med('retrieve'):.2f} | "
          f"{med('retrieve_copy'):.2f} | {statistics.median(mc):.2f} | {med('store_copy') / statistics.median(mc):.2f} |")
for m in modes:
    for f in sorted(glob.glob(f"{out}/{m}.*.status.json"))[:1]:
        print(f"{m}: {json.load(open(f)).get('pool_backing_detail')}")
PY
