"""A real server's STATS and /metrics carry the miss-ratio curve (server/mrc.py)."""

from __future__ import annotations

import urllib.request

import pytest

from gcache.sdk import Client, Status
from gcache.testing.cluster import ServerProc, free_port

pytestmark = pytest.mark.integration


@pytest.mark.timeout(30)
def test_stats_and_metrics_carry_the_curve_per_namespace(tmp_path):
    port = free_port()
    srv = ServerProc(f"mrc-{port}", "16MiB", slab="1MiB", log_dir=str(tmp_path),
                     extra=["--metrics-listen", f"127.0.0.1:{port}", "--mrc-sample-rate", "1"])
    srv.start()
    try:
        keys = [f"k{i}".encode() for i in range(40)]
        with Client([srv.address], namespace="team-a", timeout_ms=5000) as c:
            assert c.put_batch(keys, [b"v" * 4000] * 40) == [Status.OK] * 40
            for _ in range(3):  # every key fits: hits at every factor from the second read
                assert all(v is not None for v in c.get_batch(keys))
            assert c.get_batch([b"never-put"]) == [None]
            mrc = c.stats()[srv.address]["mrc"]
        assert mrc["factors"] == [0.5, 1.0, 2.0, 4.0, 8.0]
        assert mrc["sample_rate"] == 1.0  # 41 keys: all tracked
        ns = mrc["namespaces"]["team-a"]
        assert ns["gets"] == 121
        assert ns["hit_ratio"] == [round(120 / 121, 4)] * 5  # the one miss was never put
        assert ns["actual_hit_ratio"] == round(120 / 121, 4)
        assert mrc["namespaces"]["*"]["gets"] == 121
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = text.decode()
        assert f'gcache_mrc_hit_ratio{{capacity_factor="8",namespace="team-a"}} ' \
               f'{round(120 / 121, 4)}' in text
        assert 'gcache_mrc_gets{namespace="*"} 121.0' in text
    finally:
        srv.terminate()
        srv.remove_arena()

