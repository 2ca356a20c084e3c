"""``GCacheConnectorV1``: gcache as the shared L3 KV cache behind vLLM's v1 engine.

Load it with::

    --kv-transfer-config '{"kv_connector": "GCacheConnectorV1",
                           "kv_connector_module_path": "gcache.sdk.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"masters": "m1:7700,m2:7700"}}'

Contract (vLLM's ``KVConnectorBase_V1``; which side calls what, docs/vllm.md):

Scheduler side (vLLM's scheduler thread; may block only for the lookup's deadline):
    ``get_num_new_matched_tokens``: one batched ``exists`` per call over the blocks past
        the local prefix (full groups: every block; window groups: every block, of which
        the hit rule reads only the last ones before each candidate end; see
        ``matching``). Side-effect free: it stores nothing and pins nothing; it
        remembers the answer for ``update_state_after_alloc``. A store fault is a miss.
        Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS).
    ``update_state_after_alloc``: the blocks vLLM allocated for the hit become a load
        plan (group, block id, block hash); window groups load only the window.
    ``build_connector_meta``: hands the plans to the workers, once each, with the blocks
        this step fills (full groups: every new whole block; window groups: the blocks
        the window sees at the step's end), which the workers copy out after the
        forward, so a running request's prefix is shared before it finishes.
    ``request_finished[_all_groups]``: a finished request's blocks not saved yet become
        a save plan; they stay held (returns True) until the workers report it done.
Worker side (vLLM's model-runner thread; never blocks on the store):
    ``register_kv_caches``: maps every group's blocks to byte runs of the KV tensors
        (``layout.GroupLayout``); block-outermost layouts (the connector asks vLLM for
        ``BLHNC``: ``get_required_kvcache_layout``) are read and written in place; with
        the nixl transport the tensors are registered for one-sided transfers.
    ``start_load_kv``: issues the loads (``get_batch_into_async``), completion on the
        SDK's dispatch threads. ``wait_for_save``: copies the step's filled blocks into
        host staging and issues every save (``put_batch_from_async(if_absent=True)``).
        ``wait_for_layer_load`` and ``save_kv_layer`` do nothing: transfers are
        whole-block, between steps.
    ``get_transfer_results``: finished loads and saves; a load that failed for any
        block is reported finished *and* failed: single-group models by block id
        (``get_block_ids_with_load_errors``: vLLM keeps the valid prefix), hybrid models
        by request (``failed_recving``: block ids are per group there). A failed block is
        never used.

Keys: the client's namespace fingerprints what makes bytes interchangeable (model,
KV dtype, layout, TP/PP size, groups with their block sizes, page sizes and windows, the
block-hash algorithm and its seed); a key is ``<group>/<tp rank>/<vLLM block hash>``
(rank 0 for MLA, whose KV every rank holds alike: only rank 0 writes). vLLM's block
hash chains the whole prefix, with LoRA, multimodal and cache-salt inputs, and is
deterministic across processes for sha256 hashing (its default) or with PYTHONHASHSEED
set; without it a non-cryptographic hash is seeded at random per process, and the seed
is part of the namespace, so two such processes never share (nor confuse) blocks.

Nothing here raises into vLLM after start-up: a store fault is a miss or a load error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from gcache.sdk.client import Client
from gcache.sdk.vllm.config import ConnectorConfig
from gcache.sdk.vllm.layout import GroupLayout
from gcache.sdk.vllm.matching import (
    GroupKind,
    GroupPlan,
    blocks_to_load,
    longest_hit,
    plan_lookup,
    window_blocks,
)
from gcache.status import Status

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("gcache.vllm")

# (group id, vLLM block id, vLLM block hash)
Item = tuple[int, int, bytes]

SCATTER_BATCH = 32  # staged blocks placed per native call as a load lands


@dataclass
class GCacheConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the loads and saves to start."""

    loads: dict[str, list[Item]] = field(default_factory=dict)
    saves: dict[str, list[Item]] = field(default_factory=dict)  # finished: blocks held
    saves_now: dict[str, list[Item]] = field(default_factory=dict)  # filled this step
    # req -> gid -> block hash of the block before the first saved one (b"": the head):
    # each group's saves are consecutive blocks of one chain (``chain_parent`` on put)
    parents: dict[str, dict[int, bytes]] = field(default_factory=dict)


@dataclass
class GCacheConnectorStats(KVConnectorStats):
    """Counters since the last interval (vLLM's connector stats hooks)."""

    def _add(self, name: str, n: int) -> None:
        self.data[name] = self.data.get(name, 0) + n

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self._add(k, v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def group_plans(kv_cache_config: "KVCacheConfig", hash_block_size: int) -> list[GroupPlan]:
    """How the connector stores each KV-cache group (``matching.GroupPlan``)."""
    plans = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        bs = spec.block_size
        ratio = max(1, bs // hash_block_size)
        if not getattr(g, "enable_kv_transfer", True):  # vLLM rebuilds it after a load
            plans.append(GroupPlan(gid, GroupKind.SKIP, bs, 0, ratio, False))
        elif isinstance(spec, SlidingWindowSpec):
            plans.append(GroupPlan(gid, GroupKind.WINDOW, bs,
                                   window_blocks(spec.sliding_window, bs), ratio, False))
        elif isinstance(spec, FullAttentionSpec) and bs % hash_block_size == 0:
            plans.append(GroupPlan(gid, GroupKind.FULL, bs, 0, ratio,
                                   isinstance(spec, MLAAttentionSpec)))
        else:
            plans.append(GroupPlan(gid, GroupKind.OTHER, bs, 0, ratio, False))
    return plans


def fingerprint(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                hash_block_size: int) -> str:
    """What must match for two engines' blocks to be interchangeable, as text."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    parts = [f"model={mc.model}", f"revision={getattr(mc, 'revision', None)}",
             f"dtype={mc.dtype}", f"cache_dtype={cc.cache_dtype}",
             f"tp={pc.tensor_parallel_size}", f"pp={pc.pipeline_parallel_size}",
             f"hash={cc.prefix_caching_hash_algo}/{hash_block_size}/{_none_hash_seed()}",
             f"layout={_layout(cc)}"]
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        s = g.kv_cache_spec
        parts.append(f"g{gid}={type(s).__name__}/{s.block_size}/{s.page_size_bytes}/"
                     f"{len(g.layer_names)}/{getattr(s, 'sliding_window', None)}")
    return ";".join(parts)


def namespace_of(prefix: str, model: str, fp: str) -> str:
    """``<prefix>/<model name>-<fingerprint digest>``: a credential granted ``<prefix>/*``
    reaches every model's blocks; engines share blocks only when ``fp`` matches."""
    name = os.path.basename(str(model).rstrip("/")) or "model"
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in name)[:48]
    return f"{prefix}/{name}-{hashlib.sha256(fp.encode()).hexdigest()[:16]}"


def _none_hash_seed() -> str:
    try:
        from vllm.v1.core.kv_cache_utils import get_none_hash_seed
        return hashlib.sha256(str(get_none_hash_seed()).encode()).hexdigest()[:16]
    except Exception:  # noqa: BLE001 - older vLLM: the default seed
        return "default"


def _layout(cache_config: Any) -> str:
    try:
        return str(cache_config.get_resolved_kv_cache_layout())
    except Exception:  # noqa: BLE001 - not resolvable before the backend is chosen
        return os.environ.get("VLLM_KV_CACHE_LAYOUT", "default")


def _tp_rank(cfg: ConnectorConfig) -> int:
    if cfg.tp_rank is not None:
        return cfg.tp_rank
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no distributed state (one process): rank 0
        return 0


class StagingPool:
    """Host staging buffers, kept for reuse: a fresh buffer of a long prefix costs a page
    fault per 4 KiB on first touch, more than the copy itself. Buffers are reused by
    exact size (one size per group and transfer length: prompts of one model repeat
    them), and at most ``keep_bytes`` stay allocated. Thread-safe."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[bytearray]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if self._kept + len(buf) <= self.keep_bytes:
                self._free.setdefault(len(buf), []).append(buf)
                self._kept += len(buf)


class GCacheConnectorV1(KVConnectorBase_V1, SupportsHMA):
    """gcache behind vLLM: see the module docstring for the contract."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.cfg = ConnectorConfig.from_extra(extra)
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        _, self.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        self.plans = group_plans(kv_cache_config, self.hash_block_size)
        self.enabled = all(p.kind is not GroupKind.OTHER for p in self.plans)
        if not self.enabled:
            log.warning("gcache connector: KV-cache groups %s are neither full nor sliding-"
                        "window attention; the connector stores nothing for this model",
                        [type(g.kv_cache_spec).__name__
                         for g in kv_cache_config.kv_cache_groups])
        self.multi_group = len(self.plans) > 1
        fp = fingerprint(vllm_config, kv_cache_config, self.hash_block_size)
        ns = namespace_of(self.cfg.namespace or "vllm", vllm_config.model_config.model, fp)
        log.info("gcache connector (%s): namespace %s for %s", role.name, ns, fp)
        self.client = Client(self.cfg.servers or None, masters=self.cfg.masters or None,
                             namespace=ns, timeout_ms=self.cfg.timeout_ms,
                             credential=self.cfg.credential, token=self.cfg.token,
                             transport=self.cfg.transport, config_file=self.cfg.config_file)
        self.rank = _tp_rank(self.cfg)
        self._lock = threading.Lock()
        self._stats = GCacheConnectorStats()
        # scheduler side
        self._hits: dict[str, tuple[int, int]] = {}  # req -> (local tokens, hit end)
        self._reqs: dict[str, "Request"] = {}  # requests being served
        self._saved: dict[str, list[int]] = {}  # req -> per plan: blocks already in gcache
        self._loads: dict[str, list[Item]] = {}
        self._saves: dict[str, list[Item]] = {}
        self._parents: dict[str, dict[int, bytes]] = {}
        self._saving: set[str] = set()
        self._loading: dict[str, set[int]] = {}  # req -> block ids of its load plan
        self._tainted: set[str] = set()  # reqs whose load failed: never saved
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("gcache connector: kv_load_failure_policy=%r makes a block that "
                        "fails to load (a server lost mid-load) fail its request; set "
                        "\"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config to "
                        "recompute it instead",
                        self._kv_transfer_config.kv_load_failure_policy)
        # worker side
        self._layouts: dict[int, GroupLayout] = {}
        self._staging = StagingPool(self.cfg.staging_keep_bytes)
        self._done_loads: dict[str, set[int]] = {}  # req -> failed block ids
        self._done_saves: set[str] = set()
        self._inflight = 0  # saves issued, not completed (drain waits for them)
        self._idle = threading.Condition(self._lock)
        self._load_errors: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """``kv_layout`` (default ``BLHNC``: every layer's page of a block in one run,
        which the SDK reads and writes in place); None for ``"none"``. A layout some
        backend cannot take is not fatal: vLLM warns and picks one it can."""
        kt = vllm_config.kv_transfer_config
        extra = (kt.kv_connector_extra_config or {}) if kt is not None else {}
        layout = str(extra.get("kv_layout", ConnectorConfig.kv_layout) or "none")
        return None if layout.lower() == "none" else layout

    # ------------------------------------------------------------------ keys
    def _key(self, gid: int, block_hash: bytes, rank: int) -> bytes:
        return b"%d/%d/" % (gid, rank) + bytes(block_hash)

    def _rank_for(self, p: GroupPlan) -> int:
        return 0 if p.replicated else self.rank

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._hits.pop(request.request_id, None)
        if not self.enabled or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        try:
            n = self._lookup(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - never into the engine: a miss
            log.exception("gcache connector: lookup failed; counted as a miss")
            return 0, False
        if n <= 0:
            return 0, False
        self._hits[request.request_id] = (num_computed_tokens, num_computed_tokens + n)
        return n, True

    def _lookup(self, request: "Request", num_computed_tokens: int) -> int:
        hashes = request.block_hashes
        lk = plan_lookup(self.plans, len(hashes), self.hash_block_size, num_computed_tokens,
                         request.num_tokens)
        if lk is None:
            return 0
        keys: list[bytes] = []
        for p, blocks in zip(self.plans, lk.blocks):
            pre, r = b"%d/0/" % p.gid, p.ratio  # rank 0's keys stand for every rank's
            if not blocks:
                continue
            keys += [pre + h for h in hashes[blocks[0] * r + r - 1:(blocks[-1] + 1) * r:r]]
        found = self.client.exists_batch(keys, timeout_ms=self.cfg.lookup_timeout_ms)
        present, at = [], 0
        for blocks in lk.blocks:
            present.append(found[at:at + len(blocks)])
            at += len(blocks)
        return longest_hit(self.plans, lk, present)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        hit = self._hits.pop(request.request_id, None)
        start = hit[0] if hit is not None else request.num_computed_tokens
        end = start + max(0, num_external_tokens) if hit is not None else start
        self._reqs[request.request_id] = request
        # blocks before ``end`` are in gcache already (loaded, or computed and saved by
        # the request that left them in vLLM's prefix cache): saves start after them
        self._saved.setdefault(request.request_id, [end // p.block_size for p in self.plans])
        if num_external_tokens <= 0 or hit is None:
            return
        per_group = blocks.blocks
        hashes = request.block_hashes
        items: list[Item] = []
        for p in self.plans:
            group = per_group[p.gid]
            for j in blocks_to_load(p, start, end):
                if j < len(group) and not group[j].is_null:
                    items.append((p.gid, group[j].block_id, bytes(hashes[(j + 1) * p.ratio - 1])))
        self._loads[request.request_id] = items
        self._loading[request.request_id] = {bid for _, bid, _ in items}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """The step's loads, finished requests' saves, and the blocks this step fills: the
        workers copy those out right after the forward (``wait_for_save``), so blocks a
        concurrent request shares become visible while their request is still running."""
        now: dict[str, list[Item]] = {}
        if self.enabled and self.cfg.save and self._kv_cache_manager is not None:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                req = self._reqs.get(req_id)
                if req is None or req_id in self._tainted:
                    continue
                try:
                    end = min(req.num_computed_tokens + n, req.num_tokens)
                    if not self._fills_a_block(req, end):
                        continue  # most decode steps: no block table copied for nothing
                    ids = self._kv_cache_manager.get_block_ids(req_id)
                    items = self._progress(req, end, ids, self._parents)
                except Exception:  # noqa: BLE001 - never into the engine: not saved now
                    log.exception("gcache connector: could not plan a step's save")
                    continue
                if items:
                    now[req_id] = items
        meta = GCacheConnectorMetadata(loads=self._loads, saves=self._saves, saves_now=now,
                                       parents=self._parents)
        self._loads, self._saves, self._parents = {}, {}, {}
        return meta

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._hits.pop(request.request_id, None)
        self._reqs.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        tainted = request.request_id in self._tainted
        self._tainted.discard(request.request_id)
        if tainted or request.status.name == "FINISHED_ERROR":
            # a failed load left blocks past the valid prefix unwritten: save nothing
            return False, None
        if not self.enabled or not self.cfg.save:
            return False, None
        try:
            # the last sampled token has no KV yet: num_computed_tokens ends the blocks
            items = self._progress(request, request.num_computed_tokens, block_ids,
                                   self._parents)
        except Exception:  # noqa: BLE001 - never into the engine: nothing saved
            log.exception("gcache connector: could not plan a save; nothing saved")
            return False, None
        finally:
            self._saved.pop(request.request_id, None)
        if not items:
            return False, None
        self._saves[request.request_id] = items
        self._saving.add(request.request_id)
        return True, None

    def _fills_a_block(self, request: "Request", end: int) -> bool:
        """Whether tokens up to ``end`` complete a whole block some group has not saved."""
        saved = self._saved.get(request.request_id)
        if saved is None:
            return True
        n = len(request.block_hashes)
        return any(min(end // p.block_size, n // p.ratio) > saved[i]
                   for i, p in enumerate(self.plans) if p.kind is not GroupKind.SKIP)

    def _progress(self, request: "Request", end: int, block_ids: Sequence[Sequence[int]],
                  parents: dict[str, dict[int, bytes]]) -> list[Item]:
        """Blocks of ``request`` complete before token ``end`` and not yet in gcache: a
        full group's every block, a window group's blocks its window sees at ``end``;
        ``parents[req][gid]`` gets the hash of the block before each group's first."""
        saved = self._saved.setdefault(request.request_id, [0] * len(self.plans))
        hashes = request.block_hashes
        null = self._null_block_id()
        items: list[Item] = []
        for i, p in enumerate(self.plans):
            if p.kind is GroupKind.SKIP:
                continue
            ids = block_ids[p.gid]
            hi = min(len(ids), end // p.block_size, len(hashes) // p.ratio)
            lo = saved[i] if p.kind is GroupKind.FULL else max(saved[i], hi - p.window_blocks)
            for j in range(lo, hi):
                if ids[j] != null:
                    items.append((p.gid, ids[j], bytes(hashes[(j + 1) * p.ratio - 1])))
            if lo < hi:
                parents.setdefault(request.request_id, {})[p.gid] = \
                    bytes(hashes[lo * p.ratio - 1]) if lo else b""
            saved[i] = max(saved[i], hi)
        return items

    def _null_block_id(self) -> int:
        mgr = self._kv_cache_manager
        return mgr.block_pool.null_block.block_id if mgr is not None else 0

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_sending or ():
            self._saving.discard(req_id)
        self._tainted |= set(connector_output.failed_recving or ())
        invalid = connector_output.invalid_block_ids or set()
        if invalid:
            self._tainted |= {r for r, ids in self._loading.items() if ids & invalid}

    def has_pending_push_work(self) -> bool:
        return bool(self._saving)  # keep stepping until held blocks are saved

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        for p in self.plans:
            names = self._kv_cache_config.kv_cache_groups[p.gid].layer_names
            tensors = [kv_caches[n] for n in names if n in kv_caches]
            if tensors:
                self._layouts[p.gid] = GroupLayout(tensors, num_blocks,
                                                   device_buffers=self.cfg.transport == "nixl")
        for lay in self._layouts.values():  # nixl: one-sided READ/WRITE into the KV memory
            for storage in lay.storages:
                try:
                    self.client.register_buffer(storage)
                except Exception:  # noqa: BLE001 - not registered: the bounce buffer path
                    log.warning("gcache connector: could not register a KV tensor with "
                                "nixl; transfers go through its bounce buffer",
                                exc_info=True)
        log.info("gcache connector: %d groups registered, in place: %s", len(self._layouts),
                 {g: lay.direct for g, lay in self._layouts.items()})

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, GCacheConnectorMetadata):
            return
        for req_id, items in meta.loads.items():
            self._start_load(req_id, items)

    def _start_load(self, req_id: str, items: list[Item]) -> None:
        try:
            keys, bufs, staged, where = self._buffers(items, load=True)
        except Exception:  # noqa: BLE001 - a load we cannot start: every block failed
            log.exception("gcache connector: could not start a load; its blocks are errors")
            self._finish_load(req_id, items, [Status.BAD_REQUEST] * len(items), {})
            return
        # staged blocks are scattered into the KV tensors as their keys land (on the
        # dispatch threads that finished them), SCATTER_BATCH at a time: the copy
        # overlaps the transfer, and one native call serves many blocks
        placed: set[int] = set()
        ready: list[int] = []
        lock = threading.Lock()

        def scatter(batch: list[int]) -> None:
            by_group: dict[int, list[tuple[int, int]]] = {}
            for i in batch:
                gid, k, bid = where[i]
                by_group.setdefault(gid, []).append((k, bid))
            try:
                for gid, pairs in by_group.items():
                    self._layouts[gid].move(pairs, staged[gid][0], to_kv=True)
            except Exception:  # noqa: BLE001 - these blocks are load errors (below)
                log.exception("gcache connector: could not place loaded blocks")
                return
            with lock:
                placed.update(batch)

        def landed(i: int, _key: bytes, st: Any) -> None:
            if i not in where or st != Status.OK:
                return
            with lock:
                ready.append(i)
                if len(ready) < SCATTER_BATCH:
                    return
                batch = ready[:]
                ready.clear()
            scatter(batch)

        def done(statuses: list) -> None:
            with lock:
                batch = ready[:]
                ready.clear()
            if batch:
                scatter(batch)
            statuses = [st if (i not in where or i in placed) else Status.BAD_REQUEST
                        for i, st in enumerate(statuses)]
            self._finish_load(req_id, items, statuses, staged)

        self.client.get_batch_into_async(keys, bufs, timeout_ms=self.cfg.load_timeout_ms,
                                         callback=done, on_key=landed if where else None)

    def _buffers(self, items: list[Item], load: bool,
                 stage_all: bool = False) -> tuple[list, list, dict, dict]:
        """Keys and SDK buffers of a transfer: a block in place where its layout allows,
        else a slice of its group's staging buffer (``staged``: gid -> (staging, [(slice
        index, block id)]); ``where``: item index -> (gid, slice index, block id) of the
        staged ones); a save gathers the staged blocks first."""
        counts: dict[int, int] = {}
        for gid, _, _ in items:
            if stage_all or not self._layouts[gid].direct:
                counts[gid] = counts.get(gid, 0) + 1
        staged: dict[int, tuple[memoryview, list[tuple[int, int]]]] = {
            gid: (memoryview(self._staging.take(n * self._layouts[gid].block_bytes)), [])
            for gid, n in counts.items()}
        keys: list[bytes] = []
        bufs: list = []
        where: dict[int, tuple[int, int, int]] = {}
        for i, (gid, bid, h) in enumerate(items):
            lay = self._layouts[gid]
            keys.append(self._key(gid, h, self._rank_for(self.plans[gid])))
            if gid not in staged:
                bufs.append(lay.view(bid))
                continue
            staging, pairs = staged[gid]
            k = len(pairs)
            bufs.append(staging[k * lay.block_bytes:(k + 1) * lay.block_bytes])
            pairs.append((k, bid))
            where[i] = (gid, k, bid)
        if not load:
            for gid, (staging, pairs) in staged.items():
                self._layouts[gid].move(pairs, staging, to_kv=False)
        return keys, bufs, staged, where

    def _release(self, staged: dict[int, tuple[memoryview, list[tuple[int, int]]]]) -> None:
        for staging, _ in staged.values():
            buf = staging.obj
            staging.release()
            self._staging.give(buf)

    def _finish_load(self, req_id: str, items: list[Item], statuses: list,
                     staged: dict[int, tuple[memoryview, list[tuple[int, int]]]]) -> None:
        """On a dispatch thread (or the caller's, on a failed start): every block not OK
        (or not placed) is a load error."""
        failed = {items[i][1] for i, st in enumerate(statuses) if st != Status.OK}
        self._release(staged)
        with self._lock:
            self._done_loads[req_id] = failed
            self._stats._add("load_blocks", len(items) - len(failed))
            self._stats._add("load_failed_blocks", len(failed))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-block and asynchronous, between steps

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # saves are of finished requests' blocks, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, GCacheConnectorMetadata):
            return
        for req_id, items in meta.saves_now.items():
            self._start_save(req_id, items, False, meta.parents.get(req_id, {}))
        for req_id, items in meta.saves.items():
            self._start_save(req_id, items, True, meta.parents.get(req_id, {}))

    def _start_save(self, req_id: str, items: list[Item], held: bool,
                    parents: dict[int, bytes]) -> None:
        """``held``: a finished request's blocks, which vLLM keeps until the save is
        reported (read in place where the layout allows); else blocks of a running
        request, copied out now (vLLM may reuse them once this step returns). One put per
        group: its blocks are consecutive pages of one chain (``chain_parent``)."""
        groups: dict[int, list[Item]] = {}
        for it in items:  # MLA: rank 0 writes what every rank holds
            if not (self.plans[it[0]].replicated and self.rank != 0):
                groups.setdefault(it[0], []).append(it)
        if not groups:
            self._finish_save(req_id, [], held)
            return
        left = [len(groups)]
        results: list = []

        def part(statuses: list, staged: dict) -> None:
            self._release(staged)
            with self._lock:
                results.extend(statuses)
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._finish_save(req_id, results, held)
            with self._lock:
                self._inflight -= 1
                self._idle.notify_all()

        for gid, its in groups.items():
            with self._lock:
                self._inflight += 1
            try:
                keys, bufs, staged, _ = self._buffers(its, load=False, stage_all=not held)
            except Exception:  # noqa: BLE001 - a save we cannot start: not saved
                log.exception("gcache connector: could not start a save; not saved")
                part([Status.BAD_REQUEST] * len(its), {})
                continue
            parent = parents.get(gid)
            chain = None if parent is None else \
                self._key(gid, parent, self._rank_for(self.plans[gid])) if parent else b""
            self.client.put_batch_from_async(
                keys, bufs, timeout_ms=self.cfg.save_timeout_ms, if_absent=True,
                chain_parent=chain, callback=lambda sts, st=staged: part(sts, st))

    def _finish_save(self, req_id: str, statuses: list, held: bool) -> None:
        with self._lock:
            if held:
                self._done_saves.add(req_id)
            ok = sum(1 for st in statuses if st == Status.OK)
            self._stats._add("save_blocks", ok)
            self._stats._add("save_failed_blocks", len(statuses) - ok)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        with self._lock:
            loads, self._done_loads = self._done_loads, {}
            saves, self._done_saves = self._done_saves, set()
        out = KVConnectorTransferResults(finished_sending=saves,
                                         finished_recving=set(loads))
        for req_id, failed in loads.items():
            if not failed:
                continue
            if self.multi_group:
                out.failed_recving.add(req_id)  # block ids are per group: by request
            else:
                self._load_errors |= failed
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, GCacheConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return GCacheConnectorStats(data=dict(data or {}))

    def drain(self, timeout_s: float) -> bool:
        """Wait until every save issued so far completed (True), or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def shutdown(self) -> None:
        """Let in-flight saves finish (within ``save_timeout_ms``), then close."""
        if not self.drain(self.cfg.save_timeout_ms / 1000.0):
            log.warning("gcache connector: shutting down with saves still in flight; "
                        "those blocks are not stored")
        self.client.close()
