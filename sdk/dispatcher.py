"""Dispatch threads: bounded per-server queues, workers, deadlines, suspicion.

Design. Each server gets a ``Lane``: a bounded queue and ``conns_per_server``
dispatch threads, each owning one ``Transport``. User threads only enqueue
``Work`` (never IO); a full queue is an immediate ``QUEUE_FULL``.

Exactly-once completion: ``Work.state`` moves queued -> running (a worker
claims it) or queued -> done (the reaper expires it), under one lock, so a
frame is completed by exactly one party. A running frame is bounded by its
deadline inside the transport (every syscall's socket timeout is the time left
before the deadline), so no caller waits past its deadline plus scheduling noise.

Suspicion: a connection failure marks the lane suspect for
``probe_interval``; work for a suspect lane completes at once as
``UNAVAILABLE`` (a fast miss). The reaper thread probes suspect lanes in the
background and clears suspicion when a handshake succeeds. Two timeouts in a
row also make a lane suspect, so a hung (e.g. SIGSTOPped) server costs one
deadline, not one per request.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from typing import Callable

from gcache.status import Status
from gcache.config import TransportKind
from gcache.sdk.transports.base import AuthError, ItemResult, Transport, TransportTimeout, Work

log = logging.getLogger("gcache.sdk")

QUEUED, RUNNING, DONE = 0, 1, 2
_STOP = object()


def fail_work(work: Work, status: Status) -> None:
    work.on_done([ItemResult(status) for _ in work.items])


class Lane:
    def __init__(self, address: str, make_transport: Callable[[], Transport], *, threads: int,
                 queue_depth: int, probe_interval: float, state_lock: threading.Lock) -> None:
        self.address = address
        self.make_transport = make_transport
        self.q: queue.Queue = queue.Queue(maxsize=queue_depth)
        self.probe_interval = probe_interval
        self.suspect_until = 0.0
        self.suspect_reason = ""
        self.consecutive_timeouts = 0
        self.generation = 0
        self._state_lock = state_lock
        self._closed = False
        self.kind: TransportKind | None = None  # data path of the last connection, once known
        self.threads = [threading.Thread(target=self._run, name=f"gcache-dispatch-{address}-{i}",
                                         daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    @property
    def suspect(self) -> bool:
        return time.monotonic() < self.suspect_until

    def mark_suspect(self, reason: str) -> None:
        if not self.suspect:
            log.warning("server %s marked suspect: %s", self.address, reason)
        self.suspect_reason = reason
        self.suspect_until = time.monotonic() + self.probe_interval
        self.generation += 1  # every pooled connection to this server is now stale

    def clear_suspect(self) -> None:
        if self.suspect_until:
            log.info("server %s is reachable again", self.address)
        self.suspect_until = 0.0
        self.consecutive_timeouts = 0

    def submit(self, work: Work) -> bool:
        """Enqueue, or complete at once. The caller watches the deadline only on True."""
        status = Status.CLOSED if self._closed else Status.UNAVAILABLE if self.suspect else None
        if status is None:
            try:
                self.q.put_nowait(work)
                return True
            except queue.Full:
                status = Status.QUEUE_FULL
        work.state = DONE  # nobody else has seen this work yet
        fail_work(work, status)
        return False

    def _claim(self, work: Work) -> bool:
        with self._state_lock:
            if work.state != QUEUED:
                return False
            work.state = RUNNING
            return True

    def _run(self) -> None:
        transport = self.make_transport()
        gen = self.generation
        try:
            while True:
                work = self.q.get()
                if work is _STOP:
                    return
                if not self._claim(work):
                    continue  # the reaper expired it
                if self._closed:
                    self._finish(work, None, Status.CLOSED)
                    continue
                if self.suspect:
                    self._finish(work, None, Status.UNAVAILABLE)
                    continue
                if time.monotonic() >= work.deadline:
                    self._finish(work, None, Status.TIMEOUT)
                    continue
                if gen != self.generation:
                    transport.close()  # reconnect: the server failed since we connected
                    gen = self.generation
                reused = getattr(transport, "sock", None) is not None
                try:
                    try:
                        results = transport.execute(work)
                    except (OSError, ConnectionError) as exc:
                        if not reused or isinstance(exc, TimeoutError) \
                                or time.monotonic() >= work.deadline:
                            raise
                        # A pooled connection that died while idle (the server restarted,
                        # a NAT dropped it): one fresh connection before calling the
                        # server suspect. Every op is idempotent (a put rewrites the
                        # same bytes), and a dead server refuses the connect at once.
                        transport.close()
                        results = transport.execute(work)
                    self.kind = transport.kind
                except TransportTimeout:
                    self.consecutive_timeouts += 1
                    if self.consecutive_timeouts >= 2:
                        self.mark_suspect("two requests in a row timed out")
                    self._finish(work, None, Status.TIMEOUT)
                    continue
                except AuthError as exc:
                    self.mark_suspect(f"authentication failed: {exc}")
                    self._finish(work, None, Status.AUTH)
                    continue
                except (OSError, ConnectionError) as exc:
                    self.mark_suspect(str(exc) or type(exc).__name__)
                    self._finish(work, None, Status.UNAVAILABLE)
                    continue
                except Exception as exc:  # a bug must not kill the dispatch thread
                    log.exception("dispatch failed for %s", self.address)
                    self._finish(work, None, Status.ERROR)
                    del exc
                    continue
                self.consecutive_timeouts = 0
                self._finish(work, results, Status.OK)
        finally:
            transport.close()

    def _finish(self, work: Work, results: list[ItemResult] | None, status: Status) -> None:
        with self._state_lock:
            work.state = DONE
        try:
            if results is None:
                fail_work(work, status)
            else:
                work.on_done(results)
        except Exception:
            log.exception("completion callback raised")

    def close(self) -> None:
        self._closed = True
        while True:  # fail what never started
            try:
                w = self.q.get_nowait()
            except queue.Empty:
                break
            if w is not _STOP and self._claim(w):
                self._finish(w, None, Status.CLOSED)
        for _ in self.threads:
            self.q.put(_STOP)

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))


class Reaper:
    """Expires queued work at its deadline and probes suspect lanes."""

    def __init__(self, state_lock: threading.Lock, probe: Callable[[], None],
                 probe_interval: float) -> None:
        self._lock = state_lock
        self._heap: list[tuple[float, int, Work]] = []
        self._cv = threading.Condition(threading.Lock())
        self._seq = itertools.count()
        self._probe = probe
        self._probe_interval = probe_interval
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="gcache-reaper", daemon=True)
        self.thread.start()

    def watch(self, work: Work) -> None:
        with self._cv:
            heapq.heappush(self._heap, (work.deadline, next(self._seq), work))
            if self._heap[0][2] is work:
                self._cv.notify()

    def _run(self) -> None:
        next_probe = time.monotonic() + self._probe_interval
        while True:
            with self._cv:
                if self._stop:
                    return
                now = time.monotonic()
                wait = next_probe - now
                if self._heap:
                    wait = min(wait, self._heap[0][0] - now)
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                now = time.monotonic()
                due = []
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
            for w in due:
                with self._lock:
                    expire = w.state == QUEUED
                    if expire:
                        w.state = DONE
                if expire:
                    try:
                        fail_work(w, Status.TIMEOUT)
                    except Exception:
                        log.exception("completion callback raised")
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self._probe_interval
                try:
                    self._probe()
                except Exception:
                    log.exception("probe failed")

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self.thread.join(2)
