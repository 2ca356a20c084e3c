"""Check the online miss-ratio curve (``gcache.server.mrc``) against exact LRU replays.

One in-process run over a Mooncake FAST'25 trace: a server of ``capacity`` bytes (an
exact LRU: every page of each request is read, a missed page is put right after, as the
engine's L3 tier does) feeds its GETs and puts to a ``MissRatioCurve``; at every factor
``f`` an exact LRU of ``f x capacity`` replays the same requests (every page read, a
miss put). Prints one row per factor: the estimate, the exact hit rate and the error.

    python -m gcache.bench.mrc_check TRACE [--capacity-fraction 0.1] [--tracked-keys N]

``capacity`` is ``--capacity-fraction`` of the trace's unique pages (so 8x of 0.1 still
holds less than the whole working set).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from gcache.bench.workload import mooncake_trace
from gcache.server.mrc import FACTORS, MissRatioCurve

__all__ = ["ExactLRU", "check", "main"]


class ExactLRU:
    """A byte LRU of ``capacity`` bytes with demand fetch (a miss inserts)."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.used = 0
        self.items: OrderedDict[bytes, int] = OrderedDict()
        self.gets = self.hits = 0
        self.probes = self.found = 0

    def get(self, key: bytes, size: int, insert: bool = True) -> bool:
        """One read of ``key``; True on a hit. A miss puts it (``insert``)."""
        self.gets += 1
        items = self.items
        if key in items:
            items.move_to_end(key)
            self.hits += 1
            return True
        if insert:
            self.put(key, size)
        return False

    def put(self, key: bytes, size: int) -> None:
        items = self.items
        old = items.pop(key, None)
        if old is not None:
            self.used -= old
        items[key] = size
        self.used += size
        while self.used > self.capacity and items:
            self.used -= items.popitem(last=False)[1]

    def exists(self, key: bytes) -> bool:
        """An EXISTS (recency unchanged, as in the memory tier)."""
        self.probes += 1
        found = key in self.items
        self.found += found
        return found

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.gets if self.gets else 0.0

    @property
    def found_ratio(self) -> float:
        return self.found / self.probes if self.probes else 0.0


@dataclass(frozen=True, slots=True)
class Row:
    factor: float
    estimate: float
    exact: float

    @property
    def error(self) -> float:
        return self.estimate - self.exact


def check(trace: str, *, capacity_fraction: float = 0.1, page_bytes: int = 1 << 20,
          tracked_keys: int = 8192, sample_rate: float = 0.125, limit: int | None = None,
          ns: bytes = b"mooncake", flow: str = "get") -> tuple[list[Row], dict]:
    """Run the check; returns the rows and the curve's snapshot. ``flow``: ``get`` (every
    page read, a miss put) or ``exists`` (EXISTS every page, read the prefix that
    exists, put the missing pages: the hit rate is then EXISTS's)."""
    steps = list(mooncake_trace(trace, limit))
    unique = len({k for s in steps for k in s.page_keys})
    capacity = max(page_bytes, int(capacity_fraction * unique * page_bytes))
    server = ExactLRU(capacity)
    curve = MissRatioCurve(capacity, tracked_keys=tracked_keys, sample_rate=sample_rate)
    exact = [ExactLRU(f * capacity) for f in FACTORS]
    for s in steps:
        if flow == "get":
            for k in s.page_keys:
                hit = server.get(k, page_bytes, insert=False)
                curve.on_get(ns, k, page_bytes if hit else None)
                if not hit:
                    server.put(k, page_bytes)
                    curve.on_put(ns, k, page_bytes)
                for e in exact:
                    e.get(k, page_bytes)
            continue
        for lru, feed in [(server, curve)] + [(e, None) for e in exact]:
            found = [lru.exists(k) for k in s.page_keys]
            if feed is not None:
                for k, f in zip(s.page_keys, found):
                    feed.on_exists(ns, k, f)
            for k, f in zip(s.page_keys, found):
                if not f:
                    break
                lru.get(k, page_bytes)  # the prefix that exists is read
                if feed is not None:
                    feed.on_get(ns, k, page_bytes)
            for k, f in zip(s.page_keys, found):
                if not f:
                    lru.put(k, page_bytes)  # the missing pages are put
                    if feed is not None:
                        feed.on_put(ns, k, page_bytes)
    snap = curve.snapshot()
    est = snap["namespaces"]["*"]["hit_ratio"]
    snap["unique_pages"] = unique
    snap["server_hit_ratio"] = server.hit_ratio
    ratio = (lambda e: e.hit_ratio) if flow == "get" else (lambda e: e.found_ratio)
    return [Row(f, est[i], ratio(exact[i])) for i, f in enumerate(FACTORS)], snap


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gcache.bench.mrc_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--capacity-fraction", type=float, default=0.1)
    ap.add_argument("--tracked-keys", type=int, default=8192)
    ap.add_argument("--sample-rate", type=float, default=0.125,
                    help="the curve's starting (and highest) sample rate")
    ap.add_argument("--flow", choices=("get", "exists"), default="get",
                    help="get: every page read, a miss put; exists: EXISTS every page, "
                    "read the prefix that exists, put the missing (SGLang's HiCache)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    rows, snap = check(a.trace, capacity_fraction=a.capacity_fraction,
                       tracked_keys=a.tracked_keys, sample_rate=a.sample_rate, limit=a.limit,
                       flow=a.flow)
    secs = time.monotonic() - t0
    if a.json:
        print(json.dumps({"rows": [[r.factor, r.estimate, r.exact, r.error] for r in rows],
                          "snapshot": snap, "seconds": secs}))
        return 0
    print(f"flow {a.flow}, unique pages {snap['unique_pages']:,}, "
          f"capacity fraction {a.capacity_fraction}, "
          f"tracked keys {a.tracked_keys:,}, final sample rate {snap['sample_rate']:.4f}, "
          f"{secs:.1f} s")
    print("| factor | estimate | exact | error |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r.factor:g}x | {r.estimate:.4f} | {r.exact:.4f} | {r.error:+.4f} |")
    return 0 if all(abs(r.error) <= 0.03 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
