"""A lost server's KV events, from the leader master (``--kv-events-endpoint``).

Design. Each gcache-server publishes its own index changes (``gcache.server.kv_events``),
but a dead server publishes nothing, and its subscribers cannot tell a quiet server from
a dead one. The masters decide that a member is gone: the failure detector's committed
``mark_down`` (missed heartbeats), or a ``remove`` (admin, or a drained server removing
itself). That decision is made once, on the leader, and replicated, so the leader is the
one place to announce it; an SDK's "suspect" mark is one client's guess about a slow
peer and would clear routers on noise. For each such member the leader publishes one
``KVEventBatch([AllBlocksCleared()])`` on ``kv@<member id>@*`` (the topic a server's own
publisher uses for what concerns all its namespaces; the member id is the server's
``--name``), in vLLM's wire format: PUB frames ``(topic, seq, payload)``, ``seq`` 8
bytes big-endian, counting per topic from 1 in each master process. Every master binds
its endpoint; only the leader sends. A router connects one SUB socket per endpoint (as
it does per server) to every master. No replay: a router that missed the frame still
sees the member down or gone in the masters' view.

Threads. The constructor (binds; ``zmq.ZMQError`` is the caller's setup fault) and
``close`` are the owner's. ``member_gone`` is called by the detector's monitor thread
(after a ``mark_down`` committed) and by API request threads (after a ``remove``
committed); a lock serialises the socket. It never blocks: a PUB send drops for a
subscriber past its high-water mark, and a send error is logged, not raised.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq

from gcache.kv_events import ALL_NAMESPACES, AllBlocksCleared, KVEventBatch, topic

log = logging.getLogger("gcache.master")

_ENCODE = msgspec.msgpack.Encoder().encode


class DownPublisher:
    """Publishes ``AllBlocksCleared`` for members the masters declared gone."""

    def __init__(self, endpoint: str, hwm: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._pub = zmq.Context.instance().socket(zmq.PUB)
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(hwm)
            self._pub.bind(endpoint)
        except zmq.ZMQError:
            self._pub.close(linger=0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq: dict[bytes, int] = {}
        self.published = 0

    def member_gone(self, member_id: str) -> None:
        """Announce that every block of ``member_id`` is gone (never raises)."""
        t = topic(member_id.encode(), ALL_NAMESPACES)
        payload = _ENCODE(KVEventBatch(time.time(), [AllBlocksCleared()]))
        with self._lock:
            seq = self._seq.get(t, 1)
            self._seq[t] = seq + 1
            try:
                self._pub.send_multipart((t, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                self.published += 1
            except zmq.ZMQError as exc:
                log.warning("could not publish that member %s is gone: %s", member_id, exc)

    def close(self) -> None:
        with self._lock:
            self._pub.close(linger=0)
