"""Where each key goes: the membership view, owners and groups, and NOT_OWNER re-routes.

The ``Router`` holds the view this client routes by (``View``: epoch and members)
and its placement ring. With masters it follows their epoch: a watcher thread
long-polls ``/view?since=EPOCH`` and, with every master down, keeps routing on the
last view it saw (the IO path never waits for a master). Without masters the view
is the static server list, replaced only by ``update``.

Placement: a key's hash is ``placement_hash(namespace, key)``, or with ``group=`` the
group's hash (every key of a group lands on one owner); the ring maps hashes to
members. Requests routed by a master view carry the epoch (``ep``) and the hashes
(``ph``); a server whose view is newer and that does not own an item answers
``NOT_OWNER``, and the items are re-routed once (a second NOT_OWNER is final):

* ``reroute`` (on the dispatch thread that got the reply; never blocks) hands the
  items, as one held ``Work``, to the reaper, which completes them as TIMEOUT at
  their deadline unless taken first, and queues them for the re-route thread;
* the re-route thread (one per client) takes everything queued, refreshes the view
  from the masters once for all of it, bounded by the latest of their deadlines, and
  sends each item it can still take to its owner in the refreshed view. So a master
  that hangs costs the held items their deadline, never more, and no reply starts a
  thread.

``send`` cuts each owner's items into frames (``Framing``, by the lane's data path)
and hands them to the dispatcher.

Threads. ``hashes``, ``owners``, ``send`` and ``view`` run on user threads (and on
dispatch threads, for a byte get's remaining slices) and never block: they read one
snapshot of (view, ring). ``update`` runs on any thread and takes a short lock.
``reroute`` is called on dispatch threads and never blocks. The watcher thread blocks
in the masters' long-poll; the re-route thread in a view refresh, up to a deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Sequence

from gcache.discovery import MasterClient, MasterError, MasterUnavailable
from gcache.hashing import placement_hash
from gcache.status import Status
from gcache.view import View, view_from_wire
from gcache.sdk.dispatcher import Dispatcher
from gcache.sdk.transports.base import Framing, Work

if TYPE_CHECKING:
    from gcache.sdk.batch import Batch, Routed

log = logging.getLogger("gcache.sdk")

WATCH_WAIT_MS = 5000  # one long-poll of the masters' view
WATCH_RETRY_S = 0.5  # pause after a failed long-poll (every master down)


class Router:
    """The view a client routes by, and the path from a batch's items to its lanes."""

    def __init__(self, namespace: bytes, servers: Sequence[str], master: MasterClient | None,
                 dispatcher: Dispatcher, framing: Framing) -> None:
        """``servers``: the static view (or, with ``master``, the bootstrap until a
        master answers). With ``master`` the first refresh runs here, once."""
        self.namespace = namespace
        self._master = master
        self._dispatcher = dispatcher
        self._framing = framing
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # NOT_OWNER items awaiting the re-route thread: (batch, held work), None = stop
        self._held: queue.SimpleQueue = queue.SimpleQueue()
        self._held_lock = threading.Lock()  # orders reroute against close
        static = View.static(list(servers))
        self._snapshot: tuple[View, Any] = (static, static.ring)  # swapped whole, never torn
        if master is not None:
            self._snapshot = (View(-1, ()), static.ring)  # any master view is newer
            if not self.refresh(wait_ms=0) and servers:
                self._snapshot = (static, static.ring)  # bootstrap until a master answers
        for m in self.view.members:
            dispatcher.lane(m.address)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Follow the masters' epoch and re-route NOT_OWNER items in the background
        (nothing to do without masters)."""
        if self._master is not None:
            threading.Thread(target=self._watch, name="gcache-view-watch",
                             daemon=True).start()
            threading.Thread(target=self._reroute_loop, name="gcache-reroute",
                             daemon=True).start()

    def close(self) -> None:
        """Stop the threads; held NOT_OWNER items complete as CLOSED."""
        with self._held_lock:
            self._stop.set()  # nothing is held after this
        while True:
            try:
                got = self._held.get_nowait()
            except queue.Empty:
                break
            if got is not None:
                self._closed(*got)
        self._held.put(None)

    # ------------------------------------------------------------------ the view
    @property
    def view(self) -> View:
        return self._snapshot[0]

    def update(self, view: View) -> None:
        """Route by ``view`` (with masters: only when its epoch is newer)."""
        with self._lock:
            if self._master is not None and view.epoch <= self.view.epoch:
                return
            for m in view.members:
                self._dispatcher.lane(m.address)
            self._snapshot = (view, view.ring)
        log.info("routing by view epoch %d (%d servers)", view.epoch, len(view.members))

    def install(self, view: View) -> None:
        """Route by ``view`` whatever its epoch (tests simulate a missed epoch)."""
        with self._lock:
            for m in view.members:
                self._dispatcher.lane(m.address)
            self._snapshot = (view, view.ring)

    def refresh(self, wait_ms: int, deadline: float | None = None) -> bool:
        """Fetch the masters' view (long-poll past our epoch when wait_ms > 0), giving up
        at ``deadline`` (an op's, when the refresh is on that op's path)."""
        try:
            doc = self._master.view(since=self.view.epoch, wait_ms=wait_ms, deadline=deadline)
        except (MasterUnavailable, MasterError, OSError, ValueError) as exc:
            log.debug("view refresh failed: %s", exc)
            return False
        self.update(view_from_wire(doc))
        return True

    def _watch(self) -> None:
        """Follow the epoch; with every master down, keep routing on the last view."""
        while not self._stop.is_set():
            if not self.refresh(wait_ms=WATCH_WAIT_MS):
                self._stop.wait(WATCH_RETRY_S)

    # ------------------------------------------------------------------ placement
    def hashes(self, keys: list[bytes], group: Any = None) -> list[int]:
        """The placement hash of each key (``group``: one group for all, or one per key)."""
        ns = self.namespace
        if group is None:
            return [placement_hash(ns, k) for k in keys]
        if isinstance(group, (str, bytes)):
            g = group.encode() if isinstance(group, str) else group
            return [placement_hash(ns, b"", g)] * len(keys)
        gs = list(group)
        if len(gs) != len(keys):
            raise ValueError("group= sequence must have one entry per key")
        return [placement_hash(ns, k, None if g is None else
                               (g.encode() if isinstance(g, str) else bytes(g)))
                for k, g in zip(keys, gs)]

    def owners(self, hashes: list[int]) -> list[str]:
        """The owner address of each hash in the current view ('' when it is empty)."""
        ring = self._snapshot[1]
        if len(ring) == 0:
            return [""] * len(hashes)
        return [m.address for m in ring.owners(hashes)]

    # ------------------------------------------------------------------ sending
    def send(self, batch: Batch, routed: Routed, retried: bool = False) -> None:
        """Frame each owner's items and queue them on its lane ('' owner: UNAVAILABLE)."""
        dispatcher, framing, op = self._dispatcher, self._framing, batch.op
        for addr, items in routed.items():
            if not addr:  # empty view: no server to ask
                batch.fail(items, Status.UNAVAILABLE)
                continue
            lane = dispatcher.lane(addr)
            for frame in framing.frames(lane.kind, op, items):
                extra = batch.flags
                if self._master is not None:
                    hashes = batch.hashes
                    extra = {"ep": self.view.epoch, "ph": [hashes[it.index] for it in frame],
                             **(extra or {})}
                dispatcher.submit(lane, Work(op, self.namespace, frame, batch.deadline,
                                             batch.frame_done, extra, retried, addr))

    def reroute(self, batch: Batch, work: Work, moved: list) -> None:
        """The items ``moved`` of ``work`` got NOT_OWNER: this client's view is stale.
        Hold them for the re-route thread (see the module docstring); a re-sent item's
        NOT_OWNER is final, as is any NOT_OWNER without masters."""
        if work.retried or self._master is None:
            batch.fail(moved, Status.NOT_OWNER)
            return
        held = Work(work.op, work.ns, moved, work.deadline, batch.frame_done, work.extra,
                    True, work.address)
        with self._held_lock:
            closed = self._stop.is_set()
            if not closed:
                self._dispatcher.watch(held)  # TIMEOUT at the deadline unless taken first
                self._held.put((batch, held))
        if closed:
            batch.fail(moved, Status.CLOSED)

    def _reroute_loop(self) -> None:
        """The re-route thread: one view refresh for everything held, then re-send."""
        while True:
            got = self._held.get()
            if got is None:
                return
            todo = [got]
            while True:
                try:
                    more = self._held.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._held.put(None)  # stop after this round
                    break
                todo.append(more)
            # bounded by the latest deadline held: items due earlier are the reaper's
            self.refresh(wait_ms=0, deadline=max(held.deadline for _, held in todo))
            for batch, held in todo:
                if self._stop.is_set():
                    self._closed(batch, held)
                elif self._dispatcher.take(held):
                    hashes = batch.hashes
                    owners = self.owners([hashes[it.index] for it in held.items])
                    routed: dict[str, list] = {}
                    for it, addr in zip(held.items, owners):
                        routed.setdefault(addr, []).append(it)
                    self.send(batch, routed, retried=True)

    def _closed(self, batch: Batch, held: Work) -> None:
        if self._dispatcher.take(held):
            batch.fail(held.items, Status.CLOSED)
