"""Online miss-ratio curve: what more (or less) memory would buy, per namespace.

Design. A sampled ghost cache (SHARDS, Waldspurger et al., FAST'15) replays the
memory tier's accesses against simulated LRU caches of ``factor x capacity`` for each
factor (0.5, 1, 2, 4, 8 by default) and counts, per namespace, the GETs each would have
served. Spatial sampling: a key is tracked iff ``xxh3(key) mod P < T`` (``P = 2**24``),
so the sampled keys see *every* access of theirs, and their ghost caches are scaled by
the sampling rate ``R = T / P`` (a cache of ``f x capacity x R`` bytes over the sampled
keys behaves like one of ``f x capacity`` over all of them). Fixed-size SHARDS: when more
than ``tracked_keys`` keys sit in the ghost, the threshold is lowered to the largest
tracked hash and that key dropped, so memory stays bounded whatever the key count, and
``R`` settles where ``tracked_keys`` keys span the largest factor. Each sampled access
counts ``1 / R`` so a rate change does not skew the ratios.

Ghost: one LRU stack cut into one band per factor (an ``OrderedDict`` each; band ``i``
holds the keys at byte stack distance ``(cap[i-1], cap[i]]``). Byte LRU caches of
growing size hold growing prefixes of one recency stack (inclusion), so a key in band
``b`` is a hit at every factor ``>= b``: one access is one lookup, one move to the top
and a cascade of at most one spill per band (amortized), O(number of factors).
A key that falls off the last band is forgotten (a miss at every factor).

Model. A GET refreshes its key (it moves to the top of the stack), hit or miss: a missed
page is put (or promoted from disk) right after, as an L3 KV cache does. A key the ghost
does not know is sized by its namespace's mean put size until its put says; a put
refreshes and resizes its key without counting. Only whole-object reads count (a GET at
offset 0: one per sliced read). Deletes are not seen (they are rare for KV pages, and a
deleted key's next GET is then counted as the ghost's hit). The curve is cumulative
since the server started.

Estimates. ``snapshot()['namespaces'][ns]``: ``gets`` (estimated GETs counted),
``hit_ratio`` and ``byte_hit_ratio`` (one per factor), and ``actual_hit_ratio`` (what the
memory tier really served for the same sampled GETs: compare it with factor 1).
Namespace ``"*"`` is every namespace together; past ``max_namespaces`` the rest count
as ``"other"``.

Threads. ``on_get`` and ``on_put`` are called by the memory tier (``memory_tier``),
from connection threads, usually with the tier's lock held. They never block, sleep or
do IO: an unsampled key costs one xxh3 of the key and a compare (O(1), no lock); a
sampled one takes this object's own lock (innermost: nothing is called while it is held)
for O(number of factors) work, amortized O(log n) for a threshold change. ``snapshot``
may be called from any thread (heartbeats, scrapes, STATS); it takes the same lock for
O(namespaces x factors).
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from typing import Protocol

import xxhash

from gcache.errors import ConfigError

__all__ = ["AccessObserver", "FACTORS", "MissRatioCurve", "SAMPLE_MODULUS"]

#: Capacity factors the curve is estimated at (multiples of the memory tier's capacity).
FACTORS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
#: ``P`` of the spatial sampling: a key is tracked iff ``hash mod P < threshold``.
SAMPLE_MODULUS = 1 << 24
_MASK = SAMPLE_MODULUS - 1
ALL = "*"
OTHER = "other"


class AccessObserver(Protocol):
    """What the memory tier tells about accesses (``MemoryTier(access_observer=)``).

    Both are called with the tier's lock held, from connection threads: they must not
    block, do IO or take a lock that is ever held while calling out.
    """

    def on_get(self, ns: bytes, key: bytes, length: int | None) -> None:
        """A whole-object read (offset 0): ``length`` if memory served it, None on a miss."""

    def on_put(self, ns: bytes, key: bytes, length: int) -> None:
        """A put of ``length`` value bytes became the current object of ``(ns, key)``."""


class _Counts:
    """Weighted counts of one namespace: gets, hits per factor, and their bytes."""

    __slots__ = ("gets", "get_bytes", "hits", "hit_bytes", "served", "puts", "put_bytes")

    def __init__(self, n: int) -> None:
        self.gets = self.get_bytes = self.served = 0.0
        self.puts = self.put_bytes = 0.0
        self.hits = [0.0] * n
        self.hit_bytes = [0.0] * n

    def mean_size(self) -> float:
        return self.put_bytes / self.puts if self.puts else 0.0

    def doc(self) -> dict:
        g, gb = self.gets, self.get_bytes
        return {"gets": round(g),
                "hit_ratio": [round(h / g, 4) if g else 0.0 for h in self.hits],
                "byte_hit_ratio": [round(h / gb, 4) if gb else 0.0 for h in self.hit_bytes],
                "actual_hit_ratio": round(self.served / g, 4) if g else 0.0}


class MissRatioCurve:
    """The sampled ghost cache of one memory tier (see the module docstring).

    ``capacity_bytes``: the memory tier's capacity (factor 1). ``tracked_keys``: most keys
    the ghost holds (memory is O(tracked_keys + max_namespaces x factors)).
    ``sample_rate``: the starting rate (1.0: every key until the ghost fills).
    """

    def __init__(self, capacity_bytes: int, *, tracked_keys: int = 8192,
                 factors: tuple[float, ...] = FACTORS, max_namespaces: int = 16,
                 sample_rate: float = 1.0) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"miss-ratio curve: capacity_bytes must be > 0, not "
                              f"{capacity_bytes}")
        if tracked_keys < 16:
            raise ConfigError(f"mrc_tracked_keys must be >= 16 (or turn the curve off with "
                              f"--mrc false), not {tracked_keys}")
        if not factors or any(f <= 0 for f in factors) or list(factors) != sorted(set(factors)):
            raise ConfigError(f"miss-ratio curve factors must be positive and increasing, "
                              f"not {factors}")
        if not 0.0 < sample_rate <= 1.0:
            raise ConfigError(f"miss-ratio curve sample_rate must be in (0, 1], not "
                              f"{sample_rate}")
        self.capacity = capacity_bytes
        self.factors = tuple(float(f) for f in factors)
        self.max_tracked = tracked_keys
        self.max_namespaces = max_namespaces
        self.threshold = max(1, int(sample_rate * SAMPLE_MODULUS))
        self._lock = threading.Lock()
        n = len(self.factors)
        self._bands: list[OrderedDict[tuple[bytes, bytes], int]] = [OrderedDict()
                                                                    for _ in range(n)]
        self._band_bytes = [0] * n
        self._where: dict[tuple[bytes, bytes], int] = {}  # tracked key -> its band
        self._heap: list[tuple[int, tuple[bytes, bytes]]] = []  # (-hash, key), lazy
        self._caps = self._scaled_caps()
        self._all = _Counts(n)
        self._ns: dict[bytes, _Counts] = {}
        self.sampled = 0  # sampled accesses (gets and puts), for tests and overhead checks

    # ------------------------------------------------------------------ hooks
    def on_get(self, ns: bytes, key: bytes, length: int | None) -> None:
        """A whole-object GET of ``(ns, key)``: ``length`` if the memory tier served it,
        None on a miss."""
        h = xxhash.xxh3_64_intdigest(key) & _MASK
        if h >= self.threshold:
            return
        with self._lock:
            self._get(ns, key, length, h)

    def on_put(self, ns: bytes, key: bytes, length: int) -> None:
        """A put of ``length`` value bytes was published as ``(ns, key)``."""
        h = xxhash.xxh3_64_intdigest(key) & _MASK
        if h >= self.threshold:
            return
        with self._lock:
            w = SAMPLE_MODULUS / self.threshold
            c = self._counts(ns)
            c.puts += w
            c.put_bytes += w * length
            self._all.puts += w
            self._all.put_bytes += w * length
            self._touch((ns, key), length, h)

    # ------------------------------------------------------------------ estimates
    def snapshot(self, top: int | None = None) -> dict:
        """The curve: see the module docstring. ``top``: only the namespaces with the most
        GETs (``"*"`` always)."""
        with self._lock:
            nss = sorted(self._ns.items(), key=lambda kv: -kv[1].gets)
            if top is not None:
                nss = nss[:top]
            docs = {ALL: self._all.doc()}
            for ns, c in nss:
                docs[ns.decode("utf-8", "replace")] = c.doc()
            return {"capacity_bytes": self.capacity, "factors": list(self.factors),
                    "sample_rate": self.threshold / SAMPLE_MODULUS,
                    "tracked_keys": len(self._where), "max_tracked_keys": self.max_tracked,
                    "namespaces": docs}

    # ------------------------------------------------------------------ internals
    def _scaled_caps(self) -> list[float]:
        rate = self.threshold / SAMPLE_MODULUS
        return [f * self.capacity * rate for f in self.factors]

    def _counts(self, ns: bytes) -> _Counts:
        c = self._ns.get(ns)
        if c is None:
            if len(self._ns) >= self.max_namespaces:
                ns = OTHER.encode()
                c = self._ns.get(ns)
            if c is None:
                c = self._ns[ns] = _Counts(len(self.factors))
        return c

    def _get(self, ns: bytes, key: bytes, length: int | None, h: int) -> None:
        w = SAMPLE_MODULUS / self.threshold
        c = self._counts(ns)
        k = (ns, key)
        band = self._where.get(k)
        size = length
        if size is None:
            size = (self._bands[band][k] if band is not None
                    else c.mean_size() or self._all.mean_size())
        for cc in (c, self._all):
            cc.gets += w
            cc.get_bytes += w * size
            if length is not None:
                cc.served += w
            if band is not None:
                for i in range(band, len(self.factors)):
                    cc.hits[i] += w
                    cc.hit_bytes[i] += w * size
        if size:
            self._touch(k, int(size), h)

    def _touch(self, k: tuple[bytes, bytes], size: int, h: int) -> None:
        """Move (or add) ``k`` to the top of the stack with ``size`` bytes."""
        self.sampled += 1
        band = self._where.get(k)
        if band is not None:
            self._band_bytes[band] -= self._bands[band].pop(k)
        else:
            heapq.heappush(self._heap, (-h, k))
        top = self._bands[0]
        top[k] = size
        self._band_bytes[0] += size
        self._where[k] = 0
        self._cascade()
        if len(self._where) > self.max_tracked:
            self._lower_threshold()

    def _cascade(self) -> None:
        """Spill each band's oldest keys down until bands 0..i hold at most ``cap[i]``;
        the last band's spill is forgotten."""
        above = 0
        last = len(self._bands) - 1
        for i, band in enumerate(self._bands):
            limit = self._caps[i] - above
            while self._band_bytes[i] > limit and band:
                k, s = band.popitem(last=False)
                self._band_bytes[i] -= s
                if i < last:
                    self._bands[i + 1][k] = s  # newest of the next band
                    self._band_bytes[i + 1] += s
                    self._where[k] = i + 1
                else:
                    del self._where[k]
            above += self._band_bytes[i]

    def _lower_threshold(self) -> None:
        """Fixed-size SHARDS: drop the largest tracked hash and sample below it from now."""
        heap = self._heap
        if len(heap) > 4 * self.max_tracked:  # mostly forgotten keys: rebuild
            heap[:] = list({e[1]: e for e in heap if e[1] in self._where}.values())
            heapq.heapify(heap)
        while heap and (len(self._where) > self.max_tracked or -heap[0][0] >= self.threshold):
            neg, k = heapq.heappop(heap)
            self.threshold = max(1, min(self.threshold, -neg))
            band = self._where.pop(k, None)
            if band is not None:  # else forgotten already
                self._band_bytes[band] -= self._bands[band].pop(k)
        self._caps = self._scaled_caps()
        self._cascade()
