"""``Client(metrics=...)``: hits, misses by cause and latency histograms per op and
transport, in the caller's registry; nothing counted when not asked."""

from __future__ import annotations

import time
from concurrent import futures

import pytest
from prometheus_client import CollectorRegistry

from gcache.sdk import Client, Status
from gcache.sdk.metrics import SdkMetrics
from gcache.testing.cluster import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_hits_misses_by_cause_and_latency_per_op(cluster, transport: str) -> None:
    reg = CollectorRegistry()
    with Client(cluster.addresses, transport=transport, metrics=reg) as c, \
            Client(cluster.addresses, transport=transport) as quiet:
        assert c.put_batch([b"a", b"b"], [b"1", b"2"]) == [Status.OK] * 2
        assert c.get_batch([b"a", b"b", b"nope"]) == [b"1", b"2", None]
        assert c.exists_batch([b"a", b"nope"]) == [True, False]
        assert quiet.get(b"a") == b"1"  # a client without metrics counts nothing
    assert _value(reg, "gcache_client_items_total", op="put", result="ok") == 2
    assert _value(reg, "gcache_client_items_total", op="get", result="hit") == 2
    assert _value(reg, "gcache_client_items_total", op="get", result="miss") == 1
    assert _value(reg, "gcache_client_items_total", op="exists", result="hit") == 1
    assert _value(reg, "gcache_client_items_total", op="exists", result="miss") == 1
    for op in ("put", "get", "exists"):
        assert _value(reg, "gcache_client_op_seconds_count", op=op, transport=transport) == 1
        assert _value(reg, "gcache_client_op_seconds_sum", op=op, transport=transport) > 0


def test_an_unreachable_server_is_counted_as_its_cause() -> None:
    reg = CollectorRegistry()
    with Client([f"127.0.0.1:{free_port()}"], metrics=reg, timeout_ms=500,
                connect_timeout_ms=200) as c:
        assert c.get(b"k") is None
    causes = {s.labels["result"] for m in reg.collect() for s in m.samples
              if s.name == "gcache_client_items_total"}
    assert causes and causes <= {"unavailable", "timeout", "error"}, causes
    assert "hit" not in causes and "miss" not in causes


def test_a_call_is_counted_before_it_returns(cluster, monkeypatch) -> None:
    """A synchronous call completed by another thread (here a dispatch thread: the
    one-hop path is off) is counted before the caller sees its results.
    Counting in a Future done-callback was not: ``set_result`` wakes the waiter first,
    and a slow completing thread (simulated: its callbacks start 0.3 s late) let the
    caller read the registry before the count."""
    real = futures.Future._invoke_callbacks

    def late(self):
        time.sleep(0.3)
        real(self)

    monkeypatch.setattr(futures.Future, "_invoke_callbacks", late)
    reg = CollectorRegistry()
    keys = [b"big%d" % i for i in range(64)]
    with Client(cluster.addresses, transport="tcp", metrics=reg, one_hop_max_bytes=0) as c:
        assert c.put_batch(keys, [bytes(4096)] * len(keys)) == [Status.OK] * len(keys)
        assert _value(reg, "gcache_client_items_total", op="put", result="ok") == len(keys)
        assert c.get_batch(keys + [b"nope"]) == [bytes(4096)] * len(keys) + [None]
        assert _value(reg, "gcache_client_items_total", op="get", result="hit") == len(keys)
        assert _value(reg, "gcache_client_items_total", op="get", result="miss") == 1


def test_a_new_registry_never_counts_into_a_freed_one() -> None:
    """Metrics are kept per registry object, not per id(): CPython hands a freed
    registry's address to the next one made, and an id-keyed cache then gave the new
    registry metrics that counted into the freed one (a test's fresh registry read 0)."""
    old = CollectorRegistry()
    SdkMetrics.for_registry(old)
    del old
    new = CollectorRegistry()  # made at once: most often at the freed one's address
    SdkMetrics.for_registry(new).items.labels("get", "hit").inc()
    assert _value(new, "gcache_client_items_total", op="get", result="hit") == 1
