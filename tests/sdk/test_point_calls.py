"""One-key ``get`` and ``exists`` run without a batch, and keep every batch rule.

``sdk/point.py``: a synchronous one-key call with no callbacks runs its frame on the
calling thread without making a ``Batch``; its answer is final for a whole hit or a plain
miss, and anything else continues as a batch from where it stopped. Pinned here against
real servers (tcp and shm lanes):

* a hit, a miss, an exists, a touch and a delete make no batch and give the right
  answer;
* an object longer than the first read continues as a batch and comes back whole: on
  tcp past ``slice_bytes``; on a shm lane the first read stays under
  ``one_sided_min_bytes`` (one plain GET, no LEASE) and the rest takes the one-sided
  path;
* with ``verify_checksums`` a flipped value is never a hit (also in
  test_checksum_flip_never_a_hit), metrics count each call once, and a closed client
  answers CLOSED misses.

NOT_OWNER re-routes and previous-owner reads of one-key calls are pinned in
test_not_owner_reroute_bounded_without_thread_per_reply and
test_previous_owner_fallback_on_join.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client import CollectorRegistry

from gcache.sdk import Client, Status, batch as batch_mod
from gcache.sdk.transports import onesided
from gcache.testing.cluster import Cluster
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.integration]


@pytest.fixture
def batches(monkeypatch):
    """How many byte-get, get-into and key batches the calls made."""
    made = {"get": 0, "into": 0, "key": 0}

    def count(cls, name):
        init = cls.__init__

        def counted(self, *a, **kw):
            made[name] += 1
            init(self, *a, **kw)

        monkeypatch.setattr(cls, "__init__", counted)

    count(batch_mod.BytesBatch, "get")
    count(batch_mod.IntoBatch, "into")
    count(batch_mod.KeyBatch, "key")
    return made


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_hits_and_misses_make_no_batch(cluster, batches, transport):
    keys = [b"point-%d" % i for i in range(20)]
    with Client(cluster.addresses, transport=transport, timeout_ms=5000) as c:
        assert c.put_batch(keys, [value_for(k, 4096 + 997 * i) for i, k in enumerate(keys)]) \
            == [Status.OK] * len(keys)
        assert c.put(b"empty", b"") == Status.OK
        before = dict(batches)
        for i, k in enumerate(keys):
            assert c.get(k) == value_for(k, 4096 + 997 * i)
            assert c.exists(k) is True
        assert c.get(b"absent") is None and c.exists(b"absent") is False
        assert c.get(b"empty") == b""
        # the one-key batch forms too, with IntoBatch's rules for a caller's buffer
        k, n = keys[3], 4096 + 997 * 3
        assert c.get_batch([k]) == [value_for(k, n)]
        assert c.exists_batch([k]) == [True] and c.exists_batch([b"absent"]) == [False]
        out = bytearray(n)
        assert c.get_batch_into([k], [out]) == [Status.OK] and out == value_for(k, n)
        assert c.get_batch_into([b"absent"], [bytearray(8)]) == [Status.MISS]
        for wrong in (n - 1, n + 1):  # the buffer must be the object's size
            assert c.get_batch_into([k], [bytearray(wrong)]) == [Status.SIZE_MISMATCH]
        assert c.touch(k) == Status.OK and c.touch_batch([b"absent"]) == [Status.MISS]
        assert c.delete(keys[5]) == Status.OK and c.exists(keys[5]) is False
        assert c.delete_batch([keys[5]]) == [Status.MISS]
        assert batches == before, "a one-key call made a batch"
        # callbacks keep the batch path (they fire exactly once there)
        seen = []
        assert c.get(keys[0], callback=seen.append) == value_for(keys[0], 4096)
        assert batches["get"] == before["get"] + 1 and len(seen) == 1


@pytest.mark.timeout(60)
def test_longer_than_the_first_read_continues_as_a_batch_tcp(cluster, batches):
    with Client(cluster.addresses, transport="tcp", timeout_ms=5000,
                slice_bytes=64 << 10) as c:
        for n in (64 << 10, (64 << 10) + 1, 300_000):
            k = b"long-%d" % n
            assert c.put(k, value_for(k, n)) == Status.OK
            made = batches["get"]
            assert c.get(k) == value_for(k, n)
            assert batches["get"] == made + (n > 64 << 10)


@pytest.mark.timeout(60)
def test_shm_lane_first_read_is_one_plain_get(cluster, batches):
    with Client(cluster.addresses, transport="shm", timeout_ms=5000) as c:
        small, big = b"shm-small", b"shm-big"
        assert c.put(small, value_for(small, 100_000)) == Status.OK
        assert c.put(big, value_for(big, 900_000)) == Status.OK
        assert c.get(small) == value_for(small, 100_000)  # the lane's kind is known now
        plain = onesided.STATS["small_frame_tcp_items"]
        made = batches["get"]
        assert c.get(small) == value_for(small, 100_000)
        assert onesided.STATS["small_frame_tcp_items"] == plain + 1  # no LEASE
        assert batches["get"] == made
        assert c.get(big) == value_for(big, 900_000)  # the rest through the arena
        assert batches["get"] == made + 1


@pytest.mark.timeout(60)
def test_metrics_count_each_one_key_call_once(cluster):
    reg = CollectorRegistry()
    with Client(cluster.addresses, transport="tcp", metrics=reg) as c:
        assert c.put(b"m", b"1") == Status.OK
        assert c.get(b"m") == b"1" and c.get(b"m-absent") is None
        assert c.exists(b"m") and not c.exists(b"m-absent")

    def value(name, **labels):
        return reg.get_sample_value(name, labels) or 0.0

    for op in ("get", "exists"):
        assert value("gcache_client_items_total", op=op, result="hit") == 1
        assert value("gcache_client_items_total", op=op, result="miss") == 1
        assert value("gcache_client_op_seconds_count", op=op, transport="tcp") == 2


@pytest.mark.timeout(60)
def test_closed_client_answers_closed_misses(cluster):
    c = Client(cluster.addresses, transport="tcp")
    assert c.put(b"c", b"1") == Status.OK and c.get(b"c") == b"1"
    c.close()
    assert c.get(b"c") is None and c.exists(b"c") is False



SIZES = [0, 1, 4096, 100_000, 300_000]


@pytest.fixture(scope="module")
def point_cluster():
    with Cluster(1, "64MiB", slab="1MiB", prefix=f"point{os.getpid()}") as cl:
        with Client(cl.addresses, transport="tcp", timeout_ms=10000) as c:
            for n in SIZES:
                assert c.put(b"d%d" % n, value_for(b"d%d" % n, n)) == Status.OK
        yield cl


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_key_calls_answer_as_their_batch_twins(point_cluster, transport):
    """Every one-key call answers exactly as the same call through the batch path (a
    callback sends it there): hits, misses, empty values, buffers of the wrong size,
    values past the shm lane's first read, touches and deletes, with and without
    checksums."""
    clients = {v: Client(point_cluster.addresses, transport=transport, timeout_ms=10000,
                         verify_checksums=v) for v in (False, True)}

    def twin(r):
        return None

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(size=st.sampled_from(SIZES), present=st.booleans(), verify=st.booleans(),
           kind=st.sampled_from(["get", "get_batch", "into", "exists", "touch", "delete"]),
           delta=st.sampled_from([0, 0, -1, 1]))
    def check(size, present, verify, kind, delta):
        c = clients[verify]
        k = b"d%d" % size if present else b"absent-%d" % size
        if kind == "into":
            a, b = bytearray(max(0, size + delta)), bytearray(max(0, size + delta))
            assert c.get_batch_into([k], [a]) == c.get_batch_into([k], [b], callback=twin)
            assert a == b
        elif kind == "get":
            assert c.get(k) == c.get(k, callback=twin)
        elif kind == "get_batch":
            assert c.get_batch([k]) == c.get_batch([k], callback=twin)
        elif kind == "exists":
            assert c.exists(k) == c.exists(k, callback=twin)
        elif kind == "touch":
            assert c.touch(k) == c.touch(k, callback=twin)
        else:  # each delete of a present key deletes a fresh copy of it
            if present:
                assert c.put(k, value_for(k, size)) == Status.OK
            one = c.delete(k)
            if present:
                assert c.put(k, value_for(k, size)) == Status.OK
            assert one == c.delete(k, callback=twin)
            if present:
                assert c.put(k, value_for(k, size)) == Status.OK

    try:
        check()
    finally:
        for c in clients.values():
            c.close()
