"""``recv_into_many`` with hashers: each view's hasher sees exactly that view's bytes.

The sender writes the payload in random pieces (so reads end mid-view, span several
views, and skip empty ones); every view must hold its bytes and every hasher must
equal xxh3_64 of its view, views without a hasher untouched by hashing.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.protocol import recv_into_many

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=12),
       hashed=st.lists(st.booleans(), min_size=12, max_size=12),
       pieces=st.lists(st.integers(700, 30_000), min_size=1, max_size=20),
       seed=st.integers(0, 2**32))
def test_each_hasher_sees_exactly_its_views_bytes(sizes, hashed, pieces, seed):
    payload = random.Random(seed).randbytes(sum(sizes))
    views = [memoryview(bytearray(n)) for n in sizes]
    hashers = [xxhash.xxh3_64() if h else None for h, _ in zip(hashed, sizes)]
    a, b = socket.socketpair()
    try:
        def send() -> None:
            pos, i = 0, 0
            while pos < len(payload):
                n = pieces[i % len(pieces)]
                a.sendall(payload[pos:pos + n])
                pos += n
                i += 1
                time.sleep(0)  # let the reader run between pieces

        t = threading.Thread(target=send)
        t.start()
        recv_into_many(b, views, time.monotonic() + 30, hashers)
        t.join(10)
    finally:
        a.close()
        b.close()
    pos = 0
    for v, h, n in zip(views, hashers, sizes):
        assert bytes(v) == payload[pos:pos + n]
        if h is not None:
            assert h.intdigest() == xxhash.xxh3_64_intdigest(payload[pos:pos + n])
        pos += n
