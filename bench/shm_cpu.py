"""Per-key CPU of a shm (or tcp) batch get or put, client and server (a measurement driver).

Wall-clock GB/s swings 2-3x on a shared machine; process CPU per key (user + sys of
the client process and of the server process, divided by the keys moved) barely moves
with contention, so A/B comparisons of hot-path work read it first. One local server
(``gcache.testing.cluster``), one ``Client(transport="shm")`` in this process, a loop of
``get_batch_into`` or ``put_batch_from`` over a working set of ``TARGET_BYTES`` for
``--duration`` seconds after a warm-up; one line of JSON per run on stdout.

    python -m gcache.bench.shm_cpu --op get --size 64KiB --batch 1024 --duration 3
    python -m gcache.bench.shm_cpu --transport tcp --op get --size 1MiB --batch 64

The line also counts this process's garbage collections per generation during the
loop (``gc``) and the objects it tracks at the end (``objs``); ``SHMCPU_GC=off`` (or
``freeze``) runs the loop with the collector disabled (or the heap frozen first), to
price the GC's share of the client's CPU.

Not part of ``gcache-bench``: a tool for profiling and A/B runs (see NOTES / RESULTS).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import time

import numpy as np

from gcache.bench.runner import TARGET_BYTES
from gcache.testing.oracle import fill_value
from gcache.config import parse_size
from gcache.status import Status
from gcache.testing.cluster import Cluster


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def run(op: str, size: int, batch: int, duration: float, memory: str, conns: int,
        transport: str = "shm") -> dict:
    from gcache.sdk.client import Client

    n = max(batch * 4, TARGET_BYTES // size)
    keys = [b"cpu/%d/%d" % (size, i) for i in range(n)]
    src = np.empty((n, size), dtype=np.uint8)
    for k, row in zip(keys, src):
        fill_value(k, row)
    rows = list(src)
    slab = 1 << max(20, (size + (64 << 10) - 1).bit_length())
    with Cluster(1, memory, slab=f"{slab}B", prefix=f"shmcpu{os.getpid()}") as cl:
        pid = cl.servers[0].proc.pid
        with Client(cl.addresses, transport=transport, conns_per_server=conns,
                    timeout_ms=30000) as c:
            for i in range(0, n, batch):
                st = c.put_batch_from(keys[i:i + batch], rows[i:i + batch])
                assert all(s == Status.OK for s in st), st[:4]
            dst = np.zeros((batch, size), dtype=np.uint8)
            bufs = list(dst)
            groups = [(keys[i:i + batch], rows[i:i + batch]) for i in range(0, n, batch)
                      if i + batch <= n]

            def call(g: int) -> list:
                ks, vs = groups[g % len(groups)]
                return c.get_batch_into(ks, bufs) if op == "get" else c.put_batch_from(ks, vs)

            for g in range(3):  # warm up
                call(g)
            g0 = [x["collections"] for x in gc.get_stats()]
            c0, s0, t0 = _self_cpu(), _proc_cpu(pid), time.perf_counter()
            calls = bad = 0
            while time.perf_counter() - t0 < duration:
                bad += sum(1 for s in call(calls) if s != Status.OK)
                calls += 1
            wall = time.perf_counter() - t0
            c1, s1 = _self_cpu(), _proc_cpu(pid)
            gcs = [x["collections"] - y for x, y in zip(gc.get_stats(), g0)]
            objs = len(gc.get_objects())
    nk = calls * batch
    return {"op": op, "transport": transport, "size": size, "batch": batch, "keys": nk, "bad": bad,
            "GBps": round(nk * size / wall / 1e9, 3),
            "wall_us_key": round(wall / nk * 1e6, 2),
            "client_cpu_us_key": round((c1 - c0) / nk * 1e6, 2),
            "server_cpu_us_key": round((s1 - s0) / nk * 1e6, 2), "gc": gcs, "calls": calls,
            "objs": objs}


def main() -> None:
    if os.environ.get("SHMCPU_GC") == "freeze":
        gc.freeze()
    elif os.environ.get("SHMCPU_GC") == "off":
        gc.disable()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=("get", "put"), default="get")
    ap.add_argument("--size", default="64KiB")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--memory", default="2GiB")
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    a = ap.parse_args()
    print(json.dumps(run(a.op, parse_size(a.size), a.batch, a.duration, a.memory, a.conns,
                         a.transport)), flush=True)


if __name__ == "__main__":
    main()
