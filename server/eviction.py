"""The eviction policy contract: which resident objects the memory tier gives up first.

Design. Mechanism and policy are apart. The memory tier (``memory_tier.MemoryTier``)
owns the index (a plain dict ``(ns, key) -> object``), the bytes, the pins and the
quotas; a policy owns only the *order* in which resident objects are given up (evicted
to nothing, or handed to the mover for demotion). The tier tells the policy about
every index change and every hit, and asks it for candidates when it needs room. So a
prefix-, session- or frequency-aware policy (S3-FIFO, a learned one) replaces a class,
not the memory tier.

Objects are the tier's own records, seen through ``Resident`` (read-only to the
policy: ``ns``, ``key``, ``length``, ``chunk``, ``version``, ``parent``). They hash and compare
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
* ``saved_order()`` — every resident object, in the order the memory tier saves
  across a restart (recovery calls ``on_insert`` in it): first to give up first,
  WITHOUT changing the policy's state (the tier calls it every
  ``recency_snapshot_ms``). Not abstract: ``candidates()`` by default, which is right
  for a policy whose ``candidates()`` is a plain read; one whose walk changes state
  (``s3fifo``) overrides it.

The disk tier (``disk.log.SegmentLog``) keeps a policy of its own, built from the same
name, over its live records (``chunk``: the record's bytes); its compaction
(``tiering.PolicyOrder``) and quota evictions give records up in that order.

Threads: every method is called with its tier's lock held (the memory tier's, or the
segment log's for the disk's policy; so never two at once), from connection threads
(``on_hit``, ``on_insert``, ``on_remove``, ``candidates`` for a synchronous eviction)
and from the evictor or mover thread. No method may block, sleep, do IO or take
another lock.

Config: ``eviction_policy`` (``gcache.config``) names the policy; ``make_policy``
builds it:

* ``lru`` (the default): least recently used first.
* ``reuse``: objects nobody asked for again since they entered go first (LRU among
  them), then the reused ones (LRU); a bounded ghost of keys that left the index lets
  a re-put of a known key count as a reuse.
* ``s3fifo``: S3-FIFO (small FIFO, main FIFO, ghost); its ``candidates()`` walk moves
  objects between its queues as it goes (that is the algorithm), so a full listing
  (``MemoryTier.keys``) changes its order a little.
* ``chains``: ``reuse``'s two classes, with the fresh class split by the length of
  the object's chain (the writer's parent key on put, ``Resident.parent``; short
  chains first), and every victim replaced by a resident tail of its chain (see
  ``Chains``).

Measured on the Mooncake FAST'25 synthetic trace (``gcache-bench trace``,
``bench.trace_sim``): ``reuse`` closes 4-12 % of the LRU -> Belady gap at 5-20 %
capacity, ``s3fifo`` 1-12 %, ``chains`` 7-19 %; LRU stays the default.
"""

from __future__ import annotations

import abc
import bisect
import itertools
from collections import OrderedDict
from typing import Iterator, Protocol

import xxhash

from gcache.config import EVICTION_POLICIES
from gcache.errors import ConfigError

__all__ = ["Chains", "EvictionPolicy", "LRU", "Resident", "Reuse", "S3FIFO", "make_policy"]


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

    @property
    def parent(self) -> bytes | None:
        """The key of the page before this one in its chain, as its writer said on put
        (``b""``: the head of a chain; None: unknown, e.g. after a restart or from a
        writer that sent no chain). Not persisted."""
        ...


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

    def saved_order(self) -> Iterator[Resident]:
        """Every resident object, first to give up first, without changing any state
        (what a restart rebuilds; see the module docstring)."""
        return self.candidates()


class _Orders:
    """Recency lists kept in step over everyone and per namespace (LRU's two orders)."""

    __slots__ = ("all", "by_ns")

    def __init__(self) -> None:
        self.all: OrderedDict[Resident, None] = OrderedDict()
        self.by_ns: dict[bytes, OrderedDict[Resident, None]] = {}

    def add(self, obj: Resident) -> None:
        self.all[obj] = None
        ns = self.by_ns.get(obj.ns)
        if ns is None:
            ns = self.by_ns[obj.ns] = OrderedDict()
        ns[obj] = None

    def to_end(self, obj: Resident) -> None:
        self.all.move_to_end(obj)
        self.by_ns[obj.ns].move_to_end(obj)

    def discard(self, obj: Resident) -> bool:
        """Forget ``obj``; False if it was not here."""
        if obj not in self.all:
            return False
        del self.all[obj]
        ns = self.by_ns[obj.ns]
        del ns[obj]
        if not ns:
            del self.by_ns[obj.ns]
        return True

    def of(self, ns: bytes | None = None) -> Iterator[Resident]:
        if ns is None:
            return iter(self.all)
        objs = self.by_ns.get(ns)
        return iter(objs) if objs is not None else iter(())


class LRU(_Orders, EvictionPolicy):
    """Least recently used first: one recency list over everyone, and one per namespace
    (kept in step) so a quota eviction takes that namespace's own coldest object in O(1).
    """

    name = "lru"
    __slots__ = ()

    on_insert = _Orders.add
    on_hit = _Orders.to_end
    candidates = _Orders.of

    def on_remove(self, obj: Resident) -> None:
        self.discard(obj)

    def __len__(self) -> int:
        return len(self.all)


_ABSENT = object()


class _Ghost:
    """Bounded memory of keys that left the index (xxh3_64 of ns and key, 8 bytes each):
    how a policy knows that a put brings back a key it held before (a re-put after a
    miss, or after an eviction). Oldest forgotten first, past ``max(minimum, 2 x the
    most objects ever resident)`` entries."""

    __slots__ = ("_keys", "_minimum", "_peak")

    def __init__(self, minimum: int = 4096) -> None:
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._minimum = minimum
        self._peak = 0

    @staticmethod
    def name(obj: Resident) -> int:
        return xxhash.xxh3_64_intdigest(obj.key, seed=xxhash.xxh3_64_intdigest(obj.ns))

    def remember(self, obj: Resident, resident: int) -> None:
        self._peak = max(self._peak, resident)
        keys = self._keys
        keys[self.name(obj)] = None
        limit = max(self._minimum, 2 * self._peak)
        while len(keys) > limit:
            keys.popitem(last=False)

    def recall(self, obj: Resident) -> bool:
        """Whether ``obj``'s key left the index lately (and forget it: it is back)."""
        return self._keys.pop(self.name(obj), _ABSENT) is not _ABSENT

    def __len__(self) -> int:
        return len(self._keys)


class Reuse(EvictionPolicy):
    """Pages never used again go first: two recency classes, evicted in strict order.

    ``fresh``: objects not read since they entered the index, and whose key the store
    has not held before (``_Ghost``). ``reused``: objects read at least once, or put
    again for a key that left the index lately (a re-put after a prefix miss or an
    eviction: the key was asked for again). Every fresh object goes before any
    reused one; each class is least recently used first. A KV page that nobody asked
    for again (most pages of a Mooncake trace are used once) never pushes out one
    that was shared (a system prompt, an earlier turn). Per namespace the same two
    classes, for quota evictions.
    """

    name = "reuse"

    def __init__(self) -> None:
        self._fresh = _Orders()
        self._reused = _Orders()
        self._ghost = _Ghost()
        self._n = 0

    def on_insert(self, obj: Resident) -> None:
        self._n += 1
        (self._reused if self._ghost.recall(obj) else self._fresh).add(obj)

    def on_hit(self, obj: Resident) -> None:
        if self._fresh.discard(obj):
            self._reused.add(obj)
        else:
            self._reused.to_end(obj)

    def on_remove(self, obj: Resident) -> None:
        if not self._fresh.discard(obj) and not self._reused.discard(obj):
            return
        self._n -= 1
        self._ghost.remember(obj, self._n + 1)

    def candidates(self, ns: bytes | None = None) -> Iterator[Resident]:
        return itertools.chain(self._fresh.of(ns), self._reused.of(ns))

    def __len__(self) -> int:
        return self._n


class S3FIFO(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO for new objects, a main FIFO, and a
    ghost of keys that left.

    A new object enters ``small`` (``main`` if its key is in the ghost: it came back).
    A hit only counts (``freq``, at most 3); nothing moves on the GET path. Eviction
    walks ``small`` while it holds more than ``small_fraction`` of the resident bytes
    (or ``main`` is empty): an object read while there moves to ``main``, else it is
    the candidate. Then ``main``: an object with ``freq > 0`` loses one and goes to
    the back, else it is the candidate. A candidate the tier skips (pinned) goes to
    the back of its queue, so the walk ends after every object was offered once.
    Every key that leaves enters the ghost (so a re-put of a key goes to ``main``).
    Quota evictions (``candidates(ns)``) take the namespace's objects oldest first.
    """

    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1) -> None:
        if not 0 < small_fraction < 1:
            raise ConfigError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        self._small: OrderedDict[Resident, None] = OrderedDict()
        self._main: OrderedDict[Resident, None] = OrderedDict()
        self._freq: dict[Resident, int] = {}
        self._by_ns: dict[bytes, OrderedDict[Resident, None]] = {}
        self._small_bytes = 0
        self._bytes = 0
        self._ghost = _Ghost()

    def on_insert(self, obj: Resident) -> None:
        self._freq[obj] = 0
        self._bytes += obj.chunk
        if self._ghost.recall(obj):
            self._main[obj] = None
        else:
            self._small[obj] = None
            self._small_bytes += obj.chunk
        ns = self._by_ns.get(obj.ns)
        if ns is None:
            ns = self._by_ns[obj.ns] = OrderedDict()
        ns[obj] = None

    def on_hit(self, obj: Resident) -> None:
        f = self._freq[obj]
        if f < 3:
            self._freq[obj] = f + 1

    def on_remove(self, obj: Resident) -> None:
        if self._freq.pop(obj, None) is None:
            return
        self._bytes -= obj.chunk
        if self._small.pop(obj, _ABSENT) is not _ABSENT:
            self._small_bytes -= obj.chunk
        else:
            del self._main[obj]
        ns = self._by_ns[obj.ns]
        del ns[obj]
        if not ns:
            del self._by_ns[obj.ns]
        self._ghost.remember(obj, len(self._freq) + 1)

    def candidates(self, ns: bytes | None = None) -> Iterator[Resident]:
        if ns is not None:
            objs = self._by_ns.get(ns)
            return iter(objs) if objs is not None else iter(())
        return self._walk()

    def saved_order(self) -> Iterator[Resident]:
        """Small's FIFO, then main's: no walk (a walk spends every ``freq``)."""
        return itertools.chain(self._small, self._main)

    def _walk(self) -> Iterator[Resident]:
        small, main, freq = self._small, self._main, self._freq
        seen: set[Resident] = set()  # offered and skipped: at the back of their queue
        seen_small = seen_main = 0
        while True:
            small_left, main_left = len(small) > seen_small, len(main) > seen_main
            if not (small_left or main_left):
                return
            if small_left and (not main_left
                               or self._small_bytes > self.small_fraction * self._bytes):
                obj = next(iter(small))
                if obj in seen:
                    small.move_to_end(obj)
                    continue
                if freq[obj] > 0:  # read while new: it earned main
                    del small[obj]
                    self._small_bytes -= obj.chunk
                    freq[obj] = 0
                    main[obj] = None
                    continue
                seen_small += 1
                queue = small
            else:
                obj = next(iter(main))
                if obj in seen:
                    main.move_to_end(obj)
                    continue
                if freq[obj] > 0:  # read since its last round: one more round
                    freq[obj] -= 1
                    main.move_to_end(obj)
                    continue
                seen_main += 1
                queue = main
            seen.add(obj)
            yield obj
            queue.move_to_end(obj)  # still here: the tier skipped it (pinned, moving)

    def __len__(self) -> int:
        return len(self._freq)


class _Chain:
    """What the members of one chain share: its length (the deepest member ever
    inserted + 1). A piece that was put before the page it hangs from (frames of one
    batch commit in parallel) is merged into that page's chain when it comes: ``into``
    that chain, its members ``offset`` deeper (union-find; ``_resolve``). Dies with its
    last resident member (only members, and pieces merged into it, refer to it)."""

    __slots__ = ("length", "into", "offset")

    def __init__(self) -> None:
        self.length = 1
        self.into: _Chain | None = None
        self.offset = 0


class _Node:
    """A resident object's place: its class, its chain (None: unknown), its depth in it
    and the ``(ns, parent key)`` it hangs from (None: a head, or unknown)."""

    __slots__ = ("cls", "chain", "depth", "up")

    def __init__(self, cls: int, chain: _Chain | None, depth: int,
                 up: tuple[bytes, bytes] | None) -> None:
        self.cls, self.chain, self.depth, self.up = cls, chain, depth, up


_MAX_TAIL_STEPS = 1024  # a tail walk's bound (keys may form cycles: re-puts with parents)


def _resolve(n: _Node) -> _Chain | None:
    """``n``'s chain after merges (and ``n`` re-pointed at it, its depth made absolute)."""
    c = n.chain
    if c is None or c.into is None:
        return c
    d = 0
    while c.into is not None:
        d += c.offset
        c = c.into
    n.chain, n.depth = c, n.depth + d
    return c


class Chains(EvictionPolicy):
    """``reuse`` with chain structure: short new chains first, and tails before heads.

    The writer names each page's parent on put (``Resident.parent``: the wire's
    ``"ch"``, which the SGLang plugin sends). A page whose parent is resident joins the
    parent's chain one deeper; the chain's length is its deepest member's depth + 1.
    One whose parent is not resident heads a new piece, which joins the parent's chain
    if the parent comes later (the frames of one batch commit in parallel, so a
    chain's later pages can arrive first).

    Classes, given up in this order, each least recently used first:

    * fresh (not read since it entered, key not in the ghost, as in ``reuse``), split by
      its chain's length: < 10, 10-29, 30-59, >= 60 pages (``bounds``). On the Mooncake
      trace a new chain of < 10 pages comes back with probability 0.05, one of 50+
      pages with 0.5-0.9. A chain grows after its pages entered: a fresh class's
      first object whose chain has grown past it moves to its new class (at the end)
      when ``candidates()`` starts, so each object moves at most ``len(bounds)`` times.
      A fresh object of unknown chain (no parent sent, or recovered after a restart)
      goes to the last fresh class: with no chains at all this is ``reuse``'s order.
    * reused: read at least once, or re-put while its key was in the ghost.

    Tail-first: a candidate is replaced by a resident leaf of its subtree (first
    child at each level; ``_kids`` holds the resident children of each ``(ns, key)``),
    so a chain is given up from its tail: evicting a middle page would make every later
    page of its chain unreachable under prefix lookup. A walk is bounded
    (``_MAX_TAIL_STEPS``; cycles are possible) and resumes from where the previous
    one ended when it starts from the same candidate (a chain evicted tail to head costs
    O(1) per victim, not O(length)). Each object is offered at most once per walk: tails
    first, then any object not offered yet, so a walk over pinned objects ends.

    State per resident object: one ``_Node``, an entry in ``_res`` and in its parent's
    ``_kids``; it all goes with ``on_remove``. Quota walks (``candidates(ns)``) use the
    namespace's own orders and do not reclass.
    """

    name = "chains"

    def __init__(self, bounds: tuple[int, ...] = (10, 30, 60)) -> None:
        if list(bounds) != sorted(set(bounds)) or (bounds and bounds[0] < 1):
            raise ConfigError(f"bounds must be increasing positive lengths, got {bounds}")
        self.bounds = tuple(bounds)
        self._fresh_n = len(bounds) + 1
        self._reused = self._fresh_n  # the reused class: after every fresh one
        self._classes = [_Orders() for _ in range(self._fresh_n + 1)]
        self._node: dict[Resident, _Node] = {}
        self._res: dict[tuple[bytes, bytes], Resident] = {}  # (ns, key) -> current object
        self._kids: dict[tuple[bytes, bytes], dict[Resident, None]] = {}
        self._ghost = _Ghost()
        self._hint: tuple[Resident, Resident] | None = None  # (walk start, node before tail)

    def on_insert(self, obj: Resident) -> None:
        ns, parent = obj.ns, obj.parent
        k = (ns, obj.key)
        self._res[k] = obj
        chain: _Chain | None = None
        depth, up = 0, None
        if parent is not None:
            if parent and parent != obj.key:
                up = (ns, parent)
                kids = self._kids.get(up)
                if kids is None:
                    kids = self._kids[up] = {}
                kids[obj] = None
                p = self._res.get(up)
                pn = self._node.get(p) if p is not None else None
                if pn is not None and _resolve(pn) is not None:
                    chain, depth = pn.chain, pn.depth + 1
                    if chain.length <= depth:  # type: ignore[union-attr]
                        chain.length = depth + 1  # type: ignore[union-attr]
            if chain is None:
                chain = _Chain()
            kids = self._kids.get(k)
            if kids:  # pieces put before this page, their heads hanging from it: merge
                self._adopt(kids, chain, depth)
        if self._ghost.recall(obj):
            cls = self._reused
        elif chain is None:
            cls = self._fresh_n - 1
        else:
            cls = bisect.bisect_right(self.bounds, chain.length)
        self._node[obj] = _Node(cls, chain, depth, up)
        self._classes[cls].add(obj)

    def _adopt(self, kids: dict[Resident, None], chain: _Chain, depth: int) -> None:
        node = self._node
        for c in kids:
            cn = node[c]
            piece = _resolve(cn)
            if piece is None or piece is chain or cn.depth:
                continue
            piece.into, piece.offset = chain, depth + 1
            if chain.length < depth + 1 + piece.length:
                chain.length = depth + 1 + piece.length

    def on_hit(self, obj: Resident) -> None:
        n = self._node[obj]
        if n.cls == self._reused:
            self._classes[n.cls].to_end(obj)
        else:
            self._classes[n.cls].discard(obj)
            n.cls = self._reused
            self._classes[n.cls].add(obj)

    def on_remove(self, obj: Resident) -> None:
        n = self._node.pop(obj, None)
        if n is None:
            return
        self._classes[n.cls].discard(obj)
        k = (obj.ns, obj.key)
        if self._res.get(k) is obj:
            del self._res[k]
        if n.up is not None:
            kids = self._kids[n.up]
            del kids[obj]
            if not kids:
                del self._kids[n.up]
        self._ghost.remember(obj, len(self._node) + 1)

    def candidates(self, ns: bytes | None = None) -> Iterator[Resident]:
        if ns is None:
            self._reclass_fronts()
        return self._walk(ns)

    def saved_order(self) -> Iterator[Resident]:
        """Class order, no tails and no reclassing (a restart forgets chains anyway)."""
        return itertools.chain.from_iterable(c.all for c in self._classes)

    def _reclass_fronts(self) -> None:
        bounds, node, classes = self.bounds, self._node, self._classes
        for c in range(self._fresh_n - 1):  # the last fresh class has nowhere to go
            orders = classes[c]
            while orders.all:
                o = next(iter(orders.all))
                n = node[o]
                nc = bisect.bisect_right(bounds, _resolve(n).length)  # type: ignore[union-attr]
                if nc == c:
                    break
                orders.discard(o)
                n.cls = nc
                classes[nc].add(o)

    def _tail(self, v: Resident) -> Resident:
        """A resident leaf of ``v``'s subtree (``v`` itself if it has no resident child)."""
        start = v
        hint = self._hint
        if hint is not None and hint[0] is v and hint[1] in self._node:
            start = hint[1]
        kids, before, t = self._kids, start, start
        for _ in range(_MAX_TAIL_STEPS):
            below = kids.get((t.ns, t.key))
            if not below:
                break
            before, t = t, next(iter(below))
        self._hint = (v, before)
        return t

    def _walk(self, ns: bytes | None) -> Iterator[Resident]:
        offered: set[Resident] = set()
        for c in self._classes:
            for v in c.of(ns):
                t = self._tail(v)
                if t not in offered:
                    offered.add(t)
                    yield t
        for c in self._classes:  # whatever no tail walk reached (skipped tails above it)
            for v in c.of(ns):
                if v not in offered:
                    offered.add(v)
                    yield v

    def state_entries(self) -> int:
        """Entries of per-object state (nodes, the key map, children lists): it all goes
        with the objects (0 when none is resident)."""
        return len(self._node) + len(self._res) + len(self._kids)

    def __len__(self) -> int:
        return len(self._node)


_POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, Reuse, S3FIFO, Chains)}


def make_policy(name: str) -> EvictionPolicy:
    """The policy the ``eviction_policy`` option names; ConfigError for an unknown one."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown eviction_policy {name!r}; use one of "
                          f"{', '.join(EVICTION_POLICIES)}")
    return cls()
