"""A thousand clients long-polling ``/view`` at once (every server and SDK client of a
large cluster holds one) cost the master less than 100 MB and no thread each (they are
coroutines on the API's event loop: ``gcache.bounded_aiohttp``), and every one of them
is answered when the view changes."""

from __future__ import annotations

import socket
import time

import pytest

from gcache.discovery import MasterClient
from gcache.testing.cluster import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WATCHERS = 1000
PER_ADDRESS = 200  # under the master's default cap of 256 per peer address


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith(key))


def _rss_bytes(pid: int) -> int:
    return _status(pid, "VmRSS:") * 1024


def test_a_thousand_view_watchers_cost_under_100_mb_and_all_wake(tmp_path) -> None:
    with Cluster(0, masters=1, token="t", log_dir=str(tmp_path),
                 master_extra=["--max-connections", "1100"]) as cl:
        host, port = cl.master_addresses[0].rsplit(":", 1)
        pid = cl.masters[0].proc.pid
        mc = MasterClient(cl.master_addresses, "t")
        epoch = mc.view()["epoch"]
        before, threads_before = _rss_bytes(pid), _status(pid, "Threads:")
        watchers = []
        try:
            for i in range(WATCHERS):
                s = socket.create_connection(
                    (host, int(port)), timeout=30,
                    source_address=(f"127.0.0.{2 + i // PER_ADDRESS}", 0))
                s.sendall(f"GET /view?since={epoch}&wait_ms=60000 HTTP/1.1\r\nHost: m\r\n"
                          "Authorization: Bearer t\r\n\r\n".encode())
                watchers.append(s)
            time.sleep(2.0)  # every watcher is parked in its long-poll
            grown = _rss_bytes(pid) - before
            assert grown < 100 * 2**20, f"{WATCHERS} watchers cost {grown / 2**20:.0f} MiB"
            threads = _status(pid, "Threads:") - threads_before
            assert threads < 50, f"{WATCHERS} watchers cost {threads} threads"
            mc.register("w-1", "127.0.0.1:1", 1 << 20, "boot-1")  # the view changes
            answered = 0
            for s in watchers:
                head = s.recv(64)
                answered += head.startswith(b"HTTP/1.1 200")
            assert answered == WATCHERS
        finally:
            for s in watchers:
                s.close()
