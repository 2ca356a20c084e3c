"""A working set three times the memory tier round-trips through a real server with a disk
tier: nothing lost, nothing wrong, clients see one store. Plus per-tier stats and metrics."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, value_for
from gcache.testing.waiting import wait_for
from gcache.testing.cluster import free_port

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

SIZES = [1000, 4096, 70_000, 300_000, 2_500_000]  # 2.5 MB is sliced: chunked disk reads


def _size(key: bytes) -> int:
    return SIZES[int(key.rsplit(b"-", 1)[1]) % len(SIZES)]


def test_working_set_3x_memory_round_trips_with_no_wrong_values(make_cluster, tmp_path):
    port = free_port()
    cl = make_cluster(1, "48MiB", slab="4MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk", "512MiB", "--segment-bytes", "16MiB",
        "--promote-policy", "never", "--metrics-listen", f"127.0.0.1:{port}"])
    addr = cl.addresses[0]
    keys = [f"w-{i}".encode() for i in range(260)]
    total = sum(_size(k) for k in keys)
    with Client(cl.addresses, timeout_ms=10_000) as c:
        cap = c.stats()[addr]["capacity_bytes"]
        assert total > 3 * cap
        for s in range(0, len(keys), 20):
            ks = keys[s:s + 20]
            assert c.put_batch(ks, [value_for(k, _size(k)) for k in ks]) == [Status.OK] * len(ks)
            # pace the writer to the mover: a put that outwaits the mover's 0.5 s may evict
            # to nothing (a cache's right), which is not what this test pins
            wait_for(lambda: c.stats()[addr]["used_bytes"] <= 0.95 * cap, 10)
        got = c.get_batch(keys)
        wrong = [k for k, v in zip(keys, got) if v is not None and (
            len(v) != _size(k) or not check_value(k, v))]
        missing = [k for k, v in zip(keys, got) if v is None]
        assert wrong == [] and missing == []
        # zero-copy reads of disk-resident sliced objects, straight into caller buffers
        big = [k for k in keys[:60] if _size(k) == 2_500_000]
        bufs = [np.empty(_size(k), np.uint8) for k in big]
        assert c.get_batch_into(big, bufs) == [Status.OK] * len(big)
        assert all(check_value(k, b) for k, b in zip(big, bufs))
        assert c.exists_batch(keys) == [True] * len(keys)
        assert c.touch_batch(keys[:10]) == [Status.OK] * 10
        st = c.stats()[addr]
    assert st["evictions"] == 0 and st["no_space"] == 0, "the disk tier must absorb the overflow"
    assert st["demoted"] >= len(keys) - st["objects"]
    assert st["disk_objects"] + st["objects"] >= len(keys)
    assert st["disk_hits"] > 0 and st["promoted"] == 0  # promote_policy never
    assert 0 < st["disk_used_bytes"] <= st["disk_capacity_bytes"] == 512 << 20
    assert st["used_bytes"] <= st["capacity_bytes"]
    assert st["disk_degraded"] == 0 and st["disk_corrupt_dropped"] == 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {(m.name, tuple(sorted(m.labels.items()))): m.value
               for fam in text_string_to_metric_families(text) for m in fam.samples}
    assert samples[("gcache_disk_capacity_bytes", ())] == 512 << 20
    assert samples[("gcache_tier_used_bytes", (("tier", "disk"),))] > 0
    assert samples[("gcache_tier_capacity_bytes", (("tier", "memory"),))] == st["capacity_bytes"]
    assert samples[("gcache_tier_demoted_total", ())] >= st["demoted"]
    assert samples[("gcache_disk_hits_total", ())] >= st["disk_hits"]
    assert samples[("gcache_disk_degraded", ())] == 0
    assert samples[("gcache_disk_corrupt_dropped_total", ())] == 0
