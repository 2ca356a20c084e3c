"""KV events, the publisher: ``KvEventPublisher`` sends what the tiers' ``EventQueue``s
(``kv_events``, the tiers' contract; records and topics: ``gcache.kv_events``)
collected, on ZMQ, exactly as vLLM's ``ZmqEventPublisher`` does, and answers replay and
snapshot requests. Design: ``docs/kv-events.md``.

Wire:

* PUB frames ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian integer,
  ``payload`` a msgpack ``KVEventBatch``.
* Topics, one per namespace: ``kv@<server>@<namespace>``; ``kv@<server>@*`` carries what
  concerns every namespace of this server (``AllBlocksCleared`` at each start). ZMQ
  filters by prefix: a subscriber subscribes to both and compares topics exactly.
* ``seq`` counts per topic, from 1 in each incarnation of the server, so a subscriber of
  one namespace sees every gap. A queue overflow (events dropped rather than blocking
  IO) skips one ``seq`` on every topic (and new topics start at 2): the gap shows
  wherever events may be missing.
* Replay and snapshot, on a ROUTER socket (``--kv-events-replay-endpoint``). vLLM's
  replay request ``[start_seq]`` (8 bytes, big-endian; from a REQ or a DEALER socket
  that sends an empty frame first) gets the buffered frames with ``seq >= start_seq`` of
  every topic; ``[start_seq, topic]`` those of one topic. Each reply is
  ``(b"", topic, seq, payload)``, then vLLM's end marker ``(b"", b"", -1, b"")``. A
  snapshot request is ``[-2, topic]`` (``SNAPSHOT_SEQ``): ``AllBlocksCleared`` then
  what is resident now, every frame with ``seq`` = the topic's last published ``seq``
  when the snapshot began (0: none yet); topic ``kv@<server>@*`` asks for every
  namespace. Apply it, then the live frames with a higher ``seq``: the state
  converges (every change after the snapshot began has a higher ``seq``, and applying a
  change twice is harmless). A malformed request, or one past ``MAX_JOBS`` in
  progress, gets the end marker alone; a message over ``MAX_REQUEST_BYTES``
  disconnects its peer.

Threads. Everything here runs on the one publisher thread ``gcache-kv-events``
(``start``), the only user of the sockets after the constructor bound them: it wakes
every ``FLUSH_S``, turns queued events into one batch per topic and slice of
``SLICE_EVENTS`` (giving the GIL back between slices), serves requests and
paces replays and snapshots (``SNAPSHOT_ROWS`` frames per wake and request; a
requester whose send queue is full waits for the next wake, a gone one is dropped).
The constructor and ``stop`` (bounded: 2 s) are the owner's.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable, Iterable, Iterator

import msgspec
import zmq

from gcache.kv_events import (ALL_NAMESPACES, AllBlocksCleared, BlockRemoved, KVEventBatch,
                              stored_event, stored_raw)
from gcache.kv_events import topic as topic_of
from gcache.server.kv_events import EventQueue, Resident

log = logging.getLogger("gcache.server.kv_events")

FLUSH_S = 0.01  # how often queued events go out (the events of one wake share a batch)
SNAPSHOT_ROWS = 512  # resident keys (or replayed frames) sent per wake and request
MAX_JOBS = 4  # replay/snapshot requests answered at once
MAX_REQUEST_BYTES = 1024  # a longer replay-socket message disconnects its peer
SLICE_EVENTS = 256  # queued events turned into batches per GIL hold (at most per batch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
SNAPSHOT_SEQ = -2  # a replay request for this start asks for a snapshot

_ENCODE = msgspec.msgpack.Encoder().encode


class _Job:
    """One replay or snapshot request being answered: frames still to send."""

    __slots__ = ("peer", "frames", "pending")

    def __init__(self, peer: bytes, frames: Iterator[list[bytes]]) -> None:
        self.peer = peer
        self.frames = frames
        self.pending: list[bytes] | None = None


class KvEventPublisher:
    """Publishes the ``EventQueue``'s events (see the module docstring)."""

    def __init__(self, server: str, queues: list[EventQueue], endpoint: str, *,
                 replay_endpoint: str = "", resident: Callable[[], Iterable[Resident]],
                 buffer_batches: int = 10_000, hwm: int = 100_000) -> None:
        """Bind the sockets (ZMQError: the caller's setup fault). ``resident`` walks what
        the tiers hold (a chunked snapshot; the publisher thread calls it)."""
        self.server = server.encode()
        self.queues = queues
        self._dropped = [0] * len(queues)  # each queue's ``dropped`` when last looked at
        self._resident = resident
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # full: wait, never drop
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_batches + 1))
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else "")
        self._seq: dict[bytes, int] = {}  # topic -> next seq
        self._buffer: deque[tuple[bytes, int, bytes]] = deque(maxlen=buffer_batches)
        self._gaps = False  # events were dropped: a new topic starts at seq 2, not 1
        self._jobs: deque[_Job] = deque()
        self._announce: Iterator[Resident] | None = None
        self.counters = {"kv_events_batches": 0, "kv_events_events": 0,
                         "kv_events_dropped": 0, "kv_events_replays": 0,
                         "kv_events_snapshots": 0, "kv_events_requests_refused": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Announce this incarnation (``AllBlocksCleared`` on ``kv@<server>@*``, then
        what the tiers recovered, paced) and start the publisher thread."""
        self._publish(self.topic(ALL_NAMESPACES), [AllBlocksCleared()])
        self._announce = iter(self._resident())
        self._thread = threading.Thread(target=self._run, name="gcache-kv-events",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Publish what is queued, stop the thread (at most 2 s) and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
            if self._thread.is_alive():
                log.error("the KV-event publisher did not stop within 2 s")
                return  # its sockets are still in use: leave them to process exit
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    def topic(self, ns: bytes) -> bytes:
        return topic_of(self.server, ns)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            try:
                if self._replay is not None and poller.poll(FLUSH_S * 1000):
                    self._take_requests()
                elif self._replay is None:
                    self._stop.wait(FLUSH_S)
                self._flush()
                if self._announce is not None:
                    self._announce_some()
                self._serve_jobs()
            except Exception:  # a bug here must not kill the thread: log, back off
                log.exception("KV-event publisher step failed")
                time.sleep(0.1)
            if stopping:
                return

    def _flush(self) -> None:
        """Queued events -> one batch per topic and slice of ``SLICE_EVENTS``, giving the
        GIL back between slices (the IO threads never wait for a whole backlog)."""
        for i, q in enumerate(self.queues):
            dropped = q.dropped
            if dropped != self._dropped[i]:
                self._gap(dropped - self._dropped[i])
                self._dropped[i] = dropped
            medium = q.medium
            while got := q.drain(SLICE_EVENTS):
                by_topic: dict[bytes, list] = {}
                for is_store, ns, key, parent in got:
                    evs = by_topic.get(ns)
                    if evs is None:
                        evs = by_topic[ns] = []
                    if is_store:  # a chain head (b"") has no parent
                        evs.append(stored_event(key, medium, parent) if parent
                                   else stored_raw(key, medium))
                    elif evs and type(evs[-1]) is BlockRemoved:
                        evs[-1].block_hashes.append(key)
                    else:
                        evs.append(BlockRemoved([key], medium.value))
                for ns, evs in by_topic.items():
                    self._publish(self.topic(ns), evs)
                time.sleep(0)  # let the IO threads in

    def _gap(self, lost: int) -> None:
        """``lost`` events were dropped: skip one seq on every topic (a visible gap)."""
        self.counters["kv_events_dropped"] += lost
        self._gaps = True
        for t in self._seq:
            self._seq[t] += 1
        log.warning("KV-event queue overflowed: %d events dropped; subscribers see a gap "
                    "and resync (raise --kv-events-queue-events)", lost)

    def _publish(self, topic: bytes, events: list) -> None:
        seq = self._seq.get(topic, 2 if self._gaps else 1)
        self._seq[topic] = seq + 1
        payload = _ENCODE(KVEventBatch(time.time(), events))
        seq_b = seq.to_bytes(8, "big")
        self._pub.send_multipart((topic, seq_b, payload), copy=False)
        self._buffer.append((topic, seq, payload))
        self.counters["kv_events_batches"] += 1
        self.counters["kv_events_events"] += len(events)

    def _announce_some(self) -> None:
        """Publish up to ``SNAPSHOT_ROWS`` recovered objects (after a restart)."""
        assert self._announce is not None
        rows = list(itertools.islice(self._announce, SNAPSHOT_ROWS))
        if len(rows) < SNAPSHOT_ROWS:
            self._announce = None
        by_topic: dict[bytes, list] = {}
        for r in rows:
            by_topic.setdefault(r.ns, []).append(stored_raw(r.key, r.medium))
        for ns, evs in by_topic.items():
            self._publish(self.topic(ns), evs)

    # ------------------------------------------------------------------ replay/snapshot
    def _take_requests(self) -> None:
        assert self._replay is not None
        for _ in range(64):  # bounded per wake
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._request(frames)

    def _request(self, frames: list[bytes]) -> None:
        """``[peer, b"", start(8)]`` or ``[peer, b"", start(8), topic]`` (REQ/DEALER)."""
        peer = frames[0]
        body = frames[2:] if len(frames) > 2 and frames[1] == b"" else frames[1:]
        ok = len(body) in (1, 2) and len(body[0]) == 8
        start = int.from_bytes(body[0], "big", signed=True) if ok else 0
        topic = body[1] if ok and len(body) == 2 else None
        ns = self._namespace_of(topic) if topic is not None else None
        if start == SNAPSHOT_SEQ and ns is None:
            ok = False
        elif start < 0 and start != SNAPSHOT_SEQ or topic is not None and ns is None:
            ok = False
        if not ok or len(self._jobs) >= MAX_JOBS:
            self.counters["kv_events_requests_refused"] += 1
            try:  # the end marker alone; a peer that cannot take it now goes without
                self._replay.send_multipart([peer, b"", b"", END_SEQ, b""], zmq.NOBLOCK)  # type: ignore[union-attr]
            except zmq.ZMQError:
                pass
            return
        if start == SNAPSHOT_SEQ:
            self.counters["kv_events_snapshots"] += 1
            frames_it = self._snapshot_frames(ns)  # type: ignore[arg-type]
        else:
            self.counters["kv_events_replays"] += 1
            frames_it = iter([[t, s.to_bytes(8, "big"), p] for t, s, p in list(self._buffer)
                              if s >= start and (topic is None or t == topic)])
        self._jobs.append(_Job(peer, frames_it))

    def _namespace_of(self, topic: bytes) -> bytes | None:
        prefix = self.topic(b"")
        return topic[len(prefix):] if topic.startswith(prefix) else None

    def _snapshot_frames(self, ns: bytes) -> Iterator[list[bytes]]:
        """AllBlocksCleared, then the resident keys of ``ns`` (or of all: ``*``), each
        frame at its topic's last published seq when the snapshot began."""
        last = {t: s - 1 for t, s in self._seq.items()}

        def seq_of(topic: bytes) -> bytes:
            return last.get(topic, 0).to_bytes(8, "big")  # 0: nothing published yet

        top = self.topic(ns)
        yield [top, seq_of(top), _ENCODE(KVEventBatch(time.time(), [AllBlocksCleared()]))]
        rows = (r for r in self._resident() if ns == ALL_NAMESPACES or r.ns == ns)
        while True:
            chunk = list(itertools.islice(rows, SNAPSHOT_ROWS))
            if not chunk:
                return
            by_topic: dict[bytes, list] = {}
            for r in chunk:
                by_topic.setdefault(self.topic(r.ns), []).append(stored_raw(r.key, r.medium))
            for t, evs in by_topic.items():
                yield [t, seq_of(t), _ENCODE(KVEventBatch(time.time(), evs))]

    def _serve_jobs(self) -> None:
        """Send what the requesters can take: at most ``SNAPSHOT_ROWS`` frames per job
        and wake; a full send queue waits for the next wake; a gone peer ends its job."""
        assert self._replay is not None or not self._jobs
        for job in list(self._jobs):
            try:
                for _ in range(SNAPSHOT_ROWS):
                    if job.pending is None:
                        nxt = next(job.frames, None)
                        job.pending = ([job.peer, b"", *nxt] if nxt is not None
                                       else [job.peer, b"", b"", END_SEQ, b""])
                    self._replay.send_multipart(job.pending, zmq.NOBLOCK)  # type: ignore[union-attr]
                    if job.pending[3] == END_SEQ and job.pending[2] == b"":
                        self._jobs.remove(job)
                        break
                    job.pending = None
            except zmq.Again:
                continue  # its queue is full: the rest next wake
            except zmq.ZMQError:  # EHOSTUNREACH: the requester is gone
                self._jobs.remove(job)
