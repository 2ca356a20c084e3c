"""Offline replay of a KV-page trace against the REAL eviction policies: token hit rate
at a fixed capacity, the infinite-cache ceiling and the Belady oracle.

    from gcache.bench.trace_sim import load_trace, simulate, belady, ceiling
    reqs = load_trace("mooncake_fast25_synthetic_trace.jsonl")
    cap = capacity_blocks(reqs, 0.05)
    simulate(reqs, cap, "lru").hit_rate, belady(reqs, cap), ceiling(reqs)

Design. A request is the page-key chain of one prompt (``workload.Step``: Mooncake's
512-token ``hash_ids``, or the finer pages of ``swa_replay``'s geometry), and its hit
is the leading run of resident pages, exactly as an engine's L3 lookup (``replay``)
stops at the first miss. ``simulate`` models the memory tier's mechanism around a
policy built by ``server.eviction.make_policy`` and driven only through the
``EvictionPolicy`` seam, in the order the real tier calls it:

* the hit prefix is read: ``on_hit`` per page, front to back (``pin_read``);
* every page after it is put (``put_batch_from``), resident or not, in one PUT
  frame naming the chain's page before it (``chain_parent``: each page's parent is the
  key before it in the request, ``b""`` for the first): the server reserves a chunk for every item first (``begin_put``; older
  copies of those keys still count), evicting the policy's first candidate
  (``on_remove``) while the cache is full (it may be such an older copy; with only
  puts in flight left, the remaining items get NO_SPACE), then commits them in
  order: ``on_remove(old)`` if an older copy is left, ``on_insert(new)``.

Capacity is in pages (all pages of a trace are one size, so one chunk each).

``belady`` is the farthest-next-use oracle over the same page accesses (every page of
every request is an access); a page whose next use is later than every resident's is
not admitted. ``ceiling`` is the hit rate of an infinite cache. Hit rates count pages
(x ``block_tokens`` = tokens; every page of a trace has the same tokens).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

from gcache.bench.workload import Step, mooncake_trace
from gcache.server.eviction import EvictionPolicy, make_policy

__all__ = ["Page", "Request", "SimResult", "belady", "capacity_blocks", "ceiling",
           "load_trace", "simulate", "unique_blocks"]

NS = b"trace"


class Page:
    """A resident page as a policy sees it (``eviction.Resident``)."""

    __slots__ = ("ns", "key", "length", "chunk", "version", "parent")

    def __init__(self, key: bytes, version: int, parent: bytes | None = None) -> None:
        self.ns, self.key, self.version, self.parent = NS, key, version, parent
        self.length = self.chunk = 1


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: its page chain and its trace time."""

    keys: tuple[bytes, ...]
    t_s: float


@dataclass
class SimResult:
    policy: str
    capacity: int
    pages: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.pages if self.pages else 0.0


def load_trace(path: str, limit: int | None = None) -> list[Request]:
    """The requests of a Mooncake FAST'25 JSONL trace (``workload.mooncake_trace``)."""
    return from_steps(mooncake_trace(path, limit))


def from_steps(steps: Iterable[Step]) -> list[Request]:
    return [Request(tuple(s.page_keys), s.timestamp_ms / 1000.0) for s in steps]


def unique_blocks(reqs: Sequence[Request]) -> int:
    return len({k for r in reqs for k in r.keys})


def capacity_blocks(reqs: Sequence[Request], fraction: float) -> int:
    """``fraction`` of the trace's unique pages (at least 1)."""
    return max(1, int(fraction * unique_blocks(reqs)))


def _leading(keys: Sequence[bytes], present) -> int:  # noqa: ANN001 - a container
    n = 0
    for k in keys:
        if k not in present:
            break
        n += 1
    return n


def ceiling(reqs: Sequence[Request]) -> float:
    """Hit rate of an infinite cache (no eviction)."""
    seen: set[bytes] = set()
    pages = hits = 0
    for r in reqs:
        pages += len(r.keys)
        hits += _leading(r.keys, seen)
        seen.update(r.keys)
    return hits / pages if pages else 0.0


def simulate(reqs: Sequence[Request], capacity: int,
             policy: str | EvictionPolicy) -> SimResult:
    """Replay ``reqs`` against a cache of ``capacity`` pages ordered by ``policy`` (a
    name for ``make_policy``, or a built policy)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 page, got {capacity}")
    pol = make_policy(policy) if isinstance(policy, str) else policy
    res = SimResult(pol.name, capacity)
    index: dict[bytes, Page] = {}
    used = 0
    version = 0
    on_hit, on_insert, on_remove, candidates = (pol.on_hit, pol.on_insert, pol.on_remove,
                                                pol.candidates)
    for r in reqs:
        keys = r.keys
        hit = _leading(keys, index)
        res.pages += len(keys)
        res.hits += hit
        for k in keys[:hit]:
            on_hit(index[k])
        todo = keys[hit:]
        room = 0  # one PUT frame: every destination is reserved first, then all commit
        for _ in todo:
            while used >= capacity:
                victim = next(candidates(), None)
                if victim is None:
                    break  # only puts in flight left: the rest get NO_SPACE
                on_remove(victim)
                del index[victim.key]
                used -= 1
                res.evictions += 1
            if used >= capacity:
                break
            used += 1
            room += 1
        parent = keys[hit - 1] if hit else b""  # the frame's "ch": the page before it
        for k in todo[:room]:
            version += 1
            o = Page(k, version, parent)
            parent = k
            old = index.get(k)
            if old is not None:
                on_remove(old)
                used -= 1
            index[k] = o
            on_insert(o)
    return res


def belady(reqs: Sequence[Request], capacity: int) -> float:
    """Hit rate of the farthest-next-use oracle at ``capacity`` pages (with bypass: a
    page used later than every resident one is not admitted)."""
    seq = [k for r in reqs for k in r.keys]
    never = len(seq)
    nxt = [never] * len(seq)
    last: dict[bytes, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], never)
        last[seq[i]] = i
    resident: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries skipped
    i = pages = hits = 0
    for r in reqs:
        pages += len(r.keys)
        hits += _leading(r.keys, resident)
        for k in r.keys:
            nu = nxt[i]
            i += 1
            if k not in resident and len(resident) >= capacity:
                while resident.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if -heap[0][0] <= nu:
                    continue  # bypass: every resident page is needed sooner
                del resident[heapq.heappop(heap)[1]]
            resident[k] = nu
            heapq.heappush(heap, (-nu, k))
    return hits / pages if pages else 0.0
