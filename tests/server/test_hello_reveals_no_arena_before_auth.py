"""HELLO goes to anyone who connects, so it names no arena path, owner uid or boot id.

Before the fix HELLO carried the shared-memory identity (``"shm": {path, uid, boot_id,
dev, ino, ...}``) to unauthenticated peers. It now travels in the AUTH reply, which
only a peer holding the token gets; the shm transport reads it from there and still
maps the arena.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from gcache.network import boot_id
from gcache.protocol import PREFIX, PREFIX_SIZE, Limits
from gcache.sdk import Client
from gcache.sdk.transports.onesided import STATS
from gcache.sdk.transports.tcp import TcpTransport
from gcache.status import Status

from rawwire import RawConn

pytestmark = [pytest.mark.integration]

TOKEN = "s3cret"


def test_hello_reveals_no_arena_before_auth(make_cluster):
    cl = make_cluster(1, "32MiB", token=TOKEN)
    srv = cl.servers[0]
    host, port = cl.addresses[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        prefix = s.recv(PREFIX_SIZE, socket.MSG_WAITALL)
        hlen = PREFIX.unpack(prefix)[7]
        raw_hello = s.recv(hlen, socket.MSG_WAITALL)
    assert len(raw_hello) == hlen
    for secret in (srv.arena_path.encode(), os.path.basename(srv.arena_path).encode(),
                   boot_id().encode(), b"shm", b"uid", b"boot_id", b"path"):
        assert secret not in raw_hello, f"HELLO reveals {secret!r} before AUTH"

    with RawConn(cl.addresses[0]) as raw:
        assert "shm" not in raw.hello
        raw.auth(TOKEN)  # the identity comes with a successful AUTH
    t = TcpTransport(cl.addresses[0], TOKEN, Limits(), 2.0)
    t.connect(time.monotonic() + 5)
    try:
        info = t.auth_reply["shm"]
        assert info["path"] == srv.arena_path and info["uid"] == os.getuid()
        assert info["boot_id"] == boot_id()
    finally:
        t.close()

    before = STATS["shm_connections"]
    with Client(servers=cl.addresses, namespace="h", timeout_ms=3000, token=TOKEN,
                transport="shm") as c:  # shm still finds and maps the arena
        assert c.put("k", b"v" * 300_000) == Status.OK
        assert c.get("k") == b"v" * 300_000
    assert STATS["shm_connections"] > before
