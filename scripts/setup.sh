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
#                      it is recorded (see below), so `scripts/setup.sh --undo-hugepages` puts
#                      back the value from before.
#   KVNODE_SKIP_APT=1  do not touch apt.
#
# Host-side hugepage options (root only; each does only this and exits, no packages, no Rust):
#   --hugepages [N]    reserve N 2 MiB hugetlb pages (default 640) if fewer are reserved. A root
#                      `kvnode lmcache-server` then puts its POSIX shm segment on them (a
#                      hugetlbfs file bind-mounted at /dev/shm/<name>), and `kvnode serve` its
#                      memfd pool. Reserved pages are unavailable to other programs.
#   --shm-huge         remount /dev/shm with huge=within_size, so that every POSIX shm segment of
#                      at least 2 MiB (kvnode's when it is not root, and other programs') gets
#                      transparent huge pages. Affects every program using /dev/shm, hence never
#                      done by default.
#   --undo-hugepages   restore exactly what --hugepages, --shm-huge and KVNODE_HUGEPAGES changed
#                      (the nr_hugepages and /dev/shm huge= values from before the first change).
#   --hugepages-status show the current values and what is recorded.
# What was changed is recorded in /run/kvnode/host-setup.env (the first "before" value of each
# knob; /run is cleared at reboot, as are the changes themselves). Neither change is needed:
# without them the node falls back to a private huge tmpfs (root) or 4 KiB pages, with a warning.
set -euo pipefail

log() { printf '[setup] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }

STATE_DIR=/run/kvnode
STATE="$STATE_DIR/host-setup.env"
NR=/proc/sys/vm/nr_hugepages

# Records KEY=VALUE in the state file unless KEY is already recorded (the first value wins).
record_before() {
  mkdir -p "$STATE_DIR" && chmod 0755 "$STATE_DIR"
  touch "$STATE"
  grep -q "^$1=" "$STATE" || echo "$1=$2" >> "$STATE"
}
recorded() { [ -f "$STATE" ] && sed -n "s/^$1=//p" "$STATE" | head -n1; }
# The huge= option of the /dev/shm mount that paths resolve to (the last one listed).
dev_shm_huge() {
  awk '$2 == "/dev/shm" && $3 == "tmpfs" { o = "never"; n = split($4, a, ","); for (i = 1; i <= n; i++) if (a[i] ~ /^huge=/) o = substr(a[i], 6); last = o } END { print last }' /proc/self/mounts
}
reserve_hugepages() { # N
  local want=$1 have
  case "$want" in
    ''|*[!0-9]*) log "hugepage count '$want' is not a whole number of 2 MiB pages"; exit 2 ;;
  esac
  if [ "${#want}" -gt 7 ]; then
    log "hugepage count $want is more than 9999999 pages (about 19 TiB)"; exit 2
  fi
  have=$(cat "$NR")
  if [ "$have" -ge "$want" ]; then
    log "2 MiB hugepages already reserved: $have (asked for $want)"
    return 0
  fi
  record_before nr_hugepages "$have"
  echo "$want" > "$NR" || true
  log "2 MiB hugepages reserved: $(cat "$NR") (asked for $want, was $have); this memory is"
  log "unavailable to other programs until released: undo with scripts/setup.sh --undo-hugepages"
}
host_only() {
  [ "$(id -u)" -eq 0 ] || { log "$1 needs root"; exit 1; }
}
case "${1:-}" in
  --hugepages)
    host_only "$1"
    reserve_hugepages "${2:-640}"
    exit 0 ;;
  --shm-huge)
    host_only "$1"
    cur=$(dev_shm_huge)
    if [ -z "$cur" ]; then log "/dev/shm is not a tmpfs here; nothing changed"; exit 1; fi
    if [ "$cur" = within_size ] || [ "$cur" = always ]; then
      log "/dev/shm already has huge=$cur"
      exit 0
    fi
    record_before dev_shm_huge "$cur"
    mount -o remount,huge=within_size /dev/shm
    log "/dev/shm remounted with huge=within_size (was huge=$cur); undo with scripts/setup.sh --undo-hugepages"
    exit 0 ;;
  --undo-hugepages)
    host_only "$1"
    if grep -q ' kvnode-segment-' /proc/self/mountinfo; then
      log "note: kvnode segment mounts exist (a node runs, or one died): their hugepages stay in use"
      log "until that node stops or a node of the same name restarts"
    fi
    if v=$(recorded nr_hugepages) && [ -n "$v" ]; then
      echo "$v" > "$NR" || true
      log "nr_hugepages back to $v (now $(cat "$NR"); pages in use are released when freed)"
    fi
    if v=$(recorded dev_shm_huge) && [ -n "$v" ]; then
      mount -o "remount,huge=$v" /dev/shm
      log "/dev/shm remounted with huge=$v"
    fi
    rm -f "$STATE"
    log "nothing else was changed by setup.sh"
    exit 0 ;;
  --hugepages-status)
    echo "nr_hugepages=$(cat "$NR") free=$(cat /sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages 2>/dev/null)"
    echo "dev_shm_huge=$(dev_shm_huge)"
    echo "segment_mounts=$(grep -c ' kvnode-segment-' /proc/self/mountinfo || true)"
    [ -f "$STATE" ] && sed 's/^/recorded before: /' "$STATE"
    exit 0 ;;
  "") ;;
  *) log "unknown option $1 (see the header of $0)"; exit 2 ;;
esac

# 1. System packages (compilers and tools the build and tests use).
need_pkgs=()
# libibverbs-dev, librdmacm-dev and libclang-dev (with pkg-config): the `rdma` cargo feature (on by
# default) generates its verbs bindings at build time and links libibverbs/librdmacm.
# protobuf-compiler: the etcd client (cluster membership) generates its gRPC code with protoc.
for p in build-essential pkg-config ca-certificates curl procps valgrind fonts-dejavu-core libzmq3-dev python3 python3-venv iproute2 util-linux libibverbs-dev librdmacm-dev libclang-dev protobuf-compiler; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need_pkgs+=("$p")
done
if [ "${KVNODE_SKIP_APT:-0}" != 1 ] && [ ${#need_pkgs[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  log "installing ${need_pkgs[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq || log "apt-get update failed (offline?)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-upgrade "${need_pkgs[@]}" \
    || log "apt-get install failed; continuing with what is present"
fi

# 1b. etcd for the cluster tests: Debian's etcd-server package, unpacked into tools/etcd under
# the cargo target directory rather than installed (installing it would start an etcd service
# on the host). Used when no `etcd` is on the PATH; tests find it through KVNODE_ETCD_BIN
# (scripts/test.sh sets it) and skip, saying so, without one.
etcd_dir="$(cd "$(dirname "$0")/.." && pwd)/${CARGO_TARGET_DIR:-target}/tools/etcd"
case "${CARGO_TARGET_DIR:-}" in /*) etcd_dir="$CARGO_TARGET_DIR/tools/etcd" ;; esac
if ! command -v etcd >/dev/null && [ ! -x "$etcd_dir/usr/bin/etcd" ] \
   && [ "${KVNODE_SKIP_APT:-0}" != 1 ] && command -v apt-get >/dev/null; then
  log "fetching Debian's etcd-server package into $etcd_dir (not installed: no service is started)"
  tmp_deb=$(mktemp -d)
  if (cd "$tmp_deb" && apt-get download etcd-server >/dev/null 2>&1) \
     || { as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
          && (cd "$tmp_deb" && apt-get download etcd-server >/dev/null 2>&1); }; then
    mkdir -p "$etcd_dir" && dpkg-deb -x "$tmp_deb"/etcd-server_*.deb "$etcd_dir" \
      || log "could not unpack etcd-server; the cluster tests will be skipped"
  else
    log "could not download etcd-server (offline?); the cluster tests will be skipped"
  fi
  rm -rf "$tmp_deb"
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

# 3. Hugepages for the pool (root only; the node itself never needs root). Recorded, so that
# `scripts/setup.sh --undo-hugepages` restores the value from before.
want=${KVNODE_HUGEPAGES:-640}
case "$want" in
  ''|*[!0-9]*) log "KVNODE_HUGEPAGES='$want' is not a whole number of 2 MiB pages"; exit 2 ;;
esac
if [ "$want" -gt 0 ] && [ -w "$NR" ]; then
  reserve_hugepages "$want"
else
  log "not reserving hugepages (not root or KVNODE_HUGEPAGES=0): the pool falls back to THP/4k"
fi
