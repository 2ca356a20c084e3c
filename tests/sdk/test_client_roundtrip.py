"""SDK round trips against real servers: every API form, every buffer type, callbacks once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, value_for

pytestmark = pytest.mark.integration


@pytest.fixture
def three(make_cluster):
    return make_cluster(3, "96MiB", slab="4MiB")


def test_single_key_ops(three):
    with Client(three.addresses, namespace="t") as c:
        assert c.get("nope") is None
        assert c.exists("nope") is False
        assert c.put("a", b"hello") == Status.OK
        assert c.get("a") == b"hello"
        assert c.exists(b"a") is True
        assert c.touch("a") == Status.OK
        assert c.put("a", b"replaced") == Status.OK  # replace is atomic
        assert c.get("a") == b"replaced"
        assert c.delete("a") == Status.OK
        assert c.delete("a") == Status.MISS
        assert c.get("a") is None
        assert c.put("empty", b"") == Status.OK
        assert c.get("empty") == b""


def test_namespaces_are_isolated(three):
    with Client(three.addresses, namespace="m1") as a, Client(three.addresses, namespace="m2") as b:
        assert a.put("k", b"one") == Status.OK
        assert b.get("k") is None
        assert b.put("k", b"two") == Status.OK
        assert a.get("k") == b"one"


@pytest.mark.parametrize("size", [1, 4095, 65536, 1 << 20, (1 << 20) + 1, 3_000_001])
def test_batch_roundtrip_sizes(three, size):
    keys = [f"s{size}-{i}".encode() for i in range(12)]
    vals = [value_for(k, size) for k in keys]
    with Client(three.addresses, slice_bytes=1 << 20) as c:
        assert c.put_batch(keys, vals) == [Status.OK] * 12
        got = c.get_batch(keys)
        assert all(g is not None and len(g) == size and check_value(k, g)
                   for k, g in zip(keys, got))
        outs = [bytearray(size) for _ in keys]
        assert c.get_batch_into(keys, outs) == [Status.OK] * 12
        assert all(check_value(k, o) for k, o in zip(keys, outs))
        assert c.exists_batch(keys + [b"missing"]) == [True] * 12 + [False]


def test_numpy_and_torch_buffers_zero_copy(three):
    with Client(three.addresses) as c:
        arr = np.arange(65536, dtype=np.float32)
        ten = torch.arange(1 << 18, dtype=torch.bfloat16)
        assert c.put_batch_from(["np", "pt"], [arr, ten]) == [Status.OK, Status.OK]
        out_np = np.empty_like(arr)
        out_pt = torch.empty_like(ten)
        assert c.get_batch_into(["np", "pt"], [out_np, out_pt]) == [Status.OK, Status.OK]
        assert np.array_equal(arr, out_np)
        assert torch.equal(ten, out_pt)
        wrong = np.empty(10, dtype=np.uint8)
        assert c.get_batch_into(["np"], [wrong]) == [Status.SIZE_MISMATCH]
        with pytest.raises(ValueError):
            c.get_batch_into(["np"], [memoryview(b"readonly")])
        with pytest.raises(ValueError):
            c.put_batch_from(["x"], [np.arange(10)[::2]])  # not contiguous


def test_callbacks_fire_exactly_once(three):
    keys = [f"cb-{i}".encode() for i in range(40)]
    vals = [value_for(k, 200_000) for k in keys]
    seen: list[int] = []
    batches: list[list] = []
    lock = threading.Lock()

    def on_key(i, key, res):
        with lock:
            seen.append(i)

    with Client(three.addresses) as c:
        fut = c.put_batch_async(keys, vals, on_key=on_key, callback=batches.append)
        assert fut.result(10) == [Status.OK] * 40
        assert sorted(seen) == list(range(40)) and len(batches) == 1
        seen.clear()
        batches.clear()
        fut = c.get_batch_async(keys + [b"absent"], on_key=on_key, callback=batches.append)
        res = fut.result(10)
        assert res[-1] is None and all(check_value(k, v) for k, v in zip(keys, res))
        assert sorted(seen) == list(range(41)) and len(batches) == 1
        assert c.get_async("cb-3").result(10) == vals[3]
        assert c.put_async("cb-new", b"v").result(10) == Status.OK


def test_group_places_keys_on_one_server(three):
    with Client(three.addresses) as c:
        keys = [f"g-{i}".encode() for i in range(30)]
        assert c.put_batch(keys, [b"v"] * 30, group="session-7") == [Status.OK] * 30
        counts = [s["objects"] for s in c.stats().values()]
        assert sorted(counts) == [0, 0, 30]
        assert c.get_batch(keys, group="session-7") == [b"v"] * 30


def test_oversized_value_and_key(three):
    with Client(three.addresses) as c:
        assert c.put("big", bytes(5 << 20)) == Status.TOO_LARGE  # one slab page is 4 MiB
        assert c.put("ok", b"fine") == Status.OK
        with pytest.raises(ValueError):
            c.put("k" * 600, b"v")


def test_closed_client_reports_closed(three):
    c = Client(three.addresses)
    c.close()
    assert c.put("x", b"y") == Status.CLOSED
    assert c.get("x") is None
    c.close()  # idempotent
