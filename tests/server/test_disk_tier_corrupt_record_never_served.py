"""A corrupt record on disk is skipped and counted, never served: a flipped byte in a
segment file (found by its key), and corruption injected into reads by a failpoint."""

from __future__ import annotations

import struct

import pytest

from gcache.sdk import Client, Status
from gcache.server.disk.records import BLOCK, REC_HDR, REC_MAGIC, segment_paths, tier_root
from gcache.testing.oracle import check_value, value_for
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 300_000


def _fill(c: Client, n: int) -> list[bytes]:
    keys = [f"c-{i}".encode() for i in range(n)]
    for s in range(0, n, 20):
        ks = keys[s:s + 20]
        assert c.put_batch(ks, [value_for(k, SIZE) for k in ks]) == [Status.OK] * len(ks)
        # pace the writer to the mover (a put that outwaits it may evict to nothing)
        wait_for(lambda: all(st["used_bytes"] <= 0.95 * st["capacity_bytes"]
                             for st in c.stats().values()), 10)
    return keys


def _record_of(root: str, key: bytes) -> tuple[str, int]:
    """(segment file, offset of the key's bytes) of the record holding ``key``: a record
    header on a 4 KiB boundary whose key field is exactly ``key``."""
    for _sid, path in segment_paths(root):
        data = open(path, "rb").read()
        for off in range(BLOCK, len(data), BLOCK):
            ns_len, key_len = struct.unpack_from("<HH", data, off + 8)
            at = off + 64 + ns_len
            if (REC_HDR.unpack_from(data, off)[0] == REC_MAGIC and key_len == len(key)
                    and data[at:at + key_len] == key):
                return path, at
    raise AssertionError(f"{key!r} not found on disk")


def test_flipped_segment_byte_is_dropped_and_counted(make_cluster, tmp_path):
    disk = tmp_path / "disk"
    cl = make_cluster(1, "16MiB", slab="1MiB", extra=[
        "--disk-dir", str(disk), "--disk", "128MiB", "--segment-bytes", "4MiB",
        "--promote-policy", "never"])
    srv, addr = cl.servers[0], cl.addresses[0]
    with Client(cl.addresses, timeout_ms=10_000) as c:
        keys = _fill(c, 100)  # 30 MB: the first keys live on disk only
        assert c.stats()[addr]["disk_objects"] > 40
    srv.terminate()
    victim = keys[7]
    root = tier_root(str(disk), srv.name)
    path, pos = _record_of(root, victim)
    with open(path, "r+b") as f:  # one bit flip in the middle of the victim's data
        f.seek(pos + 150_000)
        b = f.read(1)
        f.seek(pos + 150_000)
        f.write(bytes([b[0] ^ 0x01]))
    srv.start()
    with Client(cl.addresses, timeout_ms=10_000) as c:
        got = c.get_batch(keys)
        assert got[7] is None, "a corrupt disk record was served"
        bad = [k for k, v in zip(keys, got) if v is not None and not check_value(k, v)]
        assert bad == []
        assert sum(v is not None for v in got) == len(keys) - 1
        st = c.stats()[addr]
        assert st["disk_corrupt_dropped"] == 1
        assert c.get(victim) is None and not c.exists(victim)  # dropped, not retried


def test_injected_read_corruption_is_never_served(make_cluster, tmp_path):
    cl = make_cluster(1, "16MiB", slab="1MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk", "128MiB", "--segment-bytes", "4MiB",
        "--promote-policy", "never", "--failpoints", "disk_read_corrupt=0.3,seed=3"])
    addr = cl.addresses[0]
    with Client(cl.addresses, timeout_ms=10_000) as c:
        keys = _fill(c, 100)
        served = 0
        for _ in range(3):
            got = c.get_batch(keys)
            assert all(check_value(k, v) for k, v in zip(keys, got) if v is not None)
            served += sum(v is not None for v in got)
        st = c.stats()[addr]
    assert st["disk_corrupt_dropped"] > 5
    assert served > 0
    assert st["disk_objects"] + st["objects"] == len(keys) - st["disk_corrupt_dropped"]
