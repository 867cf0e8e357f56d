#!/usr/bin/env bash
# Kill loop over the L2 disk tier: `kvnode serve` with a 24 MiB pool and a 256 MiB disk tier in a
# fresh directory under L2DIR (default /var/tmp; removed afterwards unless the loop fails); each
# iteration stores objects whose bytes are a function of their key, SIGKILLs the node at a random
# moment while its write-behind is busy (with --clear: around a CLEAR), restarts it on the same
# directory and retrieves every key ever stored: any wrong byte, any object served after a CLEAR
# that returned, any MEMCHECK failure fails the loop. Details: bench/README.md
# ("kvnode-bench l2-killloop"); figures: RELIABILITY.md.
#
# Prints ONE summary line on stdout (`L2-KILLLOOP: <n> iterations, <kills> kills, <served> served,
# <wrong> wrong, ...: PASS|FAIL`; one line per iteration, build and diagnostics on stderr); the
# exit status is non-zero on any failure.
#
# Usage: scripts/l2-killloop.sh [--iterations N] [--engine uring|pread|auto] [--clear] [--l2-dir DIR]
#        [more `kvnode-bench l2-killloop` flags: --seed N, --json FILE, --keep-dir, --l2-size SIZE,
#        --pool-size SIZE, --hidden N, --max-objects N]        (default 100 iterations, auto)
set -euo pipefail
cd "$(dirname "$0")/.."
iterations=100
engine=auto
l2dir=${L2DIR:-/var/tmp}
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --iterations) iterations=${2:?--iterations needs a value}; shift 2 ;;
    --iterations=*) iterations=${1#*=}; shift ;;
    --engine) engine=${2:?--engine needs a value}; shift 2 ;;
    --engine=*) engine=${1#*=}; shift ;;
    --l2-dir) l2dir=${2:?--l2-dir needs a value}; shift 2 ;;
    --l2-dir=*) l2dir=${1#*=}; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
case "$engine" in
  uring|pread|auto) ;;
  *) echo "l2-killloop.sh: --engine must be uring, pread or auto (got '$engine')" >&2; exit 2 ;;
esac
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --release --locked -p kvnode -p kvnode-bench >&2
exec "${CARGO_TARGET_DIR:-target}/release/kvnode-bench" l2-killloop --iterations "$iterations" \
  --engine "$engine" --l2-dir "$l2dir" "${args[@]}"
