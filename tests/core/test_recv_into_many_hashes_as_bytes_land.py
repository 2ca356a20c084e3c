"""``recv_into_many`` with ``want``: each flagged view's digest is of exactly its bytes.

The sender writes the payload in random pieces (so reads end mid-view, span several
views, and skip empty ones); every view must hold its bytes and every flagged view's
digest must equal xxh3_64 of its bytes, the others None. Run with a deadline
(``native.recv_views``) and without one (the Python loop, the socket's own timeout).
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
       seed=st.integers(0, 2**32), deadline=st.booleans())
def test_each_flagged_view_hashes_exactly_its_bytes(sizes, hashed, pieces, seed, deadline):
    payload = random.Random(seed).randbytes(sum(sizes))
    views = [memoryview(bytearray(n)) for n in sizes]
    want = hashed[:len(sizes)]
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
        if deadline:
            digests = recv_into_many(b, views, time.monotonic() + 30, want)
        else:
            b.settimeout(30)
            digests = recv_into_many(b, views, None, want)
        t.join(10)
    finally:
        a.close()
        b.close()
    pos = 0
    assert len(digests) == len(views)
    for v, w, d, n in zip(views, want, digests, sizes):
        assert bytes(v) == payload[pos:pos + n]
        assert d == (xxhash.xxh3_64_intdigest(payload[pos:pos + n]) if w else None)
        pos += n
