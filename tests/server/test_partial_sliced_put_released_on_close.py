"""An incomplete sliced put is bounded per connection and released when it closes.

Before the fix a 1-byte first slice reserved the whole object for
``pending_put_timeout_ms`` (30 s), even after the connection closed: 80 bytes sent
blocked 55 MiB. Now the reservation is charged to the connection (BUSY past a quarter
of the arena) and released the moment a connection that contributed to it closes.
"""

from __future__ import annotations

import time

import pytest

from gcache.protocol import Op, encode_frame
from gcache.sdk import Client
from gcache.status import Status

from rawwire import RawConn

pytestmark = [pytest.mark.integration, pytest.mark.faults]

MIB = 1 << 20


def _stats(addr: str) -> dict:
    with Client([addr], transport="tcp", timeout_ms=5000) as c:
        return next(iter(c.stats().values()))


def _first_slice(c: RawConn, rid: int, key: bytes, total: int) -> int:
    c.send(encode_frame(Op.PUT, rid, {"ns": b"p", "items": [[key, total, 0, 1, 1000 + rid]]},
                        1), b"x")
    fh, rep = c.read()
    assert fh.status == 0, rep
    return rep["st"][0]


@pytest.mark.timeout(60)
def test_partial_sliced_put_released_on_close(make_cluster):
    cl = make_cluster(1, "64MiB", slab="8MiB")
    addr = cl.addresses[0]
    c = RawConn(addr)
    c.auth()
    cap = _stats(addr)["capacity_bytes"]
    # 1-byte first slices of 3 MiB objects: at most a quarter of the arena per connection
    st = [_first_slice(c, 2 + i, b"big%d" % i, 3 * MIB) for i in range(8)]
    n_ok = st.count(Status.OK)
    assert n_ok >= 2 and st[:n_ok] == [Status.OK] * n_ok and Status.BUSY in st, st
    s = _stats(addr)
    assert s["pending_puts"] == n_ok and 3 * MIB * n_ok <= s["reserved_bytes"] <= cap // 4
    # other writers are not locked out meanwhile
    with Client([addr], transport="tcp", timeout_ms=5000) as w:
        assert w.put_batch([f"o{i}" for i in range(4)], [b"v" * MIB] * 4) == [Status.OK] * 4
    c.close()  # the writer goes away: its incomplete puts go with it, at once
    end = time.monotonic() + 5
    while (s := _stats(addr))["pending_puts"] and time.monotonic() < end:
        time.sleep(0.1)
    assert s["pending_puts"] == 0 and s["reserved_bytes"] == 0
    assert s["pending_released"] == n_ok
