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
  reads in parallel (the default just loops over ``pin_read``).
* ``begin_put`` reserves space (evicting if needed) and returns a ``PutSlot``
  whose ``view`` the caller fills (``recv_into``); ``finish_put`` checksums and
  commits, ``abort_put`` releases. ``csum`` is the writer's checksum of the whole
  value: ``finish_put`` refuses the commit (CORRUPT, the chunk freed) when the bytes
  that arrived hash differently. ``holder`` (a ``memory_tier.Holder``, one per
  connection) answers for reservations that may outlive the request (ALLOC slots,
  incomplete sliced puts): they are bounded per holder and released by
  ``release_holder`` when its connection closes. A slot never becomes visible before commit,
  so a reader sees the old object or the new one, never a mix.
* ``exists``/``delete``/``touch`` never block on IO.

The seams behind it: ``eviction.py`` (which objects memory gives up first),
``movement.py`` (what the tiered store's mover may call on memory and on disk,
and the lock order), ``tiering.py`` (promotion and compaction policies).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from gcache.status import Status


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


class Tier(abc.ABC):
    @abc.abstractmethod
    def pin_read(self, ns: bytes, key: bytes, offset: int, max_len: int,
                 expect_version: int) -> Pinned: ...

    def pin_read_many(self, ns: bytes, items: list[tuple[bytes, int, int, int]]
                      ) -> list[Pinned]:
        """``pin_read`` of each ``(key, offset, max_len, expect_version)``, in order."""
        return [self.pin_read(ns, k, off, mx, ev) for k, off, mx, ev in items]

    @abc.abstractmethod
    def unpin(self, pinned: Pinned) -> None: ...

    @abc.abstractmethod
    def begin_put(self, ns: bytes, key: bytes, total_len: int, offset: int, length: int,
                  put_id: int, *, csum: int | None = None, holder: Any = None) -> PutSlot: ...

    @abc.abstractmethod
    def finish_put(self, slot: PutSlot) -> Status: ...

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
