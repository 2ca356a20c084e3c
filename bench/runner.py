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
``measure_memcpy`` times a single-thread memcpy of the case's value size (from a
working set out of the caches) just before each shm case, the ceiling a shm copy is
compared with ("vs memcpy"), measured moments from it on the same noisy machine.

Disk tier (``--tier disk``): the case's working set targets ``target`` bytes
capped by the disk capacity, and ``after_prefill`` runs once the working set
is written — the CLI waits there for demotion to settle and measures the raw
pread baseline over the server's segment files, so both numbers come from the
same bytes on the same disk. ``run_demotion_impact`` measures foreground get
latency on a small hot set, first alone, then while a paced background put
stream pushes memory past its watermark (so the mover demotes all the time).
"""

from __future__ import annotations

import inspect
import multiprocessing
import statistics
import threading
import time
from collections import Counter
from typing import Any, Callable

import numpy as np

from gcache.bench.raw_socket import RawSocketPeer
from gcache.config import format_size
from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, fill_value

__all__ = ["TARGET_BYTES", "cluster_capacity", "measure_baseline", "measure_memcpy", "raw_gbps",
           "raw_latency", "run_case", "run_demotion_impact", "working_set_keys"]

TARGET_BYTES = 256 << 20
"""Working-set size a case aims for (more keys than the batch, so gets rotate)."""
WARMUP_BATCHES = 2
_CHUNK_BYTES = 64 << 20  # prefill / cleanup call size


def _footprint(size: int) -> int:
    """Rough arena bytes one object of ``size`` takes (header + size-class slack)."""
    return size + size // 16 + 4096


def working_set_keys(size: int, batch: int, capacity: int | None,
                     target: int = TARGET_BYTES) -> int:
    """max(batch*4, target/size) keys, capped at ~50% of capacity, >= batch."""
    n = max(batch * 4, -(-target // size))
    if capacity:
        n = min(n, capacity // 2 // _footprint(size))
    return max(n, batch)


def cluster_capacity(client: Client) -> int | None:
    """Sum of the servers' arena capacities (None if no server answered STATS)."""
    caps = [s.get("capacity_bytes", 0) for s in client.stats().values()]
    return sum(caps) or None


def _chunks(n: int, size: int, chunk_bytes: int = _CHUNK_BYTES) -> list[slice]:
    step = max(1, min(4096, chunk_bytes // size))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _percentiles(ns: np.ndarray) -> tuple[float, float]:
    if not len(ns):
        return 0.0, 0.0
    p50, p99 = np.percentile(ns, [50, 99])
    return float(p50) / 1e3, float(p99) / 1e3


def run_case(client: Client, op: str, size: int, batch: int, concurrency: int, *,
             duration: float | None, iters: int | None, verify: bool = False,
             capacity: int | None = None, tag: str = "", target: int = TARGET_BYTES,
             after_prefill: Callable[[], dict[str, Any]] | None = None,
             rounds: int = 1, before_round: Callable[[], float] | None = None,
             prefill_bytes: int = _CHUNK_BYTES, register: bool = False) -> dict[str, Any]:
    """Run one case and return its result row (see module docstring).

    ``register`` registers the case's source (puts) and destination (gets) buffers with
    the client (``Client.register_buffer``: the nixl transport then moves them with no
    local copy) and unregisters them at the end.

    ``rounds`` > 1 splits ``duration`` into timed rounds; ``before_round`` runs before
    each (all workers wait) and returns a reference GB/s for that round (the raw pread
    baseline), so the row carries paired per-round ratios measured moments apart.
    ``prefill_bytes`` bounds one prefill call: puts in flight are not demotable, so a
    small memory tier in front of a disk tier needs smaller calls.
    """
    if duration is None and iters is None:
        raise ValueError("need a duration or an iteration count")
    if rounds > 1 and duration is None:
        raise ValueError("rounds need a duration")
    n = working_set_keys(size, batch, capacity, target)
    keys = [b"bench/%s/%d/%d" % (tag.encode(), size, i) for i in range(n)]
    src = np.empty((n, size), dtype=np.uint8)
    for k, row in zip(keys, src):
        fill_value(k, row)
    rows = list(src)
    kinds: Counter[str] = Counter()
    if op in ("get", "exists"):  # prefill the working set, then drop the source buffers
        for sl in _chunks(n, size, prefill_bytes):
            kinds.update(Status(s).name for s in client.put_batch_from(keys[sl], rows[sl])
                         if s != Status.OK)
        src = rows = None
    prefill_errors = sum(kinds.values())
    extra = after_prefill() if after_prefill is not None else {}
    registered: list[np.ndarray] = []
    if register and op == "put":
        client.register_buffer(src)
        registered.append(src)

    groups = -(-n // batch)
    gkeys = [[keys[(g * batch + j) % n] for j in range(batch)] for g in range(groups)]
    gsrc = ([[rows[(g * batch + j) % n] for j in range(batch)] for g in range(groups)]
            if op == "put" else None)
    clock: dict[str, float] = {}
    seg = duration / rounds if duration is not None else None
    starts: list[float] = []
    ends: list[float] = []
    refs: list[float] = []

    def start_round() -> None:
        if before_round is not None:
            refs.append(before_round())
        starts.append(time.perf_counter())
        clock.setdefault("start", starts[-1])

    barrier = threading.Barrier(concurrency, action=start_round)
    end_barrier = threading.Barrier(concurrency, action=lambda: ends.append(time.perf_counter()))
    results: list[dict[str, Any]] = [{} for _ in range(concurrency)]

    def worker(t: int) -> None:
        try:
            if op == "get":
                dst = np.empty((batch, size), dtype=np.uint8)
                dst.fill(0)  # touch the pages before timing
                bufs = list(dst)
                if register:
                    client.register_buffer(dst)
                    registered.append(dst)

                def call(g: int) -> list[Status]:
                    return client.get_batch_into(gkeys[g], bufs)
            elif op == "exists":
                def call(g: int) -> list[Status]:
                    return [Status.OK if e else Status.MISS
                            for e in client.exists_batch(gkeys[g])]
            else:
                def call(g: int) -> list[Status]:
                    return client.put_batch_from(gkeys[g], gsrc[g])
            g = t * groups // concurrency
            for _ in range(WARMUP_BATCHES):
                call(g)
                g = (g + 1) % groups
            lat: list[int] = []
            bad: Counter[str] = Counter()
            ok = 0
            per_round: list[int] = []
            for _r in range(rounds):
                barrier.wait()
                deadline = starts[-1] + seg if seg is not None else None
                ok_before = ok
                n_calls = 0
                while (iters is None or n_calls < iters) and (
                        deadline is None or time.perf_counter() < deadline):
                    t0 = time.perf_counter_ns()
                    st = call(g)
                    lat.append(time.perf_counter_ns() - t0)
                    n_calls += 1
                    for k, s, i in zip(gkeys[g], st, range(batch)):
                        if s != Status.OK:
                            bad[Status(s).name] += 1
                        elif verify and op == "get" and not check_value(k, bufs[i]):
                            bad["VERIFY"] += 1
                        else:
                            ok += 1
                    g = (g + 1) % groups
                per_round.append(ok - ok_before)
                end_barrier.wait()
            results[t] = {"lat": lat, "bad": bad, "ok": ok, "rounds": per_round}
        except BaseException as exc:  # surface in the main thread
            barrier.abort()
            end_barrier.abort()
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

    for buf in registered:
        client.unregister_buffer(buf)
    for sl in _chunks(n, size):  # free the slab pages for the next case
        client.delete_batch(keys[sl])

    lat_ns = np.array([x for r in results for x in r["lat"]], dtype=np.float64)
    for r in results:
        kinds.update(r["bad"])
    ok_keys = sum(r["ok"] for r in results)
    spans = [max(e - s, 1e-9) for s, e in zip(starts, ends)]
    elapsed = sum(spans)
    round_gbps = [sum(r["rounds"][i] for r in results) * size / 1e9 / spans[i]
                  for i in range(rounds)]
    if refs:
        extra = dict(extra, round_gbps=round_gbps, round_ref_gbps=refs,
                     round_ratios=[g / r if r else None for g, r in zip(round_gbps, refs)])
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
        "vs_raw": None, **extra,
    }


BASELINE_BYTES = 1 << 30  # long enough (~0.3 s) that one scheduler hiccup can't dominate


def measure_baseline(sizes: list[int], *, repeats: int = 5, rtt_iters: int = 2000
                     ) -> dict[str, Any]:
    """Loopback TCP: stream GB/s per direction and chunk size (median of ``repeats``
    transfers of max(1 GiB, 4 chunks)) over ONE connection, the 64-byte ping-pong RTT,
    and per size a request/reply (64 B out, one value back: ``request_reply``). The
    SDK stripes over ``conns_per_server`` connections, so it can beat the streams."""
    stream: dict[str, dict[str, dict[str, Any]]] = {"get": {}, "put": {}}
    with RawSocketPeer() as peer:
        for size in sizes:
            total = max(BASELINE_BYTES, 4 * size)
            for direction in ("get", "put"):
                runs = [peer.stream(total, size, direction) for _ in range(repeats)]
                best = dict(runs[0], gbps=statistics.median(r["gbps"] for r in runs))
                stream[direction][format_size(size)] = best
        rtt = peer.rtt(64, rtt_iters)
        # a 64 B request answered by one value: the floor of a single-key get's latency
        reply = {format_size(size): peer.request_reply(
            size, max(20, min(rtt_iters, REQREP_BYTES // size))) for size in sizes}
    return {"connections": 1, "stream": stream, "rtt": rtt, "request_reply": reply}


REQREP_BYTES = 256 << 20  # bytes one request/reply baseline moves at most (fewer rounds)


def raw_latency(baseline: dict[str, Any] | None, op: str, size: int) -> float | None:
    """The raw p50 (µs) a single-key case compares with: a 64 B request answered by
    ``size`` bytes for a get, the 64 B round trip for exists; None otherwise."""
    if not baseline:
        return None
    if op == "exists":
        return baseline["rtt"]["p50_us"]
    if op == "get":
        entry = baseline.get("request_reply", {}).get(format_size(size))
        return entry["p50_us"] if entry else None
    return None


MEMCPY_SOURCE_BYTES = 256 << 20  # a case's working set: more than the caches hold
MEMCPY_DEST_BYTES = 64 << 20  # one 1024 x 64 KiB batch of destination buffers


def measure_memcpy(size: int, *, seconds: float = 0.3, repeats: int = 3) -> float:
    """Single-thread ``memcpy`` GB/s of ``size``-byte copies from a 256 MiB source (as
    an arena's working set, out of the caches) into 64 MiB of destination buffers: the
    copy a shm get or staged put makes per value, with nothing else. Median of
    ``repeats`` runs of ``seconds`` each; both buffers are touched before timing."""
    import ctypes

    n_src = max(1, MEMCPY_SOURCE_BYTES // size)
    n_dst = max(1, MEMCPY_DEST_BYTES // size)
    src = np.ones(n_src * size, dtype=np.uint8)
    dst = np.ones(n_dst * size, dtype=np.uint8)
    sa, da = int(src.ctypes.data), int(dst.ctypes.data)
    move = ctypes.memmove
    runs = []
    i = 0
    for _ in range(repeats):
        copied, t0 = 0, time.perf_counter()
        while True:
            for _ in range(16):
                move(da + (i % n_dst) * size, sa + (i % n_src) * size, size)
                i += 1
            copied += 16 * size
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        runs.append(copied / dt / 1e9)
    return statistics.median(runs)


def raw_gbps(baseline: dict[str, Any] | None, op: str, size: int) -> float | None:
    """The baseline stream GB/s matching a case, if measured."""
    if not baseline:
        return None
    entry = baseline["stream"].get(op, {}).get(format_size(size))
    return entry["gbps"] if entry else None


def run_demotion_impact(addresses: list[str], *, size: int, batch: int, seconds: float,
                        bg_mbps: float, bg_size: int = 1 << 20, token: str = "",
                        namespace: str = "bench-impact") -> dict[str, Any]:
    """Foreground get latency on a memory-resident hot set: alone, then under a paced
    background put stream (``bg_mbps`` MB/s of ``bg_size`` values, new keys only) that
    keeps memory above its high watermark. Returns both latency summaries and the
    server's demotion / eviction counts during the busy phase. Both clients use TCP."""
    # over TCP: every foreground get is served by the server's threads, the ones that share
    # the process with the mover (a same-host shared-memory path would hide the contention)
    kw: dict[str, Any] = {"namespace": namespace, "token": token, "timeout_ms": 30_000}
    if "transport" in inspect.signature(Client).parameters:
        kw["transport"] = "tcp"
    fg = Client(addresses, **kw)
    bg = Client(addresses, **kw)  # STATS only; the put stream runs in its own process
    proc = stop = None
    try:
        hot = [b"hot/%d" % i for i in range(batch * 4)]
        src = np.empty((len(hot), size), dtype=np.uint8)
        for k, row in zip(hot, src):
            fill_value(k, row)
        if any(s != Status.OK for s in fg.put_batch_from(hot, list(src))):
            raise RuntimeError("hot-set prefill failed")
        dst = np.zeros((batch, size), dtype=np.uint8)
        bufs = list(dst)
        groups = [hot[i:i + batch] for i in range(0, len(hot) - batch + 1, batch)]

        def measure() -> dict[str, Any]:
            lat, kinds, g = [], Counter(), 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t0 = time.perf_counter_ns()
                st = fg.get_batch_into(groups[g % len(groups)], bufs)
                lat.append(time.perf_counter_ns() - t0)
                kinds.update(Status(s).name for s in st if s != Status.OK)
                g += 1
            p50, p99 = _percentiles(np.array(lat, dtype=np.float64))
            return {"calls": len(lat), "p50_us": p50, "p99_us": p99,
                    "errors": sum(kinds.values()), "error_kinds": dict(kinds)}

        def counters() -> dict[str, int]:
            st = next(iter(bg.stats().values()))
            return {k: st.get(k, 0) for k in ("demoted", "demoted_bytes", "evictions")}

        for _ in range(20):  # warm up connections and the hot set's pages
            fg.get_batch_into(groups[0], bufs)
        idle = measure()
        ctx = multiprocessing.get_context("spawn")
        stop = ctx.Event()
        bg_errors = ctx.Queue()
        proc = ctx.Process(target=_background_puts, daemon=True, args=(
            addresses, kw, bg_mbps, bg_size, stop, bg_errors))
        proc.start()
        start = counters()
        end = time.monotonic() + 60
        while time.monotonic() < end:  # memory fills past the watermark: demotion starts
            if not bg_errors.empty():
                stop.set()
                raise RuntimeError(f"background puts fail: {bg_errors.get()}")
            now = counters()
            if now["demoted"] + now["evictions"] > start["demoted"] + start["evictions"] + 16:
                break
            t_read = time.monotonic() + 0.1
            while time.monotonic() < t_read:  # keep the hot set hot meanwhile
                for grp in groups:
                    fg.get_batch_into(grp, bufs)
        before = counters()
        t0 = time.perf_counter()
        busy = measure()
        busy_s = time.perf_counter() - t0
        after = counters()
        stop.set()
        proc.join(30)
        errors: Counter[str] = Counter()
        while not bg_errors.empty():
            errors.update(bg_errors.get())
        moved = {k: after[k] - before[k] for k in before}
        return {"size": size, "batch": batch, "bg_mbps": bg_mbps, "idle": idle, "busy": busy,
                "busy_demoted_mbps": moved["demoted_bytes"] / 1e6 / busy_s,
                "busy_demoted": moved["demoted"], "busy_evictions": moved["evictions"],
                "bg_errors": dict(errors),
                "p99_ratio": busy["p99_us"] / idle["p99_us"] if idle["p99_us"] else None}
    finally:
        if proc is not None:
            stop.set()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        fg.close()
        bg.close()


def _background_puts(addresses: list[str], kw: dict[str, Any], mbps: float, size: int,
                     stop: Any, errors: Any) -> None:
    """Child process of ``run_demotion_impact``: put new keys at ``mbps`` MB/s until
    ``stop``; non-OK statuses go to the ``errors`` queue. A separate process, so the
    load generator does not share the measuring client's GIL."""
    src = np.empty((16, size), dtype=np.uint8)
    src.fill(0x5A)
    rows = list(src)
    with Client(addresses, **kw) as c:
        i, sent, t0 = 0, 0, time.perf_counter()
        while not stop.is_set():
            keys = [b"bg/%d" % (i + j) for j in range(len(rows))]
            bad = Counter(Status(s).name for s in c.put_batch_from(keys, rows) if s != Status.OK)
            if bad:
                errors.put(dict(bad))
            i += len(keys)
            sent += len(keys) * size
            ahead = sent / (mbps * 1e6) - (time.perf_counter() - t0)
            if ahead > 0:
                stop.wait(ahead)
