"""One-key synchronous calls without a batch: ``get``, ``exists``, ``delete``, ``touch``,
and their batch forms of one key (``get_batch``, ``get_batch_into``, ``exists_batch``,
``delete_batch``, ``touch_batch``).

Design. A synchronous call of one key (no callbacks, no ``stream=``; a get into a host
buffer of at most ``slice_bytes``) whose owner has an idle one-hop
connection runs the frame a one-key batch would send, on the calling thread
(``Lane.run_here``: every rule of the dispatch threads), but without making the batch
first: no ``Batch``, routing dict, framing pass, fold or finalize, about a hundred
Python calls fewer per call. Its answer is final when it is

* a whole hit (a get's bytes are the whole object and, with ``verify_checksums``, hash
  to the server's checksum; a get into a buffer keeps ``IntoBatch``'s rules,
  ``batch.landed_status`` and ``batch.whole_status``: SIZE_MISMATCH, CORRUPT), or
* a miss with nobody else to ask: not NOT_OWNER, and not a MISS while the previous
  ring's handoff window is open (``Router.handoff_open``), or a failure status
  (TIMEOUT, UNAVAILABLE, ...), which the batch path would report the same way; a
  delete's OK or MISS in that window continues too (it must reach the previous owner,
  ``Router.handoff``).

Anything else continues in the batch path from where the point call stopped: the batch
is made with the same deadline, routed to the same server, and handed the frame and its
answer (``Batch.frame_done``), so NOT_OWNER re-routes, previous-owner reads and the
remaining slices of an object longer than the first read happen exactly as for a batch
call. When the call cannot run here (no idle one-hop connection, a suspect or closed
lane, an empty view, a closed client) nothing was sent, and the batch path runs the
whole call.

A get's first read asks for ``slice_bytes`` on a TCP lane; on a one-sided (shm, nixl)
lane it asks for less than ``one_sided_min_bytes``, so the frame goes as one plain GET
(one round trip, its bytes on the socket) rather than LEASE + copy + RELEASE; an object
longer than that continues as a batch whose remaining slices take the one-sided path.

Metrics (``Client(metrics=...)``) count a final answer as the batch path would
(``SdkMetrics.count_one``); a continued call is counted by its batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gcache.config import TransportKind
from gcache.protocol import Op
from gcache.sdk.batch import BytesBatch, IntoBatch, KeyBatch, landed_status, whole_status
from gcache.sdk.buffers import digest
from gcache.sdk.transports.base import GetItem, ItemResult, KeyItem, Work
from gcache.status import Status

if TYPE_CHECKING:
    from gcache.sdk.client import Client

_OK, _MISS, _NOT_OWNER = Status.OK, Status.MISS, Status.NOT_OWNER
_PLAIN_KINDS = (None, TransportKind.TCP)


def call(c: Client, op: int, key: bytes, group: Any, deadline: float,
         view: memoryview | None = None) -> Any:
    """``get`` (op GET: bytes or None), ``get_batch_into`` of one key (op GET with
    ``view``, a writable host byte view of at most ``slice_bytes``: its Status),
    ``exists`` (op EXISTS: bool), ``delete`` or ``touch`` (op DELETE / TOUCH: its
    Status) of ``key``, which ``Client._key`` checked, by ``deadline``."""
    router, dispatcher, metrics = c._router, c._dispatcher, c._metrics
    started = dispatcher.clock.monotonic() if metrics is not None else 0.0
    h = router.hashes([key], group)[0]
    addr = router.owners([h])[0]
    if c._closed or not addr:
        return _batch(c, op, key, group, deadline, view)
    lane = dispatcher.lane(addr)
    if view is not None:
        item: Any = GetItem(key, 0, len(view), 0, view, 0)
    elif op == Op.GET:
        step = c.slice
        if lane.kind not in _PLAIN_KINDS and c.one_sided_min > 1:  # one plain GET
            step = min(step, c.one_sided_min - 1)
        item = GetItem(key, 0, step, 0, None, 0)
    else:
        item = KeyItem(key, 0)
    extra = None
    if router.routed_by_master:
        extra = {"ep": router.view.epoch, "ph": [h]}
    box: list[list[ItemResult]] = []
    work = Work(op, router.namespace, [item], deadline, lambda _w, r: box.append(r), extra,
                False, addr, verify=op == Op.GET and c.verify)
    if not lane.run_here(work):
        return _batch(c, op, key, group, deadline, view)
    res = box[0][0]
    st = res.status
    if st == _NOT_OWNER or (router.handoff_open(op) and (
            st == _MISS or st == _OK and op == Op.DELETE)):  # Router.handoff's rule
        return _continue(c, work, box[0], h, started)
    if view is not None:
        st = whole_status(c._checks, c.verify, item, res,
                          landed_status(c._checks, c.verify, item, res))
    elif st == _OK and op == Op.GET:
        if res.total_len > res.nbytes:  # longer than the first read (or a size claim)
            return _continue(c, work, box[0], h, started)
        if res.total_len != res.nbytes:
            st = Status.ERROR  # a server that says the object is shorter than it sent
        elif c.verify:
            got = res.landed if res.landed is not None else digest(res.data or b"")
            st = c._checks.compare(key, got, res.checksum)
    if metrics is not None:
        metrics.count_one(op, str(c.transport), st, dispatcher.clock.monotonic() - started)
    if op == Op.EXISTS:
        return st == _OK
    if view is not None or op != Op.GET:  # get into a buffer, delete, touch: the Status
        return st
    return (bytes(res.data) if res.data is not None else b"") if st == _OK else None


def _batch(c: Client, op: int, key: bytes, group: Any, deadline: float,
           view: memoryview | None) -> Any:
    """The whole call through the batch path (nothing was sent)."""
    return c._wait(c._start(_make(c, op, key, deadline, view), group, None, True), 1,
                   _missed(op, view))[0]


def _continue(c: Client, work: Work, results: list[ItemResult], h: int,
              started: float) -> Any:
    """The call as a batch that has sent ``work`` and just got ``results``: it folds
    them (re-routing, asking previous owners, fetching the remaining slices) and the
    caller waits for it as for any synchronous batch."""
    it, router = work.items[0], c._router
    view = it.dest if work.op == Op.GET else None
    batch = _make(c, work.op, it.key, work.deadline, view)
    if c._metrics is not None:
        c._metrics.watch(batch, str(c.transport), started, c._dispatcher.clock.monotonic)
    batch.hashes = [h]
    batch.handoff = router.handoff_for(batch)
    batch.route([work.address], c.slice)  # the key's one outstanding part: this frame
    batch.frame_done(work, results)
    return c._wait(batch, 1, _missed(work.op, view))[0]


def _make(c: Client, op: int, key: bytes, deadline: float, view: memoryview | None) -> Any:
    """The batch the call would have made."""
    if view is not None:
        return IntoBatch([key], [view], c._checks, deadline, c._router, None, None)
    if op == Op.GET:
        return BytesBatch([key], c._checks, deadline, c._router, None, None,
                          c.limits.max_value_bytes)
    return KeyBatch(op, [key], deadline, c._router, None, None)


def _missed(op: int, view: memoryview | None) -> Any:
    """What the call returns if its batch outlived its deadline (as the sync methods)."""
    if op == Op.GET:
        return Status.TIMEOUT if view is not None else None
    return False if op == Op.EXISTS else Status.TIMEOUT
