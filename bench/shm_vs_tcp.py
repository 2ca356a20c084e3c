"""shm vs tcp batch get throughput on one local server (issue 6).

Run: .venv/bin/python -m gcache.bench.shm_vs_tcp
Starts one local server (2 GiB arena, 8 MiB slabs), stores N values per size, then times
``get_batch_into`` of the whole set (5 reps after a warm-up) with Client(transport=tcp|shm).
"""

from __future__ import annotations

import time

import numpy as np

from gcache.sdk.client import Client
from gcache.testing.cluster import Cluster

CASES = ((64 << 10, 2048), (1 << 20, 256), (4 << 20, 64))


def main(reps: int = 5) -> None:
    with Cluster(1, "2GiB", slab="8MiB", prefix="shmbench") as c:
        for size, n in CASES:
            res = {}
            for mode in ("tcp", "shm"):
                with Client(c.addresses, transport=mode, timeout_ms=10000) as cl:
                    keys = [f"{size}-{i}" for i in range(n)]
                    vals = [np.full(size, i % 251, dtype=np.uint8) for i in range(n)]
                    assert all(s == 0 for s in cl.put_batch_from(keys, vals))
                    bufs = [np.empty(size, dtype=np.uint8) for _ in range(n)]
                    cl.get_batch_into(keys, bufs)  # warm-up (maps pages)
                    t = time.perf_counter()
                    for _ in range(reps):
                        st = cl.get_batch_into(keys, bufs)
                    dt = time.perf_counter() - t
                    assert all(s == 0 for s in st)
                    assert all(int(b[0]) == i % 251 for i, b in enumerate(bufs))
                    res[mode] = size * n * reps / dt / 1e9
            print(f"get_batch_into {size >> 10} KiB x {n}: tcp {res['tcp']:.2f} GB/s, "
                  f"shm {res['shm']:.2f} GB/s ({res['shm'] / res['tcp']:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
