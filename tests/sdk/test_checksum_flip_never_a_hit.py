"""A byte flipped in flight or in the live arena is never returned as a hit.

Every value comes from the value oracle (value = f(key)), so any byte returned can be
checked against the key alone. Two faults:

* in flight: a userspace proxy between the SDK and the server flips one payload byte
  of a GET reply (server -> client) or of a PUT (client -> server);
* in the arena: a byte of a committed object's data is flipped in
  /dev/shm/gcache-*.arena while the server runs; the object is then read over tcp and
  over shm (the server only checks recovered objects, so it serves the flipped bytes).

Before the fix the SDK returned the flipped bytes as a hit (the server had no checksum
to send). Now a get reply carries the stored checksum, the SDK verifies it, and a
mismatch is a CORRUPT miss; a flipped PUT is refused by the server (writer's checksum).
With ``verify_checksums=False`` the flipped bytes do come back: the fault is real.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, value_for
from gcache.testing.standin import Proxy

pytestmark = [pytest.mark.integration, pytest.mark.faults]

SIZE = 256 << 10


class FlipProxy(Proxy):
    """TCP proxy to ``target``; flips the last byte of the first chunk of at least
    ``min_chunk`` bytes going in direction ``flip`` ("down": server -> client, "up")."""

    def __init__(self, target: str, flip: str, min_chunk: int = 16 << 10) -> None:
        self.flip, self.min_chunk = flip, min_chunk
        self.flipped = 0
        self.armed = True
        self.lock = threading.Lock()
        super().__init__(target)

    def forward(self, data: bytes, down: bool) -> bytes:
        if (self.flip == "down") == down and len(data) >= self.min_chunk:
            with self.lock:
                hit = self.armed
                self.armed = False
            if hit:
                data = bytearray(data)
                data[-1] ^= 0x20
                self.flipped += 1
        return data


def _fresh_get(addr: str, key: str, **kw) -> tuple[bytes | None, int]:
    with Client([addr], timeout_ms=5000, conns_per_server=1, **kw) as c:
        return c.get(key), c.counters["checksum_mismatch"]


@pytest.mark.timeout(90)
def test_flip_in_flight_is_never_a_hit(cluster):
    real = cluster.addresses[0]
    keys = [f"wire-{i}" for i in range(3)]
    with Client([real], transport="tcp", timeout_ms=5000) as c:
        assert c.put_batch(keys, [value_for(k.encode(), SIZE) for k in keys]) == [Status.OK] * 3
    # GET reply flipped on its way to the client: a CORRUPT miss, counted
    p = FlipProxy(real, "down")
    try:
        got, bad = _fresh_get(p.address, keys[0], transport="tcp")
        assert p.flipped == 1
        assert got is None and bad == 1
        # the same fault with verification off does return wrong bytes: the fault is real
        p.armed = True
        got, bad = _fresh_get(p.address, keys[1], transport="tcp", verify_checksums=False)
        assert p.flipped == 2 and got is not None and not check_value(keys[1].encode(), got)
        # into a buffer as well
        p.armed = True
        out = np.zeros(SIZE, np.uint8)
        with Client([p.address], transport="tcp", timeout_ms=5000, conns_per_server=1) as c:
            assert c.get_batch_into([keys[2]], [out]) == [Status.CORRUPT]
        assert p.flipped == 3
    finally:
        p.close()
    # PUT flipped on its way to the server: refused, the old value stays
    p = FlipProxy(real, "up")
    try:
        with Client([p.address], transport="tcp", timeout_ms=5000, conns_per_server=1) as c:
            assert c.put(keys[0], value_for(b"other", SIZE)) == Status.CORRUPT
        assert p.flipped == 1
    finally:
        p.close()
    with Client([real], transport="tcp", timeout_ms=5000) as c:
        for k in keys:
            assert check_value(k.encode(), c.get(k))


@pytest.mark.timeout(90)
def test_flip_in_live_arena_is_never_a_hit(cluster):
    addr = cluster.addresses[0]
    key = b"arena-flip"
    value = value_for(key, SIZE)
    with Client([addr], transport="tcp", timeout_ms=5000) as c:
        assert c.put(key, value) == Status.OK
    path = cluster.servers[0].arena_path
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(value[:4096])
        assert at > 0 and mm[at:at + SIZE] == value
        mm[at + SIZE // 2] ^= 0x01  # one bit of one committed byte
    for transport in ("tcp", "shm"):
        with Client([addr], transport=transport, timeout_ms=5000) as c:
            got = c.get(key)
            assert got is None, f"{transport}: flipped bytes returned as a hit"
            out = np.zeros(SIZE, np.uint8)
            assert c.get_batch_into([key], [out]) == [Status.CORRUPT]
            assert c.counters["checksum_mismatch"] == 2
    with Client([addr], transport="shm", timeout_ms=5000, verify_checksums=False) as c:
        got = c.get(key)  # the flip is real: unverified, the wrong bytes come back
        assert got is not None and not check_value(key, got)
