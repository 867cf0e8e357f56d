#!/usr/bin/env bash
# Runs the deterministic simulator (kvnode-sim, see src/sim/) over many seeds in release mode.
#
#   scripts/simulate.sh [--seeds N] [--start-seed S] [--steps M]    many seeds (default 1000 x 4000)
#   scripts/simulate.sh --seed S [--steps M]                        one seed, with its trace
#   other flags pass through: --native N --lmcache N --skip CHECKS --fail-fast --log FILTER
#
# Prints one line per failing seed (reproduce it with --seed) and a summary line
# "SIMULATE: <seeds> seeds, <failed> failed, <steps> steps, ...". Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
if ! command -v cargo >/dev/null; then KVNODE_HUGEPAGES=0 bash scripts/setup.sh; . "$HOME/.cargo/env"; fi
args=("$@")
has_count=0
for a in "${args[@]}"; do case "$a" in --seeds|--seed) has_count=1 ;; esac; done
if [ "$has_count" = 0 ]; then args+=(--seeds 1000); fi
cargo build --release --locked --bin kvnode-sim >&2
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
exec "$target_dir/release/kvnode-sim" "${args[@]}"
