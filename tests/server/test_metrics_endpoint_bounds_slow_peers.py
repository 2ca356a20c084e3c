"""The metrics port bounds what a peer can hold: a request that trickles in is cut at
one deadline (not per recv), connections past the per-address cap are answered 503,
and a scraper from elsewhere is served meanwhile."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from gcache.server.metrics import MAX_CONNECTIONS_PER_IP, REQUEST_DEADLINE_S
from gcache.testing.cluster import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_trickling_and_piling_peers_are_bounded(make_cluster) -> None:
    port = free_port()
    make_cluster(1, "32MiB", extra=["--metrics-listen", f"127.0.0.1:{port}"])
    # a peer that sends a byte every second never finishes its request line
    slow = socket.create_connection(("127.0.0.1", port), timeout=30)
    t0 = time.monotonic()
    closed = False
    for b in b"GET /metrics HTTP/1.1\r\n" * 4:
        try:
            slow.sendall(bytes([b]))
        except OSError:
            closed = True
            break
        slow.settimeout(1.0)
        try:
            if slow.recv(4096) == b"":
                closed = True
                break
        except TimeoutError:
            pass
    took = time.monotonic() - t0
    slow.close()
    assert closed and took < REQUEST_DEADLINE_S + 4, took
    # idle connections from one address fill its cap; the next is refused, not queued
    held = [socket.create_connection(("127.0.0.1", port), timeout=5)
            for _ in range(MAX_CONNECTIONS_PER_IP)]
    try:
        time.sleep(0.3)  # every one is accepted and holds its thread
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert extra.recv(200).startswith(b"HTTP/1.1 503"), "the cap did not refuse"
        extra.close()
        other = socket.create_connection(("127.0.0.1", port), timeout=5,
                                         source_address=("127.0.0.2", 0))
        other.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert other.recv(200).startswith(b"HTTP/1.0 200")
        other.close()
    finally:
        for s in held:
            s.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert b"gcache_items_total" in r.read()
