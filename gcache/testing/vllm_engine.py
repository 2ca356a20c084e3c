"""Drive vLLM 0.33.0's own scheduler and KV-cache manager with the gcache connector
loaded through vLLM's factory, and the worker side over CPU KV tensors.

``Engine`` is one vLLM engine without a model: each step it runs the scheduler, hands
the connector metadata to a worker-side connector built by vLLM's factory (as the
model runner does), "computes" the scheduled tokens by writing each token's KV as a
pure function of (token id, position, layer) into the request's blocks, and feeds
vLLM's scheduler a ``ModelRunnerOutput`` with the connector's transfer results. So a
block restored from gcache can be compared byte for byte with the one a computation
would have written, in any fresh engine. Call ``gcache.testing.cpu_vllm.install()``
before importing this module. ``gcache.bench.vllm_restore`` and tests/vllm use it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Sequence

import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
HEADS, HEAD = 2, 16
DTYPE = torch.float16


def tiny_model_dir(root: str) -> str:
    """A local config.json for vLLM's ModelConfig (no weights: nothing runs a model)."""
    d = os.path.join(root, "tiny-llama")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": HEADS, "num_hidden_layers": 2, "vocab_size": 1000,
                   "max_position_embeddings": 65536, "torch_dtype": "float16",
                   "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}, f)
    return d


def full_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])


def mla_config(num_blocks: int) -> KVCacheConfig:
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=48, dtype=DTYPE)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])


def hybrid_config(num_blocks: int, window: int = 2 * BLOCK) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=DTYPE,
                            sliding_window=window)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["f0", "f1"], full),
                                          KVCacheGroupSpec(["s0", "s1"], swa)])


def vllm_config(model_dir: str, extra: dict, max_len: int = 40960,
                failure_policy: str = "recompute", max_batched: int | None = None
                ) -> VllmConfig:
    """``max_batched``: tokens per step (chunked prefill), default ``max_len``."""
    mc = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                     dtype="float16", max_model_len=max_len, seed=0)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched or max_len,
                         max_model_len=max_len,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector="GCacheConnectorV1",
                          kv_connector_module_path="gcache.sdk.vllm", kv_role="kv_both",
                          kv_connector_extra_config=extra,
                          kv_load_failure_policy=failure_policy)
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def kv_value(tokens: torch.Tensor, positions: torch.Tensor, layer: int, width: int) -> torch.Tensor:
    """A token's KV bytes in one layer: a pure function of (token, position, layer)."""
    base = (tokens * 7 + positions * 3 + layer * 11).to(torch.float32)
    cols = torch.arange(width, dtype=torch.float32)
    return (torch.remainder(base[:, None] + cols[None, :], 251.0) / 8.0).to(DTYPE)


class Engine:
    """One vLLM scheduler + worker-side connector over CPU KV tensors ("no model")."""

    def __init__(self, vc: VllmConfig, kcc: KVCacheConfig, *, block_major: bool = False) -> None:
        self.vc, self.kcc = vc, kcc
        algo = vc.cache_config.prefix_caching_hash_algo
        self.hash_fn = get_hash_fn_by_name(algo)
        init_none_hash(self.hash_fn)
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=kcc,
                               structured_output_manager=StructuredOutputManager(vc),
                               block_size=BLOCK, log_stats=False)
        self.worker = KVConnectorFactory.create_connector(
            config=vc, role=KVConnectorRole.WORKER, kv_cache_config=kcc)
        self.tensors: dict[str, torch.Tensor] = {}
        self.mla: set[str] = set()
        for g in kcc.kv_cache_groups:
            # block_major: one cross-layer tensor per group, block outermost (vLLM's
            # BLHNC), each layer a strided view of it
            cross = torch.zeros(kcc.num_blocks, len(g.layer_names), 2, BLOCK, HEADS, HEAD,
                                dtype=DTYPE) if block_major else None
            for i, name in enumerate(g.layer_names):
                if isinstance(g.kv_cache_spec, MLAAttentionSpec):
                    t = torch.zeros(kcc.num_blocks, BLOCK, g.kv_cache_spec.head_size, dtype=DTYPE)
                    self.mla.add(name)
                elif cross is not None:
                    t = cross[:, i]
                else:  # FlashAttention's (2, num_blocks, block, heads, head)
                    t = torch.zeros(2, kcc.num_blocks, BLOCK, HEADS, HEAD, dtype=DTYPE)
                self.tensors[name] = t
        self.worker.register_kv_caches(self.tensors)
        self.layer_group = {n: gid for gid, g in enumerate(kcc.kv_cache_groups)
                            for n in g.layer_names}
        self.tokens: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.finish_reasons: dict[str, str] = {}
        self.load_failures = 0
        self.saved_blocks = self.load_blocks = 0  # from the worker's stats (wait_saves)
        self.last_meta = None  # the connector metadata of the last step

    def close(self) -> None:
        for c in (self.worker, self.sched.connector):
            if c is not None:
                c.shutdown()

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 2) -> Request:
        req = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens,
                                                           ignore_eos=True),
                      None, block_hasher=get_request_block_hasher(BLOCK, self.hash_fn))
        self.sched.add_request(req)
        return req

    # ---------------------------------------------------------------- one step
    def step(self, after_schedule: Callable[[], None] | None = None) -> dict[str, int]:
        """One engine step; ``after_schedule`` runs between the scheduler's lookup and
        the worker's load (a fault test kills a server there)."""
        so = self.sched.schedule()
        self.last_meta = so.kv_connector_metadata
        if after_schedule is not None:
            after_schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            end = req.num_computed_tokens
            self._compute(req, end - n, end)
            sampled[req_id] = [self._next_token(req)] if end >= req.num_tokens else []
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        self.load_failures += len(invalid) + len(res.failed_recving)
        w.clear_connector_metadata()
        ids = list(sampled)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled[r] for r in ids],
                                kv_connector_output=KVConnectorOutput(
                                    finished_sending=res.finished_sending or None,
                                    finished_recving=res.finished_recving or None,
                                    failed_recving=res.failed_recving,
                                    invalid_block_ids=invalid))
        for eco in self.sched.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished.append(o.request_id)
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
        return dict(so.num_scheduled_tokens)

    def run(self, timeout_s: float = 30.0) -> None:
        """Step until every request finished and every save (held blocks, and the blocks
        steps filled) completed."""
        deadline = time.monotonic() + timeout_s
        conn = self.sched.connector
        while self.sched.has_unfinished_requests() or (conn and conn.has_pending_push_work()):
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not finish its requests in time")
            if not self.step():
                time.sleep(0.002)  # waiting for an async load or save
        if not self.worker.drain(timeout_s=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the worker's saves did not finish in time")

    def wait_saves(self, blocks: int, timeout_s: float = 10.0) -> int:
        """Blocks the worker saved, once ``blocks`` are (or the deadline passed): saves of
        running requests complete on the SDK's threads after their step."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.worker.get_kv_connector_stats()
            if stats is not None:
                self.saved_blocks += stats.data.get("save_blocks", 0)
                self.load_blocks += stats.data.get("load_blocks", 0)
            if self.saved_blocks >= blocks or time.monotonic() > deadline:
                return self.saved_blocks
            time.sleep(0.01)

    def _next_token(self, req: Request) -> int:
        return 3 + (sum(req.all_token_ids) * 31 + req.num_tokens) % 900

    def _compute(self, req: Request, start: int, end: int) -> None:
        """Write the KV of tokens [start, end) into the request's blocks, every layer."""
        if end <= start:
            return
        ids = self.sched.kv_cache_manager.get_block_ids(req.request_id)
        toks = torch.tensor(req.all_token_ids[start:end])
        pos = torch.arange(start, end)
        for name, t in self.tensors.items():
            gid = self.layer_group[name]
            table = ids[gid]
            layer = int(name[1:])
            for p in range(start, end):
                j = p // BLOCK
                if j >= len(table) or table[j] == 0:
                    continue  # a null block (out of the window)
                v = kv_value(toks[p - start:p - start + 1], pos[p - start:p - start + 1],
                             layer, self._width(name))[0]
                self._slot(name, t, table[j], p % BLOCK).copy_(v.view(self._slot_shape(name)))

    def _width(self, name: str) -> int:
        t = self.tensors[name]
        return t.shape[-1] if name in self.mla else 2 * HEADS * HEAD

    def _slot_shape(self, name: str) -> tuple[int, ...]:
        return (self.tensors[name].shape[-1],) if name in self.mla else (2, HEADS, HEAD)

    def _slot(self, name: str, t: torch.Tensor, block: int, slot: int) -> torch.Tensor:
        if name in self.mla:
            return t[block, slot]
        if t.shape[0] == 2:
            return t[:, block, slot]
        return t[block, :, slot]

    def expected_block(self, name: str, tokens: Sequence[int], j: int) -> torch.Tensor:
        """Block ``j``'s bytes in layer ``name`` as a computation writes them."""
        layer = int(name[1:])
        pos = torch.arange(j * BLOCK, (j + 1) * BLOCK)
        v = kv_value(torch.tensor(tokens[j * BLOCK:(j + 1) * BLOCK]), pos, layer,
                     self._width(name))
        return v.view((BLOCK,) + self._slot_shape(name))

    def block_of(self, name: str, block_id: int) -> torch.Tensor:
        t = self.tensors[name]
        if name in self.mla:
            return t[block_id]
        if t.shape[0] == 2:
            return t[:, block_id].permute(1, 0, 2, 3)
        return t[block_id].permute(1, 0, 2, 3)
