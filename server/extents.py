"""Free-space map of the arena: variable-size extents of 4 KiB granules, coalesced.

Design. Why not slab classes: with equal-chunk slab pages every ~6 % size class needs
whole pages of its own, so values of many sizes run out of pages long before they run
out of bytes (memcached's slab calcification: a 512 MiB arena held 153 MB of values
1 KiB..3 MiB and evicted the rest). Page rebalancing cannot help when there are more
live classes than pages. Here an object is one contiguous run of granules sized to it
(waste < one granule), so any mix of sizes packs the arena; a freed run merges with its
free neighbours at once, so holes never stay split.

* Free runs are kept three ways: ``start -> length``, ``end -> start`` (to merge with
  the run before), and in bins by ``length.bit_length()`` (bin ``b`` holds lengths in
  ``[2**(b-1), 2**b)``). ``alloc(n)`` looks at a few runs of ``n``'s own bin (first fit
  there), then takes any run of a higher bin (all fit); it carves from the run's start
  and keeps the rest free. O(1) dict operations per call, apart from the bounded look.
* It only knows granule numbers: the memory tier turns them into arena offsets, writes
  the chunk headers and the arena's start map (``arena.Arena.mark``), and rebuilds this
  map after a restart as the complement of the recovered objects (``from_used``).
* Nothing here moves an allocated run; the memory tier may relocate an unpinned
  object (``MemoryTier.do_compact``), never a pinned or leased one, so its bytes stay
  where its readers (shm one-sided ones too) look.

Not thread-safe: the memory tier calls it with its lock held (``fits`` excepted: a hint
read without the lock).
"""

from __future__ import annotations

from typing import Iterable

_LOOK = 16  # runs of the request's own bin looked at before taking a bigger bin's


class ExtentAllocator:
    """Free runs over granules ``[0, total)``; all free at construction."""

    __slots__ = ("total", "free", "_by_start", "_by_end", "_bins")

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = 0  # free granules
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._bins: list[dict[int, int]] = [{} for _ in range(max(1, total).bit_length() + 1)]
        if total:
            self._add(0, total)

    @classmethod
    def from_used(cls, total: int, used: Iterable[tuple[int, int]]) -> "ExtentAllocator":
        """The map with ``used`` (``(start, length)`` runs, disjoint, any order) taken."""
        a = cls(0)
        a.total = total
        a._bins = [{} for _ in range(max(1, total).bit_length() + 1)]
        at = 0
        for start, n in sorted(used):
            if start > at:
                a._add(at, start - at)
            at = max(at, start + n)
        if at < total:
            a._add(at, total - at)
        return a

    def _add(self, start: int, n: int) -> None:
        self._by_start[start] = n
        self._by_end[start + n] = start
        self._bins[n.bit_length()][start] = n
        self.free += n

    def _take(self, start: int, n: int) -> None:
        del self._by_start[start]
        del self._by_end[start + n]
        del self._bins[n.bit_length()][start]
        self.free -= n

    def alloc(self, n: int) -> int | None:
        """The first granule of a free run of ``n`` granules (now taken), or None."""
        b = n.bit_length()
        bins = self._bins
        if b >= len(bins):
            return None
        start = -1
        own = bins[b]
        if own:
            for i, (s, m) in enumerate(own.items()):
                if m >= n:
                    start, have = s, m
                    break
                if i >= _LOOK:
                    break
        if start < 0:
            for bigger in bins[b + 1:]:
                if bigger:
                    start, have = next(iter(bigger.items()))
                    break
            else:
                return None
        self._take(start, have)
        if have > n:
            self._add(start + n, have - n)
        return start

    def alloc_at(self, start: int, n: int) -> int | None:
        """Take ``n`` granules from the start of the free run that begins at ``start``
        (``start``), or None if no run of at least ``n`` begins there."""
        have = self._by_start.get(start, 0)
        if have < n:
            return None
        self._take(start, have)
        if have > n:
            self._add(start + n, have - n)
        return start

    def release(self, start: int, n: int) -> None:
        """Give back the run ``[start, start + n)``; it merges with free neighbours."""
        before = self._by_end.get(start)
        if before is not None:
            m = self._by_start[before]
            self._take(before, m)
            start, n = before, n + m
        after = self._by_start.get(start + n)
        if after is not None:
            self._take(start + n, after)
            n += after
        self._add(start, n)

    def fits(self, n: int) -> bool:
        """Whether ``alloc(n)`` would succeed now (a hint; safe without the lock)."""
        b = n.bit_length()
        bins = self._bins
        if b >= len(bins):
            return False
        if any(bins[b + 1:]):
            return True
        return any(m >= n for m in list(bins[b].values())[:_LOOK + 1])

    def largest(self) -> int:
        """Granules in the longest free run (a scan of the top non-empty bin)."""
        return self.largest_run()[1]

    def largest_run(self) -> tuple[int, int]:
        """The longest free run ``(start, length)``; ``(0, 0)`` when nothing is free."""
        for bin_ in reversed(self._bins):
            if bin_:
                return max(bin_.items(), key=lambda r: r[1])
        return 0, 0

    def take_run(self, start: int) -> int:
        """Take the whole free run that begins at ``start``; its length (0: none)."""
        n = self._by_start.get(start, 0)
        if n:
            self._take(start, n)
        return n

    def free_run_at(self, start: int) -> int:
        """Length of the free run that begins at ``start`` (0: none)."""
        return self._by_start.get(start, 0)

    def runs(self) -> list[tuple[int, int]]:
        """The free runs ``(start, length)``, by start (for tests and stats)."""
        return sorted(self._by_start.items())


__all__ = ["ExtentAllocator"]
