"""The Tier contract: what the server's IO threads need from a storage tier.

The memory tier (``memory_tier.MemoryTier``) implements it; with a disk tier the
service talks to ``tiered_store.TieredStore`` (memory in front of the NVMe
segment log), which implements the same methods.

Threads: every method is called from the server's connection threads, many at
once, and from the background evictor thread. Methods take the tier's own lock
for bookkeeping only; data is copied *outside* the lock, protected by pins:

* ``pin_read`` returns a ``Pinned`` read lease; eviction, delete and replace
  never free those bytes until ``unpin``. The memory tier never blocks on IO;
  a disk-tier hit reads (and verifies) the record before it returns.
  ``pin_read_many`` pins a whole GET frame's items; a tier may run their disk
  reads in parallel, and takes its lock once per frame, not once per item (the
  default just loops over ``pin_read``); ``unpin_many`` releases a frame's leases
  the same way. ``pin_read_stream`` is the same with the pins handed out in order as
  soon as a prefix of them is pinned (``ready(end, pins)`` on the calling thread), so a
  streamed GET reply (``"sr": 1``) sends the first items while later ones are read.
* ``begin_put`` reserves space (evicting if needed) and returns a ``PutSlot``
  whose ``view`` the caller fills (``recv_into``); ``finish_put`` checksums and
  commits, ``abort_put`` releases. ``csum`` is the writer's checksum of the whole
  value: ``finish_put`` refuses the commit (CORRUPT, the chunk freed) when the bytes
  that arrived hash differently. ``holder`` (a ``memory_tier.Holder``, one per
  connection) answers for reservations that may outlive the request (ALLOC slots,
  incomplete sliced puts): they are bounded per holder and released by
  ``release_holder`` when its connection closes. A slot never becomes visible before commit,
  so a reader sees the old object or the new one, never a mix.
  ``finish_put(slot, if_absent=True)`` (the ``"ia"`` put flag) publishes only if the
  key has no current object in either tier at that moment, checked under the memory
  lock in the same step as the publish; otherwise the bytes are dropped, the answer
  is still OK (a value is there) and ``put_if_absent_skipped`` counts it.
* ``exists``/``delete``/``touch`` never block on IO.
* Handoff (the server's handoff worker thread, while connection threads serve):
  ``held()`` iterates ``HeldObject``s, the committed objects of both tiers. It is a
  snapshot taken in chunks: one C-level copy of the key list under the lock, then
  ``HELD_CHUNK`` keys at a time re-read under it (the lock is never held for the walk,
  and nothing blocks on IO). An object put after the walk started may be missed; one
  deleted meanwhile is not yielded (unless its chunk was read before). A key held in
  both tiers (a clean disk copy) is yielded once. ``delete_if_version`` deletes a key
  only while its current object is ``version`` (both tiers, one step under the memory
  lock), so a newer put is never lost; it never blocks on IO beyond the disk's death
  record.
* Placement hashes. ``begin_put(..., ph=)`` keeps the ring position the writer routed
  the key by (the ``ph`` a master-routed client sends per item: its group's hash for a
  ``group=`` key) with the object, in both tiers and across restarts, demotion and
  promotion; ``held()`` yields it (``HeldObject.ph``; None when the writer sent none:
  the object is placed by ``placement_hash(ns, key)``), so the handoff moves each
  object to the owner its readers ask.
* Chain parents. ``begin_put(..., parent=)``: the key of the page before this one in
  its chain (from the frame's ``"ch"``, ``protocol.chain_parents``), kept with the memory
  object for its eviction policy (``eviction.Resident.parent``); never persisted, not
  carried to disk or by promotion or the handoff (None there: unknown).

The seams behind it: ``eviction.py`` (which objects memory gives up first),
``movement.py`` (what the tiered store's mover may call on memory and on disk,
and the lock order), ``tiering.py`` (promotion and compaction policies).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

from gcache.status import Status

HELD_CHUNK = 1024  # keys re-read per lock hold by ``held()``


@dataclass(slots=True)
class Pinned:
    """A read lease on ``view`` (object bytes ``[offset, offset+len(view))``)."""

    status: Status
    total_len: int = 0
    version: int = 0
    view: memoryview | None = None
    token: Any = None  # tier-private handle passed back to unpin
    checksum: int = 0  # xxh3_64 of the whole object (sent to readers, who verify it)


@dataclass(slots=True)
class PutSlot:
    """A reserved, uncommitted destination for (part of) one object."""

    status: Status
    view: memoryview | None = None
    token: Any = None
    extra: dict = field(default_factory=dict)


class PutRequest(NamedTuple):
    """One item of ``Tier.begin_puts``: ``begin_put``'s arguments after the namespace."""

    key: bytes
    total_len: int
    offset: int
    length: int
    put_id: int
    csum: int | None = None
    holder: Any = None
    ph: int | None = None
    parent: bytes | None = None


class HeldObject(NamedTuple):
    """One committed object, as ``Tier.held()`` saw it."""

    ns: bytes
    key: bytes
    length: int  # value bytes
    version: int
    ph: int | None = None  # the placement hash it was put with (None: placed by its key)


def abort_slots(tier: Tier, slots: list[PutSlot]) -> None:
    """``abort_put`` of each reserved (OK) slot: a frame that failed before finishing."""
    for s in slots:
        if s.status == Status.OK:
            tier.abort_put(s)


def held_snapshot(lock: Any, index: dict, row: Callable[[Any, Any], HeldObject | None],
                  chunk: int = HELD_CHUNK) -> Iterator[HeldObject]:
    """Walk ``index`` (guarded by ``lock``) in chunks: copy its keys under the lock
    once, then re-read ``chunk`` keys per lock hold; ``row(key, value)`` makes the record
    (None: skip it). The generator holds no lock between the records it yields."""
    with lock:
        keys = list(index)
    for a in range(0, len(keys), chunk):
        with lock:
            rows = [row(k, v) for k in keys[a:a + chunk] if (v := index.get(k)) is not None]
        for r in rows:
            if r is not None:
                yield r


class Tier(abc.ABC):
    @abc.abstractmethod
    def pin_read(self, ns: bytes, key: bytes, offset: int, max_len: int,
                 expect_version: int) -> Pinned: ...

    def pin_read_many(self, ns: bytes, items: list[tuple[bytes, int, int, int]]
                      ) -> list[Pinned]:
        """``pin_read`` of each ``(key, offset, max_len, expect_version)``, in order."""
        return [self.pin_read(ns, k, off, mx, ev) for k, off, mx, ev in items]

    def pin_read_stream(self, ns: bytes, items: list[tuple[bytes, int, int, int]],
                        ready: Callable[[int, list[Pinned]], None]) -> list[Pinned]:
        """``pin_read_many`` that hands its pins out in item order as soon as they are
        pinned: ``ready(end, pins)`` runs on the calling thread each time ``pins[:end]``
        grew (``end`` rises strictly, the last call has ``end == len(items)``; no call for
        no items). It may block (it sends). Returns every pin, for ``unpin_many``. If
        ``ready`` raises, every pin is released before the exception propagates.
        The default pins all items first (one ``ready`` call)."""
        pins = self.pin_read_many(ns, items)
        if pins:
            try:
                ready(len(pins), pins)
            except BaseException:
                self.unpin_many(pins)
                raise
        return pins

    @abc.abstractmethod
    def unpin(self, pinned: Pinned) -> None: ...

    def unpin_many(self, pins: list[Pinned]) -> None:
        """``unpin`` of each lease of one frame (a tier may take its lock once for all)."""
        for p in pins:
            self.unpin(p)

    @abc.abstractmethod
    def begin_put(self, ns: bytes, key: bytes, total_len: int, offset: int, length: int,
                  put_id: int, *, csum: int | None = None, holder: Any = None,
                  ph: int | None = None, parent: bytes | None = None) -> PutSlot: ...

    @abc.abstractmethod
    def finish_put(self, slot: PutSlot, *, if_absent: bool = False,
                   digest: int | None = None) -> Status:
        """Commit (see the module docstring; ``if_absent``: only if the key is absent;
        ``digest``: the caller's xxh3_64 of the slot's bytes, read from the slot's own
        view after they landed, when the slot is the whole value: not hashed again)."""

    def begin_puts(self, ns: bytes, reqs: list[PutRequest]) -> list[PutSlot]:
        """``begin_put`` of each request of one frame, in order (a tier may take its lock
        once for many)."""
        return self.begin_rest(ns, reqs, [])

    def begin_rest(self, ns: bytes, reqs: list[PutRequest], slots: list[PutSlot]
                   ) -> list[PutSlot]:
        """``slots`` (those of a prefix of ``reqs``, begun already) extended with a
        ``begin_put`` of each request after them, one by one; if one raises, every
        reserved slot is aborted first."""
        try:
            for r in reqs[len(slots):]:
                slots.append(self.begin_put(ns, r.key, r.total_len, r.offset, r.length,
                                            r.put_id, csum=r.csum, holder=r.holder, ph=r.ph,
                                            parent=r.parent))
        except BaseException:
            abort_slots(self, slots)
            raise
        return slots

    def finish_puts(self, slots: list[PutSlot], *, if_absent: bool = False,
                    digests: list[int | None] | None = None) -> list[Status]:
        """``finish_put`` of each slot (``digests[i]`` for ``slots[i]``), in order."""
        ds = digests if digests is not None else [None] * len(slots)
        return [self.finish_put(s, if_absent=if_absent, digest=d) for s, d in zip(slots, ds)]

    @abc.abstractmethod
    def abort_put(self, slot: PutSlot, quarantine: Any = None) -> None: ...

    @abc.abstractmethod
    def release_holder(self, holder: Any) -> None:
        """``holder``'s connection closed: drop what it still holds (see MemoryTier)."""

    @abc.abstractmethod
    def exists(self, ns: bytes, key: bytes) -> bool: ...

    @abc.abstractmethod
    def delete(self, ns: bytes, key: bytes) -> bool: ...

    @abc.abstractmethod
    def touch(self, ns: bytes, key: bytes) -> bool: ...

    @abc.abstractmethod
    def delete_if_version(self, ns: bytes, key: bytes, version: int) -> bool:
        """Delete ``key`` only if its current object is ``version`` (True if deleted).
        Handoff worker or connection threads; never blocks on IO."""

    @abc.abstractmethod
    def held(self) -> Iterator[HeldObject]:
        """The committed objects of every tier, a chunked snapshot (module docstring).
        Handoff worker thread, safe while serving; never blocks on IO."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int | float]: ...

    def namespace_usage(self) -> dict[bytes, tuple[int, int]]:
        """``(memory bytes, disk bytes)`` held per namespace (quota accounting)."""
        return {}

    def namespace_stats(self, quotas: Any, top: int = 64) -> dict[str, dict[str, int]]:
        """The ``top`` namespaces holding the most bytes: used bytes per tier and their
        quota (-1: unlimited), keyed by namespace (STATS)."""
        usage = self.namespace_usage()
        out: dict[str, dict[str, int]] = {}
        for ns in sorted(usage, key=lambda n: -sum(usage[n]))[:top]:
            mem, disk = usage[ns]
            lim = quotas.limits(ns) if quotas is not None else None
            out[ns.decode("utf-8", "replace")] = {
                "memory_used_bytes": mem, "disk_used_bytes": disk,
                "memory_quota_bytes": -1 if lim is None or lim.memory_bytes is None
                else lim.memory_bytes,
                "disk_quota_bytes": -1 if lim is None or lim.disk_bytes is None
                else lim.disk_bytes}
        return out

    @abc.abstractmethod
    def close(self, clean: bool = True) -> None: ...
