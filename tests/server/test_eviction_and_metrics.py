"""Eviction between watermarks, touch protecting hot keys, replace under concurrent reads,
metrics/health endpoints and config precedence — against real server processes."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from gcache.sdk import Client, Status
from gcache.testing.cluster import ServerProc, free_port
from gcache.testing.oracle import check_value, value_for

pytestmark = pytest.mark.integration


def test_overfill_evicts_lru_and_keeps_touched_keys(make_cluster):
    cl = make_cluster(1, "32MiB", slab="1MiB")  # ~31 slab pages of 1 MiB
    with Client(cl.addresses, timeout_ms=5000) as c:
        hot = [f"hot-{i}".encode() for i in range(10)]
        assert c.put_batch(hot, [value_for(k, 60_000) for k in hot]) == [Status.OK] * 10
        cold = [f"cold-{i}".encode() for i in range(2000)]  # ~120 MB through a 32 MiB arena
        for s in range(0, len(cold), 50):
            ks = cold[s:s + 50]
            assert c.touch_batch(hot) == [Status.OK] * 10  # keep the hot set recent
            assert c.put_batch(ks, [value_for(k, 60_000) for k in ks]) == [Status.OK] * 50
        st = c.stats()[cl.addresses[0]]
        assert st["evictions"] > 1000
        assert st["no_space"] == 0
        assert st["used_bytes"] <= st["capacity_bytes"]
        got = c.get_batch(hot)
        assert all(v is not None and check_value(k, v) for k, v in zip(hot, got))
        recent = c.get_batch(cold[-50:])
        assert all(v is not None and check_value(k, v) for k, v in zip(cold[-50:], recent))
        assert c.get(cold[0]) is None  # the oldest were evicted


def test_replace_during_reads_never_mixes_versions(make_cluster):
    cl = make_cluster(1, "64MiB", slab="4MiB")
    size = 2_500_000  # three slices: the read can interleave with a replace
    a, b = b"A" * size, b"B" * size
    stop = threading.Event()
    bad: list[bytes] = []
    with Client(cl.addresses, timeout_ms=5000, slice_bytes=1 << 20) as c:
        assert c.put("k", a) == Status.OK

        def writer() -> None:
            while not stop.is_set():
                c.put("k", b)
                c.put("k", a)

        t = threading.Thread(target=writer)
        t.start()
        try:
            for _ in range(150):
                v = c.get("k")
                if v is not None and v not in (a, b):
                    bad.append(v[:8])
        finally:
            stop.set()
            t.join(10)
    assert bad == []


def test_metrics_and_health_endpoints(tmp_path):
    port = free_port()
    srv = ServerProc(f"metrics-{port}", "16MiB", slab="1MiB", log_dir=str(tmp_path),
                     extra=["--metrics-listen", f"127.0.0.1:{port}", "--log-format", "json"])
    srv.start()
    try:
        with Client([srv.address]) as c:
            assert c.put("k", b"v" * 1000) == Status.OK
            assert c.get("k") is not None
            assert c.get("absent") is None
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = body.decode()
        assert 'gcache_items_total{op="get",status="OK"} 1.0' in text
        assert 'gcache_items_total{op="get",status="MISS"} 1.0' in text
        assert "gcache_memory_objects 1.0" in text
        assert "gcache_frame_seconds_bucket" in text
        assert "gcache_shm_leases 0.0" in text and "gcache_nixl 0.0" in text
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz",
                                                   timeout=5).read())
        assert health["status"] == "ok" and health["objects"] == 1
    finally:
        srv.terminate()
        srv.remove_arena()
    # structured logs: one JSON object per line, with fields merged in
    records = [json.loads(line) for line in
               (tmp_path / f"{srv.name}.log").read_text().splitlines() if line.strip()]
    ready = [r for r in records if r["msg"] == "arena ready"]
    assert ready and ready[0]["objects"] == 0 and ready[0]["level"] == "info"


def test_config_precedence_file_env_cli(tmp_path, monkeypatch):
    cfg = tmp_path / "gcache.toml"
    cfg.write_text('[server]\nmemory_bytes = "8MiB"\nslab_bytes = "1MiB"\nname = "from-file"\n')
    monkeypatch.setenv("GCACHE_MEMORY_BYTES", "12MiB")  # env beats the file
    srv = ServerProc("cfg-test", "20MiB", log_dir=str(tmp_path), extra=["--config", str(cfg)])
    srv.start()  # --memory 20MiB on the command line beats both
    try:
        with Client([srv.address]) as c:
            st = c.stats()[srv.address]
        assert st["name"] == "cfg-test"  # --name flag beats the file's name
        assert 18 << 20 <= st["capacity_bytes"] <= 20 << 20
    finally:
        srv.terminate()
        srv.remove_arena()
    log = (tmp_path / "cfg-test.log").read_text()
    assert "memory_bytes=20MiB (cli)" in log and "slab_bytes=1MiB (file:" in log


def test_shm_lease_counts_hits_and_misses(tmp_path):
    """A batch get over shm is served by LEASE: its hits and misses are counted like a
    GET's (per item, in the same series)."""
    import numpy as np

    from gcache.sdk.transports.onesided import STATS

    port = free_port()
    srv = ServerProc(f"leasemetrics-{port}", "32MiB", slab="1MiB", log_dir=str(tmp_path),
                     extra=["--metrics-listen", f"127.0.0.1:{port}"])
    srv.start()
    try:
        with Client([srv.address], transport="shm") as c:
            keys = [f"k{i}" for i in range(8)]
            assert c.put_batch(keys[:6], [bytes([i]) * 65536 for i in range(6)]) \
                == [Status.OK] * 6
            bufs = [np.empty(65536, dtype=np.uint8) for _ in keys]
            leased = STATS["shm_get_items"]
            st = c.get_batch_into(keys, bufs)
            assert st == [Status.OK] * 6 + [Status.MISS] * 2
            assert STATS["shm_get_items"] - leased == 8  # all asked by LEASE, none by GET
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                      timeout=5).read().decode()
        assert 'gcache_items_total{op="get",status="OK"} 6.0' in text
        assert 'gcache_items_total{op="get",status="MISS"} 2.0' in text
    finally:
        srv.terminate()
        srv.remove_arena()
