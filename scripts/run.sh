#!/usr/bin/env bash
# Sets everything up and runs the node on embedded defaults (1 GiB pool, 256-token chunks,
# socket in a private directory: $XDG_RUNTIME_DIR, /run/kvnode for root, else /tmp/kvnode-<uid>).
# Extra arguments go to `kvnode serve`, e.g.
#   scripts/run.sh --pool-size 4GiB --socket /run/kvnode.sock
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --release --locked -p kvnode
bin="${CARGO_TARGET_DIR:-target}/release/kvnode"
echo "[run] starting $bin serve $*" >&2
exec "$bin" serve "$@"
