"""``ServerMetrics.add`` (the per-frame counter add that skips prometheus_client's
per-call label checks) adds to the same labelled series a scrape exports, from many
threads without losing an add, and falls back to ``inc`` for a child with no value."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import generate_latest

from gcache.server.metrics import ServerMetrics

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


def _scraped(m: ServerMetrics, series: str) -> float:
    for line in generate_latest(m.registry).decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    raise AssertionError(f"{series} not exported")


def test_add_from_many_threads_reaches_the_scrape():
    m = ServerMetrics()
    add = m.add(m.items, "exists", "all")
    assert m.add(m.items, "exists", "all") is add  # cached
    m.child(m.items, "exists", "all").inc(5)  # the ordinary path, same series

    def work() -> None:
        for _ in range(2000):
            add(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _scraped(m, 'gcache_items_total{op="exists",status="all"}') == 8005
    m.add(m.read_throughs, "hit")(3)
    assert _scraped(m, 'gcache_handoff_reads_total{result="hit"}') == 3


def test_add_falls_back_to_inc_without_a_value():
    m = ServerMetrics()

    class Child:
        def __init__(self) -> None:
            self.n = 0

        def inc(self, amount: float = 1) -> None:
            self.n += amount

    class Metric:
        def __init__(self) -> None:
            self.c = Child()

        def labels(self, *labels: str) -> Child:
            return self.c

    metric = Metric()
    m.add(metric, "x")(7)
    assert metric.c.n == 7
