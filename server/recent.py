"""What a server did lately: ops/s, GET and PUT bytes/s, the GET hit ratio and the
frame-time p50/p99 over the last interval, from its own Prometheus counters.

``gcache status`` shows them per server and the masters' cluster page charts them: both
read them from the heartbeat stats (``Server.stats``), so nothing else is collected.
``RecentRates.sample`` diffs the counters against the previous sample; calls closer
than ``min_interval_s`` apart return the last figures (heartbeats, scrapes and STATS all
call it). Any thread; it holds its own lock only while it swaps snapshots.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

_READS = ("get", "lease")


def _snapshot(registry: CollectorRegistry) -> dict[str, Any]:
    """Counter totals: items by (op, status), bytes by direction, frame-time buckets."""
    items: dict[tuple[str, str], float] = {}
    moved: dict[str, float] = {}
    buckets: dict[float, float] = {}
    frames = 0.0
    for family in registry.collect():
        if family.name == "gcache_items":
            for s in family.samples:
                if s.name.endswith("_total"):
                    key = (s.labels["op"].lower(), s.labels["status"].upper())
                    items[key] = items.get(key, 0.0) + s.value
        elif family.name == "gcache_bytes":
            for s in family.samples:
                if s.name.endswith("_total"):
                    moved[s.labels["direction"]] = s.value
        elif family.name == "gcache_frame_seconds":
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif s.name.endswith("_count"):
                    frames += s.value
    return {"items": items, "bytes": moved, "buckets": buckets, "frames": frames}


def _quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile from cumulative bucket counts (Prometheus'
    ``histogram_quantile``: linear within the bucket); None without observations."""
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] <= 0:
        return None
    rank = q * buckets[edges[-1]]
    lo, below = 0.0, 0.0
    for le in edges:
        n = buckets[le]
        if n >= rank:
            if math.isinf(le):
                return lo  # beyond the last finite bucket: its lower edge
            return lo + (le - lo) * ((rank - below) / (n - below) if n > below else 1.0)
        lo, below = le, n
    return lo


class RecentRates:
    def __init__(self, registry: CollectorRegistry, min_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.min_interval, self.clock = registry, min_interval_s, clock
        self._lock = threading.Lock()
        self._prev = (clock(), _snapshot(registry))
        self._last: dict[str, float] = {}

    def sample(self) -> dict[str, float]:
        """``recent_ops_per_s``, ``recent_get_bytes_per_s``, ``recent_put_bytes_per_s``,
        ``recent_hit_ratio`` (GET/LEASE items found; absent without reads),
        ``recent_p50_ms`` / ``recent_p99_ms`` (frame service time; absent without
        frames) and ``recent_interval_s``, over the time since the previous sample."""
        now = self.clock()
        with self._lock:
            then, before = self._prev
            if now - then < self.min_interval and self._last:
                return dict(self._last)
        after = _snapshot(self.registry)
        dt = max(now - then, 1e-9)
        d_items = {k: v - before["items"].get(k, 0.0) for k, v in after["items"].items()}
        out = {"recent_interval_s": round(dt, 3),
               "recent_ops_per_s": sum(d_items.values()) / dt,
               "recent_get_bytes_per_s": (after["bytes"].get("out", 0.0)
                                          - before["bytes"].get("out", 0.0)) / dt,
               "recent_put_bytes_per_s": (after["bytes"].get("in", 0.0)
                                          - before["bytes"].get("in", 0.0)) / dt}
        reads = {s: n for (op, s), n in d_items.items() if op in _READS}
        if sum(reads.values()) > 0:
            out["recent_hit_ratio"] = reads.get("OK", 0.0) / sum(reads.values())
        d_buckets = {le: n - before["buckets"].get(le, 0.0)
                     for le, n in after["buckets"].items()}
        for name, q in (("recent_p50_ms", 0.5), ("recent_p99_ms", 0.99)):
            v = _quantile(q, d_buckets)
            if v is not None:
                out[name] = 1000.0 * v
        with self._lock:
            self._prev, self._last = (now, after), out
        return dict(out)
