"""``RecentRates``: ops/s, bytes/s, the read hit ratio and frame-time quantiles over the
last interval, from a server's own counters (a virtual clock)."""

from __future__ import annotations

import pytest

from gcache.clock import VirtualClock
from gcache.server.metrics import ServerMetrics
from gcache.server.recent import RecentRates, _quantile

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_rates_hit_ratio_and_quantiles_over_the_last_interval() -> None:
    clock = VirtualClock()
    m = ServerMetrics()
    m.items.labels("get", "OK").inc(5)  # before the first sample: not counted
    r = RecentRates(m.registry, min_interval_s=2.0, clock=clock.monotonic)
    m.items.labels("get", "OK").inc(30)
    m.items.labels("get", "MISS").inc(10)
    m.items.labels("put", "OK").inc(60)
    m.bytes.labels("out").inc(4e9)
    m.bytes.labels("in").inc(2e9)
    frames = m.frame_stats.recorder()  # a connection's frames, as the service counts them
    for _ in range(95):
        frames.record("GET", 0.0002)
    for _ in range(5):
        frames.record("GET", 0.2)
    clock.advance(4.0)
    s = r.sample()
    assert s["recent_ops_per_s"] == pytest.approx(100 / 4)
    assert s["recent_get_bytes_per_s"] == pytest.approx(1e9)
    assert s["recent_put_bytes_per_s"] == pytest.approx(5e8)
    assert s["recent_hit_ratio"] == pytest.approx(0.75)
    assert s["recent_p50_ms"] < 1.0 and 100.0 < s["recent_p99_ms"] <= 500.0
    clock.advance(1.0)  # within min_interval: the same figures
    m.items.labels("get", "MISS").inc(1000)
    assert r.sample() == s
    clock.advance(1.5)  # then a fresh interval: only the new misses
    s2 = r.sample()
    assert s2["recent_hit_ratio"] == 0.0 and "recent_p99_ms" not in s2


def test_quantile_interpolates_within_its_bucket() -> None:
    buckets = {0.001: 50.0, 0.01: 100.0, float("inf"): 100.0}
    assert _quantile(0.5, buckets) == pytest.approx(0.001)
    assert _quantile(0.75, buckets) == pytest.approx(0.0055)
    assert _quantile(0.99, {0.001: 0.0, float("inf"): 0.0}) is None
