"""Restart survival of the shared-memory arena: clean stop, kill -9, corruption, layout change."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gcache.sdk import Client, Status
from gcache.server.arena import HDR_FIXED
from gcache.testing.oracle import check_value, value_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

SIZES = [1000, 4096, 70_000, 300_000, 2_500_000]  # 2.5 MB is sliced into 1 MiB pieces


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def _size(key: bytes) -> int:
    return SIZES[int(key.rsplit(b"-", 1)[1]) % len(SIZES)]


def _put_all(c: Client, keys: list[bytes]) -> None:
    vals = [value_for(k, _size(k)) for k in keys]
    assert c.put_batch(keys, vals) == [Status.OK] * len(keys)


def _check_all(c: Client, keys: list[bytes]) -> tuple[int, int]:
    """Returns (present, wrong)."""
    got = c.get_batch(keys)
    wrong = sum(1 for k, v in zip(keys, got) if v is not None and not check_value(k, v))
    sizes_wrong = sum(1 for k, v in zip(keys, got) if v is not None and len(v) != _size(k))
    return sum(v is not None for v in got), wrong + sizes_wrong


def test_clean_restart_keeps_every_acknowledged_object(make_cluster):
    cl = make_cluster(1, "128MiB", slab="4MiB")
    srv = cl.servers[0]
    keys = _keys(100)  # ~58 MB: fits, so nothing is evicted
    with Client(cl.addresses, timeout_ms=5000) as c:
        _put_all(c, keys)
        assert c.delete(keys[0]) == Status.OK  # a delete is durable too
    srv.restart()
    with Client(cl.addresses, timeout_ms=5000) as c:
        present, wrong = _check_all(c, keys[1:])
        assert wrong == 0
        assert present == len(keys) - 1
        assert c.get(keys[0]) is None
        stats = c.stats()[srv.address]
        assert stats["recovered"] == len(keys) - 1
        assert stats["corrupt_dropped"] == 0


def test_kill9_loses_only_in_flight_writes(make_cluster):
    cl = make_cluster(1, "256MiB", slab="4MiB")
    srv = cl.servers[0]
    acked = _keys(60, "acked")
    with Client(cl.addresses, timeout_ms=5000) as c:
        _put_all(c, acked)
    # writers keep going while the server is killed; their outcome is unknown
    stop = threading.Event()
    inflight: list[bytes] = []

    def writer() -> None:
        with Client(cl.addresses, timeout_ms=2000) as c2:
            i = 0
            while not stop.is_set() and i < 1500:  # bounded: must not evict acked keys
                k = f"inflight-{i}".encode()
                inflight.append(k)
                c2.put(k, value_for(k, 70_000))
                i += 1

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.5)
    srv.kill9()
    stop.set()
    t.join(10)
    srv.start()
    with Client(cl.addresses, timeout_ms=5000) as c:
        present, wrong = _check_all(c, acked)
        assert wrong == 0
        assert present == len(acked), "an acknowledged write was lost by kill -9"
        got = c.get_batch(inflight)
        bad = [k for k, v in zip(inflight, got) if v is not None and not check_value(k, v)]
        assert bad == [], "a torn in-flight write was served"


def test_corrupt_object_is_dropped_and_counted(make_cluster):
    cl = make_cluster(1, "64MiB")
    srv = cl.servers[0]
    keys = _keys(20, "c")
    with Client(cl.addresses, timeout_ms=5000) as c:
        vals = [value_for(k, 50_000) for k in keys]
        assert c.put_batch(keys, vals) == [Status.OK] * len(keys)
    srv.terminate()
    # flip one data byte of one object, found by its key in the arena file
    with open(srv.arena_path, "r+b") as f:
        data = f.read()
        pos = data.find(b"c-7")
        assert pos > 0
        victim = pos + 64  # inside the data that follows the padded header
        f.seek(victim)
        b = f.read(1)
        f.seek(victim)
        f.write(bytes([b[0] ^ 0xFF]))
    srv.start()
    with Client(cl.addresses, timeout_ms=5000) as c:
        got = c.get_batch(keys)
        assert got[7] is None, "a corrupt object was served"
        assert all(check_value(k, v) for k, v in zip(keys, got) if v is not None)
        assert sum(v is not None for v in got) == len(keys) - 1
        assert c.stats()[srv.address]["corrupt_dropped"] == 1


def test_layout_change_means_clean_start_with_reason(make_cluster, tmp_path):
    cl = make_cluster(1, "64MiB")
    srv = cl.servers[0]
    with Client(cl.addresses, timeout_ms=5000) as c:
        assert c.put(b"x", b"y" * 100) == Status.OK
    srv.terminate()
    srv.memory = "96MiB"  # a different geometry
    srv.start()
    with Client(cl.addresses, timeout_ms=5000) as c:
        assert c.get(b"x") is None
    log = (tmp_path / f"{srv.name}.log").read_text()
    assert "clean start" in log and "size changed" in log


def test_second_server_on_same_arena_is_refused(make_cluster):
    cl = make_cluster(1, "32MiB")
    from gcache.testing.cluster import ServerProc

    twin = ServerProc(cl.servers[0].name, "32MiB", slab="1MiB")
    with pytest.raises(RuntimeError):
        twin.start(timeout=15)
    assert cl.servers[0].alive
    assert HDR_FIXED == 64  # header layout is part of the arena format
    assert os.path.exists(cl.servers[0].arena_path)
