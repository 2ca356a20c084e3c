"""``exchange``: the C version and its pure-Python twin give the same results.

For random requests and replies (a peer that reads the whole request, then writes its
reply in random pieces, possibly closing early), both send every byte of the request,
receive at least ``at_least`` bytes and at most the view's length (how many depends on
how the pieces arrive), return that count, and leave exactly the reply's first bytes in
the view; a peer that closes before ``at_least`` bytes is a ConnectionError for both. Both end at the deadline whatever the socket's own
timeout, against a peer that never answers, one that trickles, and one that never
reads a large request (the send side's wait); a deadline already past sends nothing;
bad arguments raise the same exception type and send nothing.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import native

from socket_peers import Trickler, raised

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

IMPLS = {"c": _native.exchange, "twin": native.twins.exchange}


def _peer(sock: socket.socket, expect: int, reply: bytes, pieces: list[int],
          close: bool, heard: list[bytes]) -> None:
    got = b""
    while len(got) < expect:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        got += chunk
    heard.append(got)
    pos, i = 0, 0
    try:
        while pos < len(reply):
            n = pieces[i % len(pieces)]
            sock.sendall(reply[pos:pos + n])
            pos += n
            i += 1
            time.sleep(0)  # let the caller read between pieces
        if close:
            sock.shutdown(socket.SHUT_WR)
    except OSError:  # the caller took what it needed and closed
        return


def _run(fn, request, reply, pieces, close, cap, at_least, sock_timeout):
    view = memoryview(bytearray(cap))
    a, b = socket.socketpair()
    b.settimeout(sock_timeout)
    heard: list[bytes] = []
    t = threading.Thread(target=_peer, args=(a, len(request), reply, pieces, close, heard))
    t.start()
    try:
        got = ("ok", fn(b, request, view, at_least, time.monotonic() + 30))
    except Exception as exc:  # the type is what must match
        got = ("raised", type(exc))
    finally:
        b.shutdown(socket.SHUT_RDWR)  # a peer still reading the request gets its EOF
        t.join(10)
        a.close()
        b.close()
    return got, heard, bytes(view)


@settings(max_examples=100, deadline=None)
@given(req_len=st.integers(0, 600_000), reply_len=st.integers(0, 5_000),
       cap=st.integers(1, 4_096), at_frac=st.floats(0, 1),
       pieces=st.lists(st.integers(1, 3_000), min_size=1, max_size=6),
       close=st.booleans(), seed=st.integers(0, 2**32),
       sock_timeout=st.sampled_from([None, 0.0, 5.0]))
def test_native_and_twin_agree(req_len, reply_len, cap, at_frac, pieces, close, seed,
                               sock_timeout):
    rnd = random.Random(seed)
    request, reply = rnd.randbytes(req_len), rnd.randbytes(reply_len)
    at_least = max(1, min(cap, round(at_frac * cap)))
    if reply_len < at_least:
        close = True  # else both wait out the 30 s deadline for bytes that never come
    for fn in (IMPLS["c"], IMPLS["twin"]):
        out, heard, view = _run(fn, request, reply, pieces, close, cap, at_least,
                                sock_timeout)
        assert heard == [request]  # every byte of the request, in order
        if reply_len < at_least:
            assert out == ("raised", ConnectionError)
            continue
        # how many bytes one read takes depends on how they arrive: the count is any
        # from at_least to what fits, and they are the stream's first bytes
        assert out[0] == "ok"
        n = out[1]
        assert at_least <= n <= min(cap, reply_len)
        assert view[:n] == reply[:n] and view[n:] == bytes(cap - n)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("peer", ["silent", "trickle", "never-reads"])
def test_a_silent_trickling_or_unreading_peer_ends_at_the_deadline(impl, peer):
    """The socket's own timeout (10 s) does not stretch the 0.3 s deadline: not for a
    peer that never answers, one that sends a byte every 10 ms (short of at_least),
    nor one that never reads a request larger than the socket buffers."""
    a, b = socket.socketpair()
    b.settimeout(10.0)
    request = bytes(64 << 20 if peer == "never-reads" else 64)
    view = memoryview(bytearray(1 << 16))
    t0 = time.monotonic()
    try:
        with Trickler(a, start=peer == "trickle"), pytest.raises(TimeoutError):
            IMPLS[impl](b, request, view, len(view), t0 + 0.3)
        took = time.monotonic() - t0
    finally:
        a.close()
        b.close()
    assert 0.29 <= took < 2.0


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_deadline_already_past_sends_nothing(impl):
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        with pytest.raises(TimeoutError):
            IMPLS[impl](b, b"request", memoryview(bytearray(8)), 1, time.monotonic() - 1)
        with pytest.raises(BlockingIOError):
            a.recv(16)  # nothing was sent
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_closed_peer_is_an_os_error_not_a_signal(impl):
    """Sending to a peer that closed: OSError (EPIPE or ECONNRESET), the process not
    killed by SIGPIPE."""
    a, b = socket.socketpair()
    a.close()
    try:
        with pytest.raises(OSError):
            IMPLS[impl](b, bytes(1 << 20), memoryview(bytearray(8)), 1,
                        time.monotonic() + 5)
    finally:
        b.close()


@pytest.mark.parametrize("case", ["sock", "request", "readonly", "strided", "at-zero",
                                  "at-over", "at-float", "nan"])
def test_bad_arguments_raise_the_same_type_and_send_nothing(case):
    kinds = []
    for impl in sorted(IMPLS):
        a, b = socket.socketpair()
        a.setblocking(False)
        try:
            sock = "not a socket" if case == "sock" else b
            request = object() if case == "request" else b"req"
            view = (b"read-only" if case == "readonly"
                    else memoryview(bytearray(16))[::2] if case == "strided"
                    else memoryview(bytearray(8)))
            at_least = {"at-zero": 0, "at-over": 9, "at-float": 1.5}.get(case, 4)
            stop = float("nan") if case == "nan" else time.monotonic() + 5
            kinds.append(raised(IMPLS[impl], sock, request, view, at_least, stop))
            with pytest.raises(BlockingIOError):
                a.recv(16)  # nothing was sent
        finally:
            a.close()
            b.close()
    assert kinds[0] is not None and kinds[0] == kinds[1], (case, kinds)
