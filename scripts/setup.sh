#!/usr/bin/env bash
# Sets up a fresh Debian machine for kvnode: system packages, a Rust toolchain, and (as root)
# a hugepage reservation for the pool. Idempotent; safe to run repeatedly. Installs only what is
# missing and upgrades nothing (no `apt-get upgrade`; `apt-get install --no-upgrade` for the
# missing packages only; rustup only when there is no Rust >= 1.88).
#
# Environment:
#   KVNODE_HUGEPAGES   2 MiB pages to reserve when root (default 640 = 1.25 GiB, enough for the
#                      default 1 GiB pool). 0 skips the reservation; the node then falls back to
#                      THP or 4 KiB pages and says so. The reservation is never lowered here;
#                      undo it with `echo 0 > /proc/sys/vm/nr_hugepages` (as root).
#   KVNODE_SKIP_APT=1  do not touch apt.
set -euo pipefail

log() { printf '[setup] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

# 1. System packages (compilers and tools the build and tests use).
need_pkgs=()
for p in build-essential pkg-config ca-certificates curl procps valgrind fonts-dejavu-core libzmq3-dev python3 python3-venv iproute2 util-linux; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need_pkgs+=("$p")
done
if [ "${KVNODE_SKIP_APT:-0}" != 1 ] && [ ${#need_pkgs[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  log "installing ${need_pkgs[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq || log "apt-get update failed (offline?)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-upgrade "${need_pkgs[@]}" \
    || log "apt-get install failed; continuing with what is present"
fi

# 2. Rust toolchain (rkyv 0.8 needs Rust >= 1.81; Debian's packaged cargo is too old).
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
rust_ok() {
  command -v cargo >/dev/null || return 1
  local v; v=$(rustc --version | awk '{print $2}')
  [ "$(printf '%s\n1.88.0\n' "$v" | sort -V | head -n1)" = "1.88.0" ]
}
if ! rust_ok; then
  log "installing Rust with rustup"
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal -c rustfmt,clippy
  . "$HOME/.cargo/env"
fi
rust_ok || { log "need Rust >= 1.88 (found: $(rustc --version 2>/dev/null || echo none))"; exit 1; }
for c in rustfmt clippy; do
  if command -v rustup >/dev/null && ! rustup component list --installed 2>/dev/null | grep -q "^$c"; then
    log "adding the Rust component $c"
    rustup component add "$c" 2>/dev/null || log "could not add $c (offline?)"
  fi
done

# 3. Hugepages for the pool (root only; the node itself never needs root).
want=${KVNODE_HUGEPAGES:-640}
if [ "$want" -gt 0 ] && [ -w /proc/sys/vm/nr_hugepages ]; then
  have=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$have" -lt "$want" ]; then
    echo "$want" > /proc/sys/vm/nr_hugepages || true
    log "2 MiB hugepages reserved: $(cat /proc/sys/vm/nr_hugepages) (asked for $want, was $have);"
    log "this memory is unavailable to other programs until released: undo with"
    log "  echo $have > /proc/sys/vm/nr_hugepages   (or echo 0 to release every hugepage)"
  fi
else
  log "not reserving hugepages (not root or KVNODE_HUGEPAGES=0): the pool falls back to THP/4k"
fi
