"""A join with no data moved (the handoff workers capped to a trickle): a client that saw the ring change still
reads every key as a byte-exact hit, from the key's previous owner (``"ho": 1``), while a
client that never saw the old ring misses the moved keys. A key deleted after the join
is not brought back by the fallback; a key written after it reads its new value. A
previous owner that hangs costs the op its deadline and no more (a MISS, never longer),
and one that died, or that the masters marked DOWN, is a fast plain miss.

Real processes: 3 servers and 3 masters, then a 4th server joins.
"""

from __future__ import annotations

import time

import pytest

from gcache.discovery import MasterClient
from gcache.sdk import Client, Status
from gcache.testing.cluster import Cluster, ServerProc
from gcache.testing.oracle import check_value as _check_value, value_for
from gcache.testing.waiting import wait_for


def check_value(key: bytes, v) -> bool:
    """The oracle's value for ``key`` (a miss is not)."""
    return v is not None and _check_value(key, v)


pytestmark = [pytest.mark.integration]

N, SIZE = 600, 8 << 10


def _wait(pred, timeout: float):
    return wait_for(pred, timeout, retry_on=(Exception,))


@pytest.fixture(params=["tcp", "shm"])
def joined(request, tmp_path):
    """3 servers with N keys written; then a 4th server joined. Yields the cluster, the
    client that wrote the keys (it followed the join; over tcp, or shm: LEASE), the keys,
    their owners before the join and after it."""
    # a handoff cap of 1 KB/s: the old owners' handoff workers keep the moved keys where
    # they are for the length of the test (their first batch waits about a minute)
    cl = Cluster(3, "64MiB", slab="1MiB", masters=3, token="tok", log_dir=str(tmp_path),
                 server_extra=["--migrate-mbps", "0.001"])
    cl.start()
    c = None
    try:
        mc = MasterClient(cl.master_addresses, "tok")
        _wait(lambda: sum(m["state"] == "up" for m in mc.view()["members"]) == 3, 20)
        c = Client(masters=cl.master_addresses, token="tok", timeout_ms=3000,
                   transport=request.param)
        _wait(lambda: len(c.view.members) == 3, 10)
        keys = [f"join-{i}".encode() for i in range(N)]
        for a in range(0, N, 100):
            assert c.put_batch(keys[a:a + 100], [value_for(k, SIZE) for k in keys[a:a + 100]]) \
                == [Status.OK] * 100
        before = c.owners(keys)
        first = cl.servers[0]
        new = ServerProc(first.name[:-1] + "3", "64MiB", slab="1MiB", token="tok",
                         extra=first.extra, log_dir=str(tmp_path))
        cl.servers.append(new)  # Cluster.close stops it too
        new.start()
        _wait(lambda: len(c.view.members) == 4, 20)
        after = c.owners(keys)
        yield cl, c, keys, before, after
    finally:
        if c is not None:
            c.close()
        cl.close()


@pytest.mark.timeout(240)
def test_every_key_still_hits_after_a_join_without_handoff(joined):
    cl, c, keys, before, after = joined
    new = cl.servers[3].address
    moved = [k for k, b, a in zip(keys, before, after) if b != a]
    assert all(a == new for b, a in zip(before, after) if b != a)  # only to the newcomer
    assert 0.1 * N < len(moved) < 0.45 * N
    # a client that never saw the old ring: the moved keys are misses (nothing was copied)
    with Client(masters=cl.master_addresses, token="tok", timeout_ms=3000) as fresh:
        assert len(fresh.view.members) == 4
        got = fresh.get_batch(moved)
        assert got == [None] * len(moved)
        assert fresh.counters["handoff_reads"] == 0
    # the client that followed the join: every key is a hit, byte-exact
    got = c.get_batch(keys)
    bad = [k for k, v in zip(keys, got) if not check_value(k, v)]
    assert not bad, f"{len(bad)} of {N} keys missed or differ, e.g. {bad[:3]}"
    assert c.counters["handoff_reads"] == len(moved)
    assert c.counters["handoff_read_hits"] == len(moved)
    # into caller buffers, and exists, the same
    bufs = [bytearray(SIZE) for _ in moved]
    assert c.get_batch_into(moved, bufs) == [Status.OK] * len(moved)
    assert all(check_value(k, b) for k, b in zip(moved, bufs))
    assert c.exists_batch(moved) == [True] * len(moved)
    # one-key calls (no batch: sdk/point.py) miss at the new owner and ask the previous
    reads = c.counters["handoff_reads"]
    assert c.get(moved[2]) == value_for(moved[2], SIZE) and c.exists(moved[3])
    assert c.counters["handoff_reads"] == reads + 2
    # hits at the new owner never go to the previous one
    reads = c.counters["handoff_reads"]
    k0, k1 = moved[0], moved[1]
    assert c.put(k0, value_for(b"new-" + k0, SIZE)) == Status.OK  # written after the join
    assert c.get(k0) == value_for(b"new-" + k0, SIZE)
    assert c.counters["handoff_reads"] == reads
    # a one-key delete the new owner answers OK still reaches the previous owner's old
    # copy, or the next read's fallback would bring that copy back
    assert c.delete(k0) == Status.OK
    assert c.get(k0) is None and not c.exists(k0)
    # a key deleted after the join stays deleted: the delete reached its previous owner
    assert c.delete(k1) == Status.OK
    assert c.get(k1) is None and not c.exists(k1)
    with Client(masters=cl.master_addresses, token="tok", timeout_ms=3000,
                handoff_read_window_ms=600_000) as other:
        assert other.get(k1) is None


@pytest.mark.timeout(240)
def test_previous_owner_hung_costs_the_deadline_dead_or_down_a_fast_miss(joined):
    cl, c, keys, before, after = joined
    moved = [(k, b) for k, b, a in zip(keys, before, after) if b != a]
    victim = max({b for _, b in moved}, key=lambda b: sum(1 for _, x in moved if x == b))
    proc = next(s for s in cl.servers if s.address == victim)
    theirs = [k for k, b in moved if b == victim]
    others = [k for k, b in moved if b != victim]
    assert theirs and others
    proc.pause()  # hangs: no answer, the connections stay open
    try:
        t0 = time.monotonic()
        got = c.get_batch(theirs + others, timeout_ms=800)
        took = time.monotonic() - t0
        assert got[:len(theirs)] == [None] * len(theirs)  # a miss, not an error
        assert all(check_value(k, v) for k, v in zip(others, got[len(theirs):]))
        assert 0.7 < took < 0.8 + 0.5, took  # waited for the hung owner, never longer
    finally:
        proc.resume()
    proc.kill9()  # died: its connections refuse
    t0 = time.monotonic()
    assert c.get_batch(theirs, timeout_ms=3000) == [None] * len(theirs)
    assert time.monotonic() - t0 < 1.5
    # the masters mark it DOWN: the fallback does not even ask it
    _wait(lambda: victim not in c.view.holders and len(c.view.members) == 3, 20)
    reads = c.counters["handoff_reads"]
    t0 = time.monotonic()
    gone = [k for k, a in zip(keys, after) if a == victim]  # its share: lost with it
    assert c.get_batch(gone, timeout_ms=3000) == [None] * len(gone)
    assert time.monotonic() - t0 < 1.0
    asked = c.counters["handoff_reads"] - reads
    assert asked == 0, f"{asked} reads re-asked a member that is DOWN or absent"
