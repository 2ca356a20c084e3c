"""Where each key goes: the membership view, owners and groups, and NOT_OWNER re-routes.

The ``Router`` holds the view this client routes by (``View``: epoch and members)
and its placement ring. With masters it follows their epoch: a watcher thread
long-polls ``/view?since=EPOCH`` and, with every master down, keeps routing on the
last view it saw (the IO path never waits for a master). Without masters the view
is the static server list, replaced only by ``update``.

Placement: a key's hash is ``placement_hash(namespace, key)``, or with ``group=`` the
group's hash (every key of a group lands on one owner), both by ``placement_hashes``,
the one copy of that rule; the ring maps hashes to members. Requests routed by a master view carry the epoch (``ep``) and the hashes
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
and hands them to the dispatcher; with ``here`` (a synchronous call) a call that is
one frame for one server, of one item, at most ``one_hop_max_bytes``, or (on a shm
lane) a get or put the transport moves through the arena, runs on the calling thread
when a one-hop connection of that lane is idle (``Dispatcher.run_here``).

Previous-owner fallback (reads keep hitting while a membership change moves data).
When a master view changes the ring, the router keeps the ring it replaced, each for
``handoff_read_window_ms`` after it was replaced, and at most ``HISTORY`` of them (a
join's ramp changes the ring a few times: a key may have moved several views ago).
While any is kept, the batches it starts (``handoff_for``) carry a ``handoff`` hook: a
GET or EXISTS item that answered MISS is asked again, with ``"ho": 1`` (the server then
serves what it holds, skipping its NOT_OWNER check), at its *previous owner*: its
owner in the most recent kept ring where that owner is not the server that missed and
still holds data (UP, JOINING or DRAINING: ``View.holders``). One extra round trip at
most, within the op's original deadline: a key whose deadline passed stays a MISS, and
an answer other than OK from the previous owner leaves the MISS. DELETE items are sent
to the same previous owner too (OK if either deleted), so the fallback cannot bring a
deleted key back. Outside the window, or for a static view, batches carry no hook and
nothing is checked: hits never pay, and misses pay one extra round trip only inside
the window. Counted in ``counters`` (``handoff_reads``: items re-asked,
``handoff_read_hits``: found there). A view that changes no ring member (a state
change of a member out of the ring) adds nothing to the kept rings.

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
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from gcache.backoff import Backoff
from gcache.config import TransportKind
from gcache.discovery import MasterClient, MasterError, MasterUnavailable
from gcache.hashing import PLACEMENT_SEED, placement_hash
from gcache.native import placement_hashes as native_placement_hashes
from gcache.protocol import Op
from gcache.ring import Ring
from gcache.status import Status
from gcache.view import View, view_from_wire
from gcache.sdk.dispatcher import Dispatcher
from gcache.sdk.transports.base import Framing, ItemResult, Work, frame_chain

if TYPE_CHECKING:
    from gcache.sdk.batch import Batch, Routed

log = logging.getLogger("gcache.sdk")

WATCH_WAIT_MS = 5000  # one long-poll of the masters' view
WATCH_RETRY_S = 0.5  # first pause after a failed long-poll (every master down), jittered
WATCH_RETRY_MAX_S = 5.0  # ... doubling up to this
HANDOFF_READ = {"ho": 1}  # the header flag of a read (or delete) at a previous owner
HISTORY = 8  # replaced rings kept for the previous-owner fallback
_HANDOFF_OPS = frozenset({Op.GET, Op.EXISTS, Op.DELETE})
_ARENA_OPS = frozenset({Op.GET, Op.PUT})  # what a shm transport moves through the arena


class _Previous(NamedTuple):
    """The ring a master view replaced, and until when its owners are asked again."""

    ring: Ring
    until: float  # the dispatcher's clock


def placement_hashes(namespace: bytes, keys: Sequence[bytes], group: Any = None) -> list[int]:
    """The placement hash of each key as the ops' ``group=`` argument places it: the
    rule every op and ``Client.owners`` route by, public so that benches and tools
    (``gcache.bench.blast_radius``) place keys exactly as the SDK does.

    Args:
        namespace: the client's namespace (bytes).
        keys: the keys (bytes).
        group: None (each key by its own hash), one group for every key (str or bytes),
            or one group per key (a sequence; a None entry places that key by itself).
            Every key of one group lands on one server.

    Returns:
        One 64-bit ring position per key.

    Failure:
        ValueError for a group sequence whose length is not ``len(keys)``.
    """
    if group is None:  # the whole batch in one native call (gcache.native)
        try:
            return native_placement_hashes(namespace, keys, PLACEMENT_SEED)
        except TypeError:  # keys that are bytes-like but not bytes
            return native_placement_hashes(bytes(namespace), [bytes(k) for k in keys],
                                           PLACEMENT_SEED)
    if isinstance(group, (str, bytes)):
        g = group.encode() if isinstance(group, str) else group
        return [placement_hash(namespace, b"", g)] * len(keys)
    gs = list(group)
    if len(gs) != len(keys):
        raise ValueError("group= sequence must have one entry per key")
    return [placement_hash(namespace, k, None if g is None else
                           (g.encode() if isinstance(g, str) else bytes(g)))
            for k, g in zip(keys, gs)]


class Router:
    """The view a client routes by, and the path from a batch's items to its lanes."""

    def __init__(self, namespace: bytes, servers: Sequence[str], master: MasterClient | None,
                 dispatcher: Dispatcher, framing: Framing, *,
                 handoff_window_s: float = 0.0, counters: dict | None = None,
                 one_hop_max_bytes: int = 0, one_sided_min_bytes: int = 256 << 10) -> None:
        """``servers``: the static view (or, with ``master``, the bootstrap until a
        master answers). With ``master`` the first refresh runs here, once.
        ``handoff_window_s``: how long after a ring change misses ask the previous owner
        (0: never); ``counters``: where ``handoff_reads``/``handoff_read_hits`` count;
        ``one_hop_max_bytes``: the largest frame of several items ``send(here=True)``
        runs on the calling thread (a one-item frame always may; 0: none), except
        on a shm lane, where a get or put frame of at least ``one_sided_min_bytes``
        (the shm transport's own threshold: it moves such frames through the arena,
        never through the socket) runs there whatever its size."""
        self.namespace = namespace
        self._one_hop_max = one_hop_max_bytes
        self._one_sided_min = one_sided_min_bytes
        self._master = master
        self._dispatcher = dispatcher
        self._framing = framing
        self._window = handoff_window_s
        self._previous: tuple[_Previous, ...] = ()  # most recent first; swapped whole
        self.counters = counters if counters is not None else {}
        self.counters.update(handoff_reads=0, handoff_read_hits=0)
        self._count_lock = threading.Lock()
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

    @property
    def routed_by_master(self) -> bool:
        """Whether frames carry the view's epoch and placement hashes (``ep``, ``ph``)."""
        return self._master is not None

    def update(self, view: View) -> None:
        """Route by ``view`` (with masters: only when its epoch is newer)."""
        with self._lock:
            if self._master is not None and view.epoch <= self.view.epoch:
                return
            self.do_swap(view)
        log.info("routing by view epoch %d (%d servers)", view.epoch, len(view.members))

    def install(self, view: View) -> None:
        """Route by ``view`` whatever its epoch (tests simulate a missed epoch)."""
        with self._lock:
            self.do_swap(view)

    def do_swap(self, view: View) -> None:
        """Route by ``view`` (caller holds ``_lock``). A master view that changes the
        ring keeps the ring it replaces for the previous-owner fallback. A server the
        view lists as holding data again (it registered anew: restarted, or back from
        down) is no longer suspect: its lane tries it at once instead of answering
        UNAVAILABLE until the probe interval ends."""
        for m in view.members:
            self._dispatcher.lane(m.address)
        old, ring = self._snapshot
        for address in view.holders - old.holders:
            self._dispatcher.lane(address).clear_suspect()
        if (self._master is not None and self._window > 0 and old.epoch > 0
                and old.members != view.members):
            now = self._dispatcher.clock.monotonic()
            kept = [p for p in self._previous[:HISTORY - 1] if p.until > now]
            self._previous = (_Previous(ring, now + self._window), *kept)
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
        """Follow the epoch; with every master down, keep routing on the last view and
        retry with jittered backoff (so a fleet does not retry in lockstep)."""
        backoff = Backoff(WATCH_RETRY_S, WATCH_RETRY_MAX_S)
        while not self._stop.is_set():
            if self.refresh(wait_ms=WATCH_WAIT_MS):
                backoff.reset()
            else:
                self._stop.wait(backoff.next())

    # ------------------------------------------------------------------ placement
    def hashes(self, keys: list[bytes], group: Any = None) -> list[int]:
        """The placement hash of each key (``group``: one group for all, or one per key)."""
        return placement_hashes(self.namespace, keys, group)

    def owners(self, hashes: list[int]) -> list[str]:
        """The owner address of each hash in the current view ('' when it is empty)."""
        ring = self._snapshot[1]
        if len(ring) == 0:
            return [""] * len(hashes)
        return [m.address for m in ring.owners(hashes)]

    # ------------------------------------------------------------------ sending
    def send(self, batch: Batch, routed: Routed, retried: bool = False,
             flags: dict | None = None, on_done: Callable | None = None,
             here: bool = False) -> None:
        """Frame each owner's items and queue them on its lane ('' owner: UNAVAILABLE).
        ``flags``: header flags for these frames on top of the batch's; ``on_done``:
        instead of ``batch.frame_done``. ``here`` (a synchronous call, whose thread waits
        anyway): when everything is one frame for one server holding one item, at most
        ``one_hop_max_bytes``, or (a shm lane's get or put of at least
        ``one_sided_min_bytes``) bytes that never cross the socket, run it on this
        thread over an idle connection of that server's lane (one-hop; blocks up to the
        batch's deadline), else queue it."""
        dispatcher, framing, op = self._dispatcher, self._framing, batch.op
        flags = {**batch.flags, **flags} if flags and batch.flags else flags or batch.flags
        done = on_done or batch.frame_done
        here = here and len(routed) == 1
        # a put of one chain's pages, first time: each frame of consecutive keys names the
        # key before its first (another server's page when the chain spans groups)
        chain = batch.chain if not retried else None
        if chain is not None:
            keys = batch.keys

            def before(i: int) -> bytes:
                return keys[i - 1] if i else chain
        for addr, items in routed.items():
            if not addr:  # empty view: no server to ask
                batch.fail(items, Status.UNAVAILABLE)
                continue
            lane = dispatcher.lane(addr)
            frames = framing.frames(lane.kind, op, items)
            one_hop = here and len(frames) == 1 and self._one_hop_max > 0 and (
                len(items) == 1 or self._one_hop_bytes(lane.kind, op, items))
            for frame in frames:
                extra = flags
                if chain is not None:
                    ch = frame_chain(frame, before)
                    if ch is not None:
                        extra = {**(extra or {}), "ch": ch}
                if self._master is not None:
                    hashes = batch.hashes
                    extra = {"ep": self.view.epoch, "ph": [hashes[it.index] for it in frame],
                             **(extra or {})}
                work = Work(op, self.namespace, frame, batch.deadline, done, extra, retried,
                            addr, verify=batch.verify)
                if not (one_hop and dispatcher.run_here(lane, work)):
                    dispatcher.submit(lane, work)

    def _one_hop_bytes(self, kind: TransportKind | None, op: int, items: list) -> bool:
        """Whether a one-server frame of several ``items`` may run one-hop by its size:
        at most ``one_hop_max_bytes``, or on a shm lane a get or put frame big enough
        that the transport moves it through the arena (the caller copies it there on
        whichever thread runs the frame, so its size costs the same on either)."""
        n = sum(self._framing.item_bytes(op, items))
        return n <= self._one_hop_max or (kind == TransportKind.SHM and op in _ARENA_OPS
                                          and n >= self._one_sided_min)

    # ------------------------------------------------------------------ previous owners
    def handoff_for(self, batch: Batch) -> Callable | None:
        """The hook a GET/EXISTS/DELETE batch started now carries: ``handoff`` while the
        previous ring's window is open, else None (and nothing is ever checked)."""
        return self.handoff if self.handoff_open(batch.op) else None

    def handoff_open(self, op: int) -> bool:
        """Whether a call of ``op`` started now re-asks previous owners (``handoff``):
        a GET, EXISTS or DELETE while the previous ring's window is open."""
        prevs = self._previous
        if not prevs or op not in _HANDOFF_OPS:
            return False
        if self._dispatcher.clock.monotonic() >= prevs[0].until:
            self._previous = ()  # the window of the most recent ring closed: of all
            return False
        return True

    def handoff(self, batch: Batch, work: Work, items: list, results: list[ItemResult]
                ) -> tuple[list, list[ItemResult]]:
        """Of a frame's answered items, send those to re-ask at their previous owner
        (see the module docstring) and return the rest, to fold now."""
        prevs = self._previous
        if not prevs or (work.extra is not None and work.extra.get("ho")):
            return items, results  # no window, or already an answer of a previous owner
        delete = batch.op == Op.DELETE
        if delete:
            ask = [k for k, r in enumerate(results) if r.status in (Status.OK, Status.MISS)]
        else:
            ask = [k for k, r in enumerate(results) if r.status == Status.MISS]
        now = self._dispatcher.clock.monotonic()
        if not ask or now >= batch.deadline:
            return items, results
        hashes, holders, here = batch.hashes, self.view.holders, work.address
        routed: dict[str, list] = {}
        originals: dict[str, list[ItemResult]] = {}
        taken = set()
        for prev in prevs:  # most recent first: each item goes to one previous owner
            if not ask or prev.until <= now:
                break
            rest = []
            for k, m in zip(ask, prev.ring.owners([hashes[items[k].index] for k in ask])):
                addr = m.address
                if addr != here and addr in holders:
                    routed.setdefault(addr, []).append(items[k])
                    originals.setdefault(addr, []).append(results[k])
                    taken.add(k)
                else:
                    rest.append(k)
            ask = rest
        if not taken:
            return items, results
        if not delete:
            with self._count_lock:
                self.counters["handoff_reads"] += len(taken)
        for addr, moved in routed.items():
            orig = dict(zip((id(it) for it in moved), originals[addr]))
            self.send(batch, {addr: moved}, True, HANDOFF_READ,
                      lambda w, res, orig=orig: self._handoff_done(batch, w, res, orig))
        keep = [k for k in range(len(items)) if k not in taken]
        return [items[k] for k in keep], [results[k] for k in keep]

    def _handoff_done(self, batch: Batch, work: Work, results: list[ItemResult],
                      originals: dict[int, ItemResult]) -> None:
        """A previous owner's answer: its OK stands, anything else leaves the answer
        the key's owner gave (MISS for a read)."""
        out = [r if r.status == Status.OK else originals[id(it)]
               for it, r in zip(work.items, results)]
        if batch.op != Op.DELETE:
            hits = sum(1 for r in results if r.status == Status.OK)
            if hits:
                with self._count_lock:
                    self.counters["handoff_read_hits"] += hits
        batch.fold_frame(work, work.items, out)

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
                    if batch.handoff is None:  # the refresh may have just changed the ring
                        batch.handoff = self.handoff_for(batch)
                    hashes = batch.hashes
                    owners = self.owners([hashes[it.index] for it in held.items])
                    routed: dict[str, list] = {}
                    for it, addr in zip(held.items, owners):
                        routed.setdefault(addr, []).append(it)
                    self.send(batch, routed, retried=True)

    def _closed(self, batch: Batch, held: Work) -> None:
        if self._dispatcher.take(held):
            batch.fail(held.items, Status.CLOSED)
