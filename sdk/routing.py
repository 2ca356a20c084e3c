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
``NOT_OWNER``, and ``reroute`` refreshes the view from the masters and sends those
items once more (a second NOT_OWNER is final).

``send`` cuts each owner's items into frames (``Framing``, by the lane's data path)
and hands them to the dispatcher.

Threads. ``hashes``, ``owners``, ``send`` and ``view`` run on user threads (and on
dispatch threads, for a byte get's remaining slices) and never block: they read one
snapshot of (view, ring). ``update`` runs on any thread and takes a short lock.
``reroute`` is called on dispatch threads. The watcher thread blocks in the masters'
long-poll.
"""

from __future__ import annotations

import logging
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
        """Follow the masters' epoch in the background (nothing to do without masters)."""
        if self._master is not None:
            threading.Thread(target=self._watch, name="gcache-view-watch",
                             daemon=True).start()

    def close(self) -> None:
        self._stop.set()

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
                extra = None
                if self._master is not None:
                    hashes = batch.hashes
                    extra = {"ep": self.view.epoch, "ph": [hashes[it.index] for it in frame]}
                dispatcher.submit(lane, Work(op, self.namespace, frame, batch.deadline,
                                             batch.frame_done, extra, retried, addr))

    def reroute(self, batch: Batch, work: Work, moved: list) -> None:
        """The items ``moved`` of ``work`` got NOT_OWNER: this client's view is stale.
        Refresh it, then send them once more; a re-sent item's NOT_OWNER is final, as
        is any NOT_OWNER without masters."""
        if work.retried or self._master is None:
            batch.fail(moved, Status.NOT_OWNER)
            return
        threading.Thread(target=self._reroute, args=(batch, moved), daemon=True).start()

    def _reroute(self, batch: Batch, moved: list) -> None:
        """Refresh the view from the masters, then send the items once more. Both within
        the op's deadline: a slow master makes these items TIMEOUT misses."""
        self.refresh(wait_ms=0, deadline=batch.deadline)
        hashes = batch.hashes
        owners = self.owners([hashes[it.index] for it in moved])
        routed: dict[str, list] = {}
        for it, addr in zip(moved, owners):
            routed.setdefault(addr, []).append(it)
        self.send(batch, routed, retried=True)
