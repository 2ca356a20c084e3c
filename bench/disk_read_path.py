"""The server's NVMe-tier read path alone, in-process: items/s and CPU per item against a
raw pread of the same records (a measurement driver).

Builds a ``TieredStore`` (a small memory tier in front of a ``SegmentLog`` under
``--dir``), puts ``--values`` values of ``--size`` bytes so nearly all of them are
demoted, then for ``--duration`` seconds runs ``--threads`` threads, each pinning
frames of ``--frame`` random disk-resident keys (``pin_read_many``, what a GET frame
does; its disk reads go through the tier's IO threads) and unpinning them. Then as
many threads ``preadv`` the tier's records (``disk_baseline.measure_raw_pread``,
O_DIRECT when the tier uses it) one at a time, for the same time. No sockets, no
client: what is left of a gap between the two is the server's own per-item work. One
line of JSON on stdout:

    python -m gcache.bench.disk_read_path --frame 16 --threads 4 --duration 3

``cpu_us_item`` is this process's CPU (user + sys) per item during the tier phase.
Not part of ``gcache-bench``: a tool for profiling and A/B runs (see RESULTS).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import threading
import time

import numpy as np

from gcache.bench.disk_baseline import measure_raw_pread
from gcache.server.arena import Arena
from gcache.server.disk import SegmentLog
from gcache.server.memory_tier import MemoryTier
from gcache.server.tiered_store import TieredStore
from gcache.server.tiering import make_promote_policy
from gcache.status import Status

NS = b"bench"


def _timed(threads: int, duration: float, body) -> tuple[int, float, float]:
    """Run ``body(stop_at) -> items`` on ``threads`` threads: (items, wall s, CPU s)."""
    counts: list[int] = []
    stop_at = time.monotonic() + duration
    ts = [threading.Thread(target=lambda: counts.append(body(stop_at)))
          for _ in range(threads)]
    c0, t0 = time.process_time(), time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts), time.monotonic() - t0, time.process_time() - c0


def run(frame: int, threads: int, duration: float, size: int, values: int,
        parent: str) -> dict:
    root = tempfile.mkdtemp(prefix="gcache-disk-read-path-", dir=parent)
    arena_path = os.path.join("/dev/shm", f"gcache-disk-read-path-{os.getpid()}")
    st = None
    try:
        arena = Arena(arena_path, 32 << 20, 1 << 20, prefault=False)
        mem = MemoryTier(arena, high_watermark=0.8, low_watermark=0.5)
        disk = SegmentLog(root, "bench", capacity_bytes=2 * values * size + (256 << 20),
                          segment_bytes=64 << 20, max_value_bytes=max(size, 1 << 20))
        st = TieredStore(mem, disk, make_promote_policy("never", 1000, lambda: 0.0),
                         room_wait_s=0.0)
        value = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        keys = [b"k%08d" % i for i in range(values)]
        for i, k in enumerate(keys):
            slot = st.begin_put(NS, k, size, 0, size, 0)
            slot.view[:] = value
            st.finish_put(slot)
            if i % 64 == 0:
                st.step()  # demote past the watermark as we go
        st.step()
        on_disk = [k for k in keys if not mem.exists(NS, k) and disk.exists(NS, k)]

        def tier(stop_at: float) -> int:
            rnd, n = random.Random(), 0
            while time.monotonic() < stop_at:
                pins = st.pin_read_many(NS, [(k, 0, 1 << 40, 0)
                                             for k in rnd.sample(on_disk, frame)])
                bad = [p.status for p in pins if p.status != Status.OK]
                st.unpin_many(pins)
                if bad:
                    raise RuntimeError(f"disk reads failed: {bad[:3]}")
                n += frame
            return n

        n_t, wall_t, cpu_t = _timed(threads, duration, tier)
        raw = measure_raw_pread(disk.root, threads=threads, seconds=duration,
                                direct=disk.direct)
        return {"frame": frame, "threads": threads, "size": size, "on_disk": len(on_disk),
                "direct_io": disk.direct, "tier_items_per_s": round(n_t / wall_t),
                "raw_items_per_s": round(raw["reads_per_s"]),
                "ratio": round(n_t / wall_t / raw["reads_per_s"], 3),
                "cpu_us_item": round(cpu_t / n_t * 1e6, 1)}
    finally:
        if st is not None:
            st.close()
        shutil.rmtree(root, ignore_errors=True)
        try:
            os.unlink(arena_path)
        except FileNotFoundError:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frame", type=int, default=16, help="keys per pinned frame")
    ap.add_argument("--threads", type=int, default=4, help="frames pinned at once")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per phase")
    ap.add_argument("--size", type=int, default=64 << 10, help="value bytes")
    ap.add_argument("--values", type=int, default=6000, help="values written")
    ap.add_argument("--dir", default="/var/tmp", help="parent of the segment log")
    a = ap.parse_args()
    print(json.dumps(run(a.frame, a.threads, a.duration, a.size, a.values, a.dir)))


if __name__ == "__main__":
    main()
