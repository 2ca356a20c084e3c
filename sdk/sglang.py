"""SGLang HiCache L3 storage backend on gcache (SWA-aware, zero-copy).

Load it in SGLang 0.5.23 with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name":"gcache",
        "module_path":"gcache.sdk.sglang","class_name":"GCacheStorage","interface_v1":1,
        "hicache_storage_pass_prefix_keys":true,"masters":["10.0.0.1:7000"]}'

SGLang's dynamic factory builds ``GCacheStorage(storage_config, {})`` and then
registers the host pools. docs/sglang.md lists every config key and metric.

Contract (who calls what; SGLang's ``HiCacheStorage`` in
``sglang/srt/mem_cache/hicache_storage.py`` is the source of truth):

* ``__init__``, ``register_mem_pool_host``, ``register_mem_host_pool_v2``,
  ``on_host_pools_registered``, ``clear``, ``close``: the scheduler thread, at
  attach / detach / admin time. Bad config raises ``ConfigError`` here (a setup
  fault fails the attach with a message saying what to change).
* ``batch_exists`` / ``batch_exists_v2``: SGLang's prefetch thread (hit query).
* ``batch_get_v1`` / ``batch_get_v2``: the prefetch IO thread (L3 -> host).
* ``batch_set_v1`` / ``batch_set_v2``: the backup thread (host -> L3).
  These three threads call at once; every method is thread-safe and may block
  for at most the configured deadline (``timeout_ms``) per gcache round trip.
* Runtime faults never raise and never return ``None``: a dead, slow or full
  server is a miss (``False`` / a shorter hit), counted in ``get_stats``.

Objects. One gcache object per (pool, page, component). Its identity is

    namespace  = "<namespace>/<model_name>"                   (gcache namespace)
    key        = "<pool>/<layout tag>/<page hash>/<shard>/<component>"

``layout tag`` spells dtype, page size, host layout and storage format, plus a
digest of the pool geometry (layers, heads, bytes per component), so pages
written under another layout or shape miss instead of loading wrong bytes.
``shard`` is ``tp<r>of<n>`` for rank-sharded pools (MHA: every TP rank stores
its own head shard) and ``r`` for replicated pools (MLA: only the storage
writer rank stores, every rank reads), plus ``pp``/``cp``/``dcp`` suffixes when
those are > 1. Components are the pointers ``get_page_buffer_meta`` returns per
page (MHA page_first: K and V; MLA: one), so each object is read from and
written to host memory in place: no copy beyond what the socket needs.

SWA. SGLang sends full-attention pages in pool ``kv`` and only window-resident
SWA pages in pool ``swa``, under the same page hashes. We store what arrives.
``batch_exists_v2`` answers every stop point ``p`` where KV pages ``[0, p)``
and the trailing ``W`` SWA pages ``[p-W, p)`` all exist (the window-safe hit),
as ``restorable_prefix_pages``.

Placement (group policy ``chain``, the default): the pages of one prefix chain
are grouped in runs of ``group_pages`` pages; the group of chain position ``i``
is the page hash at position ``(i // group_pages) * group_pages`` (so the first
group is named by the chain's first page). A group lands on one server, so a
chain of ``n`` pages touches at most ``ceil(n / group_pages)`` servers and a
node loss truncates a prefix at one group boundary instead of punching holes
everywhere. Positions come from SGLang's ``prefix_keys``, so ``chain`` needs
``"hicache_storage_pass_prefix_keys": true``; if a write arrives without prefix
keys the backend logs an error once and falls back to per-key placement
(policy ``key``), which is always consistent.

Keep-alive: prefix keys SGLang passes (pages resident in L1/L2, whose L3 copy
would otherwise age out) and the pages of every hit are refreshed with
``touch_batch_async``, at most once per ``touch_interval_ms`` per key.

This module imports without SGLang: ``GCacheStorage`` (the ``HiCacheStorage``
subclass) is built on first access; ``ChainStore`` and ``window_safe_stops``
are the engine-independent core that ``gcache.bench.swa_replay`` also uses.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import xxhash

from gcache.credentials import parse_client_credential
from gcache.errors import ConfigError
from gcache.sdk.client import Client
from gcache.status import Status

log = logging.getLogger("gcache.sglang")

__all__ = [
    "ChainStore",
    "GCacheStorage",  # noqa: F822 - built on first access by __getattr__
    "PluginConfig",
    "PoolSpec",
    "chain_groups",
    "window_safe_stops",
]

#: Hit policies, spelled like SGLang's ``PoolHitPolicy`` values.
ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"

#: extra_config keys that belong to SGLang and are passed through to us.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})


# --------------------------------------------------------------------------- config

@dataclass(frozen=True, slots=True)
class PluginConfig:
    """The backend's own knobs, read from SGLang's storage extra_config."""

    masters: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()
    namespace: str = "sglang"
    timeout_ms: int = 1000
    token: str | None = None
    credential: str | None = None  # "id:secret"; scopes the instance to its namespaces
    group_policy: str = "chain"
    group_pages: int = 64
    skip_existing: bool = True
    touch: bool = True
    touch_interval_ms: int = 30_000
    config_file: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> PluginConfig:
        """Parse and check ``extra_config``. Raises ConfigError naming the bad key."""
        extra = dict(extra or {})
        fields = cls.__dataclass_fields__
        ours = set(fields)
        unknown = sorted(k for k in extra if k not in ours and k not in SGLANG_KEYS)
        if unknown:
            raise ConfigError(f"unknown gcache extra_config keys {unknown}; valid keys: "
                              f"{sorted(ours)} (see docs/sglang.md)")

        def addrs(name: str) -> tuple[str, ...]:
            v = extra.get(name) or ()
            if isinstance(v, str):
                v = [a for a in v.split(",") if a.strip()]
            if not isinstance(v, (list, tuple)) or not all(isinstance(a, str) for a in v):
                raise ConfigError(f"extra_config {name!r} must be a list of 'host:port' strings")
            for a in v:
                host, _, port = a.strip().rpartition(":")
                if not host or not port.isdigit():
                    raise ConfigError(f"extra_config {name!r}: {a!r} is not host:port")
            return tuple(a.strip() for a in v)

        def integer(name: str, lo: int) -> int:
            v = extra.get(name, fields[name].default)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"extra_config {name!r} must be an int >= {lo}, got {v!r}")
            return v

        def boolean(name: str) -> bool:
            v = extra.get(name, fields[name].default)
            if not isinstance(v, bool):
                raise ConfigError(f"extra_config {name!r} must be true or false, got {v!r}")
            return v

        def text(name: str, default: str | None) -> str | None:
            v = extra.get(name, default)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"extra_config {name!r} must be a string, got {v!r}")
            return v

        def credential() -> str | None:
            v = text("credential", None)
            if v:
                parse_client_credential(v)  # ConfigError, never echoing the secret
            return v

        masters, servers = addrs("masters"), addrs("servers")
        if not masters and not servers:
            raise ConfigError('gcache needs "masters": ["host:port", ...] or "servers": '
                              '[...] in --hicache-storage-backend-extra-config')
        policy = text("group_policy", fields["group_policy"].default)
        if policy not in ("chain", "key"):
            raise ConfigError(f'extra_config "group_policy" must be "chain" or "key", got {policy!r}')
        return cls(masters=masters, servers=servers,
                   namespace=text("namespace", "sglang") or "sglang",
                   timeout_ms=integer("timeout_ms", 1), token=text("token", None),
                   credential=credential(),
                   group_policy=policy, group_pages=integer("group_pages", 1),
                   skip_existing=boolean("skip_existing"), touch=boolean("touch"),
                   touch_interval_ms=integer("touch_interval_ms", 0),
                   config_file=text("config_file", None))


# --------------------------------------------------------------------------- pure helpers

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


def leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of True."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)


def window_safe_stops(kv_present: Sequence[bool],
                      pools: Sequence[tuple[str, str, Sequence[bool], int]]
                      ) -> tuple[int, dict[str, int], list[int]]:
    """Fold per-pool presence into SGLang's ``PoolTransferResult`` fields.

    Args:
        kv_present: whether KV page i exists (all its components), per page.
        pools: ``(name, hit_policy, present, window)`` per side pool; ``window``
            is the trailing page count for ``trailing_pages``.

    Returns:
        ``(kv_hit_pages, per_pool_boundary, restorable)`` where ``restorable``
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
        if policy == TRAILING_PAGES:
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
        elif policy == BLOCK_GROUPS:
            hits[name] = leading(present)
        else:  # all_pages (and anything unknown: the conservative reading)
            b = leading(present)
            for p in range(b + 1, kv + 1):
                ok[p] = False
            hits[name] = b
    restorable = [p for p in range(1, kv + 1) if ok[p]]
    return (restorable[-1] if restorable else 0), hits, restorable


# --------------------------------------------------------------------------- core

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

    def drain_io(self) -> tuple[list[int], list[int], list[float], list[float]]:
        with self._lock:
            out = (self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth,
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
                  groups: Sequence[str] | None) -> list[bool]:
        """Store page i's components from ``bufs[i]``; pages already stored are skipped."""
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
            st = self.client.put_batch_from(objs, flat, group=g)
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

    def delete_pages(self, spec: PoolSpec, keys: Sequence[str], groups: Sequence[str] | None
                     ) -> None:
        objs, g = self._expand(spec, keys, groups)
        self.client.delete_batch(objs, group=g)


# --------------------------------------------------------------------------- host pools

class _PoolBinding:
    """One registered SGLang host pool: its PoolSpec and pointer -> view mapping."""

    def __init__(self, name: str, pool: Any, spec: PoolSpec, regions: list[tuple[int, Any]]
                 ) -> None:
        self.name, self.pool, self.spec = name, pool, spec
        self.page_size = int(pool.page_size)
        self._starts = [s for s, _ in regions]
        self._arrays = [a for _, a in regions]

    def _view(self, ptr: int, size: int) -> Any:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            arr = self._arrays[i]
            off = ptr - self._starts[i]
            if 0 <= off and off + size <= arr.shape[0]:
                return arr[off:off + size]
        # a pool kind whose buffers we did not map: trust SGLang's pointer
        return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))

    def page_views(self, host_indices: Any, npages: int) -> list[list[Any]]:
        """Per page, one writable uint8 view per component, straight over host memory."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        n = len(self.spec.comp_bytes)
        if len(ptrs) != npages * n:
            raise ValueError(f"pool {self.name}: {len(ptrs)} buffer pointers for {npages} "
                             f"pages, expected {n} per page")
        return [[self._view(int(ptrs[i * n + c]), int(sizes[i * n + c])) for c in range(n)]
                for i in range(npages)]


def _regions(pool: Any) -> list[tuple[int, Any]]:
    import torch

    found: list[tuple[int, Any]] = []
    for attr in ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer"):
        val = getattr(pool, attr, None)
        for t in (val if isinstance(val, (list, tuple)) else [val]):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() \
                    and t.numel():
                arr = t.detach().reshape(-1).view(torch.uint8).numpy()
                found.append((t.data_ptr(), arr))
    found.sort(key=lambda x: x[0])
    return found


def _pool_spec(name: str, pool: Any, storage_config: Any, legacy_kv: bool) -> PoolSpec:
    """Identity and object shapes of one host pool."""
    import torch

    page = int(pool.page_size)
    layout = str(getattr(pool, "layout", "?"))
    if getattr(storage_config, "should_split_heads", False):
        raise ConfigError("gcache does not support heterogeneous-TP head splitting "
                          "(tp_lcm_size / page_head split); run every engine with the same TP")
    replicated = hasattr(pool, "kv_cache_dim") and name != "mamba"
    _ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
    comp = tuple(int(s) for s in sizes)
    if legacy_kv:  # one flat page object (get_data_page / set_from_flat_data_page bytes)
        comp = (sum(comp),)
    if layout == "layer_first" and len(comp) > 2:
        log.warning("pool %s uses layout layer_first: %d objects per page; "
                    "--hicache-mem-layout page_first stores 1-2", name, len(comp))
    dtype = str(getattr(pool, "dtype", "?")).replace("torch.", "")
    fmt = getattr(pool, "storage_format_tag", None) or "-"
    geometry = repr((type(pool).__name__, getattr(pool, "layer_num", None),
                     getattr(pool, "start_layer", None), getattr(pool, "end_layer", None),
                     getattr(pool, "head_num", None), getattr(pool, "head_dim", None),
                     getattr(pool, "kv_cache_dim", None), comp, "flat" if legacy_kv else "v1"))
    digest = xxhash.xxh3_64_hexdigest(geometry.encode())[:8]
    tag = f"{dtype}.p{page}.{layout}.{fmt}.{digest}"
    sc = storage_config
    shard = "r" if replicated else f"tp{sc.tp_rank}of{sc.tp_size}"
    if sc.pp_size > 1:
        shard += f".pp{sc.pp_rank}of{sc.pp_size}"
    if getattr(sc, "attn_cp_size", 1) > 1:
        shard += f".cp{sc.attn_cp_rank}of{sc.attn_cp_size}"
    if getattr(sc, "dcp_size", 1) > 1:
        shard += f".dcp{sc.dcp_rank}of{sc.dcp_size}"
    writer = (not replicated) or bool(sc.is_storage_writer)
    return PoolSpec(name=name, tag=tag, shard=shard, comp_bytes=comp, writer=writer)


def _pool_name(name: Any) -> str:
    return str(getattr(name, "value", name))


def _namespace(prefix: str, model: str | None, limit: int = 128) -> str:
    model = "-".join((model or "model").split("/"))
    ns = f"{prefix}/{model}"
    if len(ns.encode()) > limit:
        ns = ns.encode()[:limit - 17].decode(errors="ignore") + "~" + \
            xxhash.xxh3_64_hexdigest(ns.encode())
    return ns


# --------------------------------------------------------------------------- the backend

class _GCacheStorageImpl:
    """Body of ``GCacheStorage``; mixed into SGLang's ``HiCacheStorage`` on first access."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = getattr(storage_config, "extra_config", None) or {}
        self.cfg = PluginConfig.from_extra(extra)
        self.storage_config = storage_config
        self.interface_v1 = bool(extra.get("interface_v1"))
        self.namespace = _namespace(self.cfg.namespace, getattr(storage_config, "model_name", None))
        self.client = Client(masters=list(self.cfg.masters) or None,
                             servers=list(self.cfg.servers) or None,
                             namespace=self.namespace, timeout_ms=self.cfg.timeout_ms,
                             token=self.cfg.token, credential=self.cfg.credential,
                             config_file=self.cfg.config_file)
        self.stats = Stats()
        self.core = ChainStore(self.client, self.cfg, self.stats)
        if not self.interface_v1:
            self.core.group_policy = "key"  # legacy get/set carry no chain context
        self._pools: dict[str, _PoolBinding] = {}
        self._anchor = "kv"
        self._reg_lock = threading.Lock()
        self._closed = False
        self._log_times: dict[str, float] = {}
        log.info("gcache HiCache backend: namespace %r, %s, group policy %s/%d, v1=%s",
                 self.namespace, f"masters={list(self.cfg.masters)}" if self.cfg.masters
                 else f"servers={list(self.cfg.servers)}", self.core.group_policy,
                 self.cfg.group_pages, self.interface_v1)

    # ---- registration (scheduler thread)
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self._bind("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool
        self._bind(_pool_name(host_pool_name), host_pool)

    def on_host_pools_registered(self) -> None:
        pools = {n: (b.spec.tag, b.spec.shard, b.spec.comp_bytes) for n, b in self._pools.items()}
        log.info("gcache HiCache pools: %s", pools)
        if "kv" not in self._pools:
            raise ConfigError("no KV host pool was registered with the gcache backend")

    def _bind(self, name: str, pool: Any) -> None:
        with self._reg_lock:
            old = self._pools.get(name)
            if old is not None and old.pool is pool:
                return
            legacy = name == "kv" and not self.interface_v1
            spec = _pool_spec(name, pool, self.storage_config, legacy)
            regions = _regions(pool)
            self._pools[name] = _PoolBinding(name, pool, spec, regions)
        for _, arr in regions:  # nixl: pages move by one-sided RDMA, no local copy
            try:
                self.client.register_buffer(arr)
            except Exception as exc:  # staged through bounce buffers instead
                log.warning("cannot register host pool %s with nixl: %s", name, exc)

    # ---- helpers
    def _guard(self, what: str, exc: BaseException) -> None:
        self.stats.add(errors=1)
        now = time.monotonic()
        if now - self._log_times.get(what, 0.0) > 10.0:  # at most one traceback per 10 s per op
            self._log_times[what] = now
            log.error("gcache %s failed; treated as a miss", what, exc_info=exc)

    def _binding(self, name: Any) -> _PoolBinding | None:
        return self._pools.get(_pool_name(name))

    @staticmethod
    def _prefix(extra_info: Any) -> list[str] | None:
        pk = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return list(pk) if pk is not None else None

    def _keepalive(self, prefix: list[str] | None, keys: Sequence[str], hit: int,
                   trailing: Mapping[str, int]) -> None:
        """Refresh recency of the L1/L2-resident prefix and of the hit pages."""
        if not self.cfg.touch:
            return
        kv = self._pools.get("kv")
        if kv is None:
            return
        pre = prefix or []
        chain = pre + list(keys[:hit])
        if not chain:
            return
        groups = self.core.groups(None, chain)
        self.core.touch(kv.spec, chain, groups)
        for name, w in trailing.items():
            b = self._pools.get(name)
            if b is not None and w > 0:
                lo = max(0, len(chain) - w)
                self.core.touch(b.spec, chain[lo:], None if groups is None else groups[lo:])

    # ---- hit queries (prefetch thread)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        try:
            keys = list(keys)
            prefix = self._prefix(extra_info)
            kv = self._pools.get("kv")
            if kv is None or not keys:
                return 0
            groups = self.core.groups(prefix, keys)
            present = self.core.wait(self.core.exists_async(kv.spec, keys, groups), len(keys))
            hit = leading(present)
            self.stats.add(exists_calls=1, exists_pages=len(keys), exists_hit_pages=hit)
            self._keepalive(prefix, keys, hit, {})
            return hit
        except Exception as exc:
            self._guard("batch_exists", exc)
            return 0

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        try:
            keys = list(keys)
            prefix = self._prefix(extra_info)
            kv = self._pools.get("kv")
            if kv is None or not keys:
                return PoolTransferResult(0, {}, [])
            groups = self.core.groups(prefix, keys)
            futs = [self.core.exists_async(kv.spec, keys, groups)]
            side: list[tuple[str, str, int]] = []
            for t in pool_transfers or []:
                name = _pool_name(t.name)
                policy = _pool_name(t.hit_policy)
                b = self._pools.get(name)
                window = len(t.keys) if t.keys else 1
                side.append((name, policy, window))
                if b is None:
                    f: Future = Future()
                    f.set_result([False] * len(keys))
                    futs.append(f)
                else:
                    futs.append(self.core.exists_async(b.spec, keys, groups))
            results = [self.core.wait(f, len(keys)) for f in futs]
            hit, per_pool, restorable = window_safe_stops(
                results[0], [(n, p, r, w) for (n, p, w), r in zip(side, results[1:])])
            self.stats.add(exists_calls=1, exists_pages=len(keys),
                           exists_hit_pages=per_pool["kv"], exists_window_safe_pages=hit)
            self._keepalive(prefix, keys, hit,
                            {n: w for n, p, w in side if p == TRAILING_PAGES})
            return PoolTransferResult(hit, per_pool, restorable)
        except Exception as exc:
            self._guard("batch_exists_v2", exc)
            return PoolTransferResult(0, {}, [])

    # ---- v1 zero-copy KV (prefetch IO / backup threads)
    def _io(self, binding: _PoolBinding, keys: list[str], host_indices: Any, prefix: Any,
            write: bool) -> list[bool]:
        n = len(keys)
        if n == 0:
            return []
        if host_indices is None or int(host_indices.numel()) != n * binding.page_size:
            log.error("gcache: pool %s got %s host slots for %d pages of %d", binding.name,
                      None if host_indices is None else int(host_indices.numel()), n,
                      binding.page_size)
            return [False] * n
        if write:
            self.core.note_write_context(prefix)
        groups = self.core.groups(prefix, keys)
        bufs = binding.page_views(host_indices, n)
        if write:
            return self.core.put_pages(binding.spec, keys, bufs, groups)
        return self.core.get_pages(binding.spec, keys, bufs, groups)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        return self._v1("batch_get_v1", keys, host_indices, extra_info, False)

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        return self._v1("batch_set_v1", keys, host_indices, extra_info, True)

    def _v1(self, what: str, keys: list[str], host_indices: Any, extra_info: Any,
            write: bool) -> list[bool]:
        try:
            b = self._pools.get("kv")
            if b is None:
                return [False] * len(keys)
            return self._io(b, list(keys), host_indices, self._prefix(extra_info), write)
        except Exception as exc:
            self._guard(what, exc)
            return [False] * len(keys)

    # ---- v2 multi-pool
    def _v2(self, transfers: Any, extra_info: Any, write: bool) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        prefix = self._prefix(extra_info)
        for t in transfers or []:
            keys = list(t.keys or [])
            name = _pool_name(t.name)
            try:
                b = self._binding(name)
                if b is None:
                    out[t.name] = [False] * len(keys)
                    continue
                res = self._io(b, keys, t.host_indices, prefix, write)
            except Exception as exc:
                self._guard("batch_set_v2" if write else "batch_get_v2", exc)
                res = [False] * len(keys)
            out[t.name] = res
        return out

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        try:
            return self._v2(transfers, extra_info, False)
        except Exception as exc:
            self._guard("batch_get_v2", exc)
            return {t.name: [False] * len(t.keys or []) for t in transfers or []}

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        try:
            return self._v2(transfers, extra_info, True)
        except Exception as exc:
            self._guard("batch_set_v2", exc)
            return {t.name: [False] * len(t.keys or []) for t in transfers or []}

    # ---- legacy v0 (flat pages; used when interface_v1 is not set)
    def _flat_keys(self, keys: Sequence[str]) -> tuple[PoolSpec, list[str]] | None:
        b = self._pools.get("kv")
        if b is None:
            return None
        return b.spec, [b.spec.keys(k)[0] for k in keys]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        try:
            r = self.batch_get([key], [target_location] if target_location is not None else None)
            return r[0] if r else None
        except Exception as exc:
            self._guard("get", exc)
            return None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        try:
            fk = self._flat_keys(keys)
            if fk is None or target_locations is None:
                return [None] * len(keys)
            _spec, objs = fk
            st = self.client.get_batch_into(objs, list(target_locations))
            ok = [s == Status.OK for s in st]
            self.stats.add(get_pages=len(keys), get_pages_ok=sum(ok))
            return [t if o else None for t, o in zip(target_locations, ok)]
        except Exception as exc:
            self._guard("batch_get", exc)
            return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        try:
            return self.batch_set([key], [value])
        except Exception as exc:
            self._guard("set", exc)
            return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        try:
            fk = self._flat_keys(keys)
            if fk is None or values is None:
                return False
            spec, objs = fk
            if not spec.writer:
                return True
            todo = list(range(len(keys)))
            if self.cfg.skip_existing:
                present = self.client.exists_batch(objs)
                todo = [i for i, p in enumerate(present) if not p]
            st = self.client.put_batch_from([objs[i] for i in todo],
                                            [values[i].contiguous() for i in todo])
            ok = all(s == Status.OK for s in st)
            self.stats.add(set_pages_written=sum(s == Status.OK for s in st),
                           set_pages_skipped=len(keys) - len(todo))
            return ok
        except Exception as exc:
            self._guard("batch_set", exc)
            return False

    def exists(self, key: str) -> bool:
        try:
            return self.batch_exists([key]) == 1
        except Exception as exc:
            self._guard("exists", exc)
            return False

    # ---- admin
    def clear(self) -> None:
        """Nothing to drop locally: gcache objects are shared by every engine and
        age out by LRU; dropping them here would empty other engines' L3."""
        log.info("gcache HiCache clear(): shared L3 objects are kept (they age out by LRU)")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.client.close()
            for b in self._pools.values():  # after close: no transfer is using them
                for arr in b._arrays:
                    self.client.unregister_buffer(arr)
        except Exception as exc:
            self._guard("close", exc)

    def gcache_stats(self) -> dict[str, Any]:
        """Cumulative counters (see docs/sglang.md) plus identity."""
        return {"namespace": self.namespace, "group_policy": self.core.group_policy,
                "pools": {n: {"tag": b.spec.tag, "shard": b.spec.shard,
                              "component_bytes": list(b.spec.comp_bytes),
                              "writer": b.spec.writer} for n, b in self._pools.items()},
                "counters": self.stats.snapshot()}

    def get_stats(self) -> Any:
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:
            return None
        try:
            m = StorageMetrics()
            p, b, pbw, bbw = self.stats.drain_io()
            m.prefetch_pgs.extend(p)
            m.backup_pgs.extend(b)
            m.prefetch_bandwidth.extend(pbw)
            m.backup_bandwidth.extend(bbw)
            m.gcache = self.gcache_stats()
            return m
        except Exception as exc:
            self._guard("get_stats", exc)
            return None


_built: dict[str, type] = {}


def _build() -> type:
    if "GCacheStorage" not in _built:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

        ns = {k: v for k, v in vars(_GCacheStorageImpl).items()
              if k not in ("__dict__", "__weakref__")}
        ns["__module__"] = __name__
        ns["__qualname__"] = "GCacheStorage"
        ns["__doc__"] = "SGLang HiCacheStorage on gcache (see the module docstring)."
        _built["GCacheStorage"] = type("GCacheStorage", (HiCacheStorage,), ns)
    return _built["GCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "GCacheStorage":
        return _build()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

