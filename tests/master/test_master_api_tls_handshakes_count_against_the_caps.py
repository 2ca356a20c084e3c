"""On an https master, a connection takes its slot under the caps before its TLS
handshake: peers that connect and never say hello hold at most the per-address cap, each
for at most the request deadline (the handshake's deadline), and the next connection from
that address is closed unanswered at once, while another address is served."""

from __future__ import annotations

import json
import socket
import ssl
import time

import pytest

from gcache.testing.cluster import MasterProc, free_port_pair
from gcache.tls import client_context

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(60)]


def _https_healthz(addr: str, ctx: ssl.SSLContext, source: str) -> dict:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5,
                                  source_address=(source, 0)) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: m\r\nConnection: close\r\n\r\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
    return json.loads(out.split(b"\r\n\r\n", 1)[1])


def test_silent_tls_peers_hold_at_most_the_cap_for_the_deadline(tmp_path, tls_files) -> None:
    m = MasterProc("m-tls-cap", free_port_pair(), [], str(tmp_path / "data"), token="t",
                   log_dir=str(tmp_path),
                   extra=["--max-connections-per-ip", "2", "--request-deadline-ms", "2000",
                          *tls_files.server_flags()])
    m.start()
    host, port = m.address.rsplit(":", 1)
    ctx = client_context(tls_files.ca_file)
    silent: list[socket.socket] = []
    try:
        for _ in range(2):  # connect, never send a ClientHello
            silent.append(socket.create_connection((host, int(port)), timeout=10))
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises((ssl.SSLError, OSError)):
            _https_healthz(m.address, ctx, "127.0.0.1")  # third from this address
        assert time.monotonic() - t0 < 2.0, "refused only after a wait"
        assert _https_healthz(m.address, ctx, "127.0.0.2") == {"status": "ok"}
        for s in silent:  # the handshake deadline ends them
            assert s.recv(1) == b""
        assert time.monotonic() - t0 < 2.0 + 3.0
        assert _https_healthz(m.address, ctx, "127.0.0.1") == {"status": "ok"}
    finally:
        for s in silent:
            s.close()
        m.terminate()
