"""The vLLM connector's speed against the SDK it runs on, in one run (issue 15).

    python -m gcache.bench.vllm_restore [--tokens 32768] [--layers 4] [--heads 8]
        [--head-size 64] [--transport tcp|shm|auto] [--layout block-major|kv-apart]
        [--runs 5] [--lookups 10]

One local gcache-server; vLLM 0.33.0's connector factory builds GCacheConnectorV1 (the
scheduler side and a worker side over CPU KV tensors). A ``--tokens`` prompt's blocks
are saved through the connector, then:

* **restore**: the worker-side load of every block of the prefix (``start_load_kv`` until
  ``get_transfer_results`` reports the request), against a direct SDK
  ``get_batch_into`` of the same keys into buffers of the same bytes (the KV tensor's
  blocks in place for ``block-major``; contiguous buffers for ``kv-apart``, whose
  connector load also scatters K and V into the layers);
* **lookup**: the scheduler-side ``get_num_new_matched_tokens`` of the request, against
  one ``exists_batch`` of the same keys.

Each figure is the median of ``--runs`` (lookups: of ``--runs`` x ``--lookups``, alternated
with the exists); the ratios are the issue's goals (restore
<= 1.2x, lookup <= 1.5x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from gcache.testing import cpu_vllm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gcache.bench.vllm_restore",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--layout", choices=("block-major", "kv-apart"), default="block-major")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=10, help="lookups (and exists) per run")
    ap.add_argument("--memory", default="1GiB")
    args = ap.parse_args(argv)
    if not cpu_vllm.install():
        print(cpu_vllm.SKIP_REASON, file=sys.stderr)
        return 2
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from gcache.sdk import Client
    from gcache.sdk.vllm.connector import GCacheConnectorMetadata
    from gcache.testing.cluster import ServerProc
    from gcache.testing.vllm_engine import BLOCK, tiny_model_dir, vllm_config

    n_blocks = args.tokens // BLOCK
    server = ServerProc(f"vllm-bench-{os.getpid()}", args.memory)
    server.start()
    model_root = tempfile.TemporaryDirectory(prefix="gcache-bench-vllm-")
    try:
        vc = vllm_config(tiny_model_dir(model_root.name),
                         {"servers": server.address, "transport": args.transport,
                          "namespace": f"bench{os.getpid()}", "load_timeout_ms": 60000,
                          "save_timeout_ms": 60000, "lookup_timeout_ms": 10000})
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=args.heads,
                                 head_size=args.head_size, dtype=torch.float16)
        names = [f"l{i}" for i in range(args.layers)]
        kcc = KVCacheConfig(num_blocks=n_blocks + 1, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        shape = (2, BLOCK, args.heads, args.head_size)
        if args.layout == "block-major":
            cross = torch.empty((kcc.num_blocks, args.layers) + shape, dtype=torch.float16)
            tensors = {n: cross[:, i] for i, n in enumerate(names)}
        else:
            tensors = {n: torch.empty((2, kcc.num_blocks, BLOCK, args.heads, args.head_size),
                                      dtype=torch.float16) for n in names}
        for t in tensors.values():
            t.copy_(torch.randn(t.shape, dtype=torch.float16))
        worker = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER,
                                                     kv_cache_config=kcc)
        sched = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER,
                                                    kv_cache_config=kcc)
        worker.register_kv_caches(tensors)
        lay = worker._layouts[0]
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import init_none_hash
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        prompt = [(i * 7919) % 30000 + 3 for i in range(args.tokens + 1)]
        req = Request("bench", prompt, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK, hash_fn))
        items = [(0, j + 1, bytes(req.block_hashes[j])) for j in range(n_blocks)]
        keys = [worker._key(0, h, 0) for _, _, h in items]

        def transfer(loads: dict, saves: dict, want: str) -> float:
            worker.bind_connector_metadata(GCacheConnectorMetadata(loads=loads, saves=saves))
            t = time.perf_counter()
            worker.start_load_kv(None)
            worker.wait_for_save()
            deadline = t + 120
            while True:
                r = worker.get_transfer_results(set())
                if want in (r.finished_recving | r.finished_sending):
                    break
                if time.perf_counter() > deadline:
                    raise TimeoutError("the transfer did not finish")
                time.sleep(0.0002)
            took = time.perf_counter() - t
            worker.clear_connector_metadata()
            bad = worker.get_block_ids_with_load_errors()
            if bad:
                raise RuntimeError(f"{len(bad)} blocks failed to load")
            return took

        transfer({}, {"save": items}, "save")
        client = Client([server.address], namespace=worker.client.namespace,
                        transport=args.transport, timeout_ms=60000)
        bufs = ([lay.view(j + 1) for j in range(n_blocks)] if lay.direct else
                [torch.empty(lay.block_bytes, dtype=torch.uint8) for _ in range(n_blocks)])
        restore, direct, lookup, exists = [], [], [], []
        for _ in range(args.runs):
            restore.append(transfer({"r": items}, {}, "r"))
            t = time.perf_counter()
            sts = client.get_batch_into(keys, bufs)
            direct.append(time.perf_counter() - t)
            assert all(int(s) == 0 for s in sts), "a direct get missed"
            for _ in range(args.lookups):  # cheap and noisy: many, alternated
                t = time.perf_counter()
                hit, _ = sched.get_num_new_matched_tokens(req, 0)
                lookup.append(time.perf_counter() - t)
                assert hit == n_blocks * BLOCK, hit
                t = time.perf_counter()
                found = client.exists_batch(keys)
                exists.append(time.perf_counter() - t)
                assert all(found)
        nbytes = n_blocks * lay.block_bytes
        m = statistics.median
        print(f"vLLM connector, {args.tokens} tokens = {n_blocks} blocks x "
              f"{lay.block_bytes // 1024} KiB ({nbytes / 2**20:.0f} MiB), {args.layout} "
              f"({'in place' if lay.direct else 'staged'}), transport {args.transport}, "
              f"median of {args.runs}")
        print(f"  restore through the connector {m(restore) * 1e3:8.1f} ms "
              f"({nbytes / m(restore) / 1e9:.2f} GB/s)")
        print(f"  SDK get_batch_into, same bytes {m(direct) * 1e3:8.1f} ms "
              f"({nbytes / m(direct) / 1e9:.2f} GB/s)  ratio {m(restore) / m(direct):.2f}x "
              f"(goal <= 1.2x)")
        print(f"  scheduler lookup               {m(lookup) * 1e3:8.2f} ms")
        print(f"  one exists_batch, same keys    {m(exists) * 1e3:8.2f} ms  ratio "
              f"{m(lookup) / m(exists):.2f}x (goal <= 1.5x)")
        client.close()
        worker.shutdown()
        sched.shutdown()
    finally:
        model_root.cleanup()
        server.terminate()
        if os.path.exists(server.arena_path):
            os.unlink(server.arena_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
