"""The engine-independent core of the plugin: pages of prefix chains as gcache objects.

``ChainStore`` is what ``GCacheStorage`` (backend.py) runs on, and what
``gcache.bench.swa_replay`` drives without SGLang. Its methods are called by SGLang's
prefetch, prefetch-IO and backup threads at once: each is thread-safe, blocks for at
most the client's deadline per gcache round trip, and reports runtime faults as
``False`` per page (counted in ``Stats``), never as an exception.

Objects. One gcache object per (pool, page, component); ``PoolSpec.keys`` spells

    key = "<pool>/<layout tag>/<page hash>/<shard>/<component>"

in the namespace ``"<namespace>/<model_name>"`` (host_pools.py builds the spec: layout
tag, shard and component sizes).

SWA. SGLang sends full-attention pages in pool ``kv`` and only window-resident SWA
pages in pool ``swa``, under the same page hashes. We store what arrives.
``window_safe_stops`` folds per-pool presence into every stop point ``p`` where KV
pages ``[0, p)`` and the trailing ``W`` SWA pages ``[p-W, p)`` all exist (the
window-safe hit), which ``batch_exists_v2`` answers as ``restorable_prefix_pages``.

Placement (group policy ``chain``, the default): the pages of one prefix chain are
grouped in runs of ``group_pages`` pages; the group of chain position ``i`` is the page
hash at position ``(i // group_pages) * group_pages`` (so the first group is named by
the chain's first page). A group lands on one server, so a chain of ``n`` pages
touches at most ``ceil(n / group_pages)`` servers and a node loss truncates a prefix
at one group boundary instead of punching holes everywhere. Positions come from
SGLang's ``prefix_keys``, so ``chain`` needs ``"hicache_storage_pass_prefix_keys":
true``; if a write arrives without prefix keys the store logs an error once and falls
back to per-key placement (policy ``key``), which is always consistent.

Keep-alive: prefix keys SGLang passes (pages resident in L1/L2, whose L3 copy would
otherwise age out) and the pages of every hit are refreshed with
``touch_batch_async``, at most once per ``touch_interval_ms`` per key.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from gcache.sdk.sglang.config import PluginConfig
from gcache.status import Status

if TYPE_CHECKING:
    from gcache.sdk.client import Client

log = logging.getLogger("gcache.sglang")


class HitPolicy(str, enum.Enum):
    """How a side pool's pages gate a hit; the values are SGLang's ``PoolHitPolicy``."""

    ALL_PAGES = "all_pages"            # pages [0, p) must all exist
    TRAILING_PAGES = "trailing_pages"  # only the trailing window [p - W, p) must exist
    BLOCK_GROUPS = "block_groups"      # reports its own leading run, never gates


class SidePool(NamedTuple):
    """A side pool's presence, as ``window_safe_stops`` reads it."""

    name: str
    hit_policy: str                 # a HitPolicy value
    present: Sequence[bool]         # per page of the query
    window: int                     # trailing page count W (``trailing_pages``)


class WindowSafeHit(NamedTuple):
    """SGLang's ``PoolTransferResult`` fields, as ``window_safe_stops`` folds them."""

    kv_hit_pages: int               # the largest restorable stop point (0 if none)
    per_pool: dict[str, int]        # each pool's own boundary ("kv" included)
    restorable: list[int]           # every restorable stop point p (1-based pages)


def chain_groups(prefix_keys: Sequence[str] | None, keys: Sequence[str],
                 group_pages: int) -> list[str]:
    """Placement group of each key: the chain's page hash at the start of its run.

    ``prefix_keys + keys`` is one chain from its first page (``None`` = the keys
    start the chain). Position ``i`` belongs to run ``i // group_pages``, named by
    the page at the run's first position.
    """
    pre = list(prefix_keys or ())
    base = len(pre)
    out = []
    for i in range(len(keys)):
        start = ((base + i) // group_pages) * group_pages
        out.append(pre[start] if start < base else keys[start - base])
    return out


def chain_parent(spec: PoolSpec, keys: Sequence[str], todo: Sequence[int],
                 before: str | None) -> str | None:
    """The object before page ``keys[todo[0]]`` in its chain (its last component;
    ``""``: the chain's head), when the pages ``todo`` are a consecutive run and the
    page before ``keys[0]`` is known (``before``); else None (nothing is said)."""
    if before is None or not todo or todo[-1] - todo[0] != len(todo) - 1:
        return None
    page = keys[todo[0] - 1] if todo[0] else before
    return spec.keys(page)[-1] if page else ""


def leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of True."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)


def window_safe_stops(kv_present: Sequence[bool], pools: Sequence[SidePool]
                      ) -> WindowSafeHit:
    """Fold per-pool presence into SGLang's ``PoolTransferResult`` fields.

    Args:
        kv_present: whether KV page i exists (all its components), per page.
        pools: ``SidePool(name, hit_policy, present, window)`` per side pool (a plain
            4-tuple works too); ``window`` is the trailing page count for ``trailing_pages``.

    Returns:
        ``WindowSafeHit(kv_hit_pages, per_pool, restorable)`` where ``restorable``
        lists every stop point p (1-based pages) at which KV ``[0, p)`` exists,
        every ``all_pages`` pool has ``[0, p)`` and every ``trailing_pages`` pool
        has ``[p - window, p)``; ``kv_hit_pages`` is its maximum (0 if empty).
        ``block_groups`` pools report their own leading run and never gate.
    """
    kv = leading(kv_present)
    hits: dict[str, int] = {"kv": kv}
    ok = [True] * (kv + 1)  # ok[p] for p in 0..kv; p = 0 is never reported
    for name, policy, present, window in pools:
        present = list(present)[:kv] + [False] * max(0, kv - len(present))
        if policy == HitPolicy.TRAILING_PAGES:
            w = max(1, int(window))
            # missing[i] = number of absent pages among the first i
            missing = [0] * (kv + 1)
            for i in range(kv):
                missing[i + 1] = missing[i] + (0 if present[i] else 1)
            best = 0
            for p in range(1, kv + 1):
                good = missing[p] - missing[max(0, p - w)] == 0
                ok[p] = ok[p] and good
                if good:
                    best = p
            hits[name] = best
        elif policy == HitPolicy.BLOCK_GROUPS:
            hits[name] = leading(present)
        else:  # all_pages (and anything unknown: the conservative reading)
            b = leading(present)
            for p in range(b + 1, kv + 1):
                ok[p] = False
            hits[name] = b
    restorable = [p for p in range(1, kv + 1) if ok[p]]
    return WindowSafeHit(restorable[-1] if restorable else 0, hits, restorable)

@dataclass(frozen=True, slots=True)
class PoolSpec:
    """How one host pool's pages map to gcache objects."""

    name: str              # SGLang pool name: "kv", "swa", ...
    tag: str               # layout tag (dtype, page size, layout, format, geometry digest)
    shard: str             # "tp0of2", "r", ... (+ pp/cp/dcp)
    comp_bytes: tuple[int, ...]  # bytes of each component object of one page
    writer: bool = True    # False: replicated pool on a non-writer rank (skip writes)

    def keys(self, page_hash: str) -> list[str]:
        base = f"{self.name}/{self.tag}/{page_hash}/{self.shard}/"
        return [base + str(c) for c in range(len(self.comp_bytes))]

    @property
    def page_bytes(self) -> int:
        return sum(self.comp_bytes)


class IoSamples(NamedTuple):
    """Pages and GB/s per prefetch (get) and backup (set) batch, drained by ``get_stats``."""

    prefetch_pgs: list[int]
    backup_pgs: list[int]
    prefetch_bandwidth: list[float]
    backup_bandwidth: list[float]


class Stats:
    """Thread-safe counters behind ``get_stats`` (see docs/sglang.md)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.c: dict[str, int] = {}
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.c[k] = self.c.get(k, 0) + v

    def add_named(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.c[name] = self.c.get(name, 0) + n

    def io(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            pgs = self.prefetch_pgs if kind == "get" else self.backup_pgs
            bw = self.prefetch_bandwidth if kind == "get" else self.backup_bandwidth
            if len(pgs) < 100_000:  # bounded if nobody polls
                pgs.append(pages)
                bw.append(nbytes / 1e9 / seconds if seconds > 0 else 0.0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self.c.items()))

    def drain_io(self) -> IoSamples:
        """The IO samples since the last drain (SGLang's ``StorageMetrics`` lists)."""
        with self._lock:
            out = IoSamples(self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth,
                            self.backup_bandwidth)
            self.prefetch_pgs, self.backup_pgs = [], []
            self.prefetch_bandwidth, self.backup_bandwidth = [], []
            return out


class _Toucher:
    """Throttled keep-alive: each key at most once per interval, bounded memory."""

    def __init__(self, client: Client, interval_s: float, stats: Stats,
                 capacity: int = 1 << 18, max_inflight: int = 8) -> None:
        self.client, self.interval, self.stats = client, interval_s, stats
        self.capacity, self.max_inflight = capacity, max_inflight
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()
        self._inflight = 0

    def offer(self, keys: Sequence[str], groups: Sequence[str | None] | None) -> None:
        now = time.monotonic()
        send_k: list[str] = []
        send_g: list[str | None] = []
        with self._lock:
            for i, k in enumerate(keys):
                t = self._seen.get(k)
                if t is not None and now - t < self.interval:
                    continue
                self._seen[k] = now
                self._seen.move_to_end(k)
                send_k.append(k)
                send_g.append(groups[i] if groups is not None else None)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            if not send_k:
                self.stats.add(touch_keys_throttled=len(keys))
                return
            if self._inflight >= self.max_inflight:
                for k in send_k:  # not sent: let a later offer retry them
                    self._seen.pop(k, None)
                self.stats.add(touch_keys_throttled=len(keys))
                return
            self._inflight += 1
        self.stats.add(touch_keys_sent=len(send_k), touch_keys_throttled=len(keys) - len(send_k))
        try:
            fut = self.client.touch_batch_async(
                send_k, group=None if groups is None else send_g)
        except Exception:
            log.exception("touch_batch_async raised")
            with self._lock:
                self._inflight -= 1
            return

        def done(_f: Future) -> None:
            with self._lock:
                self._inflight -= 1

        fut.add_done_callback(done)


class ChainStore:
    """Engine-independent core: pages of prefix chains as gcache objects.

    Every method takes the chain context (``prefix_keys``) that decides
    placement groups, and buffers as lists of per-component writable byte
    views. Runtime faults come back as ``False`` per page; nothing raises.
    """

    def __init__(self, client: Client, cfg: PluginConfig, stats: Stats | None = None) -> None:
        self.client, self.cfg = client, cfg
        self.stats = stats or Stats()
        self.group_policy = cfg.group_policy
        self.toucher = _Toucher(client, cfg.touch_interval_ms / 1000.0, self.stats)
        self._warned_no_prefix = False

    # ---- placement
    def note_write_context(self, prefix_keys: Sequence[str] | None) -> None:
        """A write without prefix keys means SGLang does not pass them: use per-key placement."""
        if prefix_keys is None and self.group_policy == "chain":
            self.group_policy = "key"
            if not self._warned_no_prefix:
                self._warned_no_prefix = True
                log.error('group_policy "chain" needs "hicache_storage_pass_prefix_keys": true '
                          "in the extra config; SGLang sent a write without prefix keys, so "
                          "this backend now places pages per key (consistent, larger blast "
                          "radius). Set the flag, or group_policy \"key\" to silence this.")

    def groups(self, prefix_keys: Sequence[str] | None, keys: Sequence[str]) -> list[str] | None:
        if self.group_policy != "chain":
            return None
        return chain_groups(prefix_keys, keys, self.cfg.group_pages)

    @staticmethod
    def _expand(spec: PoolSpec, keys: Sequence[str], groups: Sequence[str] | None
                ) -> tuple[list[str], list[str] | None]:
        n = len(spec.comp_bytes)
        objs: list[str] = []
        for k in keys:
            objs.extend(spec.keys(k))
        g = None if groups is None else [x for x in groups for _ in range(n)]
        return objs, g

    def _fold(self, spec: PoolSpec, statuses: Sequence[Status], npages: int) -> list[bool]:
        n = len(spec.comp_bytes)
        out = []
        for i in range(npages):
            sts = statuses[i * n:(i + 1) * n]
            out.append(all(s == Status.OK for s in sts))
            for s in sts:
                if s not in (Status.OK, Status.MISS):
                    self.stats.add_named(f"faults.{s.name}")
        return out

    # ---- exists
    def exists_async(self, spec: PoolSpec, keys: Sequence[str], groups: Sequence[str] | None
                     ) -> Future:
        """Future of per-page presence (every component present)."""
        objs, g = self._expand(spec, keys, groups)
        self.stats.add(exists_keys=len(objs))
        n = len(spec.comp_bytes)
        out: Future = Future()
        if not objs:
            out.set_result([])
            return out
        inner = self.client.exists_batch_async(objs, group=g)

        def done(f: Future) -> None:
            try:
                flags = f.result()
                out.set_result([all(flags[i * n:(i + 1) * n]) for i in range(len(keys))])
            except Exception:
                log.exception("exists future failed")
                out.set_result([False] * len(keys))

        inner.add_done_callback(done)
        return out

    def wait(self, fut: Future, n: int) -> list[bool]:
        try:
            return fut.result(timeout=self.client.timeout * 4 + 5.0)
        except Exception:
            self.stats.add(errors=1)
            return [False] * n

    # ---- reads and writes
    def get_pages(self, spec: PoolSpec, keys: Sequence[str], bufs: Sequence[Sequence[Any]],
                  groups: Sequence[str] | None) -> list[bool]:
        """Read page i's components into ``bufs[i]`` (writable views of exact size)."""
        if not keys:
            return []
        objs, g = self._expand(spec, keys, groups)
        flat = [b for page in bufs for b in page]
        t0 = time.perf_counter()
        st = self.client.get_batch_into(objs, flat, group=g)
        dt = time.perf_counter() - t0
        ok = self._fold(spec, st, len(keys))
        good = leading(ok)
        self.stats.add(**{"get_pages": len(keys), "get_pages_ok": sum(ok),
                          f"get_pages_ok.{spec.name}": sum(ok),
                          "get_bytes": sum(ok) * spec.page_bytes})
        self.stats.io("get", good, good * spec.page_bytes, dt)
        return ok

    def put_pages(self, spec: PoolSpec, keys: Sequence[str], bufs: Sequence[Sequence[Any]],
                  groups: Sequence[str] | None, before: str | None = None) -> list[bool]:
        """Store page i's components from ``bufs[i]``; pages already stored are skipped.

        ``before``: the page hash before ``keys[0]`` in its prefix chain (``""``: the keys
        start the chain; None: unknown). When the pages written are a consecutive run,
        the put names the object before them as its ``chain_parent`` (a page's
        components are consecutive objects of the chain), for the servers' ``chains``
        eviction policy."""
        n = len(keys)
        if not n:
            return []
        if not spec.writer:
            self.stats.add(set_pages_not_writer=n)
            return [True] * n
        todo = list(range(n))
        if self.cfg.skip_existing:
            present = self.wait(self.exists_async(spec, keys, groups), n)
            todo = [i for i in range(n) if not present[i]]
            self.stats.add(set_pages_skipped=n - len(todo))
        ok = [True] * n
        if todo:
            objs, g = self._expand(spec, [keys[i] for i in todo],
                                   None if groups is None else [groups[i] for i in todo])
            flat = [b for i in todo for b in bufs[i]]
            t0 = time.perf_counter()
            st = self.client.put_batch_from(objs, flat, group=g,
                                            chain_parent=chain_parent(spec, keys, todo, before))
            dt = time.perf_counter() - t0
            res = self._fold(spec, st, len(todo))
            for i, r in zip(todo, res):
                ok[i] = r
            written = sum(res)
            self.stats.add(**{"set_pages_written": written,
                              f"set_pages_written.{spec.name}": written,
                              "set_pages_failed": len(todo) - written,
                              "set_bytes": written * spec.page_bytes})
            self.stats.io("set", written, written * spec.page_bytes, dt)
        return ok

    def touch(self, spec: PoolSpec, keys: Sequence[str], groups: Sequence[str] | None) -> None:
        if not self.cfg.touch or not keys or not spec.writer:
            return
        objs, g = self._expand(spec, keys, groups)
        self.toucher.offer(objs, g)
