#!/usr/bin/env python3
"""A reaped LMCache worker recovers through its own heartbeat (run by lmcache-recovery.sh).

Uses the installed LMCache client (0.5.6 API) unchanged: RequestClientFactory, the engine-driven
SHM context, and the vLLM adapter's HeartbeatThread with a recovery callback that registers the
worker again (what the adapter's `_reregister_kv_caches_callback` does). Against a node that
reaps silent workers after 2 s:
  1. register, store one chunk (commit true);
  2. fall silent until the node reaps the instance (status via the native socket);
  3. a store now fails (no slot list: PREPARE gives None, COMMIT false) - never "already cached";
  4. the heartbeat's PING fails once, the next succeeds, the callback re-registers;
  5. a store succeeds again and a lookup + retrieve returns the stored bytes.
Prints RECOVERY: PASS or RECOVERY: FAIL <reason>; exit code 0 / 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import warnings  # noqa: E402

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from lmcache.integration.vllm.vllm_multi_process_adapter import HeartbeatThread  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: E402
from lmcache.v1.multiprocess.custom_types import (  # noqa: E402
    IPCCacheServerKey,
    RegisterEngineDrivenContextPayload,
)
from lmcache.v1.multiprocess.transfer_context.base import (  # noqa: E402
    EngineDrivenContextMetadata,
    create_engine_driven_context,
)
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory  # noqa: E402


def fail(why: str) -> int:
    print(f"RECOVERY: FAIL {why}", flush=True)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--kvnode", required=True, help="kvnode binary (for status)")
    ap.add_argument("--socket", required=True, help="the node's native socket")
    ap.add_argument("--heartbeat", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    T = 10.0

    def status() -> dict:
        out = subprocess.run(
            [args.kvnode, "status", "--socket", args.socket, "--json"],
            capture_output=True, text=True, timeout=30, check=True,
        )
        return json.loads(out.stdout)

    client = RequestClientFactory.create(args.url)
    chunk = int(client.get_chunk_size().result(timeout=T))
    instance_id = os.getpid()
    layers, hidden, dtype = 2, 64, torch.float16
    payload = RegisterEngineDrivenContextPayload(
        instance_id=instance_id, model_name="recovery-model", world_size=1, block_size=16,
        num_layers=layers, hidden_dim_size=hidden, dtype_str="float16", use_mla=False,
        num_physical_slots=chunk,
    )
    resp = client.register_kv_cache_engine_driven_context(payload).result(timeout=T)
    shape = torch.Size([2, layers, chunk, hidden])
    meta = EngineDrivenContextMetadata(
        layout_desc=MemoryLayoutDesc(shapes=[shape], dtypes=[dtype]), block_size=16,
        use_mla=False,
    )
    edc = create_engine_driven_context(
        meta, client, T, shm_name=resp.shm_name, pool_size=resp.pool_size, use_pickle=False
    )

    def key(tag: int, rid: str, worker: bool) -> IPCCacheServerKey:
        toks = tuple(range(tag * chunk, (tag + 1) * chunk))
        return IPCCacheServerKey(
            model_name="recovery-model", world_size=1, worker_id=0 if worker else None,
            token_ids=toks, start=0, end=chunk, request_id=rid, num_kv_readers=1,
        )

    def data(tag: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(tag)
        return torch.rand(shape, generator=g).to(dtype)

    def store(tag: int) -> bool:
        k = key(tag, f"st-{tag}", True)
        res = edc.prepare_store(k, instance_id)
        if res is not None:
            bufs, idxs = res
            for b, _ in zip(bufs, idxs):
                b.copy_(data(tag))
        return bool(edc.commit_store(k, instance_id, []))

    if not store(1):
        return fail("the first store failed")

    # 2. Silence until the node reaps the instance.
    deadline = time.monotonic() + args.timeout
    while status()["liveness"]["reaped"] < 1:
        if time.monotonic() > deadline:
            return fail("the node never reaped the silent worker")
        time.sleep(0.2)

    # 3. A store of a reaped worker fails visibly (LMCache's client: prepare None -> commit).
    res = edc.prepare_store(key(2, "st-2", True), instance_id)
    if res is not None:
        return fail(f"PREPARE_STORE of a reaped instance answered slots {res!r} (reads as cached)")
    if edc.commit_store(key(2, "st-2", True), instance_id, []):
        return fail("COMMIT_STORE of a reaped instance answered true")

    # 4. The real heartbeat: PING fails once, succeeds next, the callback re-registers.
    recovered = threading.Event()

    def recover() -> bool:
        client.register_kv_cache_engine_driven_context(payload).result(timeout=T)
        recovered.set()
        return True

    health = threading.Event()
    health.set()
    hb = HeartbeatThread(client, health, interval=args.heartbeat, instance_id=instance_id)
    hb.register_recover_callback(recover)
    hb.start()
    ok = recovered.wait(timeout=args.timeout)
    hb.stop()
    if not ok:
        return fail("the heartbeat never triggered the recovery callback")

    # 5. Stores and retrieves work again (immediately: the node reaps after 2 s of silence).
    if not store(3):
        return fail("a store after the recovery failed")
    rid = "rt-3"
    client.lookup(key(3, rid, False), 1).result(timeout=T)
    hit = client.wait_prefetch_status(rid, T).result(timeout=T + 1)
    bufs = edc.prepare_retrieve(key(3, rid, True), instance_id)
    got = None if bufs is None else bufs[0].clone()
    edc.commit_retrieve(key(3, rid, True), instance_id)
    client.end_session(rid).result(timeout=T)
    if hit != 1 or got is None:
        return fail(f"lookup after recovery: hit {hit}, retrieved {got is not None}")
    if not torch.equal(got.reshape(-1).view(torch.uint8), data(3).reshape(-1).view(torch.uint8)):
        return fail("retrieved bytes differ")
    st = status()
    print(json.dumps({"lmcache": {k: st["lmcache"].get(k) for k in (
        "unregistered_requests", "recovery_pings")}, "reaped": st["liveness"]["reaped"]}))
    print("RECOVERY: PASS", flush=True)
    edc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
