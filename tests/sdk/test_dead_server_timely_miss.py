"""Dead, paused and overloaded servers give misses by the deadline, never hangs or exceptions."""

from __future__ import annotations

import time

import pytest

from gcache.sdk import Client, Status

pytestmark = [pytest.mark.integration, pytest.mark.faults]


def _split_keys(c: Client, dead_addr: str, n: int = 40) -> tuple[list[bytes], list[bytes]]:
    keys = [f"key-{i}".encode() for i in range(n)]
    owners = c.owners(keys)
    dead = [k for k, o in zip(keys, owners) if o == dead_addr]
    live = [k for k, o in zip(keys, owners) if o != dead_addr]
    assert dead and live
    return dead, live


def test_killed_server_gives_fast_misses_and_live_keys_still_work(make_cluster):
    cl = make_cluster(2, "32MiB")
    victim = cl.servers[0]
    with Client(cl.addresses, timeout_ms=1000, probe_interval_ms=300) as c:
        dead, live = _split_keys(c, victim.address)
        assert c.put_batch(dead + live, [b"v"] * (len(dead) + len(live))) == [Status.OK] * 40
        victim.kill9()
        t0 = time.monotonic()
        got = c.get_batch(dead + live)
        assert time.monotonic() - t0 < 1.5
        assert got[:len(dead)] == [None] * len(dead)
        assert got[len(dead):] == [b"v"] * len(live)
        st = c.put_batch(dead, [b"w"] * len(dead))
        assert set(st) == {Status.UNAVAILABLE}
        # restart under the same name and port: the probe clears suspicion, data is back
        victim.start()
        end = time.monotonic() + 5
        while c.get(dead[0]) is None and time.monotonic() < end:
            time.sleep(0.1)
        assert c.get_batch(dead) == [b"v"] * len(dead)


def test_paused_server_times_out_by_deadline_then_is_suspect(make_cluster):
    cl = make_cluster(1, "32MiB")
    srv = cl.servers[0]
    with Client(cl.addresses, timeout_ms=400, probe_interval_ms=2000) as c:
        assert c.put("k", b"v") == Status.OK
        srv.pause()
        try:
            t0 = time.monotonic()
            assert c.get("k") is None
            assert c.put_batch(["a", "b"], [b"1", b"2"]) == [Status.TIMEOUT] * 2
            assert time.monotonic() - t0 < 0.4 * 2 + 0.6
            # two timeouts in a row: the lane is suspect, misses are now immediate
            t0 = time.monotonic()
            assert c.put("c", b"3") == Status.UNAVAILABLE
            assert time.monotonic() - t0 < 0.2
        finally:
            srv.resume()


def test_bounded_queue_reports_queue_full(make_cluster):
    cl = make_cluster(1, "32MiB")
    srv = cl.servers[0]
    with Client(cl.addresses, timeout_ms=1500, conns_per_server=1, queue_depth=2) as c:
        assert c.put("warm", b"v") == Status.OK
        srv.pause()
        try:
            futs = [c.get_batch_into_async([f"k{i}"], [bytearray(1)]) for i in range(6)]
            results = [f.result(5)[0] for f in futs]
        finally:
            srv.resume()
        assert Status.QUEUE_FULL in results
        assert set(results) <= {Status.QUEUE_FULL, Status.TIMEOUT}


def test_unreachable_server_at_startup(make_cluster):
    # nothing listens on this port: connect is refused, the key is a miss at once
    with Client(["127.0.0.1:1"], timeout_ms=1000) as c:
        t0 = time.monotonic()
        assert c.get("x") is None
        assert c.put("x", b"y") == Status.UNAVAILABLE
        assert time.monotonic() - t0 < 1.5
