"""An authenticated PUT that stalls mid-payload does not hold its reservation.

The server reserves an arena chunk for every PUT item before the payload arrives, so the
bytes land straight in place. Before the request deadline an authenticated peer could
announce a large value, send a few bytes and stop: the reservation (and a serving
thread) stayed held for as long as it kept the connection open. Pinned here against a
real server with ``--request-timeout-ms 1000``: the stalled connection is closed within
the deadline plus slack, the reserved bytes are freed, and the server keeps serving.
"""

from __future__ import annotations

import time

import pytest

from gcache.protocol import Op, encode_frame
from gcache.sdk import Client
from gcache.status import Status

from rawwire import RawConn, assert_serving

pytestmark = [pytest.mark.integration, pytest.mark.faults]


def _used(c: Client) -> int:
    (stats,) = c.stats().values()
    return stats["used_bytes"]


@pytest.mark.timeout(60)
def test_stalled_put_payload_is_cut_off_and_releases_its_reservation(make_cluster):
    cl = make_cluster(1, "64MiB", extra=["--request-timeout-ms", "1000"])
    with Client(servers=cl.addresses, namespace="stall", timeout_ms=5000) as c:
        assert _used(c) == 0
        raw = RawConn(cl.addresses[0])
        size = raw.hello["limits"]["max_value_bytes"]  # the largest chunk one put reserves
        raw.auth()
        raw.send(encode_frame(Op.PUT, 7, {"ns": b"stall", "items": [[b"big", size, 0, size, 0]]},
                              size), b"x" * 1024)  # 1 KiB of it, then nothing
        t0 = time.monotonic()
        while _used(c) == 0 and time.monotonic() - t0 < 2.0:
            time.sleep(0.02)
        assert _used(c) >= size, "the PUT did not reserve its chunk"
        while _used(c) > 0 and time.monotonic() - t0 < 8.0:
            time.sleep(0.1)
        freed_after = time.monotonic() - t0
        assert _used(c) == 0, f"reservation still held {freed_after:.1f} s after the stall"
        assert freed_after < 4.0  # 1 s deadline + the watchdog's tick + slack
        raw.sock.settimeout(2.0)
        assert raw.sock.recv(1) == b"", "the stalled connection was not closed"
        raw.close()
        assert c.get("big") is None  # nothing of the stalled put was published
        assert c.put("after", b"ok") == Status.OK and c.get("after") == b"ok"
    assert_serving(cl)
