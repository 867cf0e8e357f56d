#!/usr/bin/env bash
# The cluster bench on this host: a real etcd and N `kvnode serve` nodes on loopback (one
# cluster), then `kvnode-bench --etcd ... --cluster ...`: per-member and total store,
# cross-node retrieve (peer fetch) and local retrieve GB/s against the raw TCP stream measured
# in the same run, every chunk verified.
#
#   scripts/bench-cluster.sh [--nodes N] [--preset P] [--engines E] [--prefixes K] [--out DIR]
#
# Defaults: 3 nodes, preset qwen2.5-0.5b (3 MiB chunks), 1 engine per member, 8 prefixes of 8
# chunks per engine, results in target/bench-cluster/. One machine shows the protocol's cost and
# the two-hop path, not scaling: every node, etcd and the bench share its cores and memory bus.
set -euo pipefail
cd "$(dirname "$0")/.."
nodes=3 preset=qwen2.5-0.5b engines=1 prefixes=8 out=target/bench-cluster
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --preset) preset=$2; shift 2 ;;
    --engines) engines=$2; shift 2 ;;
    --prefixes) prefixes=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
case "$preset" in tiny) chunk=16 ;; *) chunk=256 ;; esac
KVNODE_HUGEPAGES=${KVNODE_HUGEPAGES:-0} bash scripts/setup.sh
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --locked --release -p kvnode -p kvnode-bench
target_dir=${CARGO_TARGET_DIR:-target}
bin=$target_dir/release
etcd_bin=${KVNODE_ETCD_BIN:-$(command -v etcd || echo "$target_dir/tools/etcd/usr/bin/etcd")}
[ -x "$etcd_bin" ] || { echo "no etcd (scripts/setup.sh unpacks Debian's etcd-server)" >&2; exit 1; }
mkdir -p "$out"
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ep=$(port); pp=$(port)
"$etcd_bin" --name b --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$ep" \
  --advertise-client-urls "http://127.0.0.1:$ep" --listen-peer-urls "http://127.0.0.1:$pp" \
  --initial-advertise-peer-urls "http://127.0.0.1:$pp" --initial-cluster "b=http://127.0.0.1:$pp" \
  >"$work/etcd.log" 2>&1 &
pids+=($!)
"$bin/kvnode" token generate "$work/token" >/dev/null
"$bin/kvnode" token generate "$work/admin" >/dev/null
for i in $(seq 0 $((nodes - 1))); do
  "$bin/kvnode" serve --socket "$work/n$i.sock" --pool-size 2GiB --chunk-size "$chunk" \
    --listen tcp://127.0.0.1:0 --auth-token-file "$work/token" --admin-token-file "$work/admin" \
    --etcd "http://127.0.0.1:$ep" --cluster bench --node-id "n$i" >"$work/n$i.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 1 200); do
  n=$("$bin/kvnode" cluster status --etcd "http://127.0.0.1:$ep" --cluster bench --json 2>/dev/null \
      | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["members"]))' 2>/dev/null || echo 0)
  [ "$n" = "$nodes" ] && break
  sleep 0.1
done
"$bin/kvnode" cluster status --etcd "http://127.0.0.1:$ep" --cluster bench
"$bin/kvnode-bench" --etcd "http://127.0.0.1:$ep" --cluster bench --token-file "$work/token" \
  --admin-token-file "$work/admin" \
  --preset "$preset" --instances "$engines" --ops "$prefixes" --json "$out/cluster-$preset.json"
echo "[bench-cluster] JSON: $out/cluster-$preset.json"
