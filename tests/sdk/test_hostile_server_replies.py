"""A hostile or buggy server cannot make the one-sided client copy outside the arena.

The shm client maps the arena file named in HELLO and copies at offsets the server
gives in LEASE/ALLOC replies; a memmove at a bad offset would crash the *engine*.
A stand-in server replays a real server's HELLO and AUTH reply (so the client maps a
real arena),
then answers LEASE with out-of-bounds, negative and malformed spans (and PUT_STAGED
with a malformed reply): every
case must be a miss or failed put (no exception escapes, no crash), and the client
keeps working against the real server afterwards.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from gcache.protocol import (FLAG_MORE, FLAG_RESPONSE, Limits, Op, encode_frame,
                             pack_lease_rows, read_frame)
from gcache.sdk import Client, Status
from gcache.sdk.transports.tcp import TcpTransport
from gcache.testing.standin import StandIn

pytestmark = pytest.mark.integration


class Hostile(StandIn):
    """Accepts connections, sends the real HELLO, answers AUTH with the real AUTH reply
    (which names the arena), answers LEASE/ALLOC with ``reply(op, meta)``: a header map,
    or a list of them, sent as one streamed reply (``FLAG_MORE`` on all but the last)."""

    def __init__(self, handshake: tuple[dict, dict], reply) -> None:
        (self.hello, self.auth_reply), self.reply = handshake, reply
        super().__init__()

    def serve(self, c: socket.socket) -> None:
        lim = Limits()
        try:
            c.sendall(encode_frame(Op.HELLO, 0, self.hello, flags=FLAG_RESPONSE))
            while True:
                fh, meta = read_frame(c, lim)
                if fh.opcode == Op.AUTH:
                    out = self.auth_reply
                else:
                    out = self.reply(fh.opcode, meta)
                frames = out if isinstance(out, list) else [out]
                for j, f in enumerate(frames):
                    more = FLAG_MORE if j < len(frames) - 1 else 0
                    c.sendall(encode_frame(fh.opcode, fh.request_id, f,
                                           flags=FLAG_RESPONSE | more))
        except (OSError, Exception):
            c.close()



def _real_handshake(addr: str) -> tuple[dict, dict]:
    """A real server's HELLO and AUTH reply."""
    t = TcpTransport(addr, "", Limits(), 2.0)
    import time
    t.connect(time.monotonic() + 5)
    out = dict(t.hello), dict(t.auth_reply)
    t.close()
    return out


BAD_LEASES = {
    "past-the-end": lambda size: [[0, 4096, 7, size - 100, 1, 0]],
    "before-data": lambda size: [[0, 4096, 7, 0, 1, 0]],
    "negative-offset": lambda size: [[0, 4096, 7, -4096, 1, 0]],
    "negative-length": lambda size: [[0, -5, 7, 1 << 20, 1, 0]],
    "huge-length": lambda size: [[0, 1 << 62, 7, 1 << 20, 1, 0]],
    "not-ints": lambda size: [[0, "4096", 7, 1 << 20, 1, 0]],
    "wrong-arity": lambda size: [[0, 4096, 7]],
    "wrong-count": lambda size: [[0, 64, 7, 1 << 20, 1, 0], [0, 64, 7, 1 << 20, 2, 0]],
    # the packed form (``"pk": 1``): the same spans as six u64 per row, or a bad blob
    "packed-past-the-end": lambda size: pack_lease_rows([[0, 4096, 7, size - 100, 1, 0]]),
    "packed-huge-length": lambda size: pack_lease_rows([[0, 1 << 62, 7, 1 << 20, 1, 0]]),
    "packed-short": lambda size: pack_lease_rows([[0, 4096, 7, 1 << 20, 1, 0]])[:-1],
    "packed-two-rows": lambda size: pack_lease_rows([[0, 64, 7, 1 << 20, 1, 0]] * 2),
    "packed-not-bytes": lambda size: [0, 4096, 7, 1 << 20, 1, 0],
}


def _one_sided_stand_in(cluster, monkeypatch) -> tuple[str, tuple[dict, dict], int]:
    """The real server's address, its handshake (for a stand-in to replay) and its
    arena's size; small frames go one-sided too."""
    monkeypatch.setenv("GCACHE_ONE_SIDED_MIN_BYTES", "1")
    real = cluster.addresses[0]
    handshake = _real_handshake(real)
    return real, handshake, handshake[1]["shm"]["size"]


@pytest.mark.parametrize("case", sorted(BAD_LEASES))
def test_bad_lease_spans_are_misses_not_crashes(cluster, case, monkeypatch):
    real, handshake, size = _one_sided_stand_in(cluster, monkeypatch)

    seen: list[int] = []

    def reply(op, meta):
        seen.append(op)
        if op == Op.LEASE:
            assert meta.get("pk") == 1  # the SDK asks for the packed form
            return {"packed" if case.startswith("packed") else "items": BAD_LEASES[case](size)}
        if op == Op.ALLOC:
            return {"items": [[0, size - 10, 1]]}  # a slot past the end of the arena
        if op == Op.PUT_STAGED:
            return {"st": [0, 0]}  # one status too many for the frame
        return {"st": [0] * len(meta.get("leases", meta.get("slots", [])))}

    h = Hostile(handshake, reply)
    try:
        with Client([h.address], transport="shm", timeout_ms=2000) as c:
            out = bytearray(4096)
            assert c.get_batch_into(["k"], [out]) != [Status.OK]
        with Client([h.address], transport="shm", timeout_ms=2000) as c:  # not suspect yet
            assert c.put("k", b"v" * 300_000) != Status.OK
        assert Op.LEASE in seen and Op.PUT_STAGED in seen  # the one-sided path ran
        # an shm client never writes the arena: its puts are staged, never ALLOC'ed
        assert Op.ALLOC not in seen and Op.COMMIT not in seen
    finally:
        h.close()
    with Client([real], transport="shm", timeout_ms=5000) as c:  # the real one still works
        assert c.put("ok", b"x" * 300_000) == Status.OK and c.get("ok") == b"x" * 300_000


def test_server_without_staged_puts_gets_plain_puts(cluster, monkeypatch):
    """An older server does not announce ``"staged"`` in its shm identity: an shm client
    then puts with plain PUT frames (never PUT_STAGED, which such a server would answer
    with an unknown-opcode error and a closed connection)."""
    monkeypatch.setenv("GCACHE_ONE_SIDED_MIN_BYTES", "1")
    hello, auth = _real_handshake(cluster.addresses[0])
    auth["shm"] = {k: v for k, v in auth["shm"].items() if k != "staged"}
    seen: list[int] = []

    def reply(op, meta):
        seen.append(op)
        return {"st": [int(Status.OK)] * len(meta.get("items", []))}

    h = Hostile((hello, auth), reply)
    try:
        with Client([h.address], transport="shm", timeout_ms=2000) as c:
            assert c.put("k", b"v" * 300_000) == Status.OK
        assert Op.PUT in seen and Op.PUT_STAGED not in seen and Op.ALLOC not in seen
    finally:
        h.close()


def _row(off: int = 1 << 20) -> list[int]:
    """An OK row of a 64-byte object at arena offset ``off``."""
    return [0, 64, 7, off, 1, 0]


# streamed LEASE replies ("sr": 1) that break the stream's rules: each row exactly once,
# "ix" a non-empty list of request rows, "packed" exactly its rows, every row by the end
BAD_STREAMS = {
    "repeats-a-row": lambda size: [{"ix": [0], "packed": pack_lease_rows([_row()])},
                                   {"ix": [0], "packed": pack_lease_rows([_row()])}],
    "row-out-of-range": lambda size: [{"ix": [2], "packed": pack_lease_rows([_row()])}],
    "negative-row": lambda size: [{"ix": [-1], "packed": pack_lease_rows([_row()])}],
    "empty-ix": lambda size: [{"ix": [], "packed": b""}],
    "ix-not-a-list": lambda size: [{"ix": b"\x00", "packed": pack_lease_rows([_row()])}],
    "ix-not-ints": lambda size: [{"ix": ["0"], "packed": pack_lease_rows([_row()])}],
    "rows-do-not-match-ix": lambda size: [{"ix": [0], "packed": pack_lease_rows(
        [_row()] * 2)}],
    "ends-with-rows-missing": lambda size: [{"ix": [0], "packed": pack_lease_rows(
        [_row()])}],
    "no-ix-after-a-first-frame": lambda size: [
        {"ix": [0], "packed": pack_lease_rows([_row()])},
        {"packed": pack_lease_rows([_row()])}],
    "span-past-the-end": lambda size: [{"ix": [0, 1], "packed": pack_lease_rows(
        [_row(), _row(size - 10)])}],
    "one-frame-with-more-but-no-ix": lambda size: [
        {"packed": pack_lease_rows([_row()] * 2)}, {"ix": [], "packed": b""}],
}


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_bad_streamed_lease_replies_are_misses_not_crashes(cluster, case, monkeypatch):
    """A get of two keys answered by a streamed LEASE reply that breaks its rules: both
    are failed gets at once (the connection is dropped, its leases with it), and the
    client then reads the real server right."""
    real, handshake, size = _one_sided_stand_in(cluster, monkeypatch)
    seen: list[int] = []

    asked: list[Any] = []

    def reply(op, meta):
        seen.append(op)
        if op == Op.LEASE:
            asked.append((meta.get("sr"), len(meta["items"])))
            return BAD_STREAMS[case](size)
        return {"st": [0] * len(meta.get("leases", []))}

    h = Hostile(handshake, reply)
    try:
        with Client([h.address], transport="shm", timeout_ms=5000) as c:
            t0 = time.monotonic()
            st = c.get_batch_into(["a", "b"], [bytearray(64), bytearray(64)])
            took = time.monotonic() - t0
        # a protocol error: the connection is dropped at once, not held to the deadline
        assert st == [Status.UNAVAILABLE] * 2 and took < 2.5, (st, took)
        assert asked == [(1, 2)]  # one LEASE of both keys, asking for a streamed reply
    finally:
        h.close()
    with Client([real], transport="shm", timeout_ms=5000) as c:
        assert c.put("ok", b"x" * 300_000) == Status.OK and c.get("ok") == b"x" * 300_000
