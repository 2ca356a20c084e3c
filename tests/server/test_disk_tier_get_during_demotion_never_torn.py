"""Concurrent gets, replaces, demotions and promotions of the same keys never return torn
bytes: a sliced read sees one version from whichever tier, or a miss."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 2_500_000  # three 1 MiB slices: one get is three reads that can straddle a move


def test_get_during_demotion_and_promotion_never_returns_torn_bytes(make_cluster, tmp_path):
    # 7 slab pages of 4 MiB hold 7 objects; 16 keys churn through memory and disk, and
    # promote_policy=first copies every disk hit back, which demotes another key
    cl = make_cluster(1, "32MiB", slab="4MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk", "256MiB", "--segment-bytes", "16MiB",
        "--promote-policy", "first"])
    keys = [f"t-{i}".encode() for i in range(16)]
    good = {k: (value_for(k, SIZE), value_for(k + b"/b", SIZE)) for k in keys}
    stop = threading.Event()
    bad: list[str] = []
    reads = [0, 0]  # served, missed

    with Client(cl.addresses, timeout_ms=10_000, slice_bytes=1 << 20) as c:
        for k in keys:
            assert c.put(k, good[k][0]) == Status.OK

        def writer() -> None:
            rng = random.Random(1)
            while not stop.is_set():
                k = rng.choice(keys)
                c.put(k, good[k][rng.randrange(2)])

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            buf = np.empty(SIZE, np.uint8)
            while not stop.is_set():
                k = rng.choice(keys)
                if seed % 2:
                    v = c.get(k)
                else:  # zero-copy form: every slice is dispatched at once
                    v = bytes(buf) if c.get_batch_into([k], [buf]) == [Status.OK] else None
                if v is None:
                    reads[1] += 1
                elif v not in good[k]:
                    bad.append(f"{k!r}: {len(v)} bytes, neither version")
                else:
                    reads[0] += 1

        threads = [threading.Thread(target=writer)] + [
            threading.Thread(target=reader, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        time.sleep(4)
        stop.set()
        for t in threads:
            t.join(20)
        st = c.stats()[cl.addresses[0]]
    assert bad == []
    assert reads[0] > 50, reads
    assert st["demoted"] > 20 and st["promoted"] > 5 and st["disk_hits"] > 5, st
    assert st["disk_corrupt_dropped"] == 0 and st["corrupt_dropped"] == 0
