"""Engine stand-ins built from SGLang 0.5.23's own code, for the plugin tests.

``build_stack`` builds what one SGLang scheduler rank has: a
``UnifiedRadixCache`` (through SGLang's unified-radix-cache test kit) whose
``init_hicache`` creates the real ``HybridCacheController``, host pools and
storage threads, and attaches ``gcache.sdk.sglang.GCacheStorage`` through
SGLang's ``dynamic`` backend factory. On CPU the device<->host copies (GPU
kernels) cannot run, so host pages are filled directly and the controller's
L3 paths are driven: ``write_storage`` (backup thread: ``batch_set_v2`` then
``batch_set_v1``), ``prefetch_from_storage`` (prefetch thread: hit query
``batch_exists[_v2]``; IO thread: ``batch_get_v1`` then ``batch_get_v2``).
"""

from __future__ import annotations

import contextlib
import json
import time
from array import array
from dataclasses import dataclass
from unittest import mock

import cpu_sglang

assert cpu_sglang.install(), cpu_sglang.SKIP_REASON

import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures as fx  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402

cpu_sglang.finish()
fx.get_device = lambda *a, **k: "cpu"

PAGE = 4
WINDOW_TOKENS = 8  # SWA window: 2 pages
WINDOW_PAGES = WINDOW_TOKENS // PAGE

PLUGIN = {"backend_name": "gcache", "module_path": "gcache.sdk.sglang",
          "class_name": "GCacheStorage", "interface_v1": 1}


def _mla_device_pool(*, size, page_size, dtype, head_num, head_dim, layer_num, device,
                     enable_memory_saver):
    return MLATokenToKVPool(size=size, page_size=page_size, dtype=dtype, kv_lora_rank=16,
                            qk_rope_head_dim=8, layer_num=layer_num, device=device,
                            enable_memory_saver=enable_memory_saver)


@dataclass
class Stack:
    cache: object
    seed: int

    @property
    def controller(self):
        return self.cache.cache_controller

    @property
    def backend(self):
        """Our GCacheStorage (unwrapped if SGLang's failure injector wraps it)."""
        b = self.controller.storage_backend
        return getattr(b, "_backend", b)

    def pool(self, name=PoolName.KV):
        return self.controller.mem_pool_host.entry_map[name].host_pool

    def page_bytes(self, name, slot: int) -> bytes:
        """One host page as SGLang itself reads it (independent of the plugin)."""
        return bytes(self.pool(name).get_data_page(int(slot)).contiguous().view(torch.uint8)
                     .numpy().tobytes())

    def backup(self, seq: list[int], *, swa_pages: list[int] | None = None,
               timeout: float = 15.0):
        """Back up ``seq`` from freshly filled host slots through the real backup thread.

        ``swa_pages``: page positions whose SWA rows SGLang hands over (a trailing
        window); None = the trailing WINDOW_PAGES when the stack has an SWA pool.
        Returns (hashes, kv_slots, {position: swa_slot}, completed_tokens).
        """
        n = len(seq) // PAGE
        hv = get_storage_hash_str(seq, None, page_size=PAGE)
        kv = self.pool(PoolName.KV)
        kidx = kv.alloc(n * PAGE)
        extra = None
        swa_slots: dict[int, int] = {}
        if PoolName.SWA in self.controller.mem_pool_host.entry_map:
            pos = list(range(max(0, n - WINDOW_PAGES), n)) if swa_pages is None else swa_pages
            sidx = self.pool(PoolName.SWA).alloc(len(pos) * PAGE)
            swa_slots = {p: int(sidx[i * PAGE]) for i, p in enumerate(pos)}
            extra = [PoolTransfer(name=PoolName.SWA, host_indices=sidx,
                                  keys=[hv[p] for p in pos],
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        self.controller.write_storage(kidx, seq, hv, [], extra_pools=extra)
        op = self.controller.ack_backup_queue.get(timeout=timeout)
        return hv, [int(kidx[i * PAGE]) for i in range(n)], swa_slots, op.completed_tokens

    def prefetch(self, seq: list[int], rid: str, timeout: float = 15.0) -> float:
        """Run SGLang's storage prefetch for ``seq`` to completion; returns seconds."""
        req = CacheRequestHandle(rid, 0)
        t0 = time.monotonic()
        self.cache.prefetch_from_storage(req, self.cache.root_node_handle(), array("q", seq),
                                         None, [])
        while time.monotonic() - t0 < timeout:
            self.cache.check_hicache_events()
            if self.cache.check_prefetch_progress(req):
                return time.monotonic() - t0
            time.sleep(0.005)
        raise AssertionError(f"prefetch {rid} did not finish in {timeout} s")

    def restored(self, seq: list[int]):
        """Host pages now in the tree for ``seq``: (kv slots, {position: swa slot})."""
        m = fx.match_prefix(self.cache, seq)
        chain = []
        node = m.last_host_node
        while node != self.cache.root_node_handle():
            chain.append(node)
            node = fx.node_parent(self.cache, node)
        chain.reverse()
        kv_slots: list[int] = []
        swa: dict[int, int] = {}
        for nd in chain:
            full = fx.node_host_value(self.cache, nd, ComponentType.FULL)
            start = len(kv_slots)
            if full is not None:
                kv_slots.extend(int(full[i]) for i in range(0, len(full), PAGE))
            if ComponentType.SWA in self.cache.tree_components:
                sv = fx.node_host_value(self.cache, nd, ComponentType.SWA)
                if sv is not None:
                    npg = len(sv) // PAGE
                    end = len(kv_slots)
                    for i in range(npg):
                        swa[end - npg + i] = int(sv[i * PAGE])
            del start
        return kv_slots, swa

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.controller.storage_backend.close()
        with contextlib.suppress(Exception):
            self.cache.release_host_resources()


def build_stack(kind: str, layout: str, servers: list[str], *, extra: dict | None = None,
                seed: int = 0) -> Stack:
    """kind: "swa" (FULL+SWA hybrid, MHA pools), "mha" or "mla" (full attention only)."""
    if kind == "swa":
        cfg = CacheConfig(page_size=PAGE, components=(ComponentType.FULL, ComponentType.SWA),
                          sliding_window_size=WINDOW_TOKENS, num_layers=6,
                          full_attention_layer_ids=(2, 5), kv_size=512, head_num=2, head_dim=8)
    else:
        cfg = CacheConfig(page_size=PAGE, num_layers=3, kv_size=512, head_num=2, head_dim=8)
    patch = (mock.patch.object(fx, "MHATokenToKVPool", _mla_device_pool) if kind == "mla"
             else contextlib.nullcontext())
    with patch:
        cache, _alloc, _rtp = fx.build_fixture(cfg)
    cfg_json = {**PLUGIN, "servers": list(servers), "prefetch_threshold": 1,
                "hicache_storage_pass_prefix_keys": True, "timeout_ms": 800, **(extra or {})}
    io = "direct" if layout == "page_first_direct" else "kernel"
    sa = ServerArgs(model_path="dummy", page_size=PAGE, hicache_io_backend=io,
                    hicache_mem_layout=layout, hicache_write_policy="write_through",
                    hicache_storage_backend="dynamic",
                    hicache_storage_backend_extra_config=json.dumps(cfg_json),
                    hicache_storage_prefetch_policy="wait_complete")
    set_global_server_args_for_scheduler(sa)
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        cache.init_hicache(sa, cache.cache_init_params)
    cc = cache.cache_controller
    cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
    g = torch.Generator().manual_seed(seed)
    for entry in cc.mem_pool_host.entries:  # every host byte random: any misplaced byte shows
        entry.host_pool.pin_memory = False  # CPU build: flat-page helpers cannot pin
        buf = entry.host_pool.kv_buffer.view(torch.uint8)
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    return Stack(cache, seed)


def seq_of(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))
