#!/usr/bin/env bash
# L2 disk tier figures: `kvnode-bench l2` for 2 MiB and 32 MiB objects (TOTAL per phase, default
# 1 GiB), RUNS times each (default 3); the summary prints medians across runs: raw O_DIRECT per
# engine, node write-behind and cold read per engine with their share of the device limit (the
# better raw engine), and CPU seconds per GB. Raw JSON of every run lands in target/bench/.
#
# The disk under test is the one holding L2DIR (default /var/tmp); each run makes and removes a
# fresh subdirectory there. As root, page caches are dropped before each cold read (all L2 and
# raw I/O is O_DIRECT anyway).
#
# Usage: scripts/bench-l2.sh [quick]     RUNS=5 TOTAL=4GiB L2DIR=/mnt/nvme scripts/bench-l2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# The node's pool (1.25 GiB) and the raw baselines' buffers (up to 512 MiB: one lookup's worth
# of 32 MiB objects for the paired reads) all on hugepages.
KVNODE_HUGEPAGES=${KVNODE_HUGEPAGES:-960} bash scripts/setup.sh
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --release --locked -p kvnode -p kvnode-bench
RUNS=${RUNS:-3}
TOTAL=${TOTAL:-1GiB}
L2DIR=${L2DIR:-/var/tmp}
out=target/bench
mkdir -p "$out"
rm -f "$out"/l2-*.json "$out"/l2-*.txt

sizes=(2MiB 32MiB)
if [ "${1:-}" = quick ]; then sizes=(2MiB); RUNS=1; fi

for size in "${sizes[@]}"; do
  for r in $(seq 1 "$RUNS"); do
    echo "== l2 $size run $r" >&2
    target/release/kvnode-bench l2 --object-size "$size" --total "$TOTAL" --l2-dir "$L2DIR" \
      --json "$out/l2-$size.$r.json" > "$out/l2-$size.$r.txt" 2>&1 \
      || { cat "$out/l2-$size.$r.txt" >&2; exit 1; }
  done
done

python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
out = sys.argv[1]
runs = {}
for f in sorted(glob.glob(os.path.join(out, "l2-*.json"))):
    name = os.path.basename(f).rsplit(".", 2)[0]
    runs.setdefault(name, []).append(json.load(open(f))["l2"])
def med(rs, *path):
    vals = []
    for r in rs:
        v = r
        for p in path:
            v = v[p]
        vals.append(v)
    vals = [v for v in vals if v is not None]
    if not vals:
        return None, 0.0
    m = statistics.median(vals)
    return m, (max(vals) - min(vals)) / m if m else 0.0
def pct(v):
    return "n/a" if v is None else f"{100 * v:.0f}%"
def x(v):
    return "n/a" if v is None else f"{v:.2f}x"
for name, rs in sorted(runs.items(), key=lambda kv: kv[1][0]["object_bytes"]):
    obj = rs[0]["object_bytes"]
    engines = rs[0]["engines"]
    print(f"### {obj >> 20} MiB objects, {rs[0]['total_bytes'] >> 20} MiB per phase, "
          f"{len(rs)} runs (medians; spread = (max-min)/median), {rs[0]['fs']}")
    print()
    print("| | write GB/s | read GB/s | write CPU s/GB | read CPU s/GB | spread w/r |")
    print("|---|---|---|---|---|---|")
    for e in engines:
        w, ws = med(rs, "raw", e, "write_gbps"); rd, rs_ = med(rs, "raw", e, "read_gbps")
        wc, _ = med(rs, "raw", e, "write_cpu_s_per_gb"); rc, _ = med(rs, "raw", e, "read_cpu_s_per_gb")
        qd = f" qd{rs[0]['raw'][e]['queue_depth']}" if e == "uring" else ""
        print(f"| raw O_DIRECT {e}{qd} | {w:.2f} | {rd:.2f} | {wc:.3f} | {rc:.3f} | {100*ws:.0f}% / {100*rs_:.0f}% |")
    dw, _ = med(rs, "device", "write_gbps"); dr, _ = med(rs, "device", "read_gbps")
    print(f"| device limit (best raw) | {dw:.2f} | {dr:.2f} | | | |")
    for e in engines:
        w, ws = med(rs, "node", e, "write_behind_gbps"); rd, rs_ = med(rs, "node", e, "read_gbps")
        wc, _ = med(rs, "node", e, "write_cpu_s_per_gb"); rc, _ = med(rs, "node", e, "read_cpu_s_per_gb")
        print(f"| node {e} (write-behind / cold read) | {w:.2f} | {rd:.2f} | {wc:.3f} | {rc:.3f} | {100*ws:.0f}% / {100*rs_:.0f}% |")
    print()
    applies = rs[0]["targets"]["applies"]
    for e in engines:
        wv, _ = med(rs, "node", e, "write_vs_device"); rv, _ = med(rs, "node", e, "read_vs_device")
        wr, _ = med(rs, "node", e, "write_vs_raw"); rr, _ = med(rs, "node", e, "read_vs_raw")
        rp, _ = med(rs, "node", e, "read_vs_paired"); rpg, _ = med(rs, "node", e, "paired_raw_read_gbps")
        rc_, _ = med(rs, "node", e, "read_vs_paired_checksum")
        rec = all(r["node"][e]["recovered"] == r["objects"] for r in rs)
        ver = all(r["node"][e]["verified"] for r in rs)
        rs_s, _ = med(rs, "node", e, "restart_s")
        tgt = lambda v: ("met" if v >= 0.9 else "MISSED") if applies else "n/a"
        print(f"- node {e}: write-behind {pct(wv)} of device ({pct(wr)} of raw {e}) [>= 90%: {tgt(wv)}], "
              f"cold read {pct(rv)} of device ({pct(rr)} of raw {e}) [>= 90%: {tgt(rv)}], "
              f"{pct(rp)} of paired raw reads ({rpg:.2f} GB/s) [>= 90%: {tgt(rp)}], "
              f"{pct(rc_)} of paired raw reads checksummed like the node, "
              f"restart {rs_s:.2f} s, recovered all: {'yes' if rec else 'NO'}, verified: {'yes' if ver else 'NO'}")
    cw, _ = med(rs, "cpu_uring_over_pread", "node_write"); cr, _ = med(rs, "cpu_uring_over_pread", "node_read")
    if cw is not None:
        mark = lambda v: "n/a" if v is None else ("met" if v < 1 else "MISSED")
        print(f"- node CPU/GB uring/pread: write-behind {x(cw)} [< 1: {mark(cw)}], cold read {x(cr)} [< 1: {mark(cr)}]")
    print()
PY
