"""A peer that sends requests and never reads the answers holds its connection (and its
slot under the per-address cap) only until the request deadline after its last answer:
the answers wait in the event loop's buffer, and the connection is aborted then, not kept
open for as long as the peer likes."""

from __future__ import annotations

import socket
import time

import pytest

from gcache.testing.cluster import MasterProc, free_port_pair
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(60)]

SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n"


def _status_line(addr: str) -> bytes:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: m\r\nConnection: close\r\n\r\n")
        return s.recv(64).split(b"\r\n", 1)[0]


def test_a_peer_that_never_reads_is_cut_at_the_deadline(tmp_path) -> None:
    m = MasterProc("m-noread", free_port_pair(), [], str(tmp_path / "data"), token="t",
                   log_dir=str(tmp_path), extra=["--max-connections-per-ip", "1",
                                                 "--request-deadline-ms", "1000"])
    m.start()
    host, port = m.address.rsplit(":", 1)
    hog = socket.socket()
    try:
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.connect((host, int(port)))
        hog.settimeout(5)
        hog.sendall(SCRAPE * 2000)  # megabytes of answers it never reads
        time.sleep(0.3)
        assert _status_line(m.address).startswith(b"HTTP/1.1 503")  # it holds the slot
        t0 = time.monotonic()
        wait_for(lambda: _status_line(m.address) == b"HTTP/1.1 200 OK", 10, step=0.2,
                 retry_on=(OSError,))
        assert time.monotonic() - t0 < 5.0
    finally:
        hog.close()
        m.terminate()
