"""Peers that never authenticate cannot hold the server's connection slots.

Before the fix the handshake timeout was a per-``recv`` socket timeout: a peer sending
one byte every few seconds kept its connection forever, and enough of them filled
``max_connections`` so every real client got UNAVAILABLE, with no token needed.

Pinned here, against a real server with small budgets:

* a trickling stranger is disconnected at the whole-handshake deadline, however often
  it sends a byte;
* strangers from one address get at most ``max_preauth_per_ip`` connections, and from
  many addresses at most ``max_preauth_connections`` in all: a client holding the token
  still connects and round-trips while the flood is on;
* each refusal is counted in ``gcache_connections_refused_total``, and the WARNING lines
  about them are rate-limited.

Strangers connect from other loopback addresses (127.0.0.2, ...), so the per-address
budget they exhaust is not the real client's (127.0.0.1).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request

import pytest

from gcache.protocol import PREFIX_SIZE
from gcache.sdk import Client
from gcache.status import Status
from gcache.testing.cluster import free_port

from rawwire import server_log

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TOKEN = "s3cret"
HANDSHAKE_MS = 1500


@pytest.fixture
def guarded(make_cluster):
    port = free_port()
    cl = make_cluster(1, "32MiB", token=TOKEN, extra=[
        "--max-connections", "24", "--max-preauth-connections", "12",
        "--max-preauth-per-ip", "4", "--handshake-timeout-ms", str(HANDSHAKE_MS),
        "--metrics-listen", f"127.0.0.1:{port}"])
    cl.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return cl


class Trickler:
    """Stranger connections from ``src`` that send one prefix byte every ``every`` s and
    never authenticate; ``open_at_end`` tells which ones the server still keeps."""

    def __init__(self, address: str, srcs: list[str], per_src: int, every: float = 0.3):
        host, port = address.rsplit(":", 1)
        self.socks: list[socket.socket] = []
        for src in srcs:
            for _ in range(per_src):
                s = socket.socket()
                s.bind((src, 0))
                s.settimeout(2)
                try:
                    s.connect((host, int(port)))
                except OSError:
                    s.close()
                    continue
                s.setblocking(False)
                self.socks.append(s)
        self.every, self.stop = every, threading.Event()
        self.sent = [0] * len(self.socks)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            for i, s in enumerate(self.socks):
                try:
                    s.recv(65536)  # drain HELLO so the server never blocks on us
                except (BlockingIOError, OSError):
                    pass
                if self.sent[i] < PREFIX_SIZE - 1:  # never a whole prefix
                    try:
                        s.send(b"G")
                        self.sent[i] += 1
                    except OSError:
                        pass

    def open_count(self) -> int:
        """Connections the server has not closed (no EOF / reset seen)."""
        n = 0
        for s in self.socks:
            try:
                while True:
                    data = s.recv(65536)
                    if not data:
                        break
            except BlockingIOError:
                n += 1
            except OSError:
                pass
        return n

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.socks:
            s.close()


def _metric(url: str, name: str) -> dict[str, float]:
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _round_trip(cl) -> None:
    key, value = f"k-{os.urandom(4).hex()}", os.urandom(4096)
    with Client(servers=cl.addresses, namespace="sl", timeout_ms=3000, token=TOKEN,
                conns_per_server=1) as c:
        assert c.put(key, value) == Status.OK
        assert c.get(key) == value


@pytest.mark.timeout(60)
def test_trickling_stranger_is_cut_at_the_handshake_deadline(guarded):
    t = Trickler(guarded.addresses[0], ["127.0.0.2"], 2, every=0.3)
    try:
        time.sleep(0.5)
        assert t.open_count() == 2
        # each byte used to re-arm a per-recv timeout; the deadline counts from accept
        time.sleep(HANDSHAKE_MS / 1000 + 2.0)
        assert t.open_count() == 0, "a trickling peer outlived the handshake deadline"
    finally:
        t.close()
    closed = _metric(guarded.metrics_url, "gcache_deadline_closed_total")
    assert closed.get('gcache_deadline_closed_total{phase="handshake"}', 0) >= 2, closed


@pytest.mark.timeout(60)
def test_strangers_from_one_address_cannot_lock_out_clients(guarded):
    t = Trickler(guarded.addresses[0], ["127.0.0.2"], 40)
    try:
        time.sleep(0.3)
        _round_trip(guarded)
        assert t.open_count() <= 4  # max_preauth_per_ip
    finally:
        t.close()
    refused = _metric(guarded.metrics_url, "gcache_connections_refused_total")
    assert refused.get('gcache_connections_refused_total{reason="preauth_per_ip"}', 0) >= 30
    lines = [ln for ln in server_log(guarded).splitlines() if "connection refused" in ln]
    assert 1 <= len(lines) <= 3, lines  # ~36 refusals, one line per reason per 10 s


@pytest.mark.timeout(60)
def test_strangers_from_many_addresses_cannot_lock_out_clients(guarded):
    srcs = [f"127.0.0.{i}" for i in range(2, 10)]  # 8 addresses x 4 = 32 > 24 slots
    t = Trickler(guarded.addresses[0], srcs, 4)
    try:
        time.sleep(0.3)
        for _ in range(3):  # the flood goes on; real clients keep getting in
            _round_trip(guarded)
        assert t.open_count() <= 12  # max_preauth_connections
    finally:
        t.close()
    refused = _metric(guarded.metrics_url, "gcache_connections_refused_total")
    assert refused.get('gcache_connections_refused_total{reason="preauth_total"}', 0) >= 20
    assert "Traceback" not in server_log(guarded)
