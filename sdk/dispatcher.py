"""Dispatch threads: bounded per-server queues, workers, deadlines, suspicion.

Design. Each server gets a ``Lane``: a bounded queue and ``conns_per_server``
dispatch threads, each owning one ``Transport``. User threads enqueue ``Work``; a
full queue is an immediate ``QUEUE_FULL``. A client's ``Dispatcher`` owns its lanes
(made on first use), the ``Reaper`` and the probe.

One-hop (``run_here``). A lane also keeps up to ``here_conns`` one-hop transports,
idle ones in a pool: a synchronous caller with one small frame pops one (an atomic
``list.pop``: one caller per connection), runs the frame on its own thread through
``_serve`` (the same rules as a dispatch thread: closed, suspect, deadline,
generation, reconnect once, suspicion) and puts it back; with none idle and no more
to make it queues the frame instead. Such work never enters the queue or the
reaper: it moves straight to RUNNING, nobody else can complete it, and its deadline
is held inside the transport. An exception escaping on the caller's thread (e.g.
KeyboardInterrupt mid-IO) closes that connection and still completes the work once.

Exactly-once completion: ``Work.state`` moves queued -> running (a worker
claims it) or queued -> done (the reaper expires it, or the holder of a NOT_OWNER
re-route takes it), by one ``claim`` under one lock, so a frame is completed by
exactly one party. A running frame is bounded by its
deadline inside the transport (every syscall's socket timeout is the time left
before the deadline), so no caller waits past its deadline plus scheduling noise.

Suspicion: a connection failure marks the lane suspect for
``probe_interval``; work for a suspect lane completes at once as
``UNAVAILABLE`` (a fast miss). The reaper thread probes suspect lanes in the
background and clears suspicion when a handshake succeeds. Two timeouts in a
row also make a lane suspect, so a hung (e.g. SIGSTOPped) server costs one
deadline, not one per request.

Time: every deadline, suspicion window and probe period is read from an injected
``gcache.clock.Clock`` (``SYSTEM`` by default), so tests run the lanes and the reaper
on a ``VirtualClock``. Deadlines are values of that clock.

Threads. ``Lane.submit`` runs on user threads (and on whichever thread re-sends
work) and never blocks: a full queue is ``QUEUE_FULL``. ``Lane.run_here`` runs on a
synchronous caller's thread and blocks up to the work's deadline. Each lane's dispatch threads
own one transport each and block in it up to a frame's deadline. ``Reaper.watch``
never blocks; the reaper thread sleeps until the earliest deadline or the next probe.
``Work.on_done`` runs on a dispatch thread, the reaper thread, or the submitting
thread (for work completed at once, or run one-hop), and must not block.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from typing import Callable

from gcache.clock import SYSTEM, Clock
from gcache.sched import background_thread
from gcache.status import Status
from gcache.config import TransportKind
from gcache.sdk.transports.base import AuthError, ItemResult, Transport, TransportTimeout, Work
from gcache.sdk.transports.tcp import TcpTransport

log = logging.getLogger("gcache.sdk")

QUEUED, RUNNING, DONE = 0, 1, 2
_STOP = object()


def claim(state_lock: threading.Lock, work: Work, to: int) -> bool:
    """The one move out of QUEUED (to RUNNING by a worker, to DONE by the reaper or a
    holder): False when another party moved ``work`` first, which then completes it."""
    with state_lock:
        if work.state != QUEUED:
            return False
        work.state = to
        return True


def fail_work(work: Work, status: Status) -> None:
    work.on_done(work, [ItemResult(status) for _ in work.items])


class Lane:
    def __init__(self, address: str, make_transport: Callable[[], Transport], *, threads: int,
                 queue_depth: int, probe_interval: float, state_lock: threading.Lock,
                 clock: Clock = SYSTEM, here_conns: int = 0) -> None:
        self.address = address
        self.clock = clock
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
        # one-hop: idle (transport, generation) pairs a calling thread may check out, and
        # how many such connections exist (at most here_conns)
        self._idle: list[tuple[Transport, int]] = []
        self._here_made = 0
        self._here_conns = here_conns
        self._here_lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, name=f"gcache-dispatch-{address}-{i}",
                                         daemon=True) for i in range(threads)]
        for t in self.threads:
            t.start()

    @property
    def suspect(self) -> bool:
        return self.clock.monotonic() < self.suspect_until

    def mark_suspect(self, reason: str) -> None:
        if not self.suspect:
            log.warning("server %s marked suspect: %s", self.address, reason)
        self.suspect_reason = reason
        self.suspect_until = self.clock.monotonic() + self.probe_interval
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

    def run_here(self, work: Work) -> bool:
        """One-hop: run ``work``, which nobody else has seen, on the calling thread over an
        idle connection of this lane, and complete it (every rule of ``_serve``). False,
        with nothing done, when no connection is idle and no more may be made, or the
        lane is closed or suspect (``submit`` then queues or fails it)."""
        if self._closed or self.suspect:
            return False
        try:
            transport, gen = self._idle.pop()  # atomic: one caller per connection
        except IndexError:
            with self._here_lock:
                if self._here_made >= self._here_conns:
                    return False  # every one-hop connection is busy: the dispatcher's
                self._here_made += 1
            try:
                transport, gen = self.make_transport(), self.generation
            except Exception:
                log.exception("one-hop transport for %s failed; using the queue", self.address)
                with self._here_lock:
                    self._here_made -= 1
                return False
        work.state = RUNNING  # unseen by the reaper and the queue: no claim to race
        try:
            gen = self._serve(transport, gen, work)
        except BaseException:  # e.g. KeyboardInterrupt on the calling thread, mid-IO
            transport.close()  # its stream position is unknown
            with self._state_lock:
                unfinished = work.state != DONE
            if unfinished:
                self._finish(work, None, Status.ERROR)  # callbacks still fire once
            raise
        finally:
            self._idle.append((transport, gen))
            if self._closed:
                self._close_idle()  # close() may have drained the pool before our append
        return True

    def _close_idle(self) -> None:
        while True:
            try:
                transport, _ = self._idle.pop()
            except IndexError:
                return
            transport.close()

    def _claim(self, work: Work) -> bool:
        return claim(self._state_lock, work, RUNNING)

    def _run(self) -> None:
        transport = self.make_transport()
        if getattr(transport, "background", False):  # a bulk mover's dispatch thread (Client(background=True))
            background_thread()
        gen = self.generation
        try:
            while True:
                work = self.q.get()
                if work is _STOP:
                    return
                if not self._claim(work):
                    continue  # the reaper expired it
                gen = self._serve(transport, gen, work)
        finally:
            transport.close()

    def _serve(self, transport: Transport, gen: int, work: Work) -> int:
        """Run claimed (RUNNING) ``work`` on ``transport``, made in lane generation ``gen``,
        and complete it: the lane's rules (closed, suspect, deadline, reconnect after a
        failure, suspicion on failures). Returns the transport's generation now."""
        if self._closed:
            self._finish(work, None, Status.CLOSED)
            return gen
        if self.suspect:
            self._finish(work, None, Status.UNAVAILABLE)
            return gen
        if self.clock.monotonic() >= work.deadline:
            self._finish(work, None, Status.TIMEOUT)
            return gen
        if gen != self.generation:
            transport.close()  # reconnect: the server failed since we connected
            gen = self.generation
        reused = getattr(transport, "sock", None) is not None
        try:
            try:
                results = transport.execute(work)
            except (OSError, ConnectionError) as exc:
                if not reused or isinstance(exc, TimeoutError) \
                        or self.clock.monotonic() >= work.deadline:
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
            return gen
        except AuthError as exc:
            self.mark_suspect(f"authentication failed: {exc}")
            self._finish(work, None, Status.AUTH)
            return gen
        except (OSError, ConnectionError) as exc:
            self.mark_suspect(str(exc) or type(exc).__name__)
            self._finish(work, None, Status.UNAVAILABLE)
            return gen
        except Exception as exc:  # a bug must not kill the dispatch thread
            log.exception("dispatch failed for %s", self.address)
            self._finish(work, None, Status.ERROR)
            del exc
            return gen
        self.consecutive_timeouts = 0
        self._finish(work, results, Status.OK)
        return gen

    def _finish(self, work: Work, results: list[ItemResult] | None, status: Status) -> None:
        with self._state_lock:
            work.state = DONE
        try:
            if results is None:
                fail_work(work, status)
            else:
                work.on_done(work, results)
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
        self._close_idle()
        for _ in self.threads:
            self.q.put(_STOP)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the dispatch threads (real time, as
        ``Thread.join`` waits, whatever the lane's clock)."""
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))


class Reaper:
    """Expires queued work at its deadline and probes suspect lanes (one thread)."""

    def __init__(self, state_lock: threading.Lock, probe: Callable[[], None],
                 probe_interval: float, clock: Clock = SYSTEM) -> None:
        self._lock = state_lock
        self._clock = clock
        self._heap: list[tuple[float, int, Work]] = []
        self._heap_lock = threading.Lock()
        self._wake = threading.Event()  # a new earliest deadline, or stop
        self._seq = itertools.count()
        self._prune_at = self.PRUNE_MIN
        self._probe = probe
        self._probe_interval = probe_interval
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="gcache-reaper", daemon=True)
        self.thread.start()

    PRUNE_MIN = 32  # heap entries before finished work is first dropped from it

    def watch(self, work: Work) -> None:
        """Complete ``work`` as TIMEOUT at its deadline unless a worker claimed it first.

        Finished work is dropped from the heap whenever it has doubled since the last
        drop (amortized O(1) per call): kept until its deadline, every finished frame of
        the last ``timeout_ms`` (its items, buffer views and batch) stayed alive, and
        the GC traversed hundreds of thousands of them (13 % of a busy client's CPU)."""
        with self._heap_lock:
            heap = self._heap
            heapq.heappush(heap, (work.deadline, next(self._seq), work))
            if len(heap) >= self._prune_at:
                # DONE is final, so reading it without the state lock drops only
                # finished work; a stale read keeps an entry until the next prune
                heap[:] = [e for e in heap if e[2].state != DONE]
                heapq.heapify(heap)
                self._prune_at = max(self.PRUNE_MIN, 2 * len(heap))
            first = bool(heap) and heap[0][2] is work  # the prune may drop it too
        if first:
            self._wake.set()

    def _run(self) -> None:
        clock = self._clock
        next_probe = clock.monotonic() + self._probe_interval
        while True:
            self._wake.clear()
            with self._heap_lock:
                if self._stop:
                    return
                now = clock.monotonic()
                wait = next_probe - now
                if self._heap:
                    wait = min(wait, self._heap[0][0] - now)
                if wait <= 0:
                    due = []
                    while self._heap and self._heap[0][0] <= now:
                        due.append(heapq.heappop(self._heap)[2])
            if wait > 0:
                clock.wait(self._wake, wait)
                continue
            for w in due:
                if claim(self._lock, w, DONE):
                    try:
                        fail_work(w, Status.TIMEOUT)
                    except Exception:
                        log.exception("completion callback raised")
            if clock.monotonic() >= next_probe:
                next_probe = clock.monotonic() + self._probe_interval
                try:
                    self._probe()
                except Exception:
                    log.exception("probe failed")

    def stop(self) -> None:
        with self._heap_lock:
            self._stop = True
        self._wake.set()
        self.thread.join(2)


class Dispatcher:
    """The lanes of one client, one per server, and the reaper that expires their work
    and probes the suspect ones.

    ``lane``, ``submit``, ``watch`` and ``take`` run on any thread and never block
    (``lane`` takes a short lock to create a lane once). ``probe`` runs on the reaper
    thread and blocks up to ``connect_timeout`` per suspect server. ``stats`` blocks
    its caller up to its deadline. ``close`` fails
    queued work with CLOSED and waits up to ``join_timeout`` for the dispatch threads.
    """

    def __init__(self, make_transport: Callable[[str], Transport],
                 dial: Callable[[str], TcpTransport], *, conns: int, queue_depth: int,
                 probe_interval: float, connect_timeout: float, clock: Clock = SYSTEM,
                 here_conns: int = 0) -> None:
        """``make_transport(address)``: a dispatch thread's (or one-hop) transport;
        ``dial(address)``: a plain transport for probes; ``here_conns``: one-hop
        connections per server (0: none, every frame goes through the queues)."""
        self._here_conns = here_conns
        self._make_transport = make_transport
        self._dial = dial
        self._conns, self._queue_depth = conns, queue_depth
        self._probe_interval = probe_interval
        self._connect_timeout = connect_timeout
        self.clock = clock
        self.state_lock = threading.Lock()  # Work.state moves under it
        self._lanes: dict[str, Lane] = {}
        self._lanes_lock = threading.Lock()
        self._closed = False
        self.reaper = Reaper(self.state_lock, self.probe, probe_interval, clock)

    def lane(self, address: str) -> Lane:
        """The lane of ``address``, made (and its threads started) on first use."""
        lane = self._lanes.get(address)
        if lane is None:
            with self._lanes_lock:
                lane = self._lanes.get(address)
                if lane is None:
                    lane = Lane(address, lambda: self._make_transport(address),
                                threads=self._conns, queue_depth=self._queue_depth,
                                probe_interval=self._probe_interval,
                                state_lock=self.state_lock, clock=self.clock,
                                here_conns=self._here_conns)
                    self._lanes[address] = lane
        return lane

    def addresses(self) -> list[str]:
        return list(self._lanes)

    def submit(self, lane: Lane, work: Work) -> None:
        """Queue ``work`` on ``lane`` (TIMEOUT at its deadline if still queued), or
        complete it at once (QUEUE_FULL, UNAVAILABLE, CLOSED)."""
        if lane.submit(work):
            self.reaper.watch(work)

    def run_here(self, lane: Lane, work: Work) -> bool:
        """One-hop: run ``work`` on the calling thread if a connection of ``lane`` is idle
        (``Lane.run_here``); False when it is not (then ``submit`` it). Blocks up to
        ``work.deadline``."""
        return lane.run_here(work)

    def watch(self, work: Work) -> None:
        """Expire ``work`` held outside the lanes (a NOT_OWNER re-route) at its deadline."""
        self.reaper.watch(work)

    def take(self, work: Work) -> bool:
        """Claim watched, held ``work`` for its holder: False when the reaper expired it
        first (then its completion is the reaper's)."""
        return claim(self.state_lock, work, DONE)

    def probe(self) -> None:
        """Handshake with each suspect server; a success clears its suspicion."""
        for lane in list(self._lanes.values()):
            if lane.suspect_until and not self._closed:
                t = self._dial(lane.address)
                try:
                    t.connect(self.clock.monotonic() + self._connect_timeout)
                    lane.clear_suspect()
                except Exception:
                    lane.suspect_until = max(lane.suspect_until,
                                             self.clock.monotonic() + lane.probe_interval)
                finally:
                    t.close()

    def stats(self, deadline: float) -> dict[str, dict]:
        """STATS of every server with a lane, each on a fresh connection of its own
        thread (not through the queues), all by ``deadline`` (this clock's); a server
        that did not answer maps to ``{"error": ...}``. Blocks until then at most."""
        addrs = self.addresses()
        out: dict[str, dict] = {}

        def one(addr: str) -> None:
            t = self._dial(addr)
            try:
                t.connect(deadline)
                out[addr] = t.call_stats(deadline)
            except Exception as exc:
                out[addr] = {"error": str(exc) or type(exc).__name__}
            finally:
                t.close()

        threads = [threading.Thread(target=one, args=(a,), name=f"gcache-stats-{a}",
                                    daemon=True) for a in addrs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - self.clock.monotonic()) + 0.5)
        return {a: out.get(a, {"error": "timed out"}) for a in addrs}

    def close(self, join_timeout: float) -> None:
        self._closed = True
        lanes = list(self._lanes.values())
        for lane in lanes:
            lane.close()
        for lane in lanes:
            lane.join(join_timeout)
        self.reaper.stop()
