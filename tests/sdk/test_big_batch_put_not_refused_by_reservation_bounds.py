"""A client's own big batch of sliced puts is not refused by the reservation bounds.

Reservations (incomplete sliced puts, ALLOC slots) are bounded per connection and in
total (half the arena), so one writer can never reserve the arena away. A legitimate
batch larger than that bound, sliced over several connections, briefly holds more
while its other connections finish their slices: before the back-pressure wait some of
its keys answered BUSY (seen as a flaky put in the callbacks test). Now a put whose
slices all travel in one frame holds no reservation past its request, and a reservation
past the bound waits, bounded, for reservations in flight to commit.
"""

from __future__ import annotations

import pytest

from gcache.sdk import Client
from gcache.status import Status
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.integration]

MIB = 1 << 20


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_batch_larger_than_the_reservation_bound_all_ok(make_cluster, transport):
    cl = make_cluster(1, "96MiB", slab="4MiB")
    keys = [f"big-{transport}-{i}".encode() for i in range(20)]
    vals = [value_for(k, 3 * MIB) for k in keys]  # 60 MiB in flight > the 48 MiB bound
    with Client(cl.addresses, transport=transport, timeout_ms=20_000, conns_per_server=4,
                frame_target_bytes=4 * MIB) as c:
        for _ in range(5):
            assert c.put_batch(keys, vals) == [Status.OK] * len(keys)
        got = c.get_batch(keys[-8:])  # the arena holds the newest; all byte-exact
        assert got == vals[-8:]


def test_self_contained_puts_are_those_tiled_by_one_frame():
    from gcache.protocol import self_contained

    items = [(b"a", 10, 0, 10, 0, 1),                      # whole value
             (b"b", 10, 0, 4, 7, 1), (b"b", 10, 4, 6, 7, 1),  # both slices here
             (b"c", 10, 0, 4, 8, 1),                        # the rest comes later
             (b"d", 10, 0, 5, 9, 1), (b"d", 10, 0, 5, 9, 1),  # overlap: not tiled
             (b"e", 10, 0, 5, 3, 1), (b"e", 10, 5, 5, 4, 1)]  # two different puts
    assert self_contained(items) == {(b"a", 0), (b"b", 7)}
