#!/usr/bin/env bash
# A reaped LMCache worker recovers through its own heartbeat: runs scripts/lmcache_recovery.py
# (the real LMCache client: RequestClientFactory, the engine-driven SHM context and the vLLM
# adapter's HeartbeatThread) against `kvnode lmcache-server` reaping silent workers after 2 s.
#
#   scripts/lmcache-recovery.sh [--version 0.5.6]
#
# Needs the venv scripts/lmcache-compat.sh installs (target/lmcache-venv-<version>; run that
# script once first). KVNODE_BIN=PATH runs another kvnode binary (e.g. an older build, to see it
# fail). Prints RECOVERY: PASS / FAIL; exit code 0 / 1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
VERSION=0.5.6
while [ $# -gt 0 ]; do
  case "$1" in
    --version) VERSION="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
PY="$target_dir/lmcache-venv-$VERSION/bin/python"
[ -x "$PY" ] || { echo "no LMCache $VERSION venv at $PY: run scripts/lmcache-compat.sh --version $VERSION first" >&2; exit 2; }
cargo build --release --locked --bin kvnode >&2
KV="${KVNODE_BIN:-$target_dir/release/kvnode}"
DIR=$(mktemp -d /tmp/kvnode-recovery.XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$KV" lmcache-server --host 127.0.0.1 --port "$PORT" --chunk-size 256 --l1-size-gb 0.25 \
  --shm-name "recovery$$" --supported-transfer-mode engine_driven --disable-metrics \
  --worker-reap-timeout-seconds 2 --worker-registration-grace-seconds 2 \
  --socket "$DIR/native.sock" 2>"$DIR/node.log" &
NODE=$!
cleanup() { kill -TERM "$NODE" 2>/dev/null || true; wait "$NODE" 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
for _ in $(seq 600); do [ -S "$DIR/native.sock" ] && break; sleep 0.1; done
set +e
"$PY" scripts/lmcache_recovery.py --url "tcp://127.0.0.1:$PORT" --kvnode "$KV" --socket "$DIR/native.sock"
rc=$?
set -e
if [ $rc -ne 0 ]; then echo "--- node log (tail)"; tail -30 "$DIR/node.log"; fi
grep -E "answering false once|reaping silent" "$DIR/node.log" | head -5 || true
exit $rc
