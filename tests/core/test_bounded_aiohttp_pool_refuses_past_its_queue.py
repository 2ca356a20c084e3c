"""``BoundedAioServer.run_blocking`` holds at most twice its workers in jobs, running or
queued: the next request is refused at once (``PoolBusy``, a 503 in the master API)
instead of waiting behind a stalled dependency without a bound; and a job whose peer hung
up still counts until it ends (it still holds its thread)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from aiohttp import web

from gcache.bounded_aiohttp import BoundedAioServer, PoolBusy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

REQUEST = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


def test_jobs_past_twice_the_workers_are_refused_at_once() -> None:
    gate = threading.Event()
    server: BoundedAioServer

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        try:
            await server.run_blocking(gate.wait, 10.0)
        except PoolBusy as exc:
            return web.Response(status=503, text=str(exc))
        return web.Response(status=200, text="ok")

    server = BoundedAioServer(("127.0.0.1", 0), handler, max_connections=64,
                              blocking_workers=2, name="t", flags=None)
    server.start("test-http")
    socks: list[socket.socket] = []
    try:
        def send() -> socket.socket:
            s = socket.create_connection(server.server_address, timeout=5)
            s.sendall(REQUEST)
            return s

        gone = send()  # its peer hangs up: its job still holds a thread
        time.sleep(0.2)
        gone.close()
        socks = [send() for _ in range(3)]  # 2 running + 2 queued = the cap of 4
        time.sleep(0.3)
        t0 = time.monotonic()
        with send() as refused:
            head = refused.recv(200)
        assert head.startswith(b"HTTP/1.1 503"), head
        assert time.monotonic() - t0 < 1.0
        gate.set()
        assert all(s.recv(200).startswith(b"HTTP/1.1 200") for s in socks)
    finally:
        gate.set()
        for s in socks:
            s.close()
        server.stop()
