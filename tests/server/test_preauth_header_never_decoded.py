"""A stranger's frame header is judged on the fixed prefix and never decoded; any header
is decoded with bounds, so no header costs memory far beyond its own size.

Before the fix the server msgpack-decoded every header before it looked at the opcode
or the auth state: one 4 MiB header of nested empty arrays cost ~280 MiB of RSS and
~1 s of GIL, without a token. Pinned here, against a real server (RSS read from
/proc/PID/status):

* before AUTH, a 4 MiB header, whether on a data op or on AUTH itself, is refused from
  the prefix (AUTH / TOO_LARGE) at once, and three at a time leave RSS flat;
* after AUTH, the same header is refused as TOO_LARGE, RSS flat, and fast.
"""

from __future__ import annotations

import struct
import threading
import time

import pytest

from gcache.protocol import Op
from gcache.status import Status

from rawwire import RawConn, assert_serving, raw_frame, rss_bytes, server_log

pytestmark = [pytest.mark.integration, pytest.mark.faults]

MIB = 1 << 20
RID = 77


def _nested_empty_arrays(size: int) -> bytes:
    """~``size`` bytes of msgpack: arrays of 4096 empty arrays (one object per byte)."""
    inner = b"\xdc" + struct.pack(">H", 4096) + b"\x90" * 4096
    n = size // len(inner)
    return b"\xdc" + struct.pack(">H", n) + inner * n


HEADER = _nested_empty_arrays(4 * MIB - 64)


def _send_and_expect(addr: str, op: int, status: int, auth: bool) -> float:
    with RawConn(addr, timeout=30) as c:
        if auth:
            c.auth()
        t0 = time.monotonic()
        try:
            c.send(raw_frame(op, RID, HEADER))
        except OSError:
            pass  # refused from the prefix: the server may close before all 4 MiB arrive
        c.expect_error(status, RID)
        return time.monotonic() - t0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", [Op.PUT, Op.AUTH, Op.STATS], ids=["put", "auth", "stats"])
def test_preauth_4mib_header_is_refused_before_decoding(cluster, op):
    pid = cluster.servers[0].proc.pid
    addr = cluster.addresses[0]
    assert_serving(cluster)
    before = rss_bytes(pid)
    status = Status.TOO_LARGE if op == Op.AUTH else Status.AUTH
    took: list[float] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            took.append(_send_and_expect(addr, op, status, auth=False))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    grown = rss_bytes(pid) - before
    assert grown < 32 * MIB, f"server RSS grew {grown / MIB:.0f} MiB for 3 refused headers"
    assert max(took) < 2.0, took
    assert_serving(cluster)
    assert "Traceback" not in server_log(cluster)


@pytest.mark.timeout(90)
def test_authenticated_4mib_nested_header_is_bounded(cluster):
    pid = cluster.servers[0].proc.pid
    assert_serving(cluster)
    before = rss_bytes(pid)
    took = _send_and_expect(cluster.addresses[0], Op.GET, Status.TOO_LARGE, auth=True)
    grown = rss_bytes(pid) - before
    assert grown < 32 * MIB, f"server RSS grew {grown / MIB:.0f} MiB decoding one header"
    assert took < 2.0, took
    assert_serving(cluster)
