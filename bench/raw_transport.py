"""Raw transport throughput from one process: the data path without the SDK around it.

``gcache-bench --raw-transport`` answers "how fast can this transport move bytes out
of a server's arena", the figure GCache reports as 170 GB/s of 1 MiB RDMA reads.
One process, ``threads`` threads, each with its own transport object (and for nixl
its own registered destination buffer): a thread leases ``count`` objects of
``size`` bytes once (LEASE; re-leased every second so no lease nears its bound),
then moves them into its preallocated destinations again and again with the
transport's byte mover alone — one NIXL READ per batch, or one memmove per object
for shm. ``tcp`` has no lease: a thread sends GET frames for the same objects on
one connection and receives them straight into the destinations (``recv_into``).
No dispatcher, futures or per-key bookkeeping are timed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from gcache.credentials import ClientCredential, parse_client_credential
from gcache.protocol import Limits, Op
from gcache.sdk import Client, Status
from gcache.sdk.transports.base import GetItem, Work
from gcache.sdk.transports.tcp import TcpTransport

RELEASE_EVERY_S = 1.0


def _transport(kind: str, address: str, token: str | ClientCredential) -> Any:
    if kind == "tcp":
        return TcpTransport(address, token, Limits(), 5.0)
    if kind == "shm":
        from gcache.sdk.transports.shm import ShmTransport

        return ShmTransport(address, token, Limits(), 5.0, "shm")
    from gcache.sdk.transports.nixl import NixlTransport

    return NixlTransport(address, token, Limits(), 5.0, "nixl")


def measure_raw_transport(address: str, kind: str, *, size: int = 1 << 20, count: int = 64,
                          seconds: float = 3.0, threads: int = 1, token: str = "",
                          namespace: str = "rawbench", credential: str = "") -> dict[str, Any]:
    """GB/s of ``kind`` (tcp|shm|nixl) reads of ``count`` x ``size`` from ``address``
    (authenticated with ``credential`` 'id:secret' when given, else ``token``)."""
    auth = parse_client_credential(credential) if credential else token
    ns = namespace.encode()
    keys = [b"raw/%d/%d" % (size, i) for i in range(count)]
    with Client([address], namespace=namespace, token=token, credential=credential or None,
                transport="tcp", timeout_ms=30_000) as c:
        vals = [np.full(size, i % 251, dtype=np.uint8) for i in range(count)]
        st = c.put_batch_from(keys, vals)
        if any(s != Status.OK for s in st):
            raise RuntimeError(f"prefill failed: {set(Status(s).name for s in st)}")
    moved = [0] * threads
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads + 1)
    stop = threading.Event()

    def worker(w: int) -> None:
        t = _transport(kind, address, auth)
        dst = np.empty((count, size), dtype=np.uint8)
        dst.fill(1)  # prefault before timing
        reg = None
        try:
            t.connect(time.monotonic() + 10)
            if kind == "nixl":
                from gcache.sdk.transports.nixl import REGISTRY

                REGISTRY.add(dst)
                reg = dst
            views = [memoryview(row) for row in dst]
            if kind == "tcp":
                items = [GetItem(k, 0, size, 0, v) for k, v in zip(keys, views)]

                def lease() -> Any:
                    return None

                def once(_h: Any) -> None:
                    res = t.execute(Work(Op.GET, ns, items, time.monotonic() + 30, None))
                    if any(r.status != Status.OK for r in res):
                        raise RuntimeError("raw GET missed")
            else:
                def lease() -> Any:
                    rep = t.call(Op.LEASE, {"ns": ns, "items": [[k, 0] for k in keys]},
                                  time.monotonic() + 10)
                    ls = rep["items"]
                    if any(x[0] != Status.OK for x in ls):
                        raise RuntimeError("raw LEASE missed (BUSY or MISS)")
                    copies = [(v, x[3], size, False) for v, x in zip(views, ls)]
                    return [x[4] for x in ls], copies, time.monotonic()

                def once(h: Any) -> None:
                    t.move_in(h[1], time.monotonic(), time.monotonic() + 30)
            h = lease()
            barrier.wait()
            while not stop.is_set():
                once(h)
                moved[w] += count * size
                if h is not None and time.monotonic() - h[2] > RELEASE_EVERY_S:
                    t.call(Op.RELEASE, {"leases": h[0]}, time.monotonic() + 10)
                    h = lease()
            if h is not None:
                t.call(Op.RELEASE, {"leases": h[0]}, time.monotonic() + 10)
            if int(dst[count - 1, size - 1]) != (count - 1) % 251:
                raise RuntimeError("raw transport read wrong bytes")
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            if reg is not None:
                from gcache.sdk.transports.nixl import REGISTRY

                REGISTRY.remove(reg)
            t.close()

    ths = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(threads)]
    for th in ths:
        th.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    base = sum(moved)
    time.sleep(seconds)
    total = sum(moved) - base
    elapsed = time.perf_counter() - t0
    stop.set()
    for th in ths:
        th.join(60)
    if errors:
        raise errors[0]
    with Client([address], namespace=namespace, token=token, credential=credential or None,
                transport="tcp") as c:
        c.delete_batch(keys)
    return {"op": "raw-read", "transport": kind, "size": size, "batch": count,
            "concurrency": threads, "gbps": total / elapsed / 1e9,
            "keys_per_s": total / size / elapsed, "seconds": elapsed}
