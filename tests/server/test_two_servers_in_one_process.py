"""Two ``Server``s in one process share nothing: each has its own arena, port, shm
registry (lease expiry read from the environment when it is built, not at import),
stats and metrics endpoint; the real SDK puts and gets through each over shm and TCP;
``stop()`` releases their ports and threads, and leaves each arena file for a restart
(which finds every object). Before ``server/app.py`` a server could only be built inside
the ``gcache-server`` click command, and ``shm_ops`` kept one process-wide lease expiry,
reaper and connection set."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
import uuid

import pytest

from gcache.config import load_config
from gcache.sdk import Client, Status
from gcache.server.app import Server

pytestmark = [pytest.mark.integration]


def _config(name: str, listen: str = "127.0.0.1:0"):
    return load_config("server", env={}, cli={
        "listen": listen, "name": name, "memory_bytes": "32MiB", "slab_bytes": "4MiB",
        "metrics_listen": "127.0.0.1:0", "nixl": "off", "log_format": "text"})


def _scrape(server: Server, metric: str) -> float:
    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(metric + " "):
            return float(line.split()[1])
    raise AssertionError(f"{metric} not scraped from {server.metrics_address}")


def _rebindable(address: str) -> bool:
    """Whether ``address`` can be bound and listened on again (as a restarted server does,
    SO_REUSEADDR included: only a socket still listening there refuses)."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
            s.listen(1)
        except OSError:
            return False
    return True


def _threads_settle(baseline: set[threading.Thread], timeout_s: float = 5.0) -> set:
    """Threads started since ``baseline`` that are still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        extra = {t for t in threading.enumerate() if t not in baseline and t.is_alive()}
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.05)


@pytest.fixture
def names():
    made = [f"inproc-{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
    yield made
    for n in made:
        try:
            os.unlink(os.path.join("/dev/shm", f"gcache-{n}.arena"))
        except FileNotFoundError:
            pass


@pytest.mark.timeout(120)
def test_two_servers_in_one_process_share_nothing(names, monkeypatch):
    baseline = set(threading.enumerate())
    monkeypatch.setenv("GCACHE_SHM_LEASE_MS", "4000")
    a = Server(_config(names[0]))
    monkeypatch.setenv("GCACHE_SHM_LEASE_MS", "7000")
    b = Server(_config(names[1]))
    servers = (a, b)
    try:
        # the lease expiry is each server's own, read when it was built
        assert (a.shm.lease_ms, b.shm.lease_ms) == (4000, 7000)
        assert a.shm is not b.shm
        for s in servers:
            s.start()
        assert a.address != b.address
        assert all(int(s.address.rsplit(":", 1)[1]) > 0 for s in servers)
        assert a.metrics_address != b.metrics_address

        for s, n in ((a, 3), (b, 5)):  # a different value set on each server
            keys = [f"{s.cfg.name}/k{i}" for i in range(n)]
            vals = [os.urandom(100_000 + i) for i in range(n)]
            with Client([s.address], transport="shm", timeout_ms=5000) as c:
                assert c.put_batch(keys, vals) == [Status.OK] * n
                assert c.get_batch(keys) == vals
            with Client([s.address], transport="tcp", timeout_ms=5000) as c:
                assert c.get_batch(keys) == vals
                assert c.put("tcp-only", b"t" * 1000) == Status.OK
                assert c.get("tcp-only") == b"t" * 1000

        # nothing crossed over: each server holds only what was put into it
        with Client([b.address], transport="tcp", timeout_ms=5000) as c:
            assert c.get(f"{a.cfg.name}/k0") is None
        assert a.stats()["objects"] == 3 + 1
        assert b.stats()["objects"] == 5 + 1
        assert _scrape(a, "gcache_memory_objects") == 4
        assert _scrape(b, "gcache_memory_objects") == 6
        assert _scrape(a, "gcache_shm_leases") == 0  # every lease was released
        ports = [s.address for s in servers] + [s.metrics_address for s in servers]
    finally:
        for s in servers:
            s.stop()

    for s in servers:
        s.stop()  # idempotent
    leaked = _threads_settle(baseline)
    assert not leaked, f"threads left running after stop(): {sorted(t.name for t in leaked)}"
    for addr in ports:
        assert _rebindable(addr), f"{addr} is still held after stop()"
    for n in names:  # stop() marks the arena clean and leaves the file for a restart
        assert os.path.exists(os.path.join("/dev/shm", f"gcache-{n}.arena"))


@pytest.mark.timeout(120)
def test_stopped_server_restarts_on_its_port_with_its_objects(names):
    first = Server(_config(names[0]))
    first.start()
    try:
        with Client([first.address], transport="tcp", timeout_ms=5000) as c:
            assert c.put("kept", b"v" * 50_000) == Status.OK
    finally:
        first.stop()
    again = Server(_config(names[0], listen=first.address))
    try:
        again.start()
        assert again.address == first.address
        assert again.arena.reused and again.arena.was_clean
        with Client([again.address], transport="shm", timeout_ms=5000) as c:
            assert c.get("kept") == b"v" * 50_000
    finally:
        again.stop()
