#!/usr/bin/env bash
# Real-client compatibility check against LMCache's multiprocess (MP) cache server protocol.
#
# Runs LMCache's own Python client (the engine-driven, non-GPU path a vLLM worker uses) through
# the driver shared/peer/lmcache_driver.py against either kvnode's LMCache frontend
# (`kvnode lmcache-server`) or LMCache's own server (the reference), then checks the result:
#   1. the full driver run: get_chunk_size, clear(force), noop pings, register engine-driven
#      context, STORE (prepare_store + copy into SHM slots + commit_store + end_session) and
#      RETRIEVE (lookup + wait_prefetch_status + prepare_retrieve + copy out + commit_retrieve +
#      end_session), every retrieved byte verified, unregister;
#   2. the vLLM-worker round trip (--worker-path-check): create_transfer_context over paged CPU
#      KV tensors, submit_store / lookup / submit_retrieve into other blocks, compare blocks;
#   3. kvnode only: a real LMCache worker process (the client's own register, ping and
#      prepare_store) is SIGKILLed between prepare_store and commit_store; kvnode's status must
#      show its instance released (its reserved slots freed) within 30 s, far below the reap
#      timeout (120 s) and registration grace (3600 s): the connection close released it;
#   4. the server stops cleanly on SIGTERM and leaves nothing behind in /dev/shm.
# Opt-in: not part of scripts/test.sh. Needs PyPI access the first time (installs lmcache, with
# torch and its CUDA libraries: ~6 GB per venv, ~1.5-3 min); later runs reuse the venv.
#
# Usage: scripts/lmcache-compat.sh [--version V] [--server kvnode|lmcache] [--port P]
#                                  [--venv DIR] [--transport shm|pickle|any] [--pin]
#                                  [--] [DRIVER ARGS...]
#   --version V     lmcache release for the client (and the reference server). Default 0.5.6;
#                   0.5.4 and 0.5.6 are known to work.
#   --server S      kvnode (default): cargo build --release -p kvnode, run
#                   `target/release/kvnode lmcache-server ...`; lmcache: run
#                   `python -m lmcache.v1.multiprocess.server ...` from the venv.
#   --port P        TCP port on 127.0.0.1 (default 5557).
#   --venv DIR      virtualenv (default target/lmcache-venv-V); created if missing, reused if its
#                   `pip show lmcache` version is V, otherwise lmcache==V is installed into it.
#   --transport T   transport the client must end up with: shm (default; SHM pool advertised by
#                   the server), pickle, or any.
#   --pin           pin the server to CPU 0 and the driver to CPU 1 (taskset).
#   DRIVER ARGS     appended to the full driver run (they override the defaults below, e.g.
#                   --layers 32 --hidden 1024 --requests 5, --capture-port 5600, --json-out F).
# Environment: SERVER_EXTRA_ARGS (extra server flags), COMPAT_STARTUP_TIMEOUT (s, default 120).
# Exit status: 0 and "LMCACHE-COMPAT: PASS" when everything passed, 1 and "... FAIL" otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

VERSION=0.5.6
SERVER=kvnode
PORT=5557
VENV=""
TRANSPORT=shm
PIN=0
DRIVER_ARGS=()
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --version) VERSION=$2; shift 2 ;;
    --version=*) VERSION=${1#*=}; shift ;;
    --server) SERVER=$2; shift 2 ;;
    --server=*) SERVER=${1#*=}; shift ;;
    --port) PORT=$2; shift 2 ;;
    --port=*) PORT=${1#*=}; shift ;;
    --venv) VENV=$2; shift 2 ;;
    --venv=*) VENV=${1#*=}; shift ;;
    --transport) TRANSPORT=$2; shift 2 ;;
    --transport=*) TRANSPORT=${1#*=}; shift ;;
    --pin) PIN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; DRIVER_ARGS+=("$@"); break ;;
    *) DRIVER_ARGS+=("$1"); shift ;;
  esac
done
case "$SERVER" in kvnode|lmcache) ;; *) echo "--server must be kvnode or lmcache" >&2; exit 2 ;; esac
case "$TRANSPORT" in shm|pickle|any) ;; *) echo "--transport must be shm, pickle or any" >&2; exit 2 ;; esac
[[ "$PORT" =~ ^[0-9]+$ ]] || { echo "--port must be a number" >&2; exit 2; }
VENV=${VENV:-target/lmcache-venv-$VERSION}
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac

DRIVER=""
for d in "$ROOT/shared/peer/lmcache_driver.py" "$ROOT/../shared/peer/lmcache_driver.py"; do
  if [ -f "$d" ]; then DRIVER=$(realpath "$d"); break; fi
done
[ -n "$DRIVER" ] || { echo "lmcache_driver.py not found (looked in shared/peer and ../shared/peer)" >&2; exit 2; }

export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 PYTHONWARNINGS=ignore
LOGDIR="$ROOT/target/lmcache-compat"
mkdir -p "$LOGDIR"
TAG="$SERVER-$VERSION-$PORT"
SERVER_LOG="$LOGDIR/$TAG.server.log"
SHM_NAME="compat$PORT"
SOCK="$ROOT/target/lmcache-compat-$PORT.sock"
URL="tcp://127.0.0.1:$PORT"
log() { printf '[lmcache-compat] %s\n' "$*" >&2; }
FAILS=()
fail() { FAILS+=("$*"); printf '[lmcache-compat] FAIL: %s\n' "$*" >&2; }

# ---------------------------------------------------------------------------------------------
# 1. The venv with lmcache==VERSION (lmcache-peer.md section 1: the plain PyPI install; torch
#    resolves to a CUDA build that imports fine without a GPU).
venv_version() { "$VENV/bin/pip" show lmcache 2>/dev/null | awk '/^Version:/{print $2}'; }
if [ -x "$VENV/bin/python" ] && [ "$(venv_version)" = "$VERSION" ]; then
  log "reusing $VENV (lmcache $VERSION)"
else
  t0=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q -U pip
  else
    log "$VENV has lmcache '$(venv_version)', installing lmcache==$VERSION into it"
  fi
  log "pip install lmcache==$VERSION (~6 GB: torch + CUDA libs; log: $LOGDIR/install-$VERSION.log)"
  if ! "$VENV/bin/pip" install "lmcache==$VERSION" > "$LOGDIR/install-$VERSION.log" 2>&1; then
    tail -n 30 "$LOGDIR/install-$VERSION.log" >&2
    echo "LMCACHE-COMPAT: FAIL (pip install lmcache==$VERSION failed)"
    exit 1
  fi
  [ "$(venv_version)" = "$VERSION" ] || { echo "LMCACHE-COMPAT: FAIL (venv has lmcache $(venv_version))"; exit 1; }
  log "installed lmcache $VERSION in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
fi
PY="$VENV/bin/python"
"$PY" -c 'import torch, lmcache.v1.multiprocess.transfer_context.base' \
  || { echo "LMCACHE-COMPAT: FAIL (lmcache client does not import from $VENV)"; exit 1; }

# The driver is written against the 0.5.5+ client API (transport.RequestClientFactory with one
# method per RPC, the 10-field key, num_physical_slots, clear(force), the 5-argument
# EngineDrivenTransferContext.register). lmcache 0.5.4 has none of that: its client is
# mq.MessageQueueClient.submit_request(RequestType, payloads). For such releases the driver runs
# unmodified under a small adapter that maps the driver's calls onto 0.5.4's own client classes,
# so every frame on the wire is produced by 0.5.4's MessageQueueClient / EngineDrivenContextShm /
# EngineDrivenTransferContext exactly as a 0.5.4 vLLM worker sends it.
DRIVER_RUN=("$PY" "$DRIVER")
if ! "$PY" -c 'import importlib.util, sys
sys.exit(0 if importlib.util.find_spec("lmcache.v1.multiprocess.transport.factory") else 1)' 2>/dev/null; then
  SHIM="$LOGDIR/run_driver_mq_client.py"
  cat > "$SHIM" <<'PYSHIM'
"""Run lmcache_driver.py (0.5.6 client API) on an lmcache release that only has the
MessageQueueClient API (0.5.4). Usage: python run_driver_mq_client.py DRIVER [ARGS...]"""
import os, runpy, sys, types
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
import zmq
import lmcache.v1.multiprocess.custom_types as ct
from lmcache.v1.multiprocess.mq import MessageQueueClient
from lmcache.v1.multiprocess.protocol import RequestType, get_payload_classes, get_response_class
import lmcache.v1.multiprocess.transfer_context.base  # noqa: F401  (bind the real classes first)
import lmcache.v1.multiprocess.transfer_context.worker_transfer as wt

RT = RequestType


def send(client, rt, payloads):
    return client.submit_request(rt, payloads, get_response_class(rt))


class RequestClient(MessageQueueClient):
    """The 0.5.6 RequestClient surface the driver uses, over 0.5.4's MessageQueueClient."""

    def get_chunk_size(self): return send(self, RT.GET_CHUNK_SIZE, [])
    def noop(self): return send(self, RT.NOOP, [])
    def ping(self, instance_id=None): return send(self, RT.PING, [instance_id])

    def clear(self, force=True):
        # 0.5.4's CLEAR has no payload (always a full clear); 0.5.6 sends force as a bool frame.
        return send(self, RT.CLEAR, [force] if get_payload_classes(RT.CLEAR) else [])

    def register_kv_cache_engine_driven_context(self, payload):
        return send(self, RT.REGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT, [payload])

    def unregister_kv_cache_engine_driven_context(self, instance_id):
        return send(self, RT.UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT, [instance_id])

    def lookup(self, key, tp_size): return send(self, RT.LOOKUP, [key, tp_size])
    def query_prefetch_status(self, rid): return send(self, RT.QUERY_PREFETCH_STATUS, [rid])
    def wait_prefetch_status(self, rid, timeout):
        return send(self, RT.WAIT_PREFETCH_STATUS, [rid, float(timeout)])
    def end_session(self, rid): return send(self, RT.END_SESSION, [rid])


class RequestClientFactory:
    @staticmethod
    def create(url):
        return RequestClient(url, zmq.Context.instance())


transport = types.ModuleType("lmcache.v1.multiprocess.transport")
transport.__path__ = []
factory = types.ModuleType("lmcache.v1.multiprocess.transport.factory")
factory.RequestClientFactory = RequestClientFactory
transport.factory = factory
sys.modules[transport.__name__] = transport
sys.modules[factory.__name__] = factory


class _DropNewFields(type):
    """Constructs the release's own class, dropping keyword fields it does not have, so the wire
    form is exactly that release's (isinstance still works)."""

    def __call__(cls, *a, **kw):
        for k in cls._drop:
            kw.pop(k, None)
        return cls._real(*a, **kw)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls._real)


def _shim(real, names):
    have = set(getattr(real, "__dataclass_fields__", {})) | set(getattr(real, "__struct_fields__", ()))
    return _DropNewFields(real.__name__, (), {"_real": real, "_drop": [n for n in names if n not in have]})


ct.IPCCacheServerKey = _shim(ct.IPCCacheServerKey, ["num_kv_readers", "request_configs"])
ct.RegisterEngineDrivenContextPayload = _shim(ct.RegisterEngineDrivenContextPayload,
                                              ["num_physical_slots"])

_real_ctc = wt.create_transfer_context


class EngineDrivenTransferContext(wt.EngineDrivenTransferContext):
    """0.5.6 call signatures over 0.5.4's EngineDrivenTransferContext (same wire traffic)."""

    def __init__(self, instance_id, client):
        super().__init__()
        self._iid, self._client = instance_id, client

    def register(self, kv_caches, model_name, world_size, blocks_in_chunk, mq_timeout):
        return super().register(self._iid, kv_caches, model_name, world_size, blocks_in_chunk,
                                self._client, mq_timeout, send_request=send)

    def submit_store(self, request_id, key, kv_caches, block_ids, event, blocks_in_chunk):
        return super().submit_store(request_id, key, self._iid, kv_caches, block_ids, event,
                                    blocks_in_chunk)

    def submit_retrieve(self, request_id, key, kv_caches, block_ids, event, blocks_in_chunk,
                        skip_first_n_tokens=0):
        return super().submit_retrieve(request_id, key, self._iid, kv_caches, block_ids, event,
                                       blocks_in_chunk, skip_first_n_tokens)

    def unregister(self):
        # What 0.5.4's LMCacheMPWorkerAdapter.shutdown sends for an engine-driven context.
        return send(self._client, RT.UNREGISTER_KV_CACHE_ENGINE_DRIVEN_CONTEXT, [self._iid])


def create_transfer_context(kv_caches, instance_id=None, req_client=None, mode=None, **kw):
    tc = _real_ctc(kv_caches, mode=mode)
    if type(tc) is not wt.EngineDrivenTransferContext:
        raise RuntimeError(f"cannot adapt {type(tc).__name__} (only the sync engine-driven path)")
    return EngineDrivenTransferContext(instance_id, req_client)


wt.create_transfer_context = create_transfer_context

driver = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(driver, run_name="__main__")
PYSHIM
  DRIVER_RUN=("$PY" "$SHIM" "$DRIVER")
  log "lmcache $VERSION has no transport.RequestClientFactory: running the driver through $SHIM"
fi

# ---------------------------------------------------------------------------------------------
# 2. Server command line.
port_busy() {
  "$PY" - "$PORT" <<'PY'
import socket, sys
s = socket.socket(); s.settimeout(0.5)
sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
PY
}
if port_busy; then echo "LMCACHE-COMPAT: FAIL (port $PORT is already in use)"; exit 1; fi

PIN_SERVER=(); PIN_DRIVER=()
if [ "$PIN" = 1 ] && command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then
  PIN_SERVER=(taskset -c 0); PIN_DRIVER=(taskset -c 1)
fi

if [ "$SERVER" = lmcache ]; then
  # Flags per lmcache-peer.md section 2; the optional ones only where this release has them.
  HELP=$("$PY" -m lmcache.v1.multiprocess.server --help 2>&1 || true)
  has_flag() { grep -q -- "$1" <<<"$HELP"; }
  SERVER_CMD=("$PY" -m lmcache.v1.multiprocess.server --host 127.0.0.1 --port "$PORT"
              --chunk-size 256 --supported-transfer-mode engine_driven --l1-size-gb 2)
  has_flag --eviction-policy && SERVER_CMD+=(--eviction-policy LRU)
  if [ "$TRANSPORT" != pickle ]; then
    SERVER_CMD+=(--shm-name "$SHM_NAME")
    # Lazy L1 (the default where the flag exists) silently disables SHM.
    has_flag --no-l1-use-lazy && SERVER_CMD+=(--no-l1-use-lazy)
  fi
  has_flag --prometheus-port && SERVER_CMD+=(--prometheus-port $((PORT + 1000)))
  has_flag --disable-metrics && SERVER_CMD+=(--disable-metrics)
else
  if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi
  log "cargo build --release -p kvnode"
  cargo build --release --locked -p kvnode >&2 \
    || { echo "LMCACHE-COMPAT: FAIL (cargo build --release -p kvnode failed)"; exit 1; }
  rm -f "$SOCK"
  SERVER_CMD=("$ROOT/target/release/kvnode" lmcache-server --host 127.0.0.1 --port "$PORT"
              --chunk-size 256 --l1-size-gb 2 --shm-name "$SHM_NAME"
              --supported-transfer-mode engine_driven --socket "$SOCK")
fi
# shellcheck disable=SC2206
[ -n "${SERVER_EXTRA_ARGS:-}" ] && SERVER_CMD+=(${SERVER_EXTRA_ARGS})

# ---------------------------------------------------------------------------------------------
# 3. Start it; always stop it (SIGTERM by PID, SIGKILL after 30 s).
SHM_BEFORE=$(ls -1 /dev/shm 2>/dev/null | sort || true)
SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  local pid=$SERVER_PID; SERVER_PID=""
  kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  local i t0s; t0s=$(date +%s%N)
  for i in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "server $pid still running 30 s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    STOP_KILLED=1
  fi
  wait "$pid" 2>/dev/null || true
  log "server $pid stopped $(( ($(date +%s%N) - t0s) / 1000000 )) ms after SIGTERM"
}
STOP_KILLED=0
trap 'stop_server' EXIT
trap 'stop_server; exit 130' INT TERM

log "server: ${SERVER_CMD[*]}"
: > "$SERVER_LOG"
"${PIN_SERVER[@]}" "${SERVER_CMD[@]}" >> "$SERVER_LOG" 2>&1 &
SERVER_PID=$!
t0=$(date +%s%N)
deadline=$(( $(date +%s) + ${COMPAT_STARTUP_TIMEOUT:-120} ))
until port_busy; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    SERVER_PID=""
    tail -n 40 "$SERVER_LOG" >&2
    echo "LMCACHE-COMPAT: FAIL (server exited before listening on $PORT; log: $SERVER_LOG)"
    exit 1
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    tail -n 40 "$SERVER_LOG" >&2
    echo "LMCACHE-COMPAT: FAIL (server not listening on $PORT after ${COMPAT_STARTUP_TIMEOUT:-120} s)"
    exit 1
  fi
  sleep 0.2
done
log "server pid $SERVER_PID listening on $URL after $(( ($(date +%s%N) - t0) / 1000000 )) ms"

# ---------------------------------------------------------------------------------------------
# 4. The driver: full run (default 1 MiB chunks x 4 per op, 20+2 ops: 88 MiB, well inside the
#    2 GiB L1), then the vLLM-worker paged-KV round trip. Short RPC timeout: the server sends
#    no reply on a handler error, so a broken request shows up as a timeout.
FULL_JSON="$LOGDIR/$TAG.driver.json"
rm -f "$FULL_JSON"
DRIVER_FULL=("${DRIVER_RUN[@]}" --url "$URL" --clear --layers 4 --hidden 256 --chunks 4
             --requests 20 --warmup 2 --pings 200 --timeout 15 --json-out "$FULL_JSON"
             "${DRIVER_ARGS[@]}")
log "driver (full): ${DRIVER_FULL[*]}"
set +e
"${PIN_DRIVER[@]}" "${DRIVER_FULL[@]}" 2>&1 | tee "$LOGDIR/$TAG.driver.log"
rc_full=${PIPESTATUS[0]}
set -e
[ "$rc_full" = 0 ] || fail "driver full run exited $rc_full"
grep -q '^RESULT: PASS' "$LOGDIR/$TAG.driver.log" || fail "driver full run did not print RESULT: PASS"

if [ -f "$FULL_JSON" ]; then
  "$PY" - "$FULL_JSON" "$TRANSPORT" > "$LOGDIR/$TAG.summary" <<'PY' || fail "driver result check failed (see above)"
import json, sys
r = json.load(open(sys.argv[1])); want = sys.argv[2]
print(f"transport={r['transport']} shm_name={r['shm_name']!r} pool_size={r['pool_size']} "
      f"chunk_size={r['chunk_size']} chunk={r['chunk_MiB']} MiB x {r['chunks_per_op']} per op, "
      f"{r['requests']} measured ops")
print(f"errors: store_errors={r['store_errors']} retrieve_misses={r['retrieve_misses']} "
      f"byte_mismatches={r['byte_mismatches']} verified={r['verified']}")
print(f"{'step':44s} {'p50 ms':>9s} {'p99 ms':>9s} {'mean ms':>9s} {'GB/s':>7s}")
for k in ["noop_rtt", "store", "store_prepare", "store_copy", "store_commit", "retrieve",
          "retrieve_lookup_wait", "retrieve_prepare", "retrieve_copy", "retrieve_commit",
          "end_session"]:
    s = r[k]
    print(f"{s['op']:44s} {s['p50_ms']:9.3f} {s['p99_ms']:9.3f} {s['mean_ms']:9.3f} "
          f"{s['GBps'] if s['GBps'] is not None else '':>7}")
ok = True
if want == "shm" and r["transport"] != "EngineDrivenContextShm":
    print(f"expected the SHM transport, got {r['transport']} (server advertised shm_name="
          f"{r['shm_name']!r} pool_size={r['pool_size']})"); ok = False
if want == "pickle" and r["transport"] != "EngineDrivenContextPickle":
    print(f"expected the pickle transport, got {r['transport']}"); ok = False
if not r["verified"]:
    print("bytes were not verified (--no-verify)"); ok = False
sys.exit(0 if ok else 1)
PY
  cat "$LOGDIR/$TAG.summary"
else
  fail "driver wrote no JSON result ($FULL_JSON)"
fi

# The worker check takes only --url and --timeout; reuse a --timeout given in DRIVER ARGS.
WORKER_TIMEOUT=15
for ((i = 0; i < ${#DRIVER_ARGS[@]}; i++)); do
  case "${DRIVER_ARGS[i]}" in
    --timeout) WORKER_TIMEOUT=${DRIVER_ARGS[i + 1]:-15} ;;
    --timeout=*) WORKER_TIMEOUT=${DRIVER_ARGS[i]#*=} ;;
  esac
done
log "driver (vLLM worker path): --worker-path-check"
set +e
"${PIN_DRIVER[@]}" "${DRIVER_RUN[@]}" --url "$URL" --timeout "$WORKER_TIMEOUT" --worker-path-check 2>&1 \
  | tee "$LOGDIR/$TAG.worker.log"
rc_worker=${PIPESTATUS[0]}
set -e
[ "$rc_worker" = 0 ] || fail "driver --worker-path-check exited $rc_worker"
grep -q '^RESULT: PASS' "$LOGDIR/$TAG.worker.log" || fail "worker path check did not print RESULT: PASS"
grep -q '"inner": "EngineDrivenContextShm"' "$LOGDIR/$TAG.worker.log" || \
  { [ "$TRANSPORT" != shm ] || fail "worker path did not use EngineDrivenContextShm"; }

# ---------------------------------------------------------------------------------------------
# 5. kvnode only: its own status report (instances, bytes in use) after the client left.
if [ "$SERVER" = kvnode ]; then
  if st=$("$ROOT/target/release/kvnode" status --socket "$SOCK" --json 2>&1); then
    "$PY" -c '
import json, sys
s = json.loads(sys.argv[1])
print("kvnode status: instances=%d used_bytes=%d pool_bytes=%d objects=%s pending_writes=%s pending_reads=%s memcheck_ok=%s" % (
    len(s.get("instances", [])), s.get("used_bytes", -1), s.get("pool_bytes", -1), s.get("objects"),
    s.get("pending_writes"), s.get("pending_reads"), s.get("memcheck_ok")))
for i in s.get("instances", []):
    print("  instance", json.dumps(i))
if s.get("memcheck_ok") is False:
    print("memcheck problems:", s.get("memcheck_problems")); sys.exit(1)
if s.get("pending_writes") or s.get("pending_reads"):
    print("prepared transfers left open after the client finished"); sys.exit(1)
' "$st" || fail "kvnode status reports a problem"
  else
    printf '%s\n' "$st" >&2
    fail "kvnode status --socket $SOCK --json failed"
  fi
fi

# ---------------------------------------------------------------------------------------------
# 5b. kvnode only: a real LMCache worker dies (SIGKILL) between prepare_store and commit_store.
#     Its connection closes; kvnode must release the instance (the slots it reserved) within
#     seconds (--worker-disconnect-grace-seconds, default 1 s), not after the reap timeout.
if [ "$SERVER" = kvnode ]; then
  VICTIM="$LOGDIR/victim_worker.py"
  cat > "$VICTIM" <<'PYVICTIM'
"""A real LMCache worker that registers, pings, prepares a store and waits to be killed."""
import os, sys, time
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey, RegisterEngineDrivenContextPayload
from lmcache.v1.multiprocess.transfer_context.base import (EngineDrivenContextMetadata,
                                                            create_engine_driven_context)
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

url, T = sys.argv[1], 15
client = RequestClientFactory.create(url)
chunk = int(client.get_chunk_size().result(timeout=T))
iid = os.getpid()
resp = client.register_kv_cache_engine_driven_context(RegisterEngineDrivenContextPayload(
    instance_id=iid, model_name="victim", world_size=1, block_size=16, num_layers=2,
    hidden_dim_size=64, dtype_str="bfloat16", use_mla=False, num_physical_slots=chunk,
)).result(timeout=T)
client.ping(iid).result(timeout=T)
shape = torch.Size([2, 2, chunk, 64])
meta = EngineDrivenContextMetadata(layout_desc=MemoryLayoutDesc(shapes=[shape], dtypes=[torch.bfloat16]),
                                   block_size=16, use_mla=False)
edc = create_engine_driven_context(meta, client, T, shm_name=resp.shm_name,
                                   pool_size=resp.pool_size, use_pickle=False)
toks = tuple(range(7_000_000, 7_000_000 + 2 * chunk))
key = IPCCacheServerKey(model_name="victim", world_size=1, worker_id=0, token_ids=toks, start=0,
                        end=2 * chunk, request_id="victim", num_kv_readers=1)
edc.prepare_store(key, iid)
print("VICTIM-READY", iid, flush=True)
time.sleep(3600)
PYVICTIM
  VICTIM_RUN=("${DRIVER_RUN[@]:0:${#DRIVER_RUN[@]}-1}" "$VICTIM")
  log "real LMCache worker to be SIGKILLed after prepare_store: ${VICTIM_RUN[*]}"
  "${VICTIM_RUN[@]}" "$URL" > "$LOGDIR/$TAG.victim.log" 2>&1 &
  VPID=$!
  viid=""
  for _ in $(seq 1 1200); do
    viid=$(awk '/^VICTIM-READY/{print $2}' "$LOGDIR/$TAG.victim.log")
    [ -n "$viid" ] && break
    kill -0 "$VPID" 2>/dev/null || break
    sleep 0.1
  done
  kvstatus() { "$ROOT/target/release/kvnode" status --socket "$SOCK" --json 2>/dev/null; }
  # Prints "<registered 0/1> <pending writes of the instance> <lmcache.disconnect_releases>".
  victim_state() {
    kvstatus | "$PY" -c '
import json, sys
s = json.load(sys.stdin); iid = int(sys.argv[1])
mine = [i for i in s.get("instances", []) if i["id"] == iid]
print(len(mine), mine[0]["pending_writes"] if mine else 0,
      s.get("lmcache", {}).get("disconnect_releases", -1))' "$1"
  }
  if [ -z "$viid" ]; then
    tail -n 20 "$LOGDIR/$TAG.victim.log" >&2
    kill -KILL "$VPID" 2>/dev/null || true
    fail "the LMCache worker to kill never got its store prepared (log: $LOGDIR/$TAG.victim.log)"
  else
    read -r reg pend rel0 <<<"$(victim_state "$viid")"
    [ "$reg" = 1 ] && [ "$pend" -ge 1 ] || fail "worker $viid: expected a registered instance with a pending store, got registered=$reg pending_writes=$pend"
    t_kill=$(date +%s%N)
    kill -KILL "$VPID"
    wait "$VPID" 2>/dev/null || true
    released=0
    for _ in $(seq 1 600); do
      read -r reg pend rel <<<"$(victim_state "$viid")"
      if [ "$reg" = 0 ]; then released=1; break; fi
      sleep 0.05
    done
    ms=$(( ($(date +%s%N) - t_kill) / 1000000 ))
    if [ "$released" = 1 ] && [ "$rel" -gt "$rel0" ]; then
      log "killed worker $viid: instance released ${ms} ms after SIGKILL (disconnect_releases $rel0 -> $rel)"
      echo "disconnect release of a SIGKILLed LMCache worker: ${ms} ms"
    else
      fail "killed worker $viid: instance not released by its connection close within 30 s (registered=$reg disconnect_releases=$rel)"
    fi
  fi
fi

# ---------------------------------------------------------------------------------------------
# 6. Stop with SIGTERM and look for leftovers.
pid_was=$SERVER_PID
stop_server
trap - EXIT INT TERM
[ "$STOP_KILLED" = 0 ] || fail "server $pid_was did not exit within 30 s of SIGTERM"
grep -E -i 'Traceback|panicked' "$SERVER_LOG" >/dev/null && fail "server log has a traceback/panic ($SERVER_LOG)"
sleep 0.2
SHM_AFTER=$(ls -1 /dev/shm 2>/dev/null | sort || true)
left=$(comm -13 <(printf '%s\n' "$SHM_BEFORE") <(printf '%s\n' "$SHM_AFTER") | sed '/^$/d' || true)
if [ -n "$left" ]; then
  if grep -q -- "$SHM_NAME" <<<"$left"; then
    fail "/dev/shm leftovers after shutdown: $(tr '\n' ' ' <<<"$left")"
  else
    log "note: new /dev/shm entries not named after $SHM_NAME (another process?): $(tr '\n' ' ' <<<"$left")"
  fi
fi
if [ "$SERVER" = kvnode ] && [ -e "$SOCK" ]; then log "note: $SOCK still exists after shutdown"; fi

if [ ${#FAILS[@]} -eq 0 ]; then
  echo "LMCACHE-COMPAT: PASS (server=$SERVER lmcache=$VERSION port=$PORT transport=$TRANSPORT; logs in ${LOGDIR#"$ROOT"/})"
  exit 0
fi
tail -n 30 "$SERVER_LOG" >&2
echo "LMCACHE-COMPAT: FAIL (server=$SERVER lmcache=$VERSION port=$PORT): ${#FAILS[@]} problem(s):"
printf '  - %s\n' "${FAILS[@]}"
exit 1
