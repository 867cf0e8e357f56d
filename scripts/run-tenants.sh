#!/usr/bin/env bash
# Runs one kvnode per trust domain: each tenant gets its own pool, socket directory and [access]
# list, so engines of different tenants never map the same memory. Usage:
#   scripts/run-tenants.sh TENANTS_FILE [BASE_DIR]
# TENANTS_FILE has one tenant per line: `name uids pool_size`, e.g.
#   teama 1001,1002 8GiB
#   teamb 2001 4GiB
# Tenant NAME serves on BASE_DIR/NAME/kvnode.sock (BASE_DIR defaults to /run/kvnode-tenants),
# with socket mode 0666 inside a 0755 directory: the [access] list (allow_uids) decides who gets
# in, and every other user is refused. Logs go to BASE_DIR/NAME/node.log. SIGTERM/SIGINT stop
# every node cleanly. Needs the release binary (built here if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
tenants="${1:?usage: scripts/run-tenants.sh TENANTS_FILE [BASE_DIR]}"
base="${2:-/run/kvnode-tenants}"
bin="${KVNODE_BIN:-${CARGO_TARGET_DIR:-target}/release/kvnode}"
if [ ! -x "$bin" ]; then
  if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
  cargo build --release --locked -p kvnode
fi
mkdir -p "$base"
pids=()
stop() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap stop TERM INT
while read -r name uids pool rest; do
  case "$name" in ''|'#'*) continue ;; esac
  if ! [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "[tenants] bad tenant name '$name' (letters, digits, _ and - only)" >&2; stop; exit 1
  fi
  if ! [[ "$uids" =~ ^[0-9]+(,[0-9]+)*$ ]] || [ -z "$pool" ] || [ -n "$rest" ]; then
    echo "[tenants] line for '$name' must be: name uid[,uid...] pool_size" >&2; stop; exit 1
  fi
  dir="$base/$name"
  if [ -e "$dir" ] && [ ! -O "$dir" ]; then
    echo "[tenants] $dir exists and is not ours; refusing to use it" >&2; stop; exit 1
  fi
  mkdir -p "$dir"
  chmod 0755 "$dir"
  cat > "$dir/node.toml" <<TOML
socket = "$dir/kvnode.sock"
socket_mode = 0o666
[access]
allow_uids = [$uids]
TOML
  echo "[tenants] $name: $dir/kvnode.sock, pool $pool, users $uids" >&2
  "$bin" serve --config "$dir/node.toml" --pool-size "$pool" 2>"$dir/node.log" &
  pids+=("$!")
done < "$tenants"
if [ "${#pids[@]}" -eq 0 ]; then echo "[tenants] no tenant in $tenants" >&2; exit 1; fi
wait
