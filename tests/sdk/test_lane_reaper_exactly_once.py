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
from gcache.sdk.batch import KeyBatch
from gcache.sdk.dispatcher import Lane, Reaper
from gcache.sdk.transports.base import GetItem, ItemResult, KeyItem, Transport, Work
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


class Rig:
    """A virtual clock, a reaper, one gated transport, the lanes made on it, and every
    completion delivered: ``of(work)`` lists the statuses of each ``on_done`` call."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        self.lock = threading.Lock()
        self.probes: list[float] = []
        self.reaper = Reaper(self.lock, lambda: self.probes.append(self.clock.monotonic()),
                             probe_interval=60.0, clock=self.clock)
        self.transport = GatedTransport()
        self.lanes: list[Lane] = []
        self._calls_lock = threading.Lock()
        self.calls: list[tuple[Work, list[Status]]] = []

    def lane(self, queue_depth: int = 8) -> Lane:
        ln = Lane("gated:1", lambda: self.transport, threads=1, queue_depth=queue_depth,
                  probe_interval=5.0, state_lock=self.lock, clock=self.clock)
        self.lanes.append(ln)
        return ln

    def work(self, due_in: float, n: int = 1) -> Work:
        items = [GetItem(b"k%d" % i, 0, 64, 0, None, i) for i in range(n)]
        return Work(Op.GET, b"ns", items, self.clock.monotonic() + due_in, self.record)

    def record(self, work: Work, results: list[ItemResult]) -> None:
        with self._calls_lock:
            self.calls.append((work, [r.status for r in results]))

    def of(self, work: Work) -> list[list[Status]]:
        with self._calls_lock:
            return [st for w, st in self.calls if w is work]

    def submit(self, lane: Lane, *works: Work, watch: bool = True) -> None:
        for w in works:
            assert lane.submit(w)
            if watch:
                self.reaper.watch(w)

    def busy(self, due_in: float = 10, queue_depth: int = 8) -> tuple[Lane, Work]:
        """A lane whose one worker is inside ``execute`` with a frame due in ``due_in``."""
        ln, w = self.lane(queue_depth), self.work(due_in)
        self.submit(ln, w)
        wait_for(lambda: self.transport.started == [w], 5)
        return ln, w

    def close(self) -> None:
        for ln in self.lanes:
            ln.close()
            self.transport.open_gate()  # let a worker still inside execute reach its stop
            ln.join(5)
        self.reaper.stop()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def _settle() -> None:
    time.sleep(0.05)  # real time for the background threads to act on what they were told


@pytest.mark.timeout(30)
def test_queued_frame_past_its_deadline_times_out_once_and_is_never_run(rig):
    ln, busy = rig.busy()
    queued = rig.work(1)
    rig.submit(ln, queued)
    _settle()
    assert rig.of(queued) == []  # nothing expires before its deadline on this clock
    rig.clock.advance(1.5)
    wait_for(lambda: rig.of(queued), 5)
    assert rig.of(queued) == [[Status.TIMEOUT]]
    rig.transport.open_gate()  # the worker finishes, then dequeues the expired frame
    wait_for(lambda: rig.of(busy), 5)
    rig.clock.advance(20)  # past the running frame's deadline too: nothing more to expire
    _settle()
    assert rig.of(busy) == [[Status.OK]]
    assert rig.of(queued) == [[Status.TIMEOUT]]
    assert rig.transport.started == [busy]  # the expired frame never reached the transport


@pytest.mark.timeout(30)
def test_late_reply_is_delivered_once_and_never_also_expired(rig):
    ln = rig.lane()
    w = rig.work(1, n=3)
    rig.submit(ln, w)
    wait_for(lambda: rig.transport.started == [w], 5)
    rig.clock.advance(5)  # the deadline passes while the frame is running
    _settle()
    assert rig.of(w) == []  # the reaper leaves a running frame to its worker
    rig.transport.open_gate()  # the reply comes late
    wait_for(lambda: rig.of(w), 5)
    rig.clock.advance(5)
    _settle()
    assert rig.of(w) == [[Status.OK] * 3]


@pytest.mark.timeout(30)
def test_worker_times_out_a_frame_dequeued_past_its_deadline(rig):
    ln, busy = rig.busy()
    late = rig.work(1)
    rig.submit(ln, late, watch=False)  # not watched: only the lane can expire it
    rig.clock.advance(2)
    rig.transport.open_gate()
    wait_for(lambda: rig.of(late), 5)
    _settle()
    assert rig.of(late) == [[Status.TIMEOUT]] and rig.of(busy) == [[Status.OK]]
    assert rig.transport.started == [busy]


@pytest.mark.timeout(30)
def test_close_fails_queued_frames_once_and_the_reaper_adds_nothing(rig):
    ln, busy = rig.busy()
    queued = [rig.work(1) for _ in range(3)]
    rig.submit(ln, *queued)
    ln.close()
    assert all(rig.of(w) == [[Status.CLOSED]] for w in queued)
    late = rig.work(1)
    assert not ln.submit(late)  # a closed lane completes new work at once
    assert rig.of(late) == [[Status.CLOSED]]
    rig.clock.advance(30)  # every deadline passes
    rig.transport.open_gate()
    wait_for(lambda: rig.of(busy), 5)
    _settle()
    assert rig.of(busy) == [[Status.OK]]
    assert all(rig.of(w) == [[Status.CLOSED]] for w in queued)


@pytest.mark.timeout(30)
def test_connection_failure_is_unavailable_once_and_suspicion_ends_on_the_clock(rig):
    ln = rig.lane()
    rig.transport.fail = ConnectionRefusedError("refused")
    w = rig.work(10)
    rig.submit(ln, w)
    rig.transport.open_gate()
    wait_for(lambda: rig.of(w), 5)
    assert rig.of(w) == [[Status.UNAVAILABLE]] and ln.suspect
    fast = rig.work(10)
    assert not ln.submit(fast)  # suspect: a fast miss, completed by the caller's thread
    assert rig.of(fast) == [[Status.UNAVAILABLE]]
    rig.clock.advance(5.0)  # the lane's probe_interval
    assert not ln.suspect
    rig.clock.advance(10)
    _settle()
    assert rig.of(w) == [[Status.UNAVAILABLE]] and rig.of(fast) == [[Status.UNAVAILABLE]]


@pytest.mark.timeout(30)
def test_full_queue_is_queue_full_at_once(rig):
    ln, _busy = rig.busy(queue_depth=1)
    rig.submit(ln, rig.work(10))  # fills the queue
    over = rig.work(10)
    assert not ln.submit(over)
    assert rig.of(over) == [[Status.QUEUE_FULL]]


@pytest.mark.timeout(30)
def test_reaper_probes_on_its_clock(rig):
    _settle()
    assert rig.probes == []
    rig.clock.advance(59)
    _settle()
    assert rig.probes == []
    rig.clock.advance(2)
    wait_for(lambda: len(rig.probes) == 1, 5)
    rig.clock.advance(60)
    wait_for(lambda: len(rig.probes) == 2, 5)


@pytest.mark.timeout(30)
def test_batch_callbacks_fire_once_when_one_frame_expires_and_one_replies_late(rig):
    """A batch whose first frame's reply comes after its deadline and whose second
    frame expires in the queue: each key's callback and the batch's fire once."""
    keys, per_key, batches = [b"a", b"b"], [], []
    deadline = rig.clock.monotonic() + 1
    batch = KeyBatch(Op.DELETE, keys, deadline, None, batches.append,
                     lambda i, k, st: per_key.append((i, st)))
    batch.parts = [1, 1]
    first, second = (Work(Op.DELETE, b"ns", [KeyItem(k, i)], deadline, batch.frame_done)
                     for i, k in enumerate(keys))
    ln = rig.lane()
    rig.submit(ln, first, second)
    wait_for(lambda: rig.transport.started == [first], 5)
    rig.clock.advance(2)
    wait_for(lambda: per_key, 5)
    assert per_key == [(1, Status.TIMEOUT)]  # the queued frame, by the reaper
    rig.transport.open_gate()  # the running frame's late reply
    assert batch.future.result(5) == [Status.OK, Status.TIMEOUT]
    rig.clock.advance(10)
    _settle()
    assert sorted(per_key) == [(0, Status.OK), (1, Status.TIMEOUT)]
    assert batches == [[Status.OK, Status.TIMEOUT]]
    assert rig.transport.started == [first]
