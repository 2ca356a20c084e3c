"""A byte get's size is the server's claim: a hostile claim is a miss by the deadline.

A byte get learns the object's size from its first slice (``BytesBatch._first_slice``)
and allocates the whole object before fetching the rest. A server that claims more than
the client's ``max_value_bytes`` (up to 2**62 bytes) made the client try to allocate it;
one that sent none of the object's bytes in its first slice made the fold raise, so the
call hung until its backstop (four times the timeout plus 5 s). Both are now misses
within the call's deadline, and a real server still serves the client afterwards.
"""

from __future__ import annotations

import time

import pytest
import xxhash

from gcache.protocol import Limits, Op
from gcache.sdk import Client, Status

from test_one_item_reply_path import Scripted, _reply  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TIMEOUT_MS = 300
SLACK_S = 0.5

CLAIMS = {
    # (total_len the server claims, bytes it sends in the first slice)
    "none_of_a_small_object": (100, 0),
    "none_of_a_huge_object": (1 << 62, 0),
    "past_max_value_bytes": (Limits().max_value_bytes + 1, 16),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CLAIMS))
def test_hostile_size_claims_are_misses_by_the_deadline(cluster, case):
    total, sent = CLAIMS[case]
    payload = b"q" * sent

    def answer(c, fh):
        row = [int(Status.OK), total, 1, sent, xxhash.xxh3_64_intdigest(payload)]
        c.sendall(_reply(Op.GET, fh.request_id, {"items": [row]}, payload))

    srv = Scripted(answer)
    try:
        with Client([srv.address], transport="tcp", timeout_ms=TIMEOUT_MS) as c:
            for call in (lambda: c.get(b"k"), lambda: c.get_batch([b"k", b"j"])):
                t0 = time.monotonic()
                got = call()
                took = time.monotonic() - t0
                assert got in (None, [None, None]), f"{case}: read as {got!r:.80}"
                assert took < TIMEOUT_MS / 1000 + SLACK_S, f"{case}: took {took:.2f} s"
    finally:
        srv.close()
    with Client(cluster.addresses, transport="tcp", timeout_ms=5000) as c:
        assert c.put(b"real", b"r" * 5000) == Status.OK and c.get(b"real") == b"r" * 5000
