"""Callbacks at CUDA-stream granularity: run a function once a stream reaches a point.

Design. ``StreamWatcher.after(stream, fn)`` records a CUDA event on ``stream`` now
(``torch.cuda.Event().record(stream)``) and calls ``fn`` from one watcher thread
once ``event.query()`` says the GPU has passed it. The Client uses it two ways:

* ``put_batch_from_async(..., stream=s)``: the put is submitted only when ``s``
  reaches the call point, so an engine can enqueue the kernels / D2H copies that
  fill the KV pages and call put right away, without synchronizing its stream; a
  stream that has not got there by the put's deadline makes every key TIMEOUT;
* ``get_batch_into_async(..., stream=s)``: when every key has landed, an event is
  recorded on ``s`` and the batch callback and the future run once the stream has
  passed it, so work the engine enqueued on ``s`` before (e.g. freeing or reusing
  the destination pages) is ordered with the completion it is told about (at the
  deadline they run regardless: the bytes have landed, only the ordering is lost).

The watcher polls pending events (a few tens of microseconds apart while any is
pending, and sleeps on a condition otherwise). Every ``fn`` runs exactly once; an
exception in ``fn`` is logged, never raised into the watcher. CUDA is optional:
``stream=`` raises ``ValueError`` when torch.cuda is not available, and the event
factory can be replaced (tests on machines without a GPU drive the watcher with
their own events).

``StreamCallbacks`` is what a Client holds: the watcher, made on the first
``stream=`` call (in the caller's thread, so a missing CUDA raises there), and the two
ways the client defers work and completions behind a stream.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger("gcache.sdk.cuda")

POLL_S = 50e-6


def cuda_event_factory() -> Callable[[], Any]:
    """torch.cuda.Event, or raise ValueError when CUDA is not available here."""
    try:
        import torch
    except ImportError:
        raise ValueError("stream= needs torch with CUDA") from None
    if not torch.cuda.is_available():
        raise ValueError("stream= needs CUDA: torch.cuda.is_available() is False")
    return torch.cuda.Event


class StreamWatcher:
    def __init__(self, event_factory: Callable[[], Any] | None = None) -> None:
        self._factory = event_factory
        self._cv = threading.Condition()
        self._pending: list[tuple[Any, Callable[[bool], None], float | None]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def after(self, stream: Any, fn: Callable[[bool], None],
              deadline: float | None = None) -> None:
        """Call ``fn(True)`` once ``stream`` has passed this point, or ``fn(False)`` at
        ``deadline`` (``time.monotonic``) if it has not by then. Exactly once."""
        if self._factory is None:
            self._factory = cuda_event_factory()
        ev = self._factory()
        ev.record(stream)
        with self._cv:
            if self._closed:
                closed = True
            else:
                closed = False
                self._pending.append((ev, fn, deadline))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="gcache-cuda-events",
                                                    daemon=True)
                    self._thread.start()
                self._cv.notify()
        if closed:  # shutting down: do not lose the callback
            _call(fn, False)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed and not self._pending:
                    return
                pending = list(self._pending)
            done = []
            now = time.monotonic()
            for item in pending:
                try:
                    ready = bool(item[0].query())
                except Exception:  # a broken event must not wedge the others
                    log.exception("CUDA event query failed; running its callback")
                    ready = False
                    item = (item[0], item[1], now)
                if ready or (item[2] is not None and now >= item[2]):
                    done.append((item, ready))
            if done:
                with self._cv:
                    for item, _ in done:
                        self._pending = [p for p in self._pending if p[1] is not item[1]]
                for item, ready in done:
                    _call(item[1], ready)
            else:
                time.sleep(POLL_S)

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the pending events complete (or ``timeout``; then run them anyway)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            t = self._thread
        if t is not None:
            t.join(timeout)
        with self._cv:
            left, self._pending = self._pending, []
        for _, fn, _ in left:
            _call(fn, False)


def _call(fn: Callable[[bool], None], reached: bool) -> None:
    try:
        fn(reached)
    except Exception:
        log.exception("stream callback raised")


class StreamCallbacks:
    """A client's ``stream=`` forms. Any thread; never blocks (the watcher thread runs
    the deferred work)."""

    def __init__(self) -> None:
        self.event_factory: Callable[[], Any] | None = None  # None: torch.cuda.Event
        self._watcher: StreamWatcher | None = None
        self._lock = threading.Lock()

    def watcher(self) -> StreamWatcher:
        """The watcher; ValueError when CUDA is not available (and no factory is set)."""
        with self._lock:
            if self._watcher is None:
                self._watcher = StreamWatcher(self.event_factory or cuda_event_factory())
            return self._watcher

    def start_after(self, stream: Any, deadline: float, start: Callable[[int], Future],
                    missed: Callable[[], list]) -> Future:
        """A future of ``start(left_ms)``'s result, called once ``stream`` reaches this
        point with the milliseconds left before ``deadline``; if the stream is not there
        by ``deadline``, of ``missed()`` (which fires the caller's callbacks)."""
        outer: Future = Future()

        def submit(reached: bool) -> None:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if not reached or left_ms < 1:  # the stream never got there in time
                outer.set_result(missed())
                return
            start(left_ms).add_done_callback(lambda f: outer.set_result(f.result()))

        self.watcher().after(stream, submit, deadline)
        return outer

    def complete_after(self, stream: Any, callback: Callable[[list], None] | None,
                       deadline: float) -> tuple[Callable[[list], None], Future]:
        """A batch callback, and the future it completes, that defer ``callback`` and the
        future until ``stream`` passes the point where the batch completed (or until
        ``deadline``: the results stand, only the ordering is lost)."""
        outer: Future = Future()
        watcher = self.watcher()

        def on_batch(results: list) -> None:
            res = list(results)

            def fire(_reached: bool) -> None:
                if callback is not None:
                    try:
                        callback(res)
                    except Exception:
                        log.exception("callback raised")
                outer.set_result(res)

            watcher.after(stream, fire, deadline)

        return on_batch, outer

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
