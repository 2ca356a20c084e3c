"""The one-hop sync path keeps every rule of the dispatch threads.

A synchronous call on a small batch runs its IO on the calling thread when one of
the lane's one-hop connections is idle (``Lane.run_here``); async calls, and sync
calls finding every one-hop connection busy, go through the dispatch threads. Which
thread ran a frame shows in the thread its per-key callback fires on: the caller's
own for one-hop, a ``gcache-dispatch-*`` thread otherwise.

Pinned here, against real servers and the trickling stand-in server of
``test_deadline_holds_against_trickling_peer``: the deadline holds on the calling
thread, callbacks fire exactly once (also on a timeout), the connection of a timed
out call is closed (the next call dials anew), two timeouts in a row make the lane
suspect, a busy one-hop connection falls back to the dispatcher, and many threads of
sync callers stay correct (value = f(key)).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from gcache.sdk import Client, Status
from gcache.sdk.transports import onesided
from gcache.testing.oracle import value_for
from gcache.testing.standin import Proxy

from test_deadline_holds_against_trickling_peer import SLACK_S, Trickler  # noqa: E402

pytestmark = [pytest.mark.integration]


@pytest.fixture
def trickler():
    made: list[Trickler] = []

    def make(mode: str) -> Trickler:
        made.append(Trickler(mode))
        return made[-1]

    yield make
    for t in made:
        t.close()


class Calls:
    """Per-key and batch callbacks that record how often, and on which thread, they ran."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: Counter = Counter()
        self.batches = 0
        self.threads: list[str] = []

    def on_key(self, i: int, key: bytes, res: object) -> None:
        with self.lock:
            self.keys[key] += 1
            self.threads.append(threading.current_thread().name)

    def callback(self, results: list) -> None:
        with self.lock:
            self.batches += 1


@pytest.mark.timeout(60)
def test_sync_runs_on_the_calling_thread_async_on_a_dispatch_thread(cluster):
    me = threading.current_thread().name
    # tcp: the byte threshold below holds on lanes whose frames carry the bytes
    with Client(cluster.addresses, namespace="onehop", transport="tcp") as c:
        assert c.put("k", b"v" * 1000) == Status.OK
        calls = Calls()
        assert c.get_batch(["k"], on_key=calls.on_key) == [b"v" * 1000]
        assert c.exists_batch(["k"], on_key=calls.on_key) == [True]
        assert calls.threads == [me, me]
        calls = Calls()
        assert c.get_batch_async(["k"], on_key=calls.on_key).result(5) == [b"v" * 1000]
        assert calls.threads[0].startswith("gcache-dispatch-")
        # several keys: one-hop while the frame is at most one_hop_max_bytes (128 KiB)
        keys = ["m%d" % i for i in range(4)]
        assert c.put_batch(keys, [bytes(64 << 10)] * 4) == [Status.OK] * 4
        if len(set(c.owners(keys))) == 1:
            calls = Calls()
            assert c.exists_batch(keys, on_key=calls.on_key) == [True] * 4  # 4 x 64 B
            assert calls.threads == [me] * 4
            calls = Calls()  # 4 x 64 KiB = 256 KiB: the dispatch threads
            assert c.get_batch_into(keys, [bytearray(64 << 10) for _ in keys],
                                    on_key=calls.on_key) == [Status.OK] * 4
            assert all(t.startswith("gcache-dispatch-") for t in calls.threads)
    with Client(cluster.addresses, namespace="onehop", one_hop_max_bytes=0) as c:
        calls = Calls()
        assert c.get_batch(["k"], on_key=calls.on_key) == [b"v" * 1000]
        assert calls.threads[0].startswith("gcache-dispatch-")  # one-hop off
        calls = Calls()  # a batch bigger than one_hop_max_bytes: the dispatch threads
    with Client(cluster.addresses, namespace="onehop", one_hop_max_bytes=100 << 10,
                transport="tcp") as c:
        bufs = [bytearray(1000) for _ in range(2)]
        assert c.put("k2", b"w" * 1000) == Status.OK
        assert c.get_batch_into(["k"], bufs[:1], on_key=calls.on_key) == [Status.OK]
        assert calls.threads == [me]
        calls = Calls()
        # a byte get asks for slice_bytes (1 MiB) per key: more than 100 KiB
        assert c.get_batch(["k", "k2"], on_key=calls.on_key) == [b"v" * 1000, b"w" * 1000]
        assert all(t.startswith("gcache-dispatch-") for t in calls.threads)


@pytest.mark.timeout(60)
def test_a_one_frame_shm_call_of_any_size_runs_on_the_calling_thread(cluster):
    """On a shm lane a get or put frame of at least one_sided_min_bytes never crosses the
    socket (the caller copies it from the arena either way), so a synchronous call that
    is one such frame runs one-hop whatever its size; a smaller frame past
    one_hop_max_bytes, more than one frame, an async call, or one_hop_max_bytes=0: the
    dispatch threads. Values stay exact on every path."""
    me = threading.current_thread().name
    size, n = 64 << 10, 48  # 3 MiB: one shm frame (below the 4 MiB frame floor)
    keys = ["shm%d" % i for i in range(n)]
    vals = [bytes([i]) * size for i in range(n)]
    with Client(cluster.addresses, namespace="onehop", transport="shm") as c:
        assert c.put_batch(keys, vals) == [Status.OK] * n
        assert c.get("shm0") == vals[0]  # the lane knows it is shm (since the put)
        calls = Calls()
        bufs = [bytearray(size) for _ in keys]
        assert c.get_batch_into(keys, bufs, on_key=calls.on_key) == [Status.OK] * n
        assert [bytes(b) for b in bufs] == vals
        assert calls.threads == [me] * n
        calls = Calls()  # 192 KiB: past one_hop_max_bytes, under one_sided_min_bytes, so
        # the frame rides the socket as on tcp, and keeps the tcp rule: dispatched
        assert c.get_batch_into(keys[:3], bufs[:3], on_key=calls.on_key) == [Status.OK] * 3
        assert all(t.startswith("gcache-dispatch-") for t in calls.threads)
        calls = Calls()
        # byte gets ask slice_bytes (1 MiB) each: 3 of them are one frame
        assert c.get_batch(keys[:3], on_key=calls.on_key) == vals[:3]
        assert calls.threads == [me] * 3
        calls = Calls()  # a put of one frame too (staged, then one PUT_STAGED)
        assert c.put_batch(keys, vals[::-1], on_key=calls.on_key) == [Status.OK] * n
        assert calls.threads == [me] * n
        vals = vals[::-1]
        calls = Calls()
        assert c.get_batch_async(keys, on_key=calls.on_key).result(10) == vals
        assert all(t.startswith("gcache-dispatch-") for t in calls.threads)
        # 48 MiB asked for (a byte get asks slice_bytes per key): split over the lane's
        # connections, several frames, so the dispatch threads run them in parallel
        many = keys * 16
        calls = Calls()
        assert c.get_batch(many, on_key=calls.on_key) == vals * 16
        assert len(calls.threads) == len(many)
        assert all(t.startswith("gcache-dispatch-") for t in calls.threads)
    with Client(cluster.addresses, namespace="onehop", transport="shm",
                one_hop_max_bytes=0) as c:
        assert c.get("shm0") == vals[0]
        calls = Calls()
        assert c.get_batch(keys, on_key=calls.on_key) == vals
        assert all(t.startswith("gcache-dispatch-") for t in calls.threads)


class StallProxy(Proxy):
    """TCP proxy to ``target`` that, while ``stall`` is set, holds what the server sends
    (a LEASE reply never arrives): the client's deadline must end the call."""

    def __init__(self, target: str) -> None:
        self.stall = threading.Event()
        super().__init__(target)

    def forward(self, data: bytes, down: bool) -> bytes:
        while down and self.stall.is_set():
            time.sleep(0.01)  # held: the client sees a server that never answers
        return data

    def close(self) -> None:
        self.stall.clear()
        super().close()


@pytest.mark.timeout(60)
@pytest.mark.faults
def test_a_big_one_hop_shm_frame_ends_by_its_deadline(cluster):
    """A one-frame shm get past one_hop_max_bytes runs on the calling thread; when its
    LEASE reply never comes, the call still ends by its deadline as TIMEOUT, each key's
    callback fires once (on the caller's thread), the connection is dropped (the server
    frees the leases), and the next call reads exact values over a new connection."""
    me = threading.current_thread().name
    proxy = StallProxy(cluster.addresses[0])
    size, n = 64 << 10, 8  # 512 KiB: past 128 KiB, one frame, moved through the arena
    keys = ["st%d" % i for i in range(n)]
    vals = [bytes([i + 1]) * size for i in range(n)]
    try:
        with Client([proxy.address], namespace="onehop", transport="shm",
                    timeout_ms=300, conns_per_server=1) as c:
            assert c.put_batch(keys, vals) == [Status.OK] * n
            bufs = [bytearray(size) for _ in keys]
            before = dict(onesided.STATS)
            assert c.get_batch_into(keys, bufs) == [Status.OK] * n  # the lane is shm now
            assert onesided.STATS["shm_get_items"] - before["shm_get_items"] == n  # leased
            proxy.stall.set()
            calls = Calls()
            t0 = time.monotonic()
            got = c.get_batch_into(keys, [bytearray(size) for _ in keys], on_key=calls.on_key)
            took = time.monotonic() - t0
            proxy.stall.clear()
            assert got == [Status.TIMEOUT] * n
            assert calls.threads == [me] * n and set(calls.keys.values()) == {1}
            assert took < 0.3 + SLACK_S, took
            bufs = [bytearray(size) for _ in keys]
            calls = Calls()
            assert c.get_batch_into(keys, bufs, on_key=calls.on_key) == [Status.OK] * n
            assert [bytes(b) for b in bufs] == vals and calls.threads == [me] * n
    finally:
        proxy.close()


@pytest.mark.timeout(60)
@pytest.mark.faults
def test_one_hop_deadline_holds_closes_the_connection_and_fires_callbacks_once(trickler):
    t = trickler("reply")  # answers AUTH, then trickles every reply one byte per 20 ms
    me = threading.current_thread().name
    with Client([t.address], namespace="onehop", timeout_ms=150, conns_per_server=1,
                probe_interval_ms=60_000) as c:
        calls = Calls()
        t0 = time.monotonic()
        assert c.get_batch(["a"], on_key=calls.on_key, callback=calls.callback) == [None]
        assert time.monotonic() - t0 < 0.15 + SLACK_S
        assert calls.threads == [me]  # it ran on this thread
        conns_after_first = len(t.conns)
        # one timeout: the connection (stream position unknown) is closed, not suspect;
        # the next call dials a new one
        calls2 = Calls()
        t0 = time.monotonic()
        assert c.exists_batch(["b"], on_key=calls2.on_key, callback=calls2.callback) == [False]
        assert time.monotonic() - t0 < 0.15 + SLACK_S
        assert calls2.threads == [me]
        assert len(t.conns) == conns_after_first + 1
        # two timeouts in a row: the lane is suspect, the next call is a fast miss
        t0 = time.monotonic()
        assert c.put("c", b"x") == Status.UNAVAILABLE
        assert time.monotonic() - t0 < 0.1
        time.sleep(0.3)  # nothing fires late, or twice
        assert calls.keys == Counter({b"a": 1}) and calls.batches == 1
        assert calls2.keys == Counter({b"b": 1}) and calls2.batches == 1


@pytest.mark.timeout(60)
@pytest.mark.faults
def test_busy_one_hop_connection_falls_back_to_the_dispatcher(trickler):
    t = trickler("reply")
    me = threading.current_thread().name
    with Client([t.address], namespace="onehop", timeout_ms=1500, conns_per_server=1,
                probe_interval_ms=60_000) as c:
        holder = Calls()
        started = threading.Event()

        def hold() -> None:
            started.set()
            c.get_batch(["held"], on_key=holder.on_key)  # trickled: busy ~1.5 s

        th = threading.Thread(target=hold, name="holder")
        th.start()
        started.wait(5)
        end = time.monotonic() + 5
        while len(t.conns) < 1 and time.monotonic() < end:
            time.sleep(0.005)
        time.sleep(0.1)  # the holder is inside its one-hop call now
        calls = Calls()
        t0 = time.monotonic()
        assert c.get_batch(["other"], timeout_ms=200, on_key=calls.on_key) == [None]
        took = time.monotonic() - t0
        # which thread ran it first: a late answer then says which path held it up
        assert len(calls.threads) == 1 and calls.threads[0] != me, (calls.threads, took)
        assert calls.threads[0].startswith("gcache-dispatch-"), (calls.threads, took)
        assert took < 0.2 + SLACK_S, (calls.threads, took, len(t.conns))
        th.join(10)
        assert holder.threads == ["holder"] and holder.keys == Counter({b"held": 1})


def _run_callers(n_threads: int, name: str, body) -> Counter:
    """Run ``body(w, on_key, errors)`` on ``n_threads`` threads at once; every error it
    records (or raises) fails the test. Returns where the per-key callbacks ran:
    ``"here"`` (the calling thread: one-hop) or ``"dispatch"``."""
    errors: list[str] = []
    where: Counter = Counter()
    lock = threading.Lock()

    def worker(w: int) -> None:
        mine = threading.current_thread().name
        seen: Counter = Counter()

        def on_key(i: int, key: bytes, res: object) -> None:
            seen["here" if threading.current_thread().name == mine else "dispatch"] += 1

        try:
            body(w, on_key, errors)
        except Exception as exc:  # surface in the main thread
            errors.append(repr(exc))
        with lock:
            where.update(seen)

    threads = [threading.Thread(target=worker, args=(w,), name=f"{name}-{w}")
               for w in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(100)
    assert not errors, errors[:5]
    return where


@pytest.mark.timeout(120)
def test_many_threads_of_sync_callers_stay_correct(cluster):
    n_threads, rounds, size = 12, 60, 4096
    keys = [b"mt/%d" % i for i in range(64)]
    values = {k: value_for(k, size) for k in keys}
    # conns_per_server=2: most calls find both one-hop connections busy and fall back
    with Client(cluster.addresses, namespace="onehop", conns_per_server=2,
                timeout_ms=10_000) as c:
        assert c.put_batch(keys, [values[k] for k in keys]) == [Status.OK] * len(keys)

        def body(w: int, on_key, errors: list[str]) -> None:
            dest = bytearray(size)
            for r in range(rounds):
                k = keys[(w * 7 + r) % len(keys)]
                got = c.get_batch([k], on_key=on_key)[0]
                if got != values[k]:
                    errors.append(f"get {k!r}: {None if got is None else len(got)}")
                st = c.get_batch_into([k], [dest], on_key=on_key)[0]
                if st != Status.OK or bytes(dest) != values[k]:
                    errors.append(f"get_into {k!r}: {st}")
                if c.exists_batch([k, b"absent/%d" % w], on_key=on_key) != [True, False]:
                    errors.append(f"exists {k!r}")
                if c.put_batch([k], [values[k]], on_key=on_key) != [Status.OK]:
                    errors.append(f"put {k!r}")

        where = _run_callers(n_threads, "caller", body)
        # every key's callback fired once: 5 per round (get, get_into, 2 exists, put)
        assert sum(where.values()) == n_threads * rounds * 5
        assert where["here"] > 0 and where["dispatch"] > 0  # both paths were used


@pytest.mark.timeout(120)
def test_many_threads_of_big_shm_batches_stay_correct(cluster):
    """Threads putting and reading one-frame shm batches of 512 KiB (one-hop when one of
    the lane's one-hop connections is idle, the dispatch threads when not): every value
    exact (value = f(key)), every key's callback once, and both paths used."""
    n_threads, rounds, size, per = 6, 20, 64 << 10, 8
    keys = [b"big/%d" % i for i in range(48)]
    values = {k: value_for(k, size) for k in keys}
    with Client(cluster.addresses, namespace="onehop", transport="shm", conns_per_server=2,
                timeout_ms=10_000) as c:
        assert c.put_batch(keys, [values[k] for k in keys]) == [Status.OK] * len(keys)

        def body(w: int, on_key, errors: list[str]) -> None:
            dests = [bytearray(size) for _ in range(per)]
            for r in range(rounds):
                ks = [keys[(w * 5 + r + j) % len(keys)] for j in range(per)]
                if c.put_batch(ks, [values[k] for k in ks], on_key=on_key) \
                        != [Status.OK] * per:
                    errors.append(f"put {ks[0]!r}")
                st = c.get_batch_into(ks, dests, on_key=on_key)
                for k, d, s in zip(ks, dests, st):
                    if s != Status.OK or bytes(d) != values[k]:
                        errors.append(f"get_into {k!r}: {s}")

        where = _run_callers(n_threads, "big", body)
        assert sum(where.values()) == n_threads * rounds * per * 2
        assert where["here"] > 0 and where["dispatch"] > 0  # both paths were used
