"""A GET whose reply is never read does not keep its pins past the send deadline.

The server pins every object of a GET while it sends the reply. Before the fix no send
timeout applied, so an authenticated client that asked for large values and never read
the reply held those pins for as long as it kept the connection: deleted or evicted
objects stayed allocated (and unevictable) forever. Pinned here, against a real server
with ``--send-timeout-ms 1000``: once the reply stalls, the connection is closed within
the deadline plus slack, and the deleted objects' memory is freed.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from gcache.protocol import Op, encode_frame
from gcache.sdk import Client
from gcache.status import Status

from rawwire import RawConn, assert_serving

pytestmark = [pytest.mark.integration, pytest.mark.faults]

KIB = 1 << 10
N, SIZE = 24, 900 * KIB  # a ~21 MiB reply: far more than both socket buffers hold


def _used(c: Client) -> int:
    (stats,) = c.stats().values()
    return stats["used_bytes"]


@pytest.mark.timeout(60)
def test_unread_get_reply_releases_pins(make_cluster):
    cl = make_cluster(1, "64MiB", extra=["--send-timeout-ms", "1000"])
    keys = [f"big-{i}".encode() for i in range(N)]
    with Client(servers=cl.addresses, namespace="pin", timeout_ms=5000) as c:
        assert c.put_batch(keys, [os.urandom(SIZE) for _ in keys]) == [Status.OK] * N
        assert _used(c) >= N * SIZE

        raw = RawConn(cl.addresses[0])
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KIB)
        raw.auth()
        raw.send(encode_frame(Op.GET, 5, {"ns": b"pin",
                                          "items": [[k, 0, SIZE, 0] for k in keys]}))
        time.sleep(0.3)  # the server is now blocked sending, every object pinned
        assert c.delete_batch(keys) == [Status.OK] * N
        t0 = time.monotonic()
        held = _used(c)
        assert held >= N * SIZE // 2, "the objects were not pinned by the stalled reply"
        while _used(c) > 0 and time.monotonic() - t0 < 8.0:
            time.sleep(0.1)
        freed_after = time.monotonic() - t0
        assert _used(c) == 0, f"pins still held {freed_after:.1f} s after the delete"
        assert freed_after < 4.0  # 1 s deadline + the watchdog's tick + slack
        raw.close()
    assert_serving(cl)
