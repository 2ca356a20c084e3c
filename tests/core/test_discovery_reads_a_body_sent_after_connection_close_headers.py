"""``http_json`` reads the body of a ``Connection: close`` answer whose body arrives in a
later segment than its headers (aiohttp, the masters' API server, writes them apart):
http.client closes the connection once it has such headers, and the deadline socket
wrapper used to close the real socket then, so the body read failed with EBADF."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from gcache.discovery import http_json

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


def test_body_after_close_headers_is_read() -> None:
    body = b'{"epoch": 7}'
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def serve() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
                time.sleep(0.2)  # the body in its own segment, after the client closed
                conn.sendall(body)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        assert http_json(f"127.0.0.1:{port}", "GET", "/view", None, "", 5.0) == {"epoch": 7}
        t.join(5)
