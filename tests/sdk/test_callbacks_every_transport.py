"""Per-key and per-batch callbacks fire exactly once, with the right statuses, on every
transport (tcp, shm, nixl), for gets into buffers, byte gets and puts."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from gcache.nixl_lib import available
from gcache.sdk import Client, Status

pytestmark = pytest.mark.integration
TRANSPORTS = ["tcp", "shm"] + ([] if available() else ["nixl"])


@pytest.fixture(scope="module")
def nixl_cluster(tmp_path_factory):
    from gcache.testing.cluster import Cluster

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    c = Cluster(1, "64MiB", slab="4MiB", extra=["--nixl", "on"],
                log_dir=str(tmp_path_factory.mktemp("logs"))).start()
    yield c
    c.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_callbacks_exactly_once(nixl_cluster, transport):
    keys = [f"{transport}-{i}" for i in range(6)]
    vals = [np.full(3000 + i * (1 << 19), i, np.uint8) for i in range(6)]  # up to 2.5 MiB
    with Client(nixl_cluster.addresses, transport=transport, timeout_ms=10_000) as c:
        per_key: list[tuple[int, Status]] = []
        batches: list[list] = []
        lock = threading.Lock()

        def on_key(i, k, st):
            with lock:
                per_key.append((i, st))

        fut = c.put_batch_from_async(keys[:5], vals[:5], on_key=on_key, callback=batches.append)
        assert fut.result(10) == [Status.OK] * 5
        assert sorted(per_key) == [(i, Status.OK) for i in range(5)] and len(batches) == 1

        per_key.clear()
        batches.clear()
        outs = [np.zeros(len(v), np.uint8) for v in vals]
        fut = c.get_batch_into_async(keys, outs, on_key=on_key, callback=batches.append)
        want = [Status.OK] * 5 + [Status.MISS]
        assert fut.result(10) == want and batches == [want]
        assert sorted(per_key) == list(enumerate(want))
        assert all(np.array_equal(o, v) for o, v in zip(outs[:5], vals[:5]))

        got: list[tuple[int, bytes | None]] = []
        fut = c.get_batch_async(keys[3:], on_key=lambda i, k, v: got.append((i, v)))
        res = fut.result(10)
        assert res[:2] == [vals[3].tobytes(), vals[4].tobytes()] and res[2] is None
        assert sorted(i for i, _ in got) == [0, 1, 2]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_batch_completion_sees_every_key_finalized(nixl_cluster, transport):
    """Frames of one batch finish on different dispatch threads; the batch callback and
    the future must still see every key's result, after every per-key callback."""
    keys = [f"fin-{transport}-{i}" for i in range(12)]
    vals = [os.urandom(3 << 20) for _ in range(12)]  # bytes() of 3 MiB: a slow finalize
    with Client(nixl_cluster.addresses, transport=transport, timeout_ms=20_000,
                conns_per_server=4, frame_target_bytes=4 << 20) as c:
        assert c.put_batch(keys, vals) == [Status.OK] * 12
        for _ in range(10):
            calls = [0]
            seen_at_batch: list[int] = []
            fut = c.get_batch_async(keys, on_key=_counting(calls),
                                    callback=lambda res, calls=calls, seen=seen_at_batch:
                                    seen.append(calls[0]))
            assert fut.result(20) == vals
            assert seen_at_batch == [12]


def _counting(calls: list[int]):
    lock = threading.Lock()

    def on_key(i, k, v):
        if i == 0:
            time.sleep(0.05)  # a slow callback on one dispatch thread
        with lock:
            calls[0] += 1
    return on_key
