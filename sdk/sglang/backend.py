"""``GCacheStorage``: SGLang's HiCache L3 storage backend on gcache (the plugin's contract).

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

This module imports SGLang (it subclasses ``HiCacheStorage``); ``gcache.sdk.sglang``
imports it only when ``GCacheStorage`` is first asked for, so the rest of the plugin
(chain_store.py, config.py) works without SGLang.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult

from gcache.errors import ConfigError
from gcache.sdk.client import Client
from gcache.sdk.sglang.chain_store import (
    ChainStore,
    HitPolicy,
    PoolSpec,
    SidePool,
    Stats,
    leading,
    window_safe_stops,
)
from gcache.sdk.sglang.config import PluginConfig
from gcache.sdk.sglang.host_pools import PoolBinding, bind_pool, pool_name
from gcache.status import Status

log = logging.getLogger("gcache.sglang")


def _namespace(prefix: str, model: str | None, limit: int = 128) -> str:
    model = "-".join((model or "model").split("/"))
    ns = f"{prefix}/{model}"
    if len(ns.encode()) > limit:
        ns = ns.encode()[:limit - 17].decode(errors="ignore") + "~" + \
            xxhash.xxh3_64_hexdigest(ns.encode())
    return ns


class GCacheStorage(HiCacheStorage):
    """SGLang HiCacheStorage on gcache (see the module docstring)."""

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
        self._pools: dict[str, PoolBinding] = {}
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
        self._bind(pool_name(host_pool_name), host_pool)

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
            binding = bind_pool(name, pool, self.storage_config, legacy)
            self._pools[name] = binding
        for arr in binding.arrays:  # nixl: pages move by one-sided RDMA, no local copy
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

    def bindings(self) -> dict[str, PoolBinding]:
        """The registered pools by name (each pool's ``PoolSpec`` and mapped host
        buffers), for diagnostics and tests. Read-only snapshot."""
        with self._reg_lock:
            return dict(self._pools)

    def _binding(self, name: Any) -> PoolBinding | None:
        return self._pools.get(pool_name(name))

    @staticmethod
    def _prefix(extra_info: Any) -> list[str] | None:
        pk = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return list(pk) if pk is not None else None

    def _keepalive(self, prefix: list[str] | None, keys: Sequence[str], hit: int,
                   trailing: Mapping[str, int], all_pages: Sequence[str] = ()) -> None:
        """Refresh recency of the L1/L2-resident prefix and of the hit pages: KV and
        every ``all_pages`` pool along the whole chain (each gates the hit), the
        trailing window of each ``trailing_pages`` pool."""
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
        for name in all_pages:
            b = self._pools.get(name)
            if b is not None:
                self.core.touch(b.spec, chain, groups)
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
                name = pool_name(t.name)
                policy = pool_name(t.hit_policy)
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
                results[0], [SidePool(n, p, r, w) for (n, p, w), r in zip(side, results[1:])])
            self.stats.add(exists_calls=1, exists_pages=len(keys),
                           exists_hit_pages=per_pool["kv"], exists_window_safe_pages=hit)
            self._keepalive(prefix, keys, hit,
                            {n: w for n, p, w in side if p == HitPolicy.TRAILING_PAGES},
                            [n for n, p, _w in side if p == HitPolicy.ALL_PAGES])
            return PoolTransferResult(hit, per_pool, restorable)
        except Exception as exc:
            self._guard("batch_exists_v2", exc)
            return PoolTransferResult(0, {}, [])

    # ---- v1 zero-copy KV (prefetch IO / backup threads)
    def _io(self, binding: PoolBinding, keys: list[str], host_indices: Any, prefix: Any,
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
        if write:  # the page before the first written: the last prefix key ("" if none)
            before = None if prefix is None else prefix[-1] if prefix else ""
            return self.core.put_pages(binding.spec, keys, bufs, groups, before)
        ok = self.core.get_pages(binding.spec, keys, bufs, groups)
        binding.finish_read(host_indices, bufs, ok)
        return ok

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
            name = pool_name(t.name)
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
                for arr in b.arrays:
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
            io = self.stats.drain_io()
            m.prefetch_pgs.extend(io.prefetch_pgs)
            m.backup_pgs.extend(io.backup_pgs)
            m.prefetch_bandwidth.extend(io.prefetch_bandwidth)
            m.backup_bandwidth.extend(io.backup_bandwidth)
            m.gcache = self.gcache_stats()
            return m
        except Exception as exc:
            self._guard("get_stats", exc)
            return None
