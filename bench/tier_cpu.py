"""Per-item CPU of the memory tier's put work, in-process (a measurement driver).

A ``MemoryTier`` over a fresh arena in ``--dir``, no server, no socket, no copy: the
work a PUT or PUT_STAGED frame's items cost the tier (reserve, header, allocator,
commit, index, eviction order, the miss-ratio curve's observer), with the value bytes
left as the arena had them and each digest handed in, as the server does once
``read_staged`` hashed the bytes. Rounds alternate the two ways a frame's items reach
the tier: one ``begin_put`` / ``finish_put`` per item (``one``) and one
``begin_puts`` / ``finish_puts`` per frame (``batch``), so drift lands on both. Each
round puts every key once (keys replace themselves after the first round, as a
steady write load does), and reports this thread's CPU per item.

    python -m gcache.bench.tier_cpu --size 64KiB --batch 1024 --keys 4096 --rounds 7

One line of JSON on stdout: each mode's CPU-us per item per round and its median.
Not part of ``gcache-bench``: a tool for A/B runs of the tier's Python (RESULTS).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

from gcache.config import parse_size
from gcache.server.arena import Arena
from gcache.server.memory_tier import MemoryTier
from gcache.server.mrc import MissRatioCurve
from gcache.server.tier import PutRequest
from gcache.status import Status

NS = b"bench"
DIGEST = 0x5EED  # no expected checksum is sent, so any digest publishes


def _one(mt: MemoryTier, keys: list[bytes], size: int) -> None:
    for k in keys:
        s = mt.begin_put(NS, k, size, 0, size, 0)
        if s.status != Status.OK:
            raise RuntimeError(f"begin_put: {s.status.name}")
        mt.finish_put(s, digest=DIGEST)


def _batch(mt: MemoryTier, keys: list[bytes], size: int) -> None:
    slots = mt.begin_puts(NS, [PutRequest(k, size, 0, size, 0) for k in keys])
    if any(s.status != Status.OK for s in slots):
        raise RuntimeError(f"begin_puts: {[s.status.name for s in slots][:4]}")
    mt.finish_puts(slots, digests=[DIGEST] * len(slots))


def run(size: int, batch: int, nkeys: int, rounds: int, memory: int, directory: str
        ) -> dict:
    path = os.path.join(directory, f"tiercpu-{os.getpid()}.arena")
    arena = Arena(path, memory, 16 << 20 if size <= 8 << 20 else 64 << 20, prefault=True)
    try:
        mt = MemoryTier(arena, access_observer=MissRatioCurve(arena.npages * arena.slab_bytes))
        keys = [b"tier-cpu/%d" % i for i in range(nkeys)]
        frames = [keys[i:i + batch] for i in range(0, nkeys, batch)]
        gc.collect()
        gc.freeze()  # as the server does after recovery (server.cli.tune_gc)
        gc.set_threshold(20_000, 20, 20)
        modes = {"one": _one, "batch": _batch}
        for f in frames:  # warm up: every key exists, so rounds replace
            _batch(mt, f, size)
        per: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for m in order:
                t0 = time.thread_time()
                for f in frames:
                    modes[m](mt, f, size)
                per[m].append(round((time.thread_time() - t0) / nkeys * 1e6, 2))
        mt.close()
    finally:
        os.unlink(path)
    return {"size": size, "batch": batch, "keys": nkeys, "rounds": rounds,
            "us_per_item": per,
            "median": {m: statistics.median(v) for m, v in per.items()},
            "batch_over_one": round(statistics.median(per["batch"])
                                    / statistics.median(per["one"]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="64KiB", help="value bytes")
    ap.add_argument("--batch", type=int, default=1024, help="items per frame")
    ap.add_argument("--keys", type=int, default=4096, help="keys put each round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--memory", default="1GiB", help="arena bytes (room for every key)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm")
                    else tempfile.gettempdir(), help="where the arena file lives")
    a = ap.parse_args()
    print(json.dumps(run(parse_size(a.size), a.batch, a.keys, a.rounds,
                         parse_size(a.memory), a.dir)), flush=True)


if __name__ == "__main__":
    main()
