#!/usr/bin/env bash
# Server-side instructions per request type, counted by valgrind/callgrind (stable on noisy
# machines, unlike wall-clock time). For each request type the node runs under callgrind twice,
# serving N1 and then N2 requests of that type from `kvnode-bench __opcount`; instructions per
# request = (Ir(N2) - Ir(N1)) / (N2 - N1), so start-up, pool pre-faulting and shutdown cancel out.
#
# Usage: scripts/bench-callgrind.sh [N1 N2]      (default 200 1200)
# Output: a table on stdout and target/callgrind/instructions.json.
set -euo pipefail
cd "$(dirname "$0")/.."
N1=${1:-200}
N2=${2:-1200}
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
command -v valgrind >/dev/null || { KVNODE_HUGEPAGES=0 bash scripts/setup.sh; apt-get install -y -qq valgrind >/dev/null 2>&1 || true; }
command -v valgrind >/dev/null || { echo "valgrind is required" >&2; exit 1; }
cargo build --release --locked -p kvnode -p kvnode-bench
out=target/callgrind
mkdir -p "$out"
sock="$out/node.sock"

run_one() { # op n -> prints total Ir of the node process
  local op=$1 n=$2 file="$out/callgrind.$1.$2.out"
  rm -f "$sock" "$file"
  valgrind --tool=callgrind --callgrind-out-file="$file" \
    target/release/kvnode serve --socket "$sock" --pool-size 64MiB --chunk-size 16 --pages 4k --workers 1 \
    --reap-timeout 0 --log warn 2>"$out/valgrind.$op.$n.log" &
  local pid=$!
  for _ in $(seq 1 600); do
    target/release/kvnode ping --socket "$sock" >/dev/null 2>&1 && break
    sleep 0.1
  done
  target/release/kvnode-bench __opcount "$sock" "$op" "$n"
  kill -TERM "$pid"
  wait "$pid" || true
  # "summary:" (or "totals:") holds the Ir total of all threads.
  awk '/^(summary|totals):/ {print $2; exit}' "$file"
}

printf '%-10s %14s %14s %16s\n' op "Ir(N1=$N1)" "Ir(N2=$N2)" "instructions/op"
json="{"
for op in ping noop store retrieve lookup; do
  a=$(run_one "$op" "$N1")
  b=$(run_one "$op" "$N2")
  per=$(( (b - a) / (N2 - N1) ))
  printf '%-10s %14s %14s %16s\n' "$op" "$a" "$b" "$per"
  json="$json\"$op\": $per, "
done
json="${json%, }}"
echo "$json" > "$out/instructions.json"
echo "written $out/instructions.json (store/retrieve = one prepare + one commit each)"
