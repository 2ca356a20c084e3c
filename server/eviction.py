"""The eviction policy contract: which resident objects the memory tier gives up first.

Design. Mechanism and policy are apart. The memory tier (``memory_tier.MemoryTier``)
owns the index (a plain dict ``(ns, key) -> object``), the bytes, the pins and the
quotas; a policy owns only the *order* in which resident objects are given up (evicted
to nothing, or handed to the mover for demotion). The tier tells the policy about
every index change and every hit, and asks it for candidates when it needs room. So a
prefix-, session- or frequency-aware policy (S3-FIFO, a learned one) replaces a class,
not the memory tier.

Objects are the tier's own records, seen through ``Resident`` (read-only to the
policy: ``ns``, ``key``, ``length``, ``chunk``, ``version``). They hash and compare
by identity, so a policy can key its own tables by them. A replaced key is two
objects: ``on_remove(old)`` then ``on_insert(new)``.

Primitives (``EvictionPolicy``):

* ``on_insert(obj)`` — ``obj`` became the current object of its key: a put
  committed, a promotion from disk was admitted, or recovery found it after a
  restart (first to give up first: after a clean stop in the order ``candidates()``
  had then, which the memory tier saves in the arena; after a crash by creation time).
* ``on_hit(obj)`` — a read (``pin_read``) or ``touch`` of the current object.
  This is on the per-item GET path: O(1), no allocation beyond the policy's own
  bookkeeping.
* ``on_remove(obj)`` — ``obj`` left the index (deleted, replaced, evicted,
  demoted, dropped as corrupt). Called once per ``on_insert``.
* ``candidates(ns=None)`` — the resident objects, the first to give up first
  (only namespace ``ns``'s when given: a quota eviction must never touch another
  namespace). Lazy, O(1) per object yielded: the tier stops at its first usable
  victim. It skips pinned and claimed objects itself (the policy knows nothing of
  pins), so a policy must not assume the first candidate is taken. The iterator
  is valid only until the next call of any other method: the tier stops
  iterating before it changes the index.

Threads: every method is called with the memory tier's lock held (so never two
at once), from connection threads (``on_hit``, ``on_insert``, ``on_remove``,
``candidates`` for a synchronous eviction) and from the evictor or mover thread.
No method may block, sleep, do IO or take another lock.

Config: ``eviction_policy`` (``gcache.config``) names the policy; ``make_policy``
builds it. Only ``lru`` exists today.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from typing import Iterator, Protocol

from gcache.config import EVICTION_POLICIES
from gcache.errors import ConfigError

__all__ = ["EvictionPolicy", "LRU", "Resident", "make_policy"]


class Resident(Protocol):
    """What a policy may read of a resident object (the memory tier's record)."""

    @property
    def ns(self) -> bytes: ...

    @property
    def key(self) -> bytes: ...

    @property
    def length(self) -> int:
        """Value bytes."""
        ...

    @property
    def chunk(self) -> int:
        """Arena bytes it holds (header and size-class rounding included)."""
        ...

    @property
    def version(self) -> int: ...


class EvictionPolicy(abc.ABC):
    """Orders the memory tier's resident objects for eviction. See the module docstring."""

    name = ""

    @abc.abstractmethod
    def on_insert(self, obj: Resident) -> None:
        """``obj`` became the current object of its key (newest)."""

    @abc.abstractmethod
    def on_hit(self, obj: Resident) -> None:
        """A read or touch of the current object ``obj``."""

    @abc.abstractmethod
    def on_remove(self, obj: Resident) -> None:
        """``obj`` left the index; forget it."""

    @abc.abstractmethod
    def candidates(self, ns: bytes | None = None) -> Iterator[Resident]:
        """Resident objects (of ``ns`` only, when given), the first to give up first."""


class LRU(EvictionPolicy):
    """Least recently used first: one recency list over everyone, and one per namespace
    (kept in step) so a quota eviction takes that namespace's own coldest object in O(1).
    """

    name = "lru"

    def __init__(self) -> None:
        self._all: OrderedDict[Resident, None] = OrderedDict()
        self._by_ns: dict[bytes, OrderedDict[Resident, None]] = {}

    def on_insert(self, obj: Resident) -> None:
        self._all[obj] = None
        ns = self._by_ns.get(obj.ns)
        if ns is None:
            ns = self._by_ns[obj.ns] = OrderedDict()
        ns[obj] = None

    def on_hit(self, obj: Resident) -> None:
        self._all.move_to_end(obj)
        self._by_ns[obj.ns].move_to_end(obj)

    def on_remove(self, obj: Resident) -> None:
        self._all.pop(obj, None)
        ns = self._by_ns.get(obj.ns)
        if ns is not None:
            ns.pop(obj, None)
            if not ns:
                del self._by_ns[obj.ns]

    def candidates(self, ns: bytes | None = None) -> Iterator[Resident]:
        if ns is None:
            return iter(self._all)
        objs = self._by_ns.get(ns)
        return iter(objs) if objs is not None else iter(())

    def __len__(self) -> int:
        return len(self._all)


def make_policy(name: str) -> EvictionPolicy:
    """The policy the ``eviction_policy`` option names; ConfigError for an unknown one."""
    if name == "lru":
        return LRU()
    raise ConfigError(f"unknown eviction_policy {name!r}; use one of "
                      f"{', '.join(EVICTION_POLICIES)}")
