#!/usr/bin/env bash
# RDMA self-test, for a host with an RDMA NIC (the RDMA fabric is untested on hardware in CI:
# the CI machine has no RDMA). Exits 0 with "no RDMA device here" on a host without one.
#
#   scripts/rdma-selftest.sh [DEVICE]     DEVICE: a name such as mlx5_0, or auto (default;
#                                         also KVNODE_RDMA_DEVICE)
#
# What it does:
#   1. lists the devices (ibv_devinfo, if ibverbs-utils is installed);
#   2. prints the device, port and GID the node would choose (hw example rdma_probe);
#   3. runs the ignored hardware test hardware_loopback_round_trip: opens the device twice (node
#      and engine side), registers an 8 MiB pool and a 4 MiB engine buffer, connects two queue
#      pairs of the device to each other, pulls 4 MiB and pushes 4 KiB with every byte checked,
#      checks a bad rkey fails the op and breaks the connection, then a teardown.
# Registration pins memory: a non-root user needs `ulimit -l` of at least 16 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
DEVICE=${1:-${KVNODE_RDMA_DEVICE:-auto}}
log() { printf '[rdma-selftest] %s\n' "$*"; }

if [ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
  log "no RDMA device here (/sys/class/infiniband is missing or empty): nothing to test"
  exit 0
fi
if command -v ibv_devinfo >/dev/null; then
  ibv_devinfo | grep -E 'hca_id|port:|state:|link_layer|active_mtu' || true
else
  log "ibv_devinfo not found (apt-get install ibverbs-utils); continuing without it"
fi
if [ "$(id -u)" -ne 0 ]; then
  log "memlock limit: $(ulimit -l) KiB (registration needs at least 16384 unless unlimited)"
fi

set +e
probe=$(cargo run -q -p kvnode-hw --features rdma --example rdma_probe -- "$DEVICE")
rc=$?
set -e
printf '%s\n' "$probe"
if [ "$rc" -eq 2 ]; then
  log "no usable RDMA device here (see the reason above): nothing to test"
  exit 0
elif [ "$rc" -ne 0 ]; then
  log "rdma_probe failed (exit $rc)"
  exit "$rc"
fi

log "hardware loopback round trip on $DEVICE"
KVNODE_RDMA_DEVICE="$DEVICE" cargo test -q -p kvnode-hw --features rdma --lib \
  fabric::rdma::tests::hardware_loopback_round_trip -- --ignored --nocapture
log "OK: RDMA works here ($(printf '%s\n' "$probe" | sed -n 's/^the node would use: //p'))"
