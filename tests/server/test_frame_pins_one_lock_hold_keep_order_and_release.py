"""A GET frame's leases taken and given back together (``pin_read_many`` /
``unpin_many``, one tier lock hold each): items come back in request order with their own
bytes and statuses, a doomed object is freed by the frame's unpin, and in the tiered store a
disk read that fails or is corrupt mid-frame becomes that item's error while its
neighbours (memory and disk) are served whole."""

from __future__ import annotations

import pytest

from gcache import failpoints
from gcache.server.arena import Arena
from gcache.server.memory_tier import MemoryTier
from gcache.status import Status
from gcache.testing.oracle import value_for

from tierops import fill_past_memory, put_value, small_tiered_store

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20
SIZE = 200_000


@pytest.fixture
def memory(tmp_path):
    mem = MemoryTier(Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False))
    yield mem
    mem.close()


@pytest.fixture
def no_failpoints():
    failpoints.configure(None)
    yield
    failpoints.configure(None)


def test_memory_frame_keeps_order_statuses_and_bytes(memory):
    v = {k: put_value(memory, NS, k, 5000) for k in (b"a", b"b", b"c")}
    items = [[b"c", 0, 1 << 30, 0], [b"nope", 0, 10, 0], [b"a", 100, 50, 0],
             [b"b", 0, 1 << 30, v[b"b"] + 1], [b"b", 0, 1 << 30, v[b"b"]]]
    pins = memory.pin_read_many(NS, items)
    try:
        assert [p.status for p in pins] == [Status.OK, Status.MISS, Status.OK,
                                            Status.CONFLICT, Status.OK]
        assert bytes(pins[0].view) == value_for(b"c", 5000)
        assert bytes(pins[2].view) == value_for(b"a", 5000)[100:150]
        assert (pins[3].total_len, pins[3].version) == (5000, v[b"b"])
        assert bytes(pins[4].view) == value_for(b"b", 5000)
    finally:
        memory.unpin_many(pins)
    assert all(p.view is None for p in pins)


def test_frame_unpin_frees_what_was_deleted_while_pinned(memory):
    put_value(memory, NS, b"a", 5000)
    put_value(memory, NS, b"b", 5000)
    before = memory.live_bytes
    pins = memory.pin_read_many(NS, [[b"a", 0, 1 << 30, 0], [b"b", 0, 1 << 30, 0]])
    assert memory.delete(NS, b"a")
    assert memory.live_bytes == before  # pinned: only doomed, its bytes still readable
    assert bytes(pins[0].view) == value_for(b"a", 5000)
    memory.unpin_many(pins)
    assert memory.live_bytes < before  # the frame's unpin freed it, once
    assert memory.stats()["objects"] == 1
    again = memory.pin_read_many(NS, [[b"b", 0, 1 << 30, 0]])
    assert bytes(again[0].view) == value_for(b"b", 5000)
    memory.unpin_many(again)


@pytest.mark.parametrize("fault", ["disk_read=eio:1x", "disk_read_corrupt=1x"])
def test_failing_disk_read_mid_frame_is_that_items_error_only(tmp_path, no_failpoints,
                                                               fault):
    st = small_tiered_store(tmp_path)
    try:
        in_mem, on_disk = fill_past_memory(st, NS, 40, SIZE)
        assert len(on_disk) >= 3 and in_mem
        frame = [in_mem[0], on_disk[0], b"absent", on_disk[1], in_mem[-1], on_disk[2]]
        failpoints.configure(fault)
        pins = st.pin_read_many(NS, [[k, 0, 1 << 30, 0] for k in frame])
        try:
            bad = [i for i, p in enumerate(pins) if p.status in (Status.ERROR, Status.CORRUPT)]
            assert len(bad) == 1 and frame[bad[0]] in on_disk  # one disk item, and only it
            assert pins[2].status == Status.MISS
            for i, (k, p) in enumerate(zip(frame, pins)):
                if i not in bad and k != b"absent":
                    assert p.status == Status.OK, (k, p.status)
                    assert bytes(p.view) == value_for(k, SIZE)  # its own bytes, whole
        finally:
            st.unpin_many(pins)
        failpoints.configure(None)
        # every lease came back: the frame can be read again, the failed item now a miss
        pins = st.pin_read_many(NS, [[k, 0, 1 << 30, 0] for k in frame])
        try:
            assert pins[bad[0]].status == Status.MISS  # dropped, never served
            assert all(bytes(p.view) == value_for(k, SIZE)
                       for k, p in zip(frame, pins) if k not in (b"absent", frame[bad[0]]))
        finally:
            st.unpin_many(pins)
    finally:
        st.close()
