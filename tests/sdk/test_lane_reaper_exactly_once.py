"""Lane and Reaper deliver every frame's completion exactly once, on a virtual clock.

In process, no server: a ``GatedTransport`` implements the Transport contract and
holds each ``execute`` until the test opens its gate, so the test decides which
frame is running, which is queued and when time passes (``VirtualClock.advance``).
Pinned: a queued frame past its deadline completes as TIMEOUT once, by the reaper,
and the worker that later dequeues it neither runs it nor completes it again; a
frame whose reply comes after its deadline is completed once (by the worker) and
never also expired; a lane's own deadline check, close, suspicion and connection
failures complete each frame once; the reaper's probe runs on the clock.
"""

from __future__ import annotations

import threading
import time

import pytest

from gcache.clock import VirtualClock
from gcache.config import TransportKind
from gcache.protocol import Op
from gcache.sdk.dispatcher import Lane, Reaper
from gcache.sdk.transports.base import GetItem, ItemResult, Transport, Work
from gcache.status import Status
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.unit]


class GatedTransport(Transport):
    """Runs one frame at a time; each ``execute`` waits for ``open_gate`` (or fails
    with ``fail`` when set) and answers OK for every item."""

    kind = TransportKind.TCP

    def __init__(self) -> None:
        self.started: list[Work] = []
        self.gate = threading.Semaphore(0)
        self.fail: BaseException | None = None

    def connect(self, deadline: float) -> None:
        pass

    def execute(self, work: Work) -> list[ItemResult]:
        self.started.append(work)
        if not self.gate.acquire(timeout=10):
            raise AssertionError("the test never opened the gate")
        if self.fail is not None:
            raise self.fail
        return [ItemResult(Status.OK) for _ in work.items]

    def open_gate(self) -> None:
        self.gate.release()

    def close(self) -> None:
        pass


class Completions:
    """Records every ``on_done`` call: (work, statuses)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[Work, list[Status]]] = []

    def for_work(self, deadline: float, n: int = 1) -> Work:
        items = [GetItem(b"k%d" % i, 0, 64, 0, None, i) for i in range(n)]
        work = Work(Op.GET, b"ns", items, deadline, None)

        def on_done(_work: Work, results: list[ItemResult]) -> None:
            with self.lock:
                self.calls.append((work, [r.status for r in results]))

        work.on_done = on_done
        return work

    def of(self, work: Work) -> list[list[Status]]:
        with self.lock:
            return [st for w, st in self.calls if w is work]


@pytest.fixture
def rig():
    clock = VirtualClock()
    lock = threading.Lock()
    probes: list[float] = []
    reaper = Reaper(lock, lambda: probes.append(clock.monotonic()), probe_interval=60.0,
                    clock=clock)
    transport = GatedTransport()
    lanes: list[Lane] = []

    def lane(threads: int = 1, queue_depth: int = 8) -> Lane:
        ln = Lane("gated:1", lambda: transport, threads=threads, queue_depth=queue_depth,
                  probe_interval=5.0, state_lock=lock, clock=clock)
        lanes.append(ln)
        return ln

    yield clock, reaper, transport, lane, probes
    for ln in lanes:
        ln.close()
        for _ in ln.threads:
            transport.open_gate()  # let a worker still inside execute reach its stop
        ln.join(5)
    reaper.stop()


def _settle() -> None:
    time.sleep(0.05)  # real time for the background threads to act on what they were told


@pytest.mark.timeout(30)
def test_queued_frame_past_its_deadline_times_out_once_and_is_never_run(rig):
    clock, reaper, transport, lane, _ = rig
    done = Completions()
    ln = lane()
    busy = done.for_work(clock.monotonic() + 10)
    queued = done.for_work(clock.monotonic() + 1)
    for w in (busy, queued):
        assert ln.submit(w)
        reaper.watch(w)
    wait_for(lambda: transport.started == [busy], 5)  # the one worker is inside execute
    _settle()
    assert done.of(queued) == []  # nothing expires before its deadline on this clock
    clock.advance(1.5)
    wait_for(lambda: done.of(queued), 5)
    assert done.of(queued) == [[Status.TIMEOUT]]
    transport.open_gate()  # the worker finishes, then dequeues the expired frame
    wait_for(lambda: done.of(busy), 5)
    clock.advance(20)  # past the running frame's deadline too: nothing more to expire
    _settle()
    assert done.of(busy) == [[Status.OK]]
    assert done.of(queued) == [[Status.TIMEOUT]]
    assert transport.started == [busy]  # the expired frame never reached the transport


@pytest.mark.timeout(30)
def test_late_reply_is_delivered_once_and_never_also_expired(rig):
    clock, reaper, transport, lane, _ = rig
    done = Completions()
    ln = lane()
    w = done.for_work(clock.monotonic() + 1, n=3)
    assert ln.submit(w)
    reaper.watch(w)
    wait_for(lambda: transport.started == [w], 5)
    clock.advance(5)  # the deadline passes while the frame is running
    _settle()
    assert done.of(w) == []  # the reaper leaves a running frame to its worker
    transport.open_gate()  # the reply comes late
    wait_for(lambda: done.of(w), 5)
    clock.advance(5)
    _settle()
    assert done.of(w) == [[Status.OK] * 3]


@pytest.mark.timeout(30)
def test_worker_times_out_a_frame_dequeued_past_its_deadline(rig):
    clock, _reaper, transport, lane, _ = rig
    done = Completions()
    ln = lane()
    busy = done.for_work(clock.monotonic() + 10)
    late = done.for_work(clock.monotonic() + 1)  # not watched: only the lane can expire it
    assert ln.submit(busy) and ln.submit(late)
    wait_for(lambda: transport.started == [busy], 5)
    clock.advance(2)
    transport.open_gate()
    wait_for(lambda: done.of(late), 5)
    _settle()
    assert done.of(late) == [[Status.TIMEOUT]] and done.of(busy) == [[Status.OK]]
    assert transport.started == [busy]


@pytest.mark.timeout(30)
def test_close_fails_queued_frames_once_and_the_reaper_adds_nothing(rig):
    clock, reaper, transport, lane, _ = rig
    done = Completions()
    ln = lane()
    busy = done.for_work(clock.monotonic() + 10)
    queued = [done.for_work(clock.monotonic() + 1) for _ in range(3)]
    for w in (busy, *queued):
        assert ln.submit(w)
        reaper.watch(w)
    wait_for(lambda: transport.started == [busy], 5)
    ln.close()
    assert all(done.of(w) == [[Status.CLOSED]] for w in queued)
    late = done.for_work(clock.monotonic() + 1)
    assert not ln.submit(late)  # a closed lane completes new work at once
    assert done.of(late) == [[Status.CLOSED]]
    clock.advance(30)  # every deadline passes
    transport.open_gate()
    wait_for(lambda: done.of(busy), 5)
    _settle()
    assert done.of(busy) == [[Status.OK]]
    assert all(done.of(w) == [[Status.CLOSED]] for w in queued)


@pytest.mark.timeout(30)
def test_connection_failure_is_unavailable_once_and_suspicion_ends_on_the_clock(rig):
    clock, reaper, transport, lane, _ = rig
    done = Completions()
    ln = lane()
    transport.fail = ConnectionRefusedError("refused")
    w = done.for_work(clock.monotonic() + 10)
    assert ln.submit(w)
    reaper.watch(w)
    transport.open_gate()
    wait_for(lambda: done.of(w), 5)
    assert done.of(w) == [[Status.UNAVAILABLE]] and ln.suspect
    fast = done.for_work(clock.monotonic() + 10)
    assert not ln.submit(fast)  # suspect: a fast miss, completed by the caller's thread
    assert done.of(fast) == [[Status.UNAVAILABLE]]
    clock.advance(5.0)  # the lane's probe_interval
    assert not ln.suspect
    clock.advance(10)
    _settle()
    assert done.of(w) == [[Status.UNAVAILABLE]] and done.of(fast) == [[Status.UNAVAILABLE]]


@pytest.mark.timeout(30)
def test_full_queue_is_queue_full_at_once(rig):
    clock, _reaper, transport, lane, _ = rig
    done = Completions()
    ln = lane(queue_depth=1)
    busy = done.for_work(clock.monotonic() + 10)
    assert ln.submit(busy)
    wait_for(lambda: transport.started == [busy], 5)
    assert ln.submit(done.for_work(clock.monotonic() + 10))  # fills the queue
    over = done.for_work(clock.monotonic() + 10)
    assert not ln.submit(over)
    assert done.of(over) == [[Status.QUEUE_FULL]]


@pytest.mark.timeout(30)
def test_reaper_probes_on_its_clock(rig):
    clock, _reaper, _transport, _lane, probes = rig
    _settle()
    assert probes == []
    clock.advance(59)
    _settle()
    assert probes == []
    clock.advance(2)
    wait_for(lambda: len(probes) == 1, 5)
    clock.advance(60)
    wait_for(lambda: len(probes) == 2, 5)
