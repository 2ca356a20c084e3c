"""One peer address cannot take every master API thread.

The master API serves at most ``--max-connections`` connections (1024) at once, and
before this also let one address hold all of them without a token (half-sent requests
until the request deadline, again and again). ``--max-connections-per-ip`` caps one
address (256 by default: the servers and SDK clients of a host share its address).
Here the cap is 8: the 9th connection from 127.0.0.1 gets a 503, while a peer at
127.0.0.2 is still served, and 127.0.0.1 is served again once its connections close.
"""

from __future__ import annotations

import socket
import time

import pytest

from gcache.testing.cluster import MasterProc, free_port_pair
from gcache.testing.waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TOKEN = "per-address-cap-token"
HALF_HEADERS = b"POST /heartbeat HTTP/1.1\r\nHost: m\r\nContent-Length: 100\r\n"
HEALTHZ = (b"GET /healthz HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer " + TOKEN.encode() +
           b"\r\nConnection: close\r\n\r\n")


def connect(addr: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))


def healthz(addr: str, source: str) -> bytes:
    with connect(addr, source) as s:
        s.sendall(HEALTHZ)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def wait_for(pred, timeout: float):
    return _wait_for(pred, timeout, step=0.1, retry_on=())


@pytest.mark.timeout(60)
def test_one_address_cannot_hold_every_api_connection(tmp_path):
    m = MasterProc("m-per-ip", free_port_pair(), [], str(tmp_path / "data"), token=TOKEN,
                   log_dir=str(tmp_path),
                   extra=["--max-connections", "64", "--max-connections-per-ip", "8",
                          "--request-deadline-ms", "20000"])
    held: list[socket.socket] = []
    try:
        m.start()
        for _ in range(8):
            s = connect(m.address)
            s.sendall(HALF_HEADERS)
            held.append(s)
        time.sleep(0.3)
        refused = healthz(m.address, "127.0.0.1")
        assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
        assert b"from your address" in refused
        assert healthz(m.address, "127.0.0.2").startswith(b"HTTP/1.1 200")
        for s in held:
            s.close()
        held.clear()
        wait_for(lambda: healthz(m.address, "127.0.0.1").startswith(b"HTTP/1.1 200"), 10)
    finally:
        for s in held:
            s.close()
        m.terminate()
    assert "per-address connection cap" in (tmp_path / "m-per-ip.log").read_text()
