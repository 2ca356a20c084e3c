"""``recv_views``: the C version and its pure-Python twin give the same results.

For random view lists (empty views among them, some flagged for hashing) and a sender
that writes the payload in random pieces, both fill every view with its bytes and
return the same digests (xxh3_64 of each flagged view, None for the others). Both end
the same way on a peer that closes mid-payload (ConnectionError, the bytes before it
landed), a peer that stops sending (TimeoutError by the deadline, whatever the
socket's own timeout, and also when bytes keep trickling in), a deadline already past
(TimeoutError before any byte is taken), and bad arguments (the same exception type).
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

from gcache import native

from socket_peers import Trickler, raised

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

IMPLS = {"c": _native.recv_views, "twin": native.twins.recv_views}


def _feed(sock: socket.socket, payload: bytes, pieces: list[int], close: bool) -> None:
    pos, i = 0, 0
    while pos < len(payload):
        n = pieces[i % len(pieces)]
        sock.sendall(payload[pos:pos + n])
        pos += n
        i += 1
        time.sleep(0)  # let the reader run between pieces
    if close:
        sock.shutdown(socket.SHUT_WR)


def _run(fn, sizes, want, payload, pieces, close, sock_timeout):
    views = [memoryview(bytearray(n)) for n in sizes]
    a, b = socket.socketpair()
    b.settimeout(sock_timeout)
    t = threading.Thread(target=_feed, args=(a, payload, pieces, close))
    t.start()
    try:
        got = ("ok", fn(b, views, want, time.monotonic() + 30))
    except Exception as exc:  # the type is what must match
        got = ("raised", type(exc))
    finally:
        t.join(10)
        a.close()
        b.close()
    return got, [bytes(v) for v in views]


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), min_size=0, max_size=10),
       flags=st.lists(st.booleans(), min_size=10, max_size=10),
       hashing=st.booleans(),
       pieces=st.lists(st.integers(500, 200_000), min_size=1, max_size=8),
       short_by=st.integers(0, 3),
       seed=st.integers(0, 2**32),
       sock_timeout=st.sampled_from([None, 0.0, 5.0]))
def test_native_and_twin_agree(sizes, flags, hashing, pieces, short_by, seed, sock_timeout):
    want = flags[:len(sizes)] if hashing else None
    whole = random.Random(seed).randbytes(sum(sizes))
    # short_by > 0: the peer closes that many bytes early (or sends it all, if empty)
    payload = whole[:max(0, len(whole) - short_by * 1000)] if short_by else whole
    close = bool(short_by)
    c = _run(IMPLS["c"], sizes, want, payload, pieces, close, sock_timeout)
    p = _run(IMPLS["twin"], sizes, want, payload, pieces, close, sock_timeout)
    assert c == p
    outcome, landed = c
    if len(payload) < len(whole):
        assert outcome == ("raised", ConnectionError)
    else:
        assert outcome[0] == "ok"
        pos = 0
        for i, (n, got) in enumerate(zip(sizes, landed)):
            assert got == whole[pos:pos + n]
            d = xxhash.xxh3_64_intdigest(got) if want and want[i] else None
            assert outcome[1][i] == d
            pos += n
    pos = 0
    for n, got in zip(sizes, landed):  # what landed is always the stream's bytes
        end = min(pos + n, len(payload))
        assert got[:max(0, end - pos)] == payload[pos:end]
        pos += n


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("trickle", [False, True])
def test_a_stalled_or_trickling_peer_ends_at_the_deadline(impl, trickle):
    """The socket's own timeout (10 s) does not stretch the 0.3 s deadline, nor does a
    peer that keeps sending a byte every 10 ms."""
    a, b = socket.socketpair()
    b.settimeout(10.0)
    view = memoryview(bytearray(1 << 20))
    t0 = time.monotonic()
    try:
        with Trickler(a, start=trickle), pytest.raises(TimeoutError):
            IMPLS[impl](b, [view], [True], t0 + 0.3)
        took = time.monotonic() - t0
    finally:
        a.close()
        b.close()
    assert 0.29 <= took < 2.0


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_deadline_already_past_takes_nothing(impl):
    a, b = socket.socketpair()
    try:
        a.sendall(b"abcd")
        view = memoryview(bytearray(4))
        with pytest.raises(TimeoutError):
            IMPLS[impl](b, [view], None, time.monotonic() - 1)
        assert b.recv(4) == b"abcd"  # still in the socket
        assert bytes(view) == bytes(4)
        # all-empty views need no read: done at once, whatever the clock says
        assert IMPLS[impl](b, [memoryview(bytearray(0))], [True], 0.0) == [
            xxhash.xxh3_64_intdigest(b"")]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("args", [
    ("sock", ["rw"], None),          # sock is no socket
    ("ok", [b"read-only"], None),    # a read-only view
    ("ok", [object()], None),        # not a buffer
    ("ok", ["rw", "rw"], [True]),    # one flag for two views
    ("ok", 5, None),                 # views not a sequence
    ("ok", ["strided"], None),       # not C-contiguous
    ("ok", ["rw"], 7),               # want not a sequence
    ("nan", ["rw"], None),           # a NaN stop_at (would poll without end)
], ids=["sock", "readonly", "nonbuffer", "flags", "views", "strided", "want", "nan"])
def test_bad_arguments_raise_the_same_type_and_take_nothing(args):
    kinds = []
    for impl in sorted(IMPLS):
        a, b = socket.socketpair()
        try:
            a.sendall(b"abcd")
            sock_kind, view_kinds, want = args
            sock = "not a socket" if sock_kind == "sock" else b
            views = view_kinds
            if isinstance(view_kinds, list):
                views = [memoryview(bytearray(4)) if k == "rw"
                         else memoryview(bytearray(8))[::2] if k == "strided" else k
                         for k in view_kinds]
            stop = float("nan") if sock_kind == "nan" else time.monotonic() + 5
            kinds.append(raised(IMPLS[impl], sock, views, want, stop))
            assert b.recv(4) == b"abcd"  # nothing was read
        finally:
            a.close()
            b.close()
    assert kinds[0] is not None and kinds[0] == kinds[1]
