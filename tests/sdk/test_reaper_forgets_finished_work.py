"""The reaper does not keep finished work alive until its deadline.

Every submitted frame is watched until its deadline (seconds away). A frame a worker
finished long before must not stay referenced by the reaper's heap meanwhile: with
its items, buffer views and batch, a busy client kept every frame of the last
``timeout_ms`` alive and the GC traversed them all. Pinned in process: thousands of
finished frames with a far deadline are collectable, while a queued one still
expires exactly once.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from gcache.clock import VirtualClock
from gcache.protocol import Op
from gcache.sdk.dispatcher import DONE, Reaper
from gcache.sdk.transports.base import Work
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Payload:
    """Stands for a frame's items (buffer views, batch): weakly referenceable."""


def test_finished_frames_are_not_held_until_their_deadline():
    clock = VirtualClock()
    lock = threading.Lock()
    reaper = Reaper(lock, lambda: None, 3600.0, clock)
    expired = []
    try:
        queued = Work(Op.GET, b"ns", [], 5.0, lambda w, r: expired.append(w))
        reaper.watch(queued)
        refs = []
        for _ in range(5000):
            p = Payload()
            refs.append(weakref.ref(p))
            w = Work(Op.GET, b"ns", [p], 60.0, lambda w, r: None)
            reaper.watch(w)
            with lock:
                w.state = DONE  # a worker finished it
            del w, p
        gc.collect()
        alive = sum(1 for r in refs if r() is not None)
        assert alive < 100, f"{alive} finished frames still referenced by the reaper"
        clock.advance(10.0)
        wait_for(lambda: expired, timeout=5)
        assert expired == [queued]
    finally:
        reaper.stop()


def test_watching_work_already_done_when_the_prune_empties_the_heap():
    """Work may finish before ``watch`` runs; if the prune then drops every entry,
    ``watch`` must not fail on the empty heap (it once raised IndexError there and
    killed the caller's thread)."""
    clock = VirtualClock()
    lock = threading.Lock()
    reaper = Reaper(lock, lambda: None, 3600.0, clock)
    try:
        for _ in range(3 * Reaper.PRUNE_MIN):
            w = Work(Op.GET, b"ns", [], 60.0, lambda w, r: None)
            with lock:
                w.state = DONE  # finished before it was watched
            reaper.watch(w)
    finally:
        reaper.stop()
