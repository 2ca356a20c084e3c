"""``FrameStats``: connection threads count frames into recorders of their own, and a
scrape exports ``gcache_frames_total{op}`` and the histogram ``gcache_frame_seconds{op}``
exactly as prometheus_client's ``Counter`` and ``Histogram`` fed the same frames would
(the series the server exported before, kept as the oracle); frames recorded while
scrapes run are never lost or counted twice, whether their connection is still open or
closed (``retire``), and no scraped count ever goes down."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gcache.server.metrics import _LAT_BUCKETS, ServerMetrics

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

OPS = ["GET", "PUT", "EXISTS", "LEASE"]


def _series(text: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(prefixes) and not line.startswith("#")}


def _oracle(frames: list[tuple[str, float]]) -> dict[str, float]:
    reg = CollectorRegistry()
    c = Counter("gcache_frames_total", "Frames handled, by op", ["op"], registry=reg)
    h = Histogram("gcache_frame_seconds", "Frame service time, by op", ["op"],
                  buckets=_LAT_BUCKETS, registry=reg)
    for op, sec in frames:
        c.labels(op).inc()
        h.labels(op).observe(sec)
    return _series(generate_latest(reg).decode(), ("gcache_frames_total{",
                                                   "gcache_frame_seconds_"))


def _scrape(m: ServerMetrics) -> dict[str, float]:
    return _series(generate_latest(m.registry).decode(), ("gcache_frames_total{",
                                                          "gcache_frame_seconds_"))


seconds = st.one_of(st.sampled_from(list(_LAT_BUCKETS)),  # on a bound: le counts it
                    st.floats(0, 5, allow_nan=False))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(OPS), seconds), max_size=30),
                min_size=1, max_size=4),
       st.lists(st.booleans(), min_size=4, max_size=4))
def test_exported_series_equal_a_prometheus_histogram(conns, closed):
    m = ServerMetrics()
    for frames, gone in zip(conns, closed):
        r = m.frame_stats.recorder()
        for op, sec in frames:
            r.record(op, sec)
        if gone:
            m.frame_stats.retire(r)
    got, want = _scrape(m), _oracle([f for frames in conns for f in frames])
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k


def test_frames_recorded_during_scrapes_are_counted_once():
    m = ServerMetrics()
    stop = threading.Event()
    per_thread, threads = 5000, []
    seen: list[float] = []

    def conn(seed: int) -> None:
        rnd = random.Random(seed)
        r = m.frame_stats.recorder()
        for _ in range(per_thread):
            r.record(rnd.choice(OPS), rnd.random() * 0.01)
        m.frame_stats.retire(r)

    def scraper() -> None:
        while not stop.is_set():
            s = _scrape(m)
            seen.append(sum(v for k, v in s.items() if k.startswith("gcache_frames_total")))

    sc = threading.Thread(target=scraper)
    sc.start()
    for i in range(4):
        threads.append(threading.Thread(target=conn, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    stop.set()
    sc.join()
    final = _scrape(m)
    assert sum(v for k, v in final.items() if k.startswith("gcache_frames_total")) \
        == 4 * per_thread
    assert sum(v for k, v in final.items() if k.startswith("gcache_frame_seconds_count")) \
        == 4 * per_thread
    assert seen == sorted(seen) and all(v <= 4 * per_thread for v in seen)
