"""A Batch finishes each key exactly once and completes exactly once, in process.

Slice results fold into per-key results: a key finishes with its last outstanding
slice, a result for a key with none outstanding is ignored (a duplicate or a late
completion), the per-key callback fires once per key, and the batch callback and
future once, after every key, with every result written. A key's status is its
first non-OK slice; slices of different versions are CONFLICT, slices reporting
different checksums CORRUPT. NOT_OWNER items go to the sender's re-route and are
not folded. The sender is a recorder implementing the ``Sender`` protocol.
"""

from __future__ import annotations

import threading

import pytest

from gcache.protocol import Limits, Op
from gcache.sdk.batch import Checksums, IntoBatch, KeyBatch, PutBatch
from gcache.sdk.transports.base import ItemResult, Work
from gcache.status import Status

pytestmark = [pytest.mark.unit]


class RecordingSender:
    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.rerouted: list[list] = []

    def send(self, batch, routed, retried=False) -> None:
        self.sent.append(routed)

    def reroute(self, batch, work, moved) -> None:
        self.rerouted.append(moved)


class Calls:
    def __init__(self) -> None:
        self.keys: list[tuple[int, object]] = []
        self.batches: list[list] = []

    def on_key(self, i: int, key: bytes, res: object) -> None:
        self.keys.append((i, res))

    def callback(self, results: list) -> None:
        self.batches.append(list(results))


def _frame(op: int, items: list) -> Work:
    return Work(op, b"ns", items, 0.0, None)


@pytest.mark.timeout(10)
def test_each_key_and_the_batch_finish_once_whatever_arrives_twice():
    calls, sender = Calls(), RecordingSender()
    b = KeyBatch(Op.DELETE, [b"a", b"b", b"c"], 0.0, sender, calls.callback, calls.on_key)
    routed = b.route(["x", "x", "y"], 1 << 20)
    on_x, on_y = routed["x"], routed["y"]
    b.frame_done(_frame(Op.DELETE, on_x), [ItemResult(Status.OK), ItemResult(Status.MISS)])
    assert calls.keys == [(0, Status.OK), (1, Status.MISS)] and not b.future.done()
    b.frame_done(_frame(Op.DELETE, on_x), [ItemResult(Status.TIMEOUT)] * 2)  # a duplicate
    assert calls.keys == [(0, Status.OK), (1, Status.MISS)]
    b.fail(on_y, Status.TIMEOUT)
    b.fail(on_y, Status.UNAVAILABLE)  # late: the key already finished
    assert calls.keys == [(0, Status.OK), (1, Status.MISS), (2, Status.TIMEOUT)]
    assert calls.batches == [[Status.OK, Status.MISS, Status.TIMEOUT]]
    assert b.future.result(0) == [Status.OK, Status.MISS, Status.TIMEOUT]


@pytest.mark.timeout(10)
def test_exists_results_are_booleans_and_an_empty_batch_is_done_at_once():
    calls, sender = Calls(), RecordingSender()
    b = KeyBatch(Op.EXISTS, [b"a", b"b"], 0.0, sender, calls.callback, calls.on_key)
    items = b.route(["x", "x"], 1 << 20)["x"]
    b.frame_done(_frame(Op.EXISTS, items), [ItemResult(Status.OK), ItemResult(Status.MISS)])
    assert b.future.result(0) == [True, False]
    empty = KeyBatch(Op.EXISTS, [], 0.0, sender, calls.callback, calls.on_key)
    assert empty.future.result(0) == []


@pytest.mark.timeout(10)
def test_sliced_key_takes_its_first_failure_and_rejects_mixed_versions_or_checksums():
    sender = RecordingSender()
    bufs = [bytearray(10), bytearray(10), bytearray(10)]
    views = [memoryview(x) for x in bufs]
    b = IntoBatch([b"fail", b"mixed", b"torn"], views, Checksums(False), 0.0, sender,
                  None, None)
    routed = b.route(["x"] * 3, 4)  # 10 bytes in slices of 4: three slices per key
    items = routed["x"]
    assert [it.index for it in items] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert b.parts == [3, 3, 3]

    def ok(it, version=7, csum=99):
        n = min(it.max_len, 10 - it.offset)
        return ItemResult(Status.OK, 10, version, n, None, csum)

    results = [ok(items[0]), ItemResult(Status.TIMEOUT), ok(items[2]),
               ok(items[3]), ok(items[4], version=8), ok(items[5]),
               ok(items[6]), ok(items[7], csum=98), ok(items[8])]
    b.frame_done(_frame(Op.GET, items), results)
    assert b.future.result(0) == [Status.TIMEOUT, Status.CONFLICT, Status.CORRUPT]


@pytest.mark.timeout(10)
def test_not_owner_items_go_to_the_reroute_and_are_not_folded():
    sender = RecordingSender()
    b = KeyBatch(Op.TOUCH, [b"a", b"b"], 0.0, sender, None, None)
    items = b.route(["x", "x"], 1 << 20)["x"]
    b.frame_done(_frame(Op.TOUCH, items), [ItemResult(Status.NOT_OWNER), ItemResult(Status.OK)])
    assert sender.rerouted == [[items[0]]]
    assert not b.future.done() and b.parts == [1, 0]
    b.fold([(0, Status.OK, 0, -1, None)])  # the re-routed answer
    assert b.future.result(0) == [Status.OK, Status.OK]


@pytest.mark.timeout(10)
def test_too_large_values_finish_without_being_sent():
    sender = RecordingSender()
    limits = Limits(max_value_bytes=8)
    views = [memoryview(b"x" * 4), memoryview(b"y" * 9)]
    b = PutBatch([b"ok", b"big"], views, limits, 0.0, sender, None, None)
    routed = b.route(["x", "x"], 1 << 20)
    assert [it.key for it in routed["x"]] == [b"ok"]
    assert b.results[1] == Status.TOO_LARGE and not b.future.done()
    b.frame_done(_frame(Op.PUT, routed["x"]), [ItemResult(Status.OK)])
    assert b.future.result(0) == [Status.OK, Status.TOO_LARGE]


@pytest.mark.timeout(30)
def test_concurrent_folds_finish_each_key_once():
    """Many threads fold the same slices at once: each key still finishes once."""
    n = 64
    calls = Calls()
    lock = threading.Lock()

    def on_key(i, k, res):
        with lock:
            calls.keys.append((i, res))

    b = KeyBatch(Op.DELETE, [b"k%d" % i for i in range(n)], 0.0, RecordingSender(),
                 calls.callback, on_key)
    items = b.route(["x"] * n, 1 << 20)["x"]
    start = threading.Barrier(8)

    def worker():
        start.wait()
        b.frame_done(_frame(Op.DELETE, items), [ItemResult(Status.OK)] * n)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(calls.keys) == [(i, Status.OK) for i in range(n)]
    assert calls.batches == [[Status.OK] * n]
