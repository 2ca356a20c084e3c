"""A Batch makes its Future only when asked (a synchronous one-hop call completed on its
own thread reads ``results`` once ``done`` and never needs one), and whenever it is made
— before completion, after it, or from another thread while a dispatch thread completes
the batch — it is set exactly once, with every result, after the batch callback ran."""

from __future__ import annotations

import threading

import pytest

from gcache.protocol import Op
from gcache.sdk.batch import KeyBatch
from gcache.sdk.transports.base import ItemResult, Work
from gcache.status import Status

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


class _Sender:
    def send(self, batch, routed, retried=False) -> None: ...

    def reroute(self, batch, work, moved) -> None: ...


def _batch(n: int, callback=None) -> tuple[KeyBatch, list]:
    b = KeyBatch(Op.EXISTS, [b"k%d" % i for i in range(n)], 0.0, _Sender(), callback, None)
    return b, b.route(["s"] * n, 1 << 20)["s"]


def _finish(b: KeyBatch, items: list) -> None:
    b.frame_done(Work(Op.EXISTS, b"ns", items, 0.0, None),
                 [ItemResult(Status.OK if i % 2 == 0 else Status.MISS) for i in range(len(items))])


def test_completed_batch_needs_no_future_and_one_made_later_is_done():
    seen = []
    b, items = _batch(3, lambda res: seen.append(list(res)))
    _finish(b, items)
    assert b.done and b._future is None  # nothing paid for a Future
    assert b.results == [True, False, True] and seen == [[True, False, True]]
    assert b.future.result(0) == [True, False, True]
    assert b.future is b.future  # one Future, made once


def test_future_made_before_completion_is_set_after_the_callback():
    order = []
    b, items = _batch(2, lambda res: order.append("callback"))
    fut = b.future
    fut.add_done_callback(lambda f: order.append("future"))
    assert not fut.done() and not b.done
    _finish(b, items)
    assert fut.result(0) == [True, False] and order == ["callback", "future"]


def test_future_asked_for_while_another_thread_completes_is_set_once():
    for _ in range(300):
        b, items = _batch(1)
        got = []
        t = threading.Thread(target=lambda b=b, got=got: got.append(b.future))
        t.start()
        _finish(b, items)
        t.join()
        assert got[0].result(1) == [True]  # set exactly once (a second set would raise)


def test_empty_batch_is_done_at_once():
    b = KeyBatch(Op.EXISTS, [], 0.0, _Sender(), None, None)
    assert b.done and b.future.result(0) == []
