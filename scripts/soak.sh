#!/usr/bin/env bash
# Kill soak: native and LMCache clients are SIGKILLed at random points (often between PREPARE and
# COMMIT) against one `kvnode lmcache-server`, while one survivor per protocol stores and
# verifies for the whole run. Afterwards the node must be clean: no instance, nothing pending,
# reserved or locked, no session, used bytes = committed objects, memcheck ok, RSS flat, and
# SIGTERM exits 0 and removes the shm segment. Details: bench/README.md ("Kill soak").
#
# Prints ONE summary line on stdout (`SOAK: PASS ...` or `SOAK: FAIL ...`; set-up, build and
# diagnostics go to stderr); the exit status is non-zero on any failure.
#
# Usage: scripts/soak.sh [--duration SECS] [--json FILE] [more `kvnode-bench soak` flags]
#        (default 60 s; e.g. --seed N, --pool-gb 0.25, --native 3 --lmcache 3, --keep-dir)
set -euo pipefail
cd "$(dirname "$0")/.."
duration=60
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration=${2:?--duration needs a value}; shift 2 ;;
    --duration=*) duration=${1#*=}; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
# The LMCache pool is POSIX shm (tmpfs): hugepages cannot back it, so none are reserved here.
KVNODE_HUGEPAGES=${KVNODE_HUGEPAGES:-0} bash scripts/setup.sh >&2
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --release --locked -p kvnode -p kvnode-bench >&2
exec "${CARGO_TARGET_DIR:-target}/release/kvnode-bench" soak --duration "$duration" "${args[@]}"
