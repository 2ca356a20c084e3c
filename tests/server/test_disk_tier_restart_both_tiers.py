"""Restart with data on both tiers: a clean stop reloads the disk index, kill -9 rescans the
segments; either way every acknowledged object is back, and deleted or replaced objects
never come back from disk."""

from __future__ import annotations

import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, value_for
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 300_000


def _check(c: Client, keys: list[bytes], deleted: set[bytes], replaced: set[bytes]) -> None:
    got = c.get_batch(keys)
    for k, v in zip(keys, got):
        if k in deleted:
            assert v is None, f"deleted {k!r} came back"
        elif k in replaced:
            assert v is not None and len(v) == 5000 and check_value(k, v), f"replaced {k!r}"
        else:
            assert v is not None and len(v) == SIZE and check_value(k, v), f"lost {k!r}"


def _mover_caught_up(c: Client, addr: str) -> bool:
    """Memory is back under its high watermark: the next batch of puts finds room
    without waiting for the mover (on a loaded machine a put that waits longer than
    the server's room wait evicts instead, and this test is about restarts, not that)."""
    st = c.stats()[addr]
    return st["used_bytes"] <= 0.7 * st["capacity_bytes"] and st["pending_puts"] == 0


def test_restart_with_data_on_both_tiers(make_cluster, tmp_path):
    cl = make_cluster(1, "32MiB", slab="1MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk", "256MiB", "--segment-bytes", "4MiB",
        "--high-watermark", "0.7", "--low-watermark", "0.5"])
    srv, addr = cl.servers[0], cl.addresses[0]
    keys = [f"r-{i}".encode() for i in range(200)]  # 60 MB: about 2x the memory tier
    with Client(cl.addresses, timeout_ms=10_000) as c:
        for s in range(0, len(keys), 10):  # 3 MB a batch: under the 30 % the mover keeps free
            ks = keys[s:s + 10]
            assert c.put_batch(ks, [value_for(k, SIZE) for k in ks]) == [Status.OK] * len(ks)
            wait_for(lambda: _mover_caught_up(c, addr), 30)
        assert c.stats()[addr]["evictions"] == 0, "every object must be demoted, none evicted"
        # deletes and replaces of objects on disk (old keys) and in memory (new keys)
        deleted = set(keys[0:5] + keys[-5:])
        replaced = set(keys[10:15] + keys[-15:-10])
        assert c.delete_batch(sorted(deleted)) == [Status.OK] * len(deleted)
        assert c.put_batch(sorted(replaced), [value_for(k, 5000) for k in sorted(replaced)]) \
            == [Status.OK] * len(replaced)
        st = c.stats()[addr]
        assert st["objects"] > 20 and st["disk_objects"] > 50, "data must sit on both tiers"
        _check(c, keys, deleted, replaced)

    srv.restart()  # SIGTERM: arena marked clean, disk index written
    with Client(cl.addresses, timeout_ms=10_000) as c:
        st = c.stats()[addr]
        assert st["recovered"] > 0 and st["disk_recovered"] > 0
        _check(c, keys, deleted, replaced)
        assert c.delete(keys[20]) == Status.OK  # a delete after the restart, then a crash
    deleted.add(keys[20])

    srv.kill9()  # no index file: the segments are scanned, deaths are applied
    srv.start()
    with Client(cl.addresses, timeout_ms=10_000) as c:
        _check(c, keys, deleted, replaced)
        st = c.stats()[addr]
        assert st["disk_corrupt_dropped"] == 0
    log = (tmp_path / f"{srv.name}.log").read_text()
    assert "source=index reason=clean stop" in log
    assert "source=scan" in log.rsplit("disk tier ready", 1)[1]
