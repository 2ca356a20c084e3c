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
``R`` settles where ``tracked_keys`` keys span the largest factor. ``R`` starts at
``sample_rate`` (1/8 by default: the hot path's average cost stays well under a
microsecond per GET). Each sampled access counts ``1 / R`` so a rate change does not
skew the ratios.

Ghost: one LRU stack cut into one band per factor (an ``OrderedDict`` each; band ``i``
holds the keys at byte stack distance ``(cap[i-1], cap[i]]``). Byte LRU caches of
growing size hold growing prefixes of one recency stack (inclusion), so a key in band
``b`` is a hit at every factor ``>= b``: one access is one lookup, one move to the top
and a cascade of at most one spill per band (amortized), O(number of factors).
A key that falls off the last band is forgotten (a miss at every factor).

Model. A GET refreshes its key (it moves to the top of the stack), hit or miss: a missed
page is put (or promoted from disk) right after, as an L3 KV cache does. An engine that
asks EXISTS first (SGLang's HiCache: it reads only the prefix that exists) sends GETs
for hits only, so an EXISTS counts as the access (found in the ghost or not; it moves
nothing, as in the memory tier) and the next GET of that key only refreshes it. A key the ghost
does not know is sized by its namespace's mean put size until its put says; a put
refreshes and resizes its key without counting. Only whole-object reads count (a GET at
offset 0: one per sliced read). Deletes are not seen (they are rare for KV pages, and a
deleted key's next GET is then counted as the ghost's hit). The curve is cumulative
since the server started.

Estimates. ``snapshot()['namespaces'][ns]``: ``gets`` (estimated accesses counted:
GETs, and EXISTS that decide them),
``hit_ratio`` and ``byte_hit_ratio`` (one per factor), and ``actual_hit_ratio`` (what the
memory tier really served for the same sampled GETs: compare it with factor 1).
Namespace ``"*"`` is every namespace together; past ``max_namespaces`` the rest count
as ``"other"``.

Validation: ``python -m gcache.bench.mrc_check TRACE`` replays a Mooncake trace against
exact LRU caches at every factor (within 0.01 on the synthetic trace).

Threads. ``on_get``, ``on_put`` and ``on_exists`` are called by the memory tier
(``memory_tier``: ``pin_read`` at offset 0, a put's publish, ``exists``), from
connection threads (and handoff reads), the first two with the tier's lock held. They
never block, sleep or do IO: an unsampled key costs one xxh3 of the key and a compare (O(1), no lock); a
sampled one takes this object's own lock (innermost: nothing is called while it is held)
for O(number of factors) work, amortized O(log n) for a threshold change (a heap of
tracked hashes). ``snapshot`` may be called from any thread (heartbeats, scrapes,
STATS); it takes the same lock for O(namespaces x factors).
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

    Called from connection threads (``on_get`` and ``on_put`` with the tier's lock held):
    they must not block, do IO or take a lock that is ever held while calling out.
    """

    def on_get(self, ns: bytes, key: bytes, length: int | None) -> None:
        """A whole-object read (offset 0): ``length`` if memory served it, None on a miss."""

    def on_put(self, ns: bytes, key: bytes, length: int) -> None:
        """A put of ``length`` value bytes became the current object of ``(ns, key)``."""

    def on_exists(self, ns: bytes, key: bytes, found: bool) -> None:
        """An EXISTS of ``(ns, key)`` (without the lock; recency unchanged)."""


class _Counts:
    """Weighted counts of one namespace: gets, and gets (and their bytes) per band the key
    was found in (the last slot: not found), cumulated into hit ratios by ``doc``."""

    __slots__ = ("gets", "get_bytes", "found", "found_bytes", "served", "puts", "put_bytes")

    def __init__(self, n: int) -> None:
        self.gets = self.get_bytes = self.served = 0.0
        self.puts = self.put_bytes = 0.0
        self.found = [0.0] * (n + 1)
        self.found_bytes = [0.0] * (n + 1)

    def add(self, other: _Counts) -> None:
        self.gets += other.gets
        self.get_bytes += other.get_bytes
        self.served += other.served
        for i, (f, fb) in enumerate(zip(other.found, other.found_bytes)):
            self.found[i] += f
            self.found_bytes[i] += fb

    def doc(self) -> dict:
        g, gb = self.gets, self.get_bytes
        hits: list[float] = []
        hit_bytes: list[float] = []
        h = hb = 0.0
        for f, fb in zip(self.found[:-1], self.found_bytes[:-1]):
            h, hb = h + f, hb + fb  # found in band b: a hit at every factor >= b
            hits.append(round(h / g, 4) if g else 0.0)
            hit_bytes.append(round(hb / gb, 4) if gb else 0.0)
        return {"gets": round(g), "hit_ratio": hits, "byte_hit_ratio": hit_bytes,
                "actual_hit_ratio": round(self.served / g, 4) if g else 0.0}


class MissRatioCurve:
    """The sampled ghost cache of one memory tier (see the module docstring).

    ``capacity_bytes``: the memory tier's capacity (factor 1). ``tracked_keys``: most keys
    the ghost holds (memory is O(tracked_keys + max_namespaces x factors)).
    ``sample_rate``: the starting (and highest) rate: 1/8 keeps a sampled GET's cost
    (a few microseconds) to well under a microsecond per GET on average.
    """

    def __init__(self, capacity_bytes: int, *, tracked_keys: int = 8192,
                 factors: tuple[float, ...] = FACTORS, max_namespaces: int = 16,
                 sample_rate: float = 0.125) -> None:
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
            raise ConfigError(f"mrc_sample_rate must be in (0, 1], not {sample_rate}")
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
        self._w = SAMPLE_MODULUS / self.threshold  # what one sampled access stands for
        self._puts = self._put_bytes = 0.0  # weighted, every namespace (a fallback size)
        self._ns: dict[bytes, _Counts] = {}
        self._probed: dict[tuple[bytes, bytes], None] = {}  # EXISTS counted, GET not yet
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
            c = self._counts(ns)
            c.puts += self._w
            c.put_bytes += self._w * length
            self._puts += self._w
            self._put_bytes += self._w * length
            self._probed.pop((ns, key), None)
            self._touch((ns, key), length, h)

    def on_exists(self, ns: bytes, key: bytes, found: bool) -> None:
        """An EXISTS of ``(ns, key)``: ``found`` in memory or not. Counted as the access
        (the engine reads only what exists), without moving the key; the GET that
        follows it only moves it."""
        h = xxhash.xxh3_64_intdigest(key) & _MASK
        if h >= self.threshold:
            return
        with self._lock:
            k = (ns, key)
            band = self._where.get(k)
            size = self._bands[band][k] if band is not None else None
            self._count(self._counts(ns), band, size, found)
            if band is not None:
                if len(self._probed) >= self.max_tracked:
                    self._probed.clear()  # probes never followed by a read: forget them
                self._probed[k] = None

    # ------------------------------------------------------------------ estimates
    def snapshot(self, top: int | None = None) -> dict:
        """The curve: see the module docstring. ``top``: only the namespaces with the most
        GETs (``"*"`` always)."""
        with self._lock:
            total = _Counts(len(self.factors))
            for c in self._ns.values():
                total.add(c)
            nss = sorted(self._ns.items(), key=lambda kv: -kv[1].gets)
            if top is not None:
                nss = nss[:top]
            docs = {ALL: total.doc()}
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
        k = (ns, key)
        band = self._where.get(k)
        if band is not None and self._probed and self._probed.pop(k, 1) is None:
            self._touch(k, self._bands[band][k] if length is None else length, h)
            return  # its EXISTS counted this access
        c = self._counts(ns)
        size = self._count(c, band, length if length is not None
                           else self._bands[band][k] if band is not None else None,
                           length is not None)
        if size:
            self._touch(k, int(size), h)

    def _count(self, c: _Counts, band: int | None, size: float | None, served: bool) -> float:
        """Count one access found in ``band`` (None: not found); returns its size (an
        unknown one: the namespace's mean put, else everyone's)."""
        if size is None:
            size = (c.put_bytes / c.puts if c.puts
                    else self._put_bytes / self._puts if self._puts else 0.0)
        w = self._w
        slot = len(self.factors) if band is None else band
        c.gets += w
        c.get_bytes += w * size
        c.found[slot] += w
        c.found_bytes[slot] += w * size
        if served:
            c.served += w
        return size

    def _touch(self, k: tuple[bytes, bytes], size: int, h: int) -> None:
        """Move (or add) ``k`` to the top of the stack with ``size`` bytes."""
        self.sampled += 1
        bands = self._bands
        band = self._where.get(k)
        if band is None:
            src = len(bands)
            heapq.heappush(self._heap, (-h, k))
        else:
            old = bands[band].pop(k)
            self._band_bytes[band] -= old
            src = band if old == size else len(bands)
        bands[0][k] = size
        self._band_bytes[0] += size
        self._where[k] = 0
        self._cascade(src)
        if len(self._where) > self.max_tracked:
            self._lower_threshold()

    def _cascade(self, src: int | None = None) -> None:
        """Spill each band's oldest keys down until bands 0..i hold at most ``cap[i]``;
        the last band's spill is forgotten. ``src``: the band a key of unchanged size moved
        up from (bands from there on hold as many bytes as before, so one there that
        spills nothing ends the cascade)."""
        bands, nbytes, caps = self._bands, self._band_bytes, self._caps
        last = len(bands) - 1
        if src is None:
            src = len(bands)
        above = 0
        for i, band in enumerate(bands):
            limit = caps[i] - above
            spilled = False
            while nbytes[i] > limit and band:
                k, s = band.popitem(last=False)
                nbytes[i] -= s
                spilled = True
                if i < last:
                    bands[i + 1][k] = s  # newest of the next band
                    nbytes[i + 1] += s
                    self._where[k] = i + 1
                else:
                    del self._where[k]
            if not spilled and i >= src:
                return
            above += nbytes[i]

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
        self._w = SAMPLE_MODULUS / self.threshold
        self._cascade()
