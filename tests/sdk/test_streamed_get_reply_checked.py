"""The SDK checks a streamed GET reply (``Client(stream_gets=True)``) frame by frame: a
stand-in server answers with well-formed frames (the values land, in order) or with a
frame that leaves no item for the next one, claims more items than are left, stops
short, or answers another request id: each bad case is a miss for the whole request
(no exception, no partial hit, no endless read), and the client keeps working."""

from __future__ import annotations

import socket
import time

import pytest

from gcache.hashing import checksum
from gcache.protocol import FLAG_MORE, FLAG_RESPONSE, Limits, Op, encode_frame, read_frame
from gcache.sdk import Client, Status
from gcache.sdk.transports.tcp import TcpTransport
from gcache.testing.standin import StandIn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

VALS = [bytes([65 + i]) * (1000 + i) for i in range(3)]


def _row(i: int) -> list[int]:
    return [int(Status.OK), len(VALS[i]), 5, len(VALS[i]), checksum(VALS[i])]


# each case: the reply frames as (request id offset, flags, item indexes)
CASES = {
    "good": [(0, FLAG_MORE, [0]), (0, 0, [1, 2])],
    "empty-more-frame": [(0, FLAG_MORE, []), (0, 0, [0, 1, 2])],
    "more-with-nothing-left": [(0, FLAG_MORE, [0, 1, 2]), (0, 0, [])],
    "stops-short": [(0, FLAG_MORE, [0]), (0, 0, [1])],
    "too-many-in-last": [(0, FLAG_MORE, [0]), (0, 0, [1, 2, 2])],
    "other-request-id": [(0, FLAG_MORE, [0]), (1, 0, [1, 2])],
}


class StreamingStandIn(StandIn):
    """Replays a real server's HELLO and AUTH reply, then answers every GET with
    ``frames``."""

    def __init__(self, handshake: tuple[dict, dict], frames: list) -> None:
        (self.hello, self.auth_reply), self.frames = handshake, frames
        self.asked_stream: list[object] = []
        super().__init__()

    def serve(self, c: socket.socket) -> None:
        try:
            c.sendall(encode_frame(Op.HELLO, 0, self.hello, flags=FLAG_RESPONSE))
            while True:
                fh, meta = read_frame(c, Limits())
                if fh.opcode == Op.AUTH:
                    c.sendall(encode_frame(Op.AUTH, fh.request_id, self.auth_reply,
                                           flags=FLAG_RESPONSE))
                    continue
                self.asked_stream.append(meta.get("sr"))
                for drid, flags, idx in self.frames:
                    payload = b"".join(VALS[i] for i in idx)
                    c.sendall(encode_frame(Op.GET, fh.request_id + drid,
                                           {"items": [_row(i) for i in idx]}, len(payload),
                                           flags=FLAG_RESPONSE | flags) + payload)
        except Exception:
            c.close()



@pytest.fixture(scope="module")
def handshake(tmp_path_factory):
    from gcache.testing.cluster import Cluster

    cl = Cluster(1, "16MiB", slab="1MiB", prefix="streamchk")
    try:
        t = TcpTransport(cl.start().addresses[0], "", Limits(), 2.0)
        t.connect(time.monotonic() + 5)
        out = dict(t.hello), dict(t.auth_reply)
        t.close()
        yield out
    finally:
        cl.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_reply_is_checked_frame_by_frame(handshake, case):
    h = StreamingStandIn(handshake, CASES[case])
    try:
        with Client([h.address], transport="tcp", timeout_ms=2000, conns_per_server=1,
                    stream_gets=True) as c:
            bufs = [bytearray(len(v)) for v in VALS]
            st = c.get_batch_into(["a", "b", "c"], bufs)
            if case == "good":
                assert st == [Status.OK] * 3
                assert [bytes(b) for b in bufs] == VALS
            else:
                assert Status.OK not in st  # the whole request is a miss, never a partial hit
        assert h.asked_stream and all(v == 1 for v in h.asked_stream)
    finally:
        h.close()
