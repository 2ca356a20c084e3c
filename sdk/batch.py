"""One call's keys: slice results fold into per-key results, then the batch result.

A ``Batch`` is made by the user thread for every Client call. It cuts its keys into
work items for their owners (``route``: one item per slice of ``slice_bytes``), and
folds what comes back. Every frame of the batch completes through ``frame_done``
(its ``Work.on_done``), which:

* hands items a server answered ``NOT_OWNER`` to the sender's ``reroute`` (the
  router refreshes its view and sends them once more, or folds NOT_OWNER);
* with a ``handoff`` hook (``Router.handoff_for``: only shortly after the ring
  changed), lets it take the items to re-ask at their previous owner (misses of a
  get or exists, deletes of keys that moved); without one nothing is checked;
* for a byte get, learns the object's size from its first slice and sends the
  remaining slices to the same server (the key's part count grows first);
* folds everything else.

Exactly once. A key is finished when its last outstanding slice is folded; a slice
folded for a key with none outstanding is ignored. Each finished key is finalized
(its result written, ``on_key`` called) exactly once, and the batch callback and
future complete exactly once, after every key. A key's status is its first non-OK
slice status; slices from different object versions make it ``CONFLICT``, and
slices reporting different checksums ``CORRUPT``.

Threads. ``route`` runs on the user thread. ``frame_done``, ``fold`` and ``fail`` run
on dispatch threads, the reaper, the router's thread or the submitting thread
(work completed at once), concurrently: one lock guards the per-slice state;
finalization and callbacks run outside it and must not block.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from gcache.protocol import Op
from gcache.sdk.buffers import digest
from gcache.sdk.transports.base import (DIGEST_LATER, GetItem, ItemResult, KeyItem, PutItem,
                                        Work)
from gcache.status import Status

if TYPE_CHECKING:
    from gcache.protocol import Limits

log = logging.getLogger("gcache.sdk")

KeyCallback = Callable[[int, bytes, Any], None]
BatchCallback = Callable[[list], None]
Routed = dict[str, list]  # owner address ('' = none) -> its items, in key order

_OK, _NOT_OWNER, _SIZE_MISMATCH = Status.OK, Status.NOT_OWNER, Status.SIZE_MISMATCH
_status = attrgetter("status")

# one folded slice, within this module: (key index, status, version, total_len, checksum)
_Slice = tuple[int, Status, int, int, "int | None"]


class Sender(Protocol):
    """Where a batch's items go (the router)."""

    def send(self, batch: Batch, routed: Routed, retried: bool = False) -> None: ...

    def reroute(self, batch: Batch, work: Work, moved: list) -> None: ...


class Checksums:
    """``verify_checksums``: every value read is checked against the server's checksum
    once all its bytes landed; a mismatch is a ``CORRUPT`` miss, counted in
    ``counters`` (any thread)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.counters = {"checksum_mismatch": 0}  # reads refused by verify_checksums
        self._lock = threading.Lock()

    def check(self, key: bytes, buf: Any, want: int | None) -> Status:
        """OK if ``buf`` (the whole object) hashes to ``want``, else CORRUPT."""
        return self.compare(key, digest(buf), want)

    def compare(self, key: bytes, got: int, want: int | None) -> Status:
        """OK if ``got`` (the hash of the whole object as read) is ``want``, else CORRUPT
        (counted and logged)."""
        if want is not None and got == want:
            return Status.OK
        with self._lock:
            self.counters["checksum_mismatch"] += 1
        log.warning("read of %r failed its checksum (%s); reported as CORRUPT, a miss",
                    key[:64], "none sent" if want is None else "bytes differ")
        return Status.CORRUPT


class Batch:
    """The keys of one call and their results (see the module docstring)."""

    DEFAULT: Any = Status.ERROR  # a key's result until it is finalized
    verify = False  # frames ask transports to hash whole-object slices as they land

    __slots__ = ("op", "keys", "deadline", "sender", "results", "left", "parts", "versions",
                 "totals", "sums", "hashes", "remaining", "lock", "_future", "done",
                 "callback", "on_key", "flags", "handoff", "chain", "watcher")

    def __init__(self, op: int, keys: list[bytes], deadline: float, sender: Sender,
                 callback: BatchCallback | None, on_key: KeyCallback | None) -> None:
        n = len(keys)
        self.op, self.keys, self.deadline, self.sender = op, keys, deadline, sender
        self.results: list[Any] = [self.DEFAULT] * n
        self.parts = [0] * n  # outstanding slices per key
        self.left: list[Status] = [Status.OK] * n  # first non-OK status per key
        self.versions = [0] * n
        self.totals = [-1] * n
        self.sums: list[int | None] = [None] * n  # the server's checksum of each object
        self.hashes: list[int] = []  # placement hash per key (routing, NOT_OWNER re-routes)
        self.remaining = n
        self.lock = threading.Lock()
        # made on first use (``future``): a synchronous call answered on its own thread
        # (one-hop) reads ``results`` once ``done`` and never needs one
        self._future: Future | None = None
        self.done = n == 0  # every key folded and the batch callback run
        self.callback, self.on_key = callback, on_key
        # the client's metrics (``SdkMetrics.watch``): counts the results when the batch
        # completes, before its future or a synchronous caller sees them
        self.watcher: Callable[[list], None] | None = None
        self.flags: dict | None = None  # header flags of every frame (``"ia"``, ``"ho"``)
        self.chain: bytes | None = None  # a put of one chain: its first key's parent
        # Router.handoff while a membership change is recent (see the module docstring)
        self.handoff: Callable | None = None

    @property
    def future(self) -> Future:
        """The batch's Future of ``results``; done once every key folded and the batch
        callback ran. Made on first use, under the lock, so it is set exactly once
        whichever thread completes the batch."""
        with self.lock:
            fut = self._future
            if fut is None:
                fut = self._future = Future()
                if self.done:
                    fut.set_result(self.results)
        return fut

    # ------------------------------------------------------------------ per kind
    def route(self, owners: list[str], slice_bytes: int) -> Routed:
        """The items of every key, grouped by owner (``owners[i]``: key i's)."""
        raise NotImplementedError

    def finalize(self, i: int, st: Status) -> Any:
        """Key ``i``'s result, once its last slice folded with status ``st``."""
        return st

    def fold_frame(self, work: Work, items: list, results: list[ItemResult]) -> None:
        """Fold a frame's items and results (NOT_OWNER items taken out)."""
        self.fold([(it.index, r.status, 0, -1, None) for it, r in zip(items, results)])

    # ------------------------------------------------------------------ completion
    def frame_done(self, work: Work, results: list[ItemResult]) -> None:
        """``Work.on_done`` of every frame of this batch: called once per frame."""
        items = work.items
        # one C-level scan of the statuses; the per-item lists only when some moved
        moved = ([it for it, r in zip(items, results) if r.status == _NOT_OWNER]
                 if _NOT_OWNER in map(_status, results) else None)
        if moved:
            self.sender.reroute(self, work, moved)
            keep = [k for k, r in enumerate(results) if r.status != Status.NOT_OWNER]
            items = [items[k] for k in keep]
            results = [results[k] for k in keep]
        if self.handoff is not None:
            items, results = self.handoff(self, work, items, results)
        self.fold_frame(work, items, results)

    def fail(self, items: Iterable, status: Status) -> None:
        """Fold ``status`` for each item (a slice each)."""
        self.fold([(it.index, status, 0, -1, None) for it in items])

    def fail_all(self, status: Status) -> Batch:
        """Every key's result is ``status`` (a closed client): nothing was sent."""
        self.parts = [1] * len(self.keys)
        self.fold([(i, status, 0, -1, None) for i in range(len(self.keys))])
        return self

    def fold(self, done: Iterable[_Slice]) -> None:
        """Fold ``(key index, status, version, total_len, checksum)`` of finished slices.
        Every key is finalized (result written, per-key callback run) before the batch
        counts it, so the batch callback and the future always see every result."""
        finished = []
        with self.lock:
            for i, st, version, total, csum in done:
                if self.parts[i] <= 0:
                    continue
                if st != Status.OK and self.left[i] == Status.OK:
                    self.left[i] = st
                if st == Status.OK and csum is not None:
                    if self.sums[i] is not None and self.sums[i] != csum \
                            and self.left[i] == Status.OK:
                        self.left[i] = Status.CORRUPT  # slices disagree on the object
                    self.sums[i] = csum
                if version:
                    if self.versions[i] and self.versions[i] != version \
                            and self.left[i] == Status.OK:
                        self.left[i] = Status.CONFLICT
                    self.versions[i] = version
                if total >= 0:
                    self.totals[i] = total
                self.parts[i] -= 1
                if not self.parts[i]:
                    finished.append(i)
        if not finished:
            return
        results, left, finalize = self.results, self.left, self.finalize
        for i in finished:
            results[i] = finalize(i, left[i])
        self.complete(finished)

    def complete(self, finished: list[int]) -> None:
        """Keys ``finished`` (each taken from ``parts`` by this caller, under the lock,
        exactly once) have their results written: run their per-key callbacks, count
        them, and complete the batch after its last key."""
        if self.on_key is not None:
            for i in finished:
                try:
                    self.on_key(i, self.keys[i], self.results[i])
                except Exception:
                    log.exception("per-key callback raised")
        with self.lock:
            self.remaining -= len(finished)
            last = self.remaining == 0
        if last:
            if self.callback is not None:
                try:
                    self.callback(self.results)
                except Exception:
                    log.exception("batch callback raised")
            if self.watcher is not None:
                try:
                    self.watcher(self.results)
                except Exception:
                    log.exception("metrics watcher raised")
            with self.lock:
                self.done = True
                fut = self._future
            if fut is not None:
                fut.set_result(self.results)


class PutBatch(Batch):
    """``put_batch_from``: one Status per key; values larger than ``max_value_bytes``
    are TOO_LARGE without being sent. ``if_absent``: every frame carries ``"ia": 1``
    (each key is published only if the server holds none). ``chain_parent``: the keys
    are consecutive pages of one chain and this is the key before the first (``b""``:
    a head); the sender gives each frame of consecutive keys its ``"ch"``
    (``transports.base.frame_chain``)."""

    __slots__ = ("views", "max_value_bytes")

    def __init__(self, keys: list[bytes], views: list, limits: Limits, deadline: float,
                 sender: Sender, callback: BatchCallback | None,
                 on_key: KeyCallback | None, if_absent: bool = False,
                 chain_parent: bytes | None = None) -> None:
        super().__init__(Op.PUT, keys, deadline, sender, callback, on_key)
        self.views, self.max_value_bytes = views, limits.max_value_bytes
        if if_absent:
            self.flags = {"ia": 1}
        self.chain = chain_parent

    def route(self, owners: list[str], slice_bytes: int) -> Routed:
        routed: Routed = {}
        too_large = []
        parts, step, most = self.parts, slice_bytes, self.max_value_bytes
        item = tuple.__new__  # PutItem(...) without the NamedTuple's Python-level __new__
        for i, (k, v, addr) in enumerate(zip(self.keys, self.views, owners)):
            n = len(v)
            if n > most:
                too_large.append(i)
                continue
            if n <= step:  # checksummed as it is sent (the shm staging copy hashes it)
                parts[i] = 1
                routed.setdefault(addr, []).append(
                    item(PutItem, (k, n, 0, n, 0, v, DIGEST_LATER, i)))
                continue
            c = digest(v)  # the server refuses to publish bytes that hash differently
            pid = int.from_bytes(os.urandom(8), "little") >> 1 or 1
            offs = range(0, n, step)
            parts[i] = len(offs)
            dest = routed.setdefault(addr, [])
            for off in offs:
                ln = min(step, n - off)
                dest.append(PutItem(k, n, off, ln, pid, v[off:off + ln], c, i))
        for i in too_large:
            parts[i] = 1
        self.fold([(i, Status.TOO_LARGE, 0, -1, None) for i in too_large])
        return routed


class KeyBatch(Batch):
    """EXISTS (True per key stored now), DELETE and TOUCH (one Status per key)."""

    __slots__ = ()

    def __init__(self, op: int, keys: list[bytes], deadline: float, sender: Sender,
                 callback: BatchCallback | None, on_key: KeyCallback | None) -> None:
        super().__init__(op, keys, deadline, sender, callback, on_key)
        if op == Op.EXISTS:
            self.results = [False] * len(keys)

    def route(self, owners: list[str], slice_bytes: int) -> Routed:
        routed: Routed = {}
        for i, (k, addr) in enumerate(zip(self.keys, owners)):
            self.parts[i] = 1
            routed.setdefault(addr, []).append(KeyItem(k, i))
        return routed

    def finalize(self, i: int, st: Status) -> Any:
        return st == Status.OK if self.op == Op.EXISTS else st


def slice_status(it: GetItem, r: ItemResult) -> Status:
    """A get slice's status: SIZE_MISMATCH when the bytes that came are not what the
    destination slice at ``it.offset`` of a ``r.total_len`` object should hold."""
    if r.status == Status.OK and it.dest is not None \
            and r.nbytes != min(it.max_len, max(0, r.total_len - it.offset)):
        return Status.SIZE_MISMATCH
    return r.status


def landed_status(checks: Checksums, verify: bool, it: GetItem, r: ItemResult) -> Status:
    """A whole-buffer get item's status from what landed, before the whole-object
    checks: ``slice_status`` at offset 0, and with ``verify`` the hash taken as the bytes
    landed against the server's checksum (a mismatch is counted: CORRUPT)."""
    st = r.status
    if st == _OK:
        if r.nbytes != min(it.max_len, max(0, r.total_len)):
            st = _SIZE_MISMATCH
        elif verify and r.landed is not None and r.landed != r.checksum:
            st = checks.compare(it.key, r.landed, r.checksum)
    return st


def whole_status(checks: Checksums, verify: bool, it: GetItem, r: ItemResult,
                 st: Status) -> Status:
    """The key's result once its one whole-buffer item finished with ``st``
    (``landed_status``): ``finalize``'s rules, the buffer must be the object's size and,
    with ``verify``, bytes not hashed as they landed are hashed now."""
    if st == _OK:
        if r.total_len != it.max_len:
            return _SIZE_MISMATCH
        if verify and r.landed is None:
            return checks.check(it.key, it.dest, r.checksum)
    return st


class IntoBatch(Batch):
    """``get_batch_into``: each object lands in its caller's buffer, which must be
    exactly the object's size (else SIZE_MISMATCH)."""

    __slots__ = ("views", "checks", "verify", "verified", "sliced")

    def __init__(self, keys: list[bytes], views: list, checks: Checksums, deadline: float,
                 sender: Sender, callback: BatchCallback | None,
                 on_key: KeyCallback | None) -> None:
        super().__init__(Op.GET, keys, deadline, sender, callback, on_key)
        self.views, self.checks = views, checks
        self.verify = checks.on
        # keys whose one slice was checked as it landed (``ItemResult.landed``)
        self.verified: list[bool] = [False] * len(keys) if checks.on else []
        self.sliced = False  # some key travels as several slices (``fold_frame``)

    def route(self, owners: list[str], slice_bytes: int) -> Routed:
        routed: Routed = {}
        parts, step = self.parts, slice_bytes
        item = tuple.__new__  # GetItem(...) without the NamedTuple's Python-level __new__
        for i, (k, v, addr) in enumerate(zip(self.keys, self.views, owners)):
            n = len(v)
            dest = routed.get(addr)
            if dest is None:
                dest = routed[addr] = []
            if n <= step:  # one slice: the whole buffer
                parts[i] = 1
                dest.append(item(GetItem, (k, 0, n, 0, v, i)))
                continue
            self.sliced = True
            offs = range(0, n, step)
            parts[i] = len(offs)
            for off in offs:
                ln = min(step, n - off)
                dest.append(GetItem(k, off, ln, 0, v[off:off + ln], i))
        return routed

    def fold_frame(self, work: Work, items: list, results: list[ItemResult]) -> None:
        if not self.sliced:
            self._fold_whole(items, results)
            return
        verified, OK = self.verified, Status.OK
        out = []
        for it, r in zip(items, results):
            st = slice_status(it, r)
            if r.landed is not None and st == OK and verified:
                # the whole object in one slice, hashed as it landed: checked now, so
                # finalize does not read it again
                st = self.checks.compare(it.key, r.landed, r.checksum)
                verified[it.index] = st == OK
            out.append((it.index, st, r.version, r.total_len, r.checksum))
        self.fold(out)

    def _fold_whole(self, items: list, results: list[ItemResult]) -> None:
        """``fold_frame`` when every key of the batch is one slice (its whole buffer):
        each item finishes its key, so its result is computed here at once, exactly as
        ``slice_status`` -> ``fold`` -> ``finalize`` would (same statuses, same checks
        in the same order, same counters), with one lock hold for the frame and no
        per-key tuple or call."""
        checks, verify, parts = self.checks, self.verify, self.parts
        # each item's status before the whole-object checks (no tuple per key)
        pre = [landed_status(checks, verify, it, r) for it, r in zip(items, results)]
        taken = []  # positions in the frame of the items that finish their key
        with self.lock:
            for k, it in enumerate(items):
                i = it.index
                if parts[i] > 0:  # else a duplicate or late answer: ignored, as fold does
                    parts[i] = 0
                    taken.append(k)
        if not taken:
            return
        res = self.results
        for k in taken:
            it = items[k]
            res[it.index] = whole_status(checks, verify, it, results[k], pre[k])
        self.complete([items[k].index for k in taken])

    def finalize(self, i: int, st: Status) -> Status:
        if st == Status.OK and self.totals[i] != len(self.views[i]):
            return Status.SIZE_MISMATCH
        if st == Status.OK and self.checks.on and not self.verified[i]:
            return self.checks.check(self.keys[i], self.views[i], self.sums[i])
        return st


class BytesBatch(Batch):
    """``get_batch``: each object as new bytes, ``None`` for every kind of miss. The
    first slice tells the size; the rest are fetched in parallel from the same server."""

    DEFAULT = None

    __slots__ = ("bufs", "checks", "slice_bytes", "max_value_bytes")

    def __init__(self, keys: list[bytes], checks: Checksums, deadline: float, sender: Sender,
                 callback: BatchCallback | None, on_key: KeyCallback | None,
                 max_value_bytes: int) -> None:
        super().__init__(Op.GET, keys, deadline, sender, callback, on_key)
        self.bufs: list[Any] = [None] * len(keys)
        self.checks = checks
        self.slice_bytes = 0
        self.max_value_bytes = max_value_bytes  # a longer object is TOO_LARGE, never allocated

    def route(self, owners: list[str], slice_bytes: int) -> Routed:
        self.slice_bytes = slice_bytes
        routed: Routed = {}
        for i, (k, addr) in enumerate(zip(self.keys, owners)):
            self.parts[i] = 1
            routed.setdefault(addr, []).append(GetItem(k, 0, slice_bytes, 0, None, i))
        return routed

    def fold_frame(self, work: Work, items: list, results: list[ItemResult]) -> None:
        bulk = []
        for it, r in zip(items, results):
            i = it.index
            if it.dest is None and r.status == Status.OK and self.bufs[i] is None:
                self._first_slice(work, it, r)  # may fan out
            else:
                bulk.append((i, slice_status(it, r), r.version, r.total_len, r.checksum))
        self.fold(bulk)

    def _first_slice(self, work: Work, it: GetItem, r: ItemResult) -> None:
        """The first slice of a byte get: learn the size, fetch the rest in parallel
        from the server that answered."""
        i, step = it.index, self.slice_bytes
        if r.total_len > self.max_value_bytes:  # the server's claim; nothing is allocated
            self.fold(((i, Status.TOO_LARGE, r.version, r.total_len, r.checksum),))
            return
        if r.total_len <= r.nbytes:
            self.bufs[i] = r.data if r.data is not None else bytearray()
        else:
            full = bytearray(r.total_len)
            if r.data is not None:  # a server may send none of it in the first slice
                full[:r.nbytes] = r.data
            self.bufs[i] = full
            view = memoryview(full)
            rest = [GetItem(self.keys[i], off, min(step, r.total_len - off), r.version,
                            view[off:off + min(step, r.total_len - off)], i)
                    for off in range(r.nbytes, r.total_len, step)]
            with self.lock:
                self.parts[i] += len(rest)
            if work.extra is not None and work.extra.get("ho"):  # a previous owner's copy
                self.sender.send(self, {work.address: rest}, flags={"ho": 1})
            else:
                self.sender.send(self, {work.address: rest})
        self.fold(((i, r.status, r.version, r.total_len, r.checksum),))

    def finalize(self, i: int, st: Status) -> bytes | None:
        buf = self.bufs[i]
        if st != Status.OK or buf is None or len(buf) != self.totals[i]:
            return None
        if self.checks.on and self.checks.check(self.keys[i], buf, self.sums[i]) != Status.OK:
            return None
        return bytes(buf)
