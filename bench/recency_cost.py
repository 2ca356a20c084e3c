"""Cost of one recency snapshot (``MemoryTier.snapshot_recency``), in-process.

    python -m gcache.bench.recency_cost [--objects 100000] [--policy lru] [--runs 3]

Fills a throwaway arena in /dev/shm with ``--objects`` small objects, then times a whole
snapshot (median of ``--runs``), the one long lock hold (the copy of the policy's order)
and one 1024-object batch of rank writes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from gcache.config import EVICTION_POLICIES
from gcache.server.arena import Arena
from gcache.server.eviction import make_policy
from gcache.server.memory_tier import _RANK_BATCH, MemoryTier
from gcache.status import Status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gcache.bench.recency_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=100_000)
    ap.add_argument("--policy", choices=EVICTION_POLICIES, default="lru")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    n = args.objects
    path = f"/dev/shm/gcache-recency-cost-{os.getpid()}.arena"
    m = MemoryTier(Arena(path, (n + 64) * 4096 + (64 << 20), 1 << 20, prefault=False),
                   eviction_policy=make_policy(args.policy), recency_snapshot_s=0)
    try:
        for i in range(n):
            slot = m.begin_put(b"ns", b"k%09d" % i, 100, 0, 100, 0)
            assert slot.status == Status.OK, slot.status
            slot.view[:] = b"x" * 100
            assert m.finish_put(slot) == Status.OK
        runs = []
        for _ in range(args.runs):
            t = time.perf_counter()
            m.snapshot_recency()
            runs.append(time.perf_counter() - t)
        t = time.perf_counter()
        with m._lock:
            order = list(m.policy.saved_order())
        copy = time.perf_counter() - t
        t = time.perf_counter()
        with m._lock:
            m.do_write_ranks(order, 1, 0, min(_RANK_BATCH, n))
        batch = time.perf_counter() - t
        med = statistics.median(runs)
        print(f"{args.policy}: {n} objects, snapshot {med:.3f} s ({med / n * 1e6:.2f} us per "
              f"object), order copy {copy * 1e3:.1f} ms, one {_RANK_BATCH}-object batch "
              f"{batch * 1e3:.2f} ms")
    finally:
        m.close(clean=False)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
