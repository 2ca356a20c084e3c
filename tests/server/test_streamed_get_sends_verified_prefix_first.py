"""A streamed GET (``"sr": 1``) hands out its pins in item order as soon as a prefix is
verified (``Tier.pin_read_stream``): memory hits go out before any disk read ends, a slow
disk read holds back only the items after it (its neighbours are read meanwhile), and a
send that fails mid-stream releases every pin once the reads in flight are done."""

from __future__ import annotations

import time

import pytest

from gcache import failpoints
from gcache.server.disk.log import SLOW_READ_S
from gcache.status import Status
from gcache.testing.oracle import value_for

from tierops import fill_past_memory, small_tiered_store

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
SIZE = 200_000


@pytest.fixture
def store(tmp_path):
    failpoints.configure(None)
    st = small_tiered_store(tmp_path)
    in_mem, on_disk = fill_past_memory(st, NS, 40, SIZE)
    assert len(on_disk) >= 8 and len(in_mem) >= 2
    yield st, in_mem, on_disk
    failpoints.configure(None)
    st.close()


def _items(keys: list[bytes]) -> list[list]:
    return [[k, 0, 1 << 30, 0] for k in keys]


def test_memory_prefix_goes_first_and_a_slow_read_holds_back_only_what_follows(store):
    st, in_mem, on_disk = store
    frame = in_mem[:2] + on_disk[:8]
    calls: list[tuple[float, int, list[Status]]] = []
    failpoints.configure("disk_read_slow=1x")
    t0 = time.monotonic()

    def ready(end, pins):
        calls.append((time.monotonic() - t0, end, [p.status for p in pins[:end]]))

    pins = st.pin_read_stream(NS, _items(frame), ready)
    elapsed = time.monotonic() - t0
    try:
        ends = [c[1] for c in calls]
        assert ends == sorted(set(ends)) and ends[-1] == len(frame)  # rising, all handed out
        # the two memory hits are handed out before the slow disk read could have ended
        assert ends[0] >= 2 and calls[0][0] < SLOW_READ_S / 2
        assert all(s == Status.OK for c in calls for s in c[2])  # only verified pins
        # one slow read, not one per item: its neighbours were read meanwhile
        assert SLOW_READ_S <= elapsed < 3 * SLOW_READ_S
        assert [bytes(p.view) for p in pins] == [value_for(k, SIZE) for k in frame]
    finally:
        st.unpin_many(pins)


def test_failed_send_mid_stream_releases_every_pin(store):
    st, in_mem, on_disk = store
    frame = in_mem[:2] + on_disk[:8]

    def ready(end, pins):
        raise OSError("peer gone")  # the first send fails: nothing after it is handed out

    with pytest.raises(OSError):
        st.pin_read_stream(NS, _items(frame), ready)
    assert all(seg.readers == 0 for seg in st.disk.segments.values())  # disk leases back
    before = st.memory.live_bytes
    assert st.memory.delete(NS, in_mem[0])
    assert st.memory.live_bytes < before  # not pinned any more: freed at once
    # the frame reads whole again
    pins = st.pin_read_many(NS, _items(frame[1:]))
    try:
        assert [bytes(p.view) for p in pins] == [value_for(k, SIZE) for k in frame[1:]]
    finally:
        st.unpin_many(pins)
