"""Cost of the chain parent on put (the frame's ``"ch"``) and of the ``chains`` policy.

    python -m gcache.bench.chain_cost [--seconds 2] [--items 64] [--value-bytes 4096]

Two measurements, each alternating its cases in short rounds so machine noise falls
on every case alike:

* in-process, this thread's CPU (``MemoryTier`` on a throwaway /dev/shm arena, full,
  so every put also evicts): put (``begin_put`` + ``finish_put``) and read
  (``pin_read`` + ``unpin``) per item, under ``lru``, ``reuse`` and ``chains``, with and
  without a parent; plus ``protocol.chain_parents`` per frame of ``--items`` items with
  and without ``"ch"``.
* end to end: one ``gcache-server`` per policy, an SDK client over TCP putting
  ``--items``-key batches of fresh keys (a new chain each) with and without
  ``chain_parent``, and reading them back; the server process's CPU (user + sys, from
  /proc) per key.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

from gcache.protocol import Limits, PutItem, chain_parents
from gcache.server.arena import Arena
from gcache.server.eviction import make_policy
from gcache.server.memory_tier import MemoryTier
from gcache.status import Status

POLICIES = ("lru", "reuse", "chains")


def _alternate(cases: dict[str, Callable[[], int]], seconds: float) -> dict[str, float]:
    """Run each case's round in turn until each had ``seconds`` of this thread's CPU
    (the tier runs no thread of its own here: no ``start()``): us per unit of work."""
    spent = dict.fromkeys(cases, 0.0)
    done = dict.fromkeys(cases, 0)
    while min(spent.values()) < seconds:
        for name, run in cases.items():
            t = time.thread_time()
            done[name] += run()
            spent[name] += time.thread_time() - t
    return {n: spent[n] / done[n] * 1e6 for n in cases}


def in_process(seconds: float, items: int, value_bytes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    lim = Limits()
    parsed = [PutItem(b"key-%06d" % i, 10, 0, 10, 0, None) for i in range(items)]
    plain, chained = {"ns": b"n", "items": []}, {"ns": b"n", "items": [], "ch": b"head"}

    def frames(meta: dict) -> Callable[[], int]:
        def run() -> int:
            for _ in range(1000):
                chain_parents(meta, parsed, lim)
            return 1000
        return run

    for name, us in _alternate({"frame without ch": frames(plain),
                                "frame with ch": frames(chained)}, seconds / 2).items():
        out[f"chain_parents, {name} ({items} items), us per frame"] = us
    tiers, paths = {}, []
    try:
        for pol in POLICIES:
            path = f"/dev/shm/gcache-chain-cost-{os.getpid()}-{pol}.arena"
            paths.append(path)
            tiers[pol] = MemoryTier(Arena(path, 64 << 20, 1 << 20, prefault=False),
                                    eviction_policy=make_policy(pol), recency_snapshot_s=0)
        counter = [0]
        val = b"v" * value_bytes
        last: dict[str, list[bytes]] = {}

        def put_round(m: MemoryTier, chained: bool) -> Callable[[], int]:
            def run() -> int:
                parent: bytes | None = b"" if chained else None
                keys = last[m.policy.name] = []
                for _ in range(items):
                    counter[0] += 1
                    k = b"k%09d" % counter[0]
                    keys.append(k)
                    slot = m.begin_put(b"n", k, value_bytes, 0, value_bytes, 0, parent=parent)
                    assert slot.status == Status.OK, slot.status
                    slot.view[:] = val
                    assert m.finish_put(slot) == Status.OK
                    if chained:
                        parent = k
                return items
            return run

        def read_round(m: MemoryTier) -> Callable[[], int]:
            def run() -> int:
                keys = last[m.policy.name]
                for k in keys:
                    p = m.pin_read(b"n", k, 0, value_bytes, 0)
                    m.unpin(p)
                return len(keys)
            return run

        cases: dict[str, Callable[[], int]] = {}
        for pol, m in tiers.items():
            cases[f"{pol}: put, no parent"] = put_round(m, False)
            cases[f"{pol}: put, parent"] = put_round(m, True)
        for pol, m in tiers.items():
            put_round(m, True)()
            cases[f"{pol}: read"] = read_round(m)
        for name, us in _alternate(cases, seconds).items():
            out[f"memory tier, {name}, us per item"] = us
    finally:
        for m in tiers.values():
            m.close(clean=False)
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
    return out


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def end_to_end(seconds: float, items: int, value_bytes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for pol in POLICIES:
        for name, us in _server_run(pol, seconds, items, value_bytes).items():
            out[f"server {pol}, {name}, CPU us per key"] = us
    return out


def _server_run(pol: str, seconds: float, items: int, value_bytes: int) -> dict[str, float]:
    import numpy as np

    from gcache.sdk import Client
    from gcache.testing.cluster import Cluster

    with Cluster(1, "64MiB", slab="1MiB", extra=["--eviction-policy", pol],
                 prefix=f"chaincost{os.getpid()}") as cl, \
            Client(servers=cl.addresses, namespace="cost", transport="tcp",
                   conns_per_server=1) as c:
        pid = cl.servers[0].proc.pid
        vals = [np.full(value_bytes, 7, np.uint8) for _ in range(items)]
        bufs = [np.empty(value_bytes, np.uint8) for _ in range(items)]
        counter = [0]
        last: list[bytes] = []

        def put(chained: bool) -> Callable[[], int]:
            def run() -> int:
                counter[0] += 1
                keys = [b"r%07d-%03d" % (counter[0], i) for i in range(items)]
                st = c.put_batch_from(keys, vals, chain_parent=b"" if chained else None)
                assert st == [Status.OK] * items, st
                last[:] = keys
                return items
            return run

        def get() -> int:
            st = c.get_batch_into(last, bufs)
            assert st == [Status.OK] * items, st
            return items

        cases = {"put, no chain_parent": put(False), "put, chain_parent": put(True),
                 "get": get}
        put(True)()
        spent = dict.fromkeys(cases, 0.0)
        keys = dict.fromkeys(cases, 0)
        t_end = time.monotonic() + seconds * len(cases)
        while time.monotonic() < t_end:
            for name, run in cases.items():
                n = 0
                cpu = _cpu_s(pid)
                for _ in range(20):
                    n += run()
                spent[name] += _cpu_s(pid) - cpu
                keys[name] += n
    return {name: spent[name] / keys[name] * 1e6 for name in cases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gcache.bench.chain_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per case")
    ap.add_argument("--items", type=int, default=64, help="items per frame / batch")
    ap.add_argument("--value-bytes", type=int, default=4096)
    ap.add_argument("--skip-servers", action="store_true", help="in-process only")
    args = ap.parse_args(argv)
    rows = in_process(args.seconds, args.items, args.value_bytes)
    if not args.skip_servers:
        rows.update(end_to_end(args.seconds, args.items, args.value_bytes))
    width = max(map(len, rows))
    for name, us in rows.items():
        print(f"{name:<{width}}  {us:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
