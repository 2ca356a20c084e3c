"""Measurement core of ``gcache-bench``: one case = op x size x batch x concurrency.

Design: a case owns a working set of keys (``max(batch*4, ~256 MiB worth)``,
capped at ~50% of cluster capacity) whose values are oracle-filled numpy
buffers, so any get can be verified from the key alone. Gets prefill the
working set first; puts overwrite it. Destination buffers are allocated and
touched before the clock starts. ``concurrency`` threads share one Client;
they warm up, meet at a barrier (which starts the clock), then each issues
``batch``-key calls over its own rotation of the working set until the
duration and/or iteration budget is spent. Latency is timed per call; wall
time runs from the barrier to the last thread's end. Keys are deleted after
each case so cases do not fight over slab pages.

The raw-socket baseline (``measure_baseline``) runs loopback TCP with the
same chunk sizes, so a reader can compare gcache with what the box can do.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from gcache.bench.raw_socket import RawSocketPeer
from gcache.config import format_size
from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, fill_value

__all__ = ["TARGET_BYTES", "cluster_capacity", "measure_baseline", "raw_gbps", "run_case",
           "working_set_keys"]

TARGET_BYTES = 256 << 20
"""Working-set size a case aims for (more keys than the batch, so gets rotate)."""
WARMUP_BATCHES = 2
_CHUNK_BYTES = 64 << 20  # prefill / cleanup call size


def _footprint(size: int) -> int:
    """Rough arena bytes one object of ``size`` takes (header + size-class slack)."""
    return size + size // 16 + 4096


def working_set_keys(size: int, batch: int, capacity: int | None) -> int:
    """max(batch*4, TARGET_BYTES/size) keys, capped at ~50% of capacity, >= batch."""
    n = max(batch * 4, -(-TARGET_BYTES // size))
    if capacity:
        n = min(n, capacity // 2 // _footprint(size))
    return max(n, batch)


def cluster_capacity(client: Client) -> int | None:
    """Sum of the servers' arena capacities (None if no server answered STATS)."""
    caps = [s.get("capacity_bytes", 0) for s in client.stats().values()]
    return sum(caps) or None


def _chunks(n: int, size: int) -> list[slice]:
    step = max(1, min(4096, _CHUNK_BYTES // size))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _percentiles(ns: np.ndarray) -> tuple[float, float]:
    if not len(ns):
        return 0.0, 0.0
    p50, p99 = np.percentile(ns, [50, 99])
    return float(p50) / 1e3, float(p99) / 1e3


def run_case(client: Client, op: str, size: int, batch: int, concurrency: int, *,
             duration: float | None, iters: int | None, verify: bool = False,
             capacity: int | None = None, tag: str = "") -> dict[str, Any]:
    """Run one case and return its result row (see module docstring)."""
    if duration is None and iters is None:
        raise ValueError("need a duration or an iteration count")
    n = working_set_keys(size, batch, capacity)
    keys = [b"bench/%s/%d/%d" % (tag.encode(), size, i) for i in range(n)]
    src = np.empty((n, size), dtype=np.uint8)
    for k, row in zip(keys, src):
        fill_value(k, row)
    rows = list(src)
    kinds: Counter[str] = Counter()
    if op == "get":  # prefill the working set, then drop the source buffers
        for sl in _chunks(n, size):
            kinds.update(Status(s).name for s in client.put_batch_from(keys[sl], rows[sl])
                         if s != Status.OK)
        src = rows = None
    prefill_errors = sum(kinds.values())

    groups = -(-n // batch)
    gkeys = [[keys[(g * batch + j) % n] for j in range(batch)] for g in range(groups)]
    gsrc = ([[rows[(g * batch + j) % n] for j in range(batch)] for g in range(groups)]
            if op == "put" else None)
    clock: dict[str, float] = {}
    barrier = threading.Barrier(concurrency, action=lambda: clock.setdefault(
        "start", time.perf_counter()))
    results: list[dict[str, Any]] = [{} for _ in range(concurrency)]

    def worker(t: int) -> None:
        try:
            if op == "get":
                dst = np.empty((batch, size), dtype=np.uint8)
                dst.fill(0)  # touch the pages before timing
                bufs = list(dst)

                def call(g: int) -> list[Status]:
                    return client.get_batch_into(gkeys[g], bufs)
            else:
                def call(g: int) -> list[Status]:
                    return client.put_batch_from(gkeys[g], gsrc[g])
            g = t * groups // concurrency
            for _ in range(WARMUP_BATCHES):
                call(g)
                g = (g + 1) % groups
            barrier.wait()
            deadline = clock["start"] + duration if duration is not None else None
            lat: list[int] = []
            bad: Counter[str] = Counter()
            ok = 0
            while (iters is None or len(lat) < iters) and (
                    deadline is None or time.perf_counter() < deadline):
                t0 = time.perf_counter_ns()
                st = call(g)
                lat.append(time.perf_counter_ns() - t0)
                for k, s, i in zip(gkeys[g], st, range(batch)):
                    if s != Status.OK:
                        bad[Status(s).name] += 1
                    elif verify and op == "get" and not check_value(k, bufs[i]):
                        bad["VERIFY"] += 1
                    else:
                        ok += 1
                g = (g + 1) % groups
            results[t] = {"lat": lat, "bad": bad, "ok": ok, "end": time.perf_counter()}
        except BaseException as exc:  # surface in the main thread
            barrier.abort()
            results[t] = {"exc": exc}

    threads = [threading.Thread(target=worker, args=(t,), name=f"bench-{t}", daemon=True)
               for t in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    excs = [r["exc"] for r in results if "exc" in r]
    if excs:  # prefer the root cause over the other threads' BrokenBarrierError
        raise next((e for e in excs if not isinstance(e, threading.BrokenBarrierError)), excs[0])

    for sl in _chunks(n, size):  # free the slab pages for the next case
        client.delete_batch(keys[sl])

    lat_ns = np.array([x for r in results for x in r["lat"]], dtype=np.float64)
    for r in results:
        kinds.update(r["bad"])
    ok_keys = sum(r["ok"] for r in results)
    elapsed = max(max(r["end"] for r in results) - clock["start"], 1e-9)
    p50, p99 = _percentiles(lat_ns)
    key_p50, _ = _percentiles(lat_ns / batch)
    return {
        "op": op, "size": size, "batch": batch, "concurrency": concurrency,
        "gbps": ok_keys * size / 1e9 / elapsed,
        "keys_per_s": ok_keys / elapsed,
        "p50_us": p50, "p99_us": p99, "key_p50_us": key_p50,
        "errors": sum(kinds.values()), "error_kinds": dict(kinds),
        "prefill_errors": prefill_errors,
        "batches": int(len(lat_ns)), "seconds": elapsed, "working_set_keys": n,
        "vs_raw": None,
    }


BASELINE_BYTES = 1 << 30  # long enough (~0.3 s) that one scheduler hiccup can't dominate


def measure_baseline(sizes: list[int], *, repeats: int = 5, rtt_iters: int = 2000
                     ) -> dict[str, Any]:
    """Loopback TCP: stream GB/s per direction and chunk size (median of ``repeats``
    transfers of max(1 GiB, 4 chunks)) over ONE connection, plus 64-byte ping-pong
    RTT. The SDK stripes over ``conns_per_server`` connections, so it can beat this."""
    stream: dict[str, dict[str, dict[str, Any]]] = {"get": {}, "put": {}}
    with RawSocketPeer() as peer:
        for size in sizes:
            total = max(BASELINE_BYTES, 4 * size)
            for direction in ("get", "put"):
                runs = [peer.stream(total, size, direction) for _ in range(repeats)]
                best = dict(runs[0], gbps=statistics.median(r["gbps"] for r in runs))
                stream[direction][format_size(size)] = best
        rtt = peer.rtt(64, rtt_iters)
    return {"connections": 1, "stream": stream, "rtt": rtt}


def raw_gbps(baseline: dict[str, Any] | None, op: str, size: int) -> float | None:
    """The baseline stream GB/s matching a case, if measured."""
    if not baseline:
        return None
    entry = baseline["stream"].get(op, {}).get(format_size(size))
    return entry["gbps"] if entry else None
