"""SGLang host pools as gcache objects: the ``PoolSpec`` of a registered host pool and
the mapping from SGLang's page pointers to writable views over host memory.

Called on SGLang's scheduler thread at registration (``bind_pool``), and by the IO
threads (``PoolBinding.page_views``, which only reads what registration built). Nothing
here does IO or blocks.

A ``PoolSpec``'s ``layout tag`` spells dtype, page size, host layout and storage
format, plus a digest of the pool geometry (layers, heads, bytes per component), so
pages written under another layout or shape miss instead of loading wrong bytes.
``shard`` is ``tp<r>of<n>`` for rank-sharded pools (MHA: every TP rank stores its own
head shard; Mamba state) and ``r`` for replicated pools (MLA, and every non-MHA pool
of a model SGLang calls rank-replicated, such as the DSA indexer: only the storage
writer rank stores, every rank reads), plus ``pp``/``cp``/``dcp`` suffixes when those
are > 1. Components are the pointers ``get_page_buffer_meta`` returns per page (MHA
page_first: K and V; MLA: one), so each object is read from and written to host memory
in place: no copy beyond what the socket needs. Two pool kinds have no such pointers:
a logical anchor (DeepSeek-V4's KV ``LogicalHostPool``) is one marker object per page,
and a pool whose ``get_page_buffer_meta`` raises ``NotImplementedError`` (Mamba with
PLE slot side states) is one whole flat page (``get_data_page`` /
``set_from_flat_data_page``, copied).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
from typing import Any

import numpy as np
import xxhash

from gcache.errors import ConfigError
from gcache.sdk.sglang.chain_store import PoolSpec

log = logging.getLogger("gcache.sglang")

#: A logical anchor pool (DeepSeek-V4's KV ``LogicalHostPool``: page indices that
#: the compressed side pools hang off, no bytes) is stored as one marker object of
#: this size per page, so its presence still gates the hit like any KV page.
MARKER_BYTES = 1


class PoolBinding:
    """One registered SGLang host pool: its PoolSpec and pointer -> view mapping."""

    def __init__(self, name: str, pool: Any, spec: PoolSpec, regions: list[tuple[int, Any]],
                 logical: bool = False, flat: bool = False) -> None:
        self.name, self.pool, self.spec = name, pool, spec
        self.page_size = int(pool.page_size)
        self.logical = logical  # an anchor with no bytes: one marker object per page
        self.flat = flat  # no zero-copy pointers: one whole-page object, copied
        self._starts = [s for s, _ in regions]
        self.arrays = [a for _, a in regions]  # the pool's CPU buffers (nixl registers them)

    def _view(self, ptr: int, size: int) -> Any:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            arr = self.arrays[i]
            off = ptr - self._starts[i]
            if 0 <= off and off + size <= arr.shape[0]:
                return arr[off:off + size]
        # a pool kind whose buffers we did not map: trust SGLang's pointer
        return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))

    def page_views(self, host_indices: Any, npages: int) -> list[list[Any]]:
        """Per page, one writable uint8 view per component, straight over host memory
        (a logical anchor: a fresh one-byte marker per page, written as 1, read and
        dropped)."""
        if self.logical:
            return [[np.ones(MARKER_BYTES, dtype=np.uint8)] for _ in range(npages)]
        if self.flat:  # a copy of each page (SGLang's flat page bytes), not a view
            import torch

            return [[self.pool.get_data_page(int(host_indices[i * self.page_size]), flat=True)
                     .contiguous().view(-1).view(torch.uint8).numpy()] for i in range(npages)]
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        n = len(self.spec.comp_bytes)
        if len(ptrs) != npages * n:
            raise ValueError(f"pool {self.name}: {len(ptrs)} buffer pointers for {npages} "
                             f"pages, expected {n} per page")
        return [[self._view(int(ptrs[i * n + c]), int(sizes[i * n + c])) for c in range(n)]
                for i in range(npages)]

    def finish_read(self, host_indices: Any, bufs: list[list[Any]], ok: list[bool]) -> None:
        """After a read into ``page_views``: a flat pool's pages that arrived are copied
        into host memory (``set_from_flat_data_page``); views need nothing."""
        if not self.flat:
            return
        import torch

        for i, good in enumerate(ok):
            if good:
                self.pool.set_from_flat_data_page(int(host_indices[i * self.page_size]),
                                                  torch.from_numpy(bufs[i][0]))


def _regions(pool: Any) -> list[tuple[int, Any]]:
    """The pool's contiguous CPU tensors as (address, uint8 array), sorted by address.

    ``get_hybrid_pool_buffer()`` is SGLang's list of a pool's host tensors (what its
    Mooncake and NIXL backends register: the DSA indexer's ``index_k_with_scale_buffer``,
    Mamba's temporal and conv states, ...); the attributes cover pools without it
    (MLA, the KV anchors). A tensor inside another one (MHA's ``k_buffer`` and
    ``v_buffer`` are views of ``kv_buffer``) is mapped, and registered, once.
    """
    import torch

    tensors: list[Any] = []
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    if callable(get):
        tensors.extend(get() or ())
    for attr in ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer"):
        val = getattr(pool, attr, None)
        tensors.extend(val if isinstance(val, (list, tuple)) else [val])
    spans = sorted(((t.data_ptr(), t.numel() * t.element_size(), t) for t in tensors
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                    and t.is_contiguous() and t.numel()), key=lambda x: (x[0], -x[1]))
    found: list[tuple[int, Any]] = []
    end = -1
    for ptr, nbytes, t in spans:  # widest first at each address: drop what it contains
        if ptr + nbytes <= end:
            continue
        found.append((ptr, t.detach().reshape(-1).view(torch.uint8).numpy()))
        end = max(end, ptr + nbytes)
    return found


def _replicated(name: str, pool: Any, storage_config: Any) -> bool:
    """Whether one copy of the pool serves every TP rank (key shard ``r``).

    SGLang's ``is_mla_model`` means "rank-replicated" (MLA, DSA, DeepSeek-V4): its
    controller backs such a model's pools up from the storage writer rank only and
    every rank reads them, so their keys must not name the rank (the DSA indexer
    and draft indexer included). Mamba state is TP-sharded even then (SGLang backs
    it up on every rank), and an MHA pool holds each rank's own heads, so neither
    is shared. An MLA pool (``kv_cache_dim``) is replicated in any model.
    """
    if name == "mamba" or hasattr(pool, "head_num"):
        return False
    return hasattr(pool, "kv_cache_dim") or bool(getattr(storage_config, "is_mla_model", False))


def _pool_spec(name: str, pool: Any, storage_config: Any, legacy_kv: bool,
               sizes: Any, flat: bool = False) -> PoolSpec:
    """Identity and object shapes of one host pool (``sizes``: bytes per component of
    one page, from ``get_page_buffer_meta``)."""
    page = int(pool.page_size)
    layout = str(getattr(pool, "layout", "?"))
    if getattr(storage_config, "should_split_heads", False):
        raise ConfigError("gcache does not support heterogeneous-TP head splitting "
                          "(tp_lcm_size / page_head split); run every engine with the same TP")
    replicated = _replicated(name, pool, storage_config)
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
                     getattr(pool, "kv_cache_dim", None), comp,
                     "flat" if legacy_kv or flat else "v1"))
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


def bind_pool(name: str, pool: Any, storage_config: Any, legacy_kv: bool) -> PoolBinding:
    """Map one host pool: its ``PoolSpec`` (ConfigError for a layout gcache cannot store)
    and its CPU buffers, for pointer -> view lookups."""
    import torch

    flat = False
    try:
        meta = pool.get_page_buffer_meta(torch.arange(int(pool.page_size), dtype=torch.int64))
    except NotImplementedError as exc:  # e.g. Mamba with PLE slot side states
        log.warning("pool %s has no zero-copy page pointers (%s); storing whole flat "
                    "pages, copied through get_data_page", name, exc)
        flat, meta = True, None
    logical = meta is None and not flat  # DeepSeek-V4's LogicalHostPool: no bytes
    if flat:
        page = pool.get_data_page(0, flat=True)  # (the dummy page may ask for pinning)
        sizes: Any = (page.numel() * page.element_size(),)
    else:
        sizes = (MARKER_BYTES,) if logical else meta[1]
    spec = _pool_spec(name, pool, storage_config, legacy_kv, sizes, flat)
    return PoolBinding(name, pool, spec, _regions(pool), logical, flat)


def pool_name(name: Any) -> str:
    """SGLang's pool name (a ``PoolName`` enum or a plain string) as a plain string."""
    return str(getattr(name, "value", name))
