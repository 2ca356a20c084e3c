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

Kinds (``build_stack``): ``swa``, ``mha``, ``mla`` (the anchor cases), ``mamba``
(FULL+Mamba: the state pool, ``trailing_pages`` with one key), ``mamba_ple``
(the same with Qwen4-Exp's PLE short-conv and N-gram slot states riding on the
Mamba slot: no zero-copy pointers, whole flat pages), ``qsa`` (the same plus Qwen4-Exp's QSA compressed-key
``indexer``, ``all_pages`` on the KV indices), ``minimax`` (MiniMax sparse attention:
MHA plus its index-key ``indexer`` on the KV indices), ``minimax_nvfp4`` (the same
packed as MiniMax M3.1's NVFP4, 128-token pages), ``dsa`` (DSA/MLA
anchor plus the ``indexer`` sidecar, ``all_pages``), ``draft`` (MHA anchor plus a
``draft`` KV sidecar), ``swa_draft`` (FULL+SWA plus a ``draft_swa`` sidecar that
follows the SWA window) and ``dsa_draft`` (DSA plus ``draft`` and
``draft_indexer``) and ``dsv4`` (DeepSeek-V4: a logical KV anchor, paged SWA, the
compressed C1 / C2 / C4 pools with their indexers and C128 on the KV indices, and
the C4 compressor states trailing on the SWA indices), ``dsv4_draft`` (plus a
one-layer V4 MTP draft worker's ``draft_swa``). Side pools are the ones
SGLang's own assembler builds;
``backup_pools`` hands them to the backup thread the way SGLang's tree components
and ``_build_sidecar_transfers`` do, and ``restored_pools`` reads back where the
prefetch put each pool's pages.
"""

from __future__ import annotations

import contextlib
import functools
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
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (  # noqa: E402
    build_hicache_draft_sidecars,
)
from sglang.srt.mem_cache.memory_pool import (  # noqa: E402
    DSATokenToKVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import (  # noqa: E402
    CacheTransferPhase,
    ComponentType,
)
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

DSA_PAGE = 64  # DSATokenToKVPool asserts 64-token physical pages off HIP/XPU
V4_PAGE = 256  # DeepSeek-V4's page (its C128 pool needs page_size % 128 == 0)

PLUGIN = {"backend_name": "gcache", "module_path": "gcache.sdk.sglang",
          "class_name": "GCacheStorage", "interface_v1": 1}


def _mla_device_pool(*, size, page_size, dtype, head_num, head_dim, layer_num, device,
                     enable_memory_saver):
    return MLATokenToKVPool(size=size, page_size=page_size, dtype=dtype, kv_lora_rank=16,
                            qk_rope_head_dim=8, layer_num=layer_num, device=device,
                            enable_memory_saver=enable_memory_saver)


def _dsa_device_pool(*, size, page_size, dtype, head_num, head_dim, layer_num, device,
                     enable_memory_saver):
    return DSATokenToKVPool(size=size, page_size=page_size, kv_lora_rank=16, dtype=dtype,
                            qk_rope_head_dim=8, layer_num=layer_num, device=device,
                            index_head_dim=128, enable_memory_saver=enable_memory_saver,
                            kv_cache_dim=24)


def _v4_device_pool(*, size, size_swa, page_size, dtype, head_num, head_dim,
                    swa_attention_layer_ids, full_attention_layer_ids, device, **_kw):
    """A 5-layer DeepSeek-V4 pool, one layer per compression ratio (0: SWA only; 1 and
    2: C1 / C2 + indexers, layers 1-2 their KV sources; 4: C4 + indexer + compressor
    states; 128: C128), fp8 as the model serves it; stands in for the kit's SWAKVPool."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=size_swa, c4_size=size // 4, c128_size=size // 128,
        c4_state_pool_size=64, c128_state_pool_size=64, page_size=page_size,
        swa_page_size=page_size, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
        indexer_head_dim=128, layer_num=5, device=device, enable_memory_saver=False,
        compression_ratios=[0, 1, 2, 4, 128], sliding_window=128, start_layer=0, end_layer=5,
        kv_source_layers=[1, 2], full_size=size)


def _qsa_device_pool(*, size, dtype, page_size, head_num, head_dim, full_attention_layer_ids,
                     device, enable_memory_saver, mamba_pool):
    """Qwen4-Exp's hybrid pool with QSA compressed keys; stands in for the kit's
    HybridLinearKVPool."""
    from sglang.srt.mem_cache.qsa_kv_pool import QSATokenToKVPool

    return QSATokenToKVPool(
        size=size, dtype=dtype, page_size=page_size, head_num=head_num, head_dim=head_dim,
        full_attention_layer_ids=list(full_attention_layer_ids), device=device,
        mamba_pool=mamba_pool, qsa_index_kv_heads=1, qsa_index_head_dim=8,
        qsa_compress_ratio=PAGE, qsa_token_topk=8, num_request_slots=10,
        enable_memory_saver=enable_memory_saver)


def _minimax_device_pool(*, size, page_size, dtype, head_num, head_dim, layer_num, device,
                         enable_memory_saver):
    """MiniMax's sparse-attention pool (dense layer 0, sparse layers 1-2 with an index
    key cache); stands in for the kit's MHATokenToKVPool."""
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    return MiniMaxSparseKVPool(size=size, page_size=page_size, dtype=dtype, head_num=head_num,
                               head_dim=head_dim, idx_head_dim=8, dense_layer_ids=[0],
                               sparse_layer_ids=[1, 2], disable_value_sparse_layer_ids=[1, 2],
                               device=device,
                               enable_memory_saver=enable_memory_saver, start_layer=0,
                               end_layer=layer_num)


def _nvfp4_device_pool(*, size, page_size, dtype, head_num, head_dim, layer_num, device,
                       enable_memory_saver):
    """MiniMax M3.1's NVFP4 pool (every layer sparse, K-only index), packed as NVFP4."""
    from sglang.srt.mem_cache.minimax_m3_nvfp4_pool import (
        MiniMaxM3Nvfp4IndexKPool,
        MiniMaxM3Nvfp4KVPool,
    )

    layers = list(range(layer_num))
    return MiniMaxM3Nvfp4KVPool(
        size=size, page_size=page_size, dtype=dtype, head_num=head_num,
        head_dim=MiniMaxM3Nvfp4IndexKPool.INDEX_HEAD_DIM,
        idx_head_dim=MiniMaxM3Nvfp4IndexKPool.INDEX_HEAD_DIM, dense_layer_ids=[],
        sparse_layer_ids=layers, disable_value_sparse_layer_ids=layers, device=device,
        enable_memory_saver=enable_memory_saver, start_layer=0, end_layer=layer_num)


def _draft_device_pool(kind: str, cache):
    """The draft worker's KV pool, as SGLang's speculative worker would size it."""
    size = cache.cache_init_params.token_to_kv_pool_allocator.size
    if kind == "draft":
        return MHATokenToKVPool(size=size, page_size=PAGE, dtype=torch.bfloat16, head_num=2,
                                head_dim=8, layer_num=1, device="cpu",
                                enable_memory_saver=False)
    if kind == "dsv4_draft":  # a one-layer SWA-only V4 draft (MTP) worker
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        return DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=size, c4_size=size // 4, c128_size=size // 128,
            c4_state_pool_size=64, c128_state_pool_size=64, page_size=V4_PAGE,
            swa_page_size=V4_PAGE, dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
            indexer_head_dim=128, layer_num=1, device="cpu", enable_memory_saver=False,
            compression_ratios=[0], sliding_window=128, start_layer=0, end_layer=1,
            full_size=size, is_draft_worker=True)
    if kind == "dsa_draft":
        return _dsa_device_pool(size=size, page_size=DSA_PAGE, dtype=torch.bfloat16,
                                head_num=1, head_dim=8, layer_num=1, device="cpu",
                                enable_memory_saver=False)
    return SWAKVPool(size=size, size_swa=size, page_size=PAGE, dtype=torch.bfloat16, head_num=2,
                     head_dim=8, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                     device="cpu")


def _host_buffers(pool) -> list:
    """Every host tensor of a pool (SGLang's own registration accessor, else kv_buffer)."""
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    bufs = get() if get is not None else pool.kv_buffer
    return [b for b in (bufs if isinstance(bufs, (list, tuple)) else [bufs])
            if b is not None and b.numel()]


@dataclass
class Backup:
    """What ``Stack.backup_pools`` handed to the backup thread."""

    hashes: list[str]
    slots: dict[str, dict[int, int]]  # pool -> {page position: host slot}
    completed_tokens: int


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

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def backup_pools(self, seq: list[int], timeout: float = 15.0) -> Backup:
        """Back up ``seq`` with every side pool of the stack, as SGLang hands them over.

        KV: every page. SWA: the pages of the trailing window. Mamba: one state slot
        for the last page (``MambaComponent.build_hicache_transfers``). Sidecars
        (indexer, draft, draft_swa): SGLang's ``_build_sidecar_transfers``, so their
        indices follow their source pool's.
        """
        ps = self.page_size
        n = len(seq) // ps
        hv = get_storage_hash_str(seq, None, page_size=ps)
        entries = self.controller.mem_pool_host.entry_map
        window = self.cache.cache_init_params.sliding_window_size or 0
        kidx = self.pool(PoolName.KV).alloc(n * ps)
        slots: dict[str, dict[int, int]] = {"kv": {i: int(kidx[i * ps]) for i in range(n)}}
        comp: dict = {}
        extra: list[PoolTransfer] = []
        if PoolName.SWA in entries:
            pos = list(range(max(0, n - -(-window // ps)), n))
            sidx = self.pool(PoolName.SWA).alloc(len(pos) * ps)
            slots["swa"] = {p: int(sidx[i * ps]) for i, p in enumerate(pos)}
            comp[ComponentType.SWA] = [PoolTransfer(
                name=PoolName.SWA, host_indices=sidx, keys=[hv[p] for p in pos],
                hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        if PoolName.MAMBA in entries:
            midx = self.pool(PoolName.MAMBA).alloc(1)
            slots["mamba"] = {n - 1: int(midx[0])}
            comp[ComponentType.MAMBA] = [PoolTransfer(
                name=PoolName.MAMBA, host_indices=midx, keys=[hv[-1]],
                hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        kv_xfer = PoolTransfer(name=PoolName.KV, host_indices=kidx, keys=hv)
        for t in self.cache._build_sidecar_transfers(CacheTransferPhase.BACKUP_STORAGE,
                                                     kv_xfer, comp):
            slots[str(t.name)] = dict(slots[str(t.indices_from_pool)])
            extra.append(t)
        extra = [x for xs in comp.values() for x in xs] + extra
        self.controller.write_storage(kidx, seq, hv, [], extra_pools=extra or None)
        op = self.controller.ack_backup_queue.get(timeout=timeout)
        return Backup(hv, slots, op.completed_tokens)

    def restored_pools(self, seq: list[int]) -> dict[str, dict[int, int]]:
        """Where the prefetch put each pool's pages: pool -> {page position: host slot}."""
        ps = self.page_size
        chain = self._host_chain(seq)
        out: dict[str, dict[int, int]] = {"kv": {}}
        for nd in chain:
            full = fx.node_host_value(self.cache, nd, ComponentType.FULL)
            base = len(out["kv"])
            for i in range(0, 0 if full is None else len(full), ps):
                out["kv"][base + i // ps] = int(full[i])
            end = len(out["kv"])
            if ComponentType.SWA in self.cache.tree_components:
                sv = fx.node_host_value(self.cache, nd, ComponentType.SWA)
                if sv is not None:
                    npg = len(sv) // ps
                    out.setdefault("swa", {}).update(
                        {end - npg + i: int(sv[i * ps]) for i in range(npg)})
            if ComponentType.MAMBA in self.cache.tree_components:
                mv = fx.node_host_value(self.cache, nd, ComponentType.MAMBA)
                if mv is not None:
                    out.setdefault("mamba", {})[end - 1] = int(mv[0])
        for spec in self.cache.sidecar_pool_specs:
            src = out.get(str(spec.indices_from_pool))
            if src:
                out[str(spec.pool_name)] = dict(src)
        return out

    def _host_chain(self, seq: list[int]) -> list:
        m = fx.match_prefix(self.cache, seq)
        chain = []
        node = m.last_host_node
        while node != self.cache.root_node_handle():
            chain.append(node)
            node = fx.node_parent(self.cache, node)
        chain.reverse()
        return chain

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
        chain = self._host_chain(seq)
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
                seed: int = 0, tp: tuple[int, int] = (0, 1)) -> Stack:
    """kind: one of the kinds in the module docstring. ``tp``: (rank, size) this
    stack's storage config carries (one process plays one rank; no collectives)."""
    page = {"dsa": DSA_PAGE, "dsa_draft": DSA_PAGE, "dsv4": V4_PAGE,
            "dsv4_draft": V4_PAGE, "minimax_nvfp4": 128}.get(kind, PAGE)  # NVFP4: 128
    if kind in ("dsv4", "dsv4_draft"):
        cfg = CacheConfig(page_size=page, components=(ComponentType.FULL, ComponentType.SWA),
                          sliding_window_size=128, num_layers=5, full_attention_layer_ids=(0,),
                          kv_size=8 * page, max_context_len=8 * page, head_num=1, head_dim=8)
    elif kind in ("swa", "swa_draft"):
        cfg = CacheConfig(page_size=PAGE, components=(ComponentType.FULL, ComponentType.SWA),
                          sliding_window_size=WINDOW_TOKENS, num_layers=6,
                          full_attention_layer_ids=(2, 5), kv_size=512, head_num=2, head_dim=8)
    elif kind in ("mamba", "mamba_ple", "qsa"):  # page > 1 needs SGLang's mamba extra buffer
        cfg = CacheConfig(page_size=PAGE, components=(ComponentType.FULL, ComponentType.MAMBA),
                          num_layers=4, full_attention_layer_ids=(1, 3), kv_size=512,
                          head_num=2, head_dim=8, enable_mamba_extra_buffer=True,
                          mamba_cache_size=20, mamba_intermediate_size=32, mamba_num_heads=2,
                          mamba_head_dim=8, mamba_state_size=4)
    else:
        cfg = CacheConfig(page_size=page, num_layers=3, kv_size=128 * page, head_num=2,
                          head_dim=8, max_context_len=128 * page)
    device_pool = {"mla": _mla_device_pool, "dsa": _dsa_device_pool,
                   "minimax": _minimax_device_pool, "minimax_nvfp4": _nvfp4_device_pool,
                   "dsa_draft": _dsa_device_pool}.get(kind)
    patch = (mock.patch.object(fx, "MHATokenToKVPool", device_pool) if device_pool
             else mock.patch.object(fx, "SWAKVPool", _v4_device_pool) if kind.startswith("dsv4")
             else mock.patch.object(fx, "HybridReqToTokenPool", functools.partial(
                 fx.HybridReqToTokenPool, ngram_context_len=4, short_conv_layer_ids=[0],
                 short_conv_state_shape=(8, 3))) if kind == "mamba_ple"
             else mock.patch.object(fx, "HybridLinearKVPool", _qsa_device_pool) if kind == "qsa"
             else contextlib.nullcontext())
    with patch, get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
        cache, _alloc, _rtp = fx.build_fixture(cfg)
    cfg_json = {**PLUGIN, "servers": list(servers), "prefetch_threshold": 1,
                "hicache_storage_pass_prefix_keys": True, "timeout_ms": 800, **(extra or {})}
    io = "direct" if layout == "page_first_direct" else "kernel"
    sa = ServerArgs(model_path="dummy", page_size=page, hicache_io_backend=io,
                    hicache_mem_layout=layout, hicache_write_policy="write_through",
                    hicache_storage_backend="dynamic",
                    hicache_storage_backend_extra_config=json.dumps(cfg_json),
                    hicache_storage_prefetch_policy="wait_complete")
    set_global_server_args_for_scheduler(sa)
    with get_parallel().override(tp_rank=tp[0], tp_size=tp[1], attn_tp_rank=tp[0],
                                 attn_tp_size=tp[1], moe_tp_rank=tp[0], moe_tp_size=tp[1],
                                 pp_rank=0, pp_size=1):
        cache.init_hicache(sa, cache.cache_init_params)
        if kind.endswith("draft"):  # what kv_cache_builder.maybe_register_hicache_draft does
            specs, entries = build_hicache_draft_sidecars(
                draft_device_pools=(_draft_device_pool(kind, cache),), tree_cache=cache)
            for spec, entry in zip(specs, entries, strict=True):
                cache.register_sidecar_pool(spec, entry)
    cc = cache.cache_controller
    cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
    g = torch.Generator().manual_seed(seed)
    for entry in cc.mem_pool_host.entries:  # every host byte random: any misplaced byte shows
        entry.host_pool.pin_memory = False  # CPU build: flat-page helpers cannot pin
        for t in _host_buffers(entry.host_pool):
            buf = t.view(torch.uint8)
            buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    return Stack(cache, seed)


@contextlib.contextmanager
def stack_pair(kind: str, servers: list[str], seeds: tuple[int, int], *,
               layout: str = "page_first", tps: tuple = ((0, 1), (0, 1))):
    """A producer and a consumer engine of one kind (own host pools, own random
    bytes), closed on exit."""
    prod = build_stack(kind, layout, servers, seed=seeds[0], tp=tps[0])
    try:
        cons = build_stack(kind, layout, servers, seed=seeds[1], tp=tps[1])
    except BaseException:
        prod.close()
        raise
    try:
        yield prod, cons
    finally:
        prod.close()
        cons.close()


def seq_of(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))
