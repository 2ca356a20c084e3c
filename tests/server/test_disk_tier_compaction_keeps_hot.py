"""A disk tier at its capacity reclaims space one segment at a time: records touched since
they were written are carried over, cold ones are dropped (evicted), nothing is wrong."""

from __future__ import annotations

import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, value_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SIZE = 200_000


def _put(c: Client, keys: list[bytes]) -> None:
    for s in range(0, len(keys), 20):
        ks = keys[s:s + 20]
        assert c.put_batch(ks, [value_for(k, SIZE) for k in ks]) == [Status.OK] * len(ks)


def test_compaction_carries_touched_records_and_drops_cold_ones(make_cluster, tmp_path):
    cl = make_cluster(1, "16MiB", slab="1MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk", "32MiB", "--segment-bytes", "4MiB",
        "--promote-policy", "never"])  # 8 segments: ~28 MB of records, far less than written
    addr = cl.addresses[0]
    hot = [f"hot-{i}".encode() for i in range(10)]
    with Client(cl.addresses, timeout_ms=10_000) as c:
        _put(c, hot)
        _put(c, [f"push-{i}".encode() for i in range(100)])  # hot keys are demoted now
        assert c.stats()[addr]["disk_objects"] >= len(hot)
        cold = [f"cold-{i}".encode() for i in range(400)]  # 80 MB through a 32 MiB disk
        for s in range(0, len(cold), 40):
            assert c.touch_batch(hot) == [Status.OK] * len(hot)  # keeps them hot on disk
            _put(c, cold[s:s + 40])
        st = c.stats()[addr]
        assert st["disk_compactions"] > 5 and st["disk_carried_over"] > 0
        assert st["disk_evictions"] > 100
        assert st["disk_allocated_bytes"] <= 32 << 20 and st["disk_degraded"] == 0
        got = c.get_batch(hot)
        assert all(v is not None and check_value(k, v) for k, v in zip(hot, got)), \
            "touched records must survive compaction"
        got = c.get_batch(cold)
        assert all(check_value(k, v) for k, v in zip(cold, got) if v is not None)
        assert 0 < sum(v is not None for v in got) < len(cold)  # the oldest cold ones went
