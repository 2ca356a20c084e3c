"""Per-key and per-batch callbacks fire exactly once, with the right statuses, on every
transport (tcp, shm, nixl), for gets into buffers, byte gets and puts."""

from __future__ import annotations

import os
import threading

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
