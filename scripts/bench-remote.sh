#!/usr/bin/env bash
# Remote engines over TCP (issue 13): every workload through `kvnode-bench --remote`, with the
# network's limits measured in the same run between the same two endpoints (raw TCP stream in
# each direction and a TCP ping-pong, against `kvnode-bench --raw-peer` beside the node), for
# both node TCP engines (--tcp-engine uring and plain):
#   * loopback: node, raw peer and bench on 127.0.0.1 (the bench spawns node and peer);
#   * veth (root only; skipped with a message otherwise): node and raw peer in a fresh network
#     namespace, the bench in this one, across a veth pair.
# Each configuration runs RUNS times (default 2); the summary prints medians. Raw JSON of every
# run lands in target/bench-remote/ (summary.txt beside it).
#
# Usage: scripts/bench-remote.sh [quick]      RUNS=5 DURATION=5 scripts/bench-remote.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
cargo build --release --locked -p kvnode -p kvnode-bench
bin="${CARGO_TARGET_DIR:-target}/release"
RUNS=${RUNS:-2}
DURATION=${DURATION:-3}
out=target/bench-remote
mkdir -p "$out"
rm -f "$out"/*.json "$out"/*.txt

# name | node pool | node chunk tokens | kvnode-bench arguments
matrix=(
  "llama-store|768MiB|256|--preset llama3-8b --workload store"
  "llama-retrieve|768MiB|256|--preset llama3-8b --workload retrieve"
  "tiny-mixed|512MiB|16|--preset tiny --workload mixed --hit-ratio 0.5"
  "tiny-multiturn|512MiB|16|--preset tiny --workload multiturn"
)
if [ "${1:-}" = quick ]; then matrix=("${matrix[@]:0:2}"); RUNS=1; fi
engines=(uring plain)
# The memcpy and Unix-socket baselines of the local report are short here (not the remote limits).
common=(--instances 1 --duration "$DURATION" --warmup 10 --baseline-secs 0.3)

run_bench() { # file, args...
  local f=$1; shift
  "$bin/kvnode-bench" "$@" --json "$f.json" > "$f.txt" 2>&1 || { cat "$f.txt" >&2; return 1; }
}

for r in $(seq 1 "$RUNS"); do
  for engine in "${engines[@]}"; do
    for entry in "${matrix[@]}"; do
      IFS='|' read -r name pool _chunk args <<< "$entry"
      echo "== loopback $engine $name run $r" >&2
      # shellcheck disable=SC2086
      run_bench "$out/loopback.$engine.$name.$r" --spawn --remote tcp://127.0.0.1:0 \
        --pool-size "$pool" --node-arg=--tcp-engine --node-arg="$engine" $args "${common[@]}"
    done
  done
done

# --- veth between two network namespaces ---------------------------------------------------
veth_note=""
if [ "$(id -u)" != 0 ]; then
  veth_note="veth: skipped (needs root for network namespaces)"
elif ! command -v ip > /dev/null; then
  veth_note="veth: skipped (no ip command)"
fi
if [ -z "$veth_note" ]; then
  ns="kvbench$$"
  hdev="vkbh$$"
  ndev="vkbn$$"
  sub="10.232.$(( $$ % 250 ))"
  host_ip="$sub.1"
  ns_ip="$sub.2"
  tmp=$(mktemp -d /tmp/kvnode-bench-remote.XXXXXX)
  node=""
  peer=""
  cleanup() {
    if [ -n "$node" ]; then kill -TERM "$node" 2> /dev/null || true; wait "$node" 2> /dev/null || true; fi
    if [ -n "$peer" ]; then kill "$peer" 2> /dev/null || true; wait "$peer" 2> /dev/null || true; fi
    ip netns del "$ns" 2> /dev/null || true
    ip link del "$hdev" 2> /dev/null || true
    rm -rf "$tmp"
  }
  trap cleanup EXIT
  ip netns add "$ns"
  ip link add "$hdev" type veth peer name "$ndev"
  ip link set "$ndev" netns "$ns"
  ip addr add "$host_ip/30" dev "$hdev"
  ip link set "$hdev" up
  ip netns exec "$ns" ip addr add "$ns_ip/30" dev "$ndev"
  ip netns exec "$ns" ip link set "$ndev" up
  ip netns exec "$ns" ip link set lo up
  "$bin/kvnode" token generate "$tmp/client.token"
  url="tcp://$ns_ip:7471"
  # `ip netns exec` execs its command: $! is the process itself.
  ip netns exec "$ns" "$bin/kvnode-bench" --raw-peer "$ns_ip:7472" > "$tmp/peer.out" 2>&1 &
  peer=$!
  for r in $(seq 1 "$RUNS"); do
    for engine in "${engines[@]}"; do
      for entry in "${matrix[@]}"; do
        IFS='|' read -r name pool chunk args <<< "$entry"
        echo "== veth $engine $name run $r" >&2
        ip netns exec "$ns" "$bin/kvnode" serve --socket "$tmp/node.sock" --pool-size "$pool" \
          --chunk-size "$chunk" --listen "$url" --auth-token-file "$tmp/client.token" \
          --tcp-engine "$engine" > /dev/null 2> "$tmp/node.log" &
        node=$!
        ok=""
        for _ in $(seq 1 600); do
          if "$bin/kvnode" ping --remote "$url" --token-file "$tmp/client.token" > /dev/null 2>&1; then
            ok=1; break
          fi
          kill -0 "$node" 2> /dev/null || break
          sleep 0.1
        done
        if [ -z "$ok" ]; then cat "$tmp/node.log" >&2; echo "the node in $ns did not answer" >&2; exit 1; fi
        # shellcheck disable=SC2086
        run_bench "$out/veth.$engine.$name.$r" --remote "$url" --token-file "$tmp/client.token" \
          --raw-peer-addr "$ns_ip:7472" --node-pid "$node" $args "${common[@]}"
        kill -TERM "$node"
        wait "$node" || { cat "$tmp/node.log" >&2; echo "the node exited badly" >&2; exit 1; }
        node=""
      done
    done
  done
fi

python3 - "$out" "$veth_note" <<'PY' | tee "$out/summary.txt"
import glob, json, os, statistics, sys
out, note = sys.argv[1], sys.argv[2]
runs = {}
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    place, engine, name, _r, _ = os.path.basename(f).split(".")
    runs.setdefault((place, name, engine), []).append(json.load(open(f)))
def med(rs, key, sub=None):
    vals = [(r[key] if sub is None else r[key][sub]) for r in rs]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else float("nan")
print(f"{'place':9}{'workload':16}{'engine':7}{'store':>7}{'retr':>7}{'raw s':>7}{'raw r':>7}"
      f"{'st/raw':>8}{'re/raw':>8}{'noop50':>8}{'pp50':>7}{'ctl/pp':>7}{'node s/GB':>10}"
      f"{'peer s/GB':>10}{'verified':>9}")
for (place, name, engine), rs in sorted(runs.items()):
    # The raw peer's CPU per GB in the workload's direction (retrieve: the peer sends).
    d = "recv" if "retrieve" in name else "send"
    peer = statistics.median(r["raw_tcp"][d]["peer_cpu_s_per_gb"] for r in rs)
    print(f"{place:9}{name:16}{engine:7}{med(rs,'store_gbps'):7.2f}{med(rs,'retrieve_gbps'):7.2f}"
          f"{med(rs,'raw_tcp_gbps'):7.2f}{med(rs,'raw_tcp_recv_gbps'):7.2f}"
          f"{med(rs,'store_vs_raw'):8.2f}{med(rs,'retrieve_vs_raw'):8.2f}"
          f"{med(rs,'control_noop_p50_us'):8.1f}{med(rs,'tcp_pingpong_p50_us'):7.1f}"
          f"{med(rs,'control_p50_vs_pingpong'):7.2f}{med(rs,'node_cpu_s_per_gb'):10.3f}"
          f"{peer:10.3f}{str(all(r['verified'] for r in rs)):>9}")
print(f"runs per row: {max(len(v) for v in runs.values())}; GB/s = 1e9 bytes/s; medians")
if note:
    print(note)
PY
