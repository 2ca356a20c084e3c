"""GCacheStorage against SGLang's interface: factory, sharding, threads, keep-alive."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _config(servers, *, tp_rank=0, tp_size=1, mla=False, **extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang_harness import PLUGIN

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=True,
        model_name="org/tiny-model", extra_config={**PLUGIN, "servers": list(servers), **extra})


def _factory(cfg):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_dynamic_factory_builds_a_hicache_storage(l3):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from gcache.sdk import sglang as plugin

    be = _factory(_config(l3.addresses))
    try:
        assert isinstance(be, HiCacheStorage)
        assert type(be) is plugin.GCacheStorage
        assert not getattr(type(be), "__abstractmethods__", None)
        assert be.namespace == "sglang/org-tiny-model"
        assert be.get_stats() is not None
    finally:
        be.close()
        be.close()  # idempotent


@pytest.mark.parametrize("extra,needle", [
    ({"servers": []}, "masters"),
    ({"group_policy": "ring"}, "group_policy"),
    ({"timeout_ms": "fast"}, "timeout_ms"),
    ({"tiemout_ms": 5}, "unknown"),
    ({"servers": ["nohost"]}, "host:port"),
])
def test_bad_config_fails_the_attach_with_a_clear_error(extra, needle):
    from gcache.errors import ConfigError

    cfg = _config(["127.0.0.1:1"])
    cfg.extra_config.update(extra)
    with pytest.raises(ConfigError, match=needle):
        _factory(cfg)


def test_core_and_sdk_do_not_import_sglang():
    code = ("import sys, gcache.sdk, gcache.sdk.client, gcache.sdk.sglang as p; "
            "assert callable(p.window_safe_stops); "
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def _mha_pool_stack(l3, kind="mha"):
    from sglang_harness import build_stack

    return build_stack(kind, "page_first", l3.addresses, seed=31)


def test_mha_ranks_store_own_shards_mla_only_writer_stores(l3):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang_harness import PAGE, seq_of

    from gcache.sdk.sglang import GCacheStorage  # noqa: F401 - builds the class
    import torch
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    for kind in ("mha", "mla"):
        st = _mha_pool_stack(l3, kind)
        try:
            pool = st.pool()
            mla = kind == "mla"
            ranks = [_factory(_config(l3.addresses, tp_rank=r, tp_size=2, mla=mla))
                     for r in (0, 1)]
            for be in ranks:
                be.register_mem_pool_host(pool)
                be.on_host_pools_registered()
            seq = seq_of(300_000 + (7 if mla else 0), 3)
            hv = get_storage_hash_str(seq, None, page_size=PAGE)
            idx = pool.alloc(3 * PAGE)
            info = HiCacheStorageExtraInfo(prefix_keys=[])
            # rank 1 writes first: under MLA it is not the writer, so nothing is stored
            assert ranks[1].batch_set_v1(hv, idx, info) == [True] * 3
            expect_r1 = 3 if not mla else 0
            assert ranks[1].batch_exists(hv, info) == expect_r1
            assert ranks[0].batch_exists(hv, info) == 0
            assert ranks[0].batch_set_v1(hv, idx, info) == [True] * 3
            assert ranks[0].batch_exists(hv, info) == 3
            assert ranks[1].batch_exists(hv, info) == 3  # MLA: reads rank 0's object
            shards = {be._pools["kv"].spec.shard for be in ranks}
            assert shards == ({"r"} if mla else {"tp0of2", "tp1of2"})
            # round trip into other slots: byte-exact
            dst = pool.alloc(3 * PAGE)
            assert ranks[1].batch_get_v1(hv, dst, info) == [True] * 3
            for i in range(3):
                a = pool.get_data_page(int(idx[i * PAGE])).contiguous().view(torch.uint8)
                b = pool.get_data_page(int(dst[i * PAGE])).contiguous().view(torch.uint8)
                assert torch.equal(a, b)
            for be in ranks:
                be.close()
        finally:
            st.close()


def test_three_sglang_threads_at_once(l3):
    """Backup, hit query and prefetch threads hammer one backend concurrently."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang_harness import PAGE, seq_of

    st = _mha_pool_stack(l3)
    be = st.backend
    pool = st.pool()
    chains = [get_storage_hash_str(seq_of(400_000 + 1000 * c, 8), None, page_size=PAGE)
              for c in range(6)]
    src = [pool.alloc(8 * PAGE) for _ in chains]
    dst = [pool.alloc(8 * PAGE) for _ in range(3)]
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    errors: list[str] = []
    stop = threading.Event()

    def backup():
        for rnd in range(3):
            for hv, idx in zip(chains, src):
                if be.batch_set_v1(hv, idx, info) != [True] * 8:
                    errors.append(f"set failed round {rnd}")
        stop.set()

    def query():
        while not stop.is_set():
            for hv in chains:
                n = be.batch_exists(hv, info)
                if not isinstance(n, int) or not 0 <= n <= 8:
                    errors.append(f"exists returned {n!r}")

    def prefetch():
        k = 0
        while not stop.is_set():
            c = k % len(chains)
            res = be.batch_get_v1(chains[c], dst[k % 3], info)
            if not isinstance(res, list) or len(res) != 8:
                errors.append(f"get returned {res!r}")
            k += 1

    threads = [threading.Thread(target=f) for f in (backup, query, prefetch)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:5]
        for hv, idx in zip(chains, src):  # after the storm every chain reads back exactly
            assert be.batch_get_v1(hv, dst[0], info) == [True] * 8
            for i in range(8):
                a = pool.get_data_page(int(idx[i * PAGE])).contiguous().view(torch.uint8)
                b = pool.get_data_page(int(dst[0][i * PAGE])).contiguous().view(torch.uint8)
                assert torch.equal(a, b)
        assert be.gcache_stats()["counters"].get("errors", 0) == 0
    finally:
        stop.set()
        st.close()


def test_prefix_keys_and_hits_are_kept_alive_throttled(l3):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang_harness import PAGE, seq_of

    st = _mha_pool_stack(l3)
    be = st.backend
    try:
        hv = get_storage_hash_str(seq_of(500_000, 6), None, page_size=PAGE)
        idx = st.pool().alloc(6 * PAGE)
        assert be.batch_set_v1(hv, idx, HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 6
        # the engine holds pages 0-2 in L1/L2 and asks L3 about 3-5
        info = HiCacheStorageExtraInfo(prefix_keys=hv[:3])
        assert be.batch_exists(hv[3:], info) == 3
        c1 = be.gcache_stats()["counters"]
        assert c1["touch_keys_sent"] == 6 * 2  # 6 pages x (K, V) objects
        assert be.batch_exists(hv[3:], info) == 3
        c2 = be.gcache_stats()["counters"]
        assert c2["touch_keys_sent"] == c1["touch_keys_sent"]  # within touch_interval_ms
        assert c2["touch_keys_throttled"] >= 12
    finally:
        st.close()


def test_legacy_flat_page_interface_round_trips(l3):
    """Without interface_v1 SGLang calls batch_set/batch_get with flat page tensors."""
    import torch
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang_harness import PAGE, seq_of

    st = _mha_pool_stack(l3)
    try:
        pool = st.pool()
        cfg = _config(l3.addresses)
        del cfg.extra_config["interface_v1"]
        be = _factory(cfg)
        be.register_mem_pool_host(pool)
        hv = get_storage_hash_str(seq_of(600_000, 3), None, page_size=PAGE)
        idx = pool.alloc(3 * PAGE)
        pages = [pool.get_data_page(int(idx[i * PAGE])) for i in range(3)]
        assert be.batch_set(hv, pages) is True
        assert be.exists(hv[0]) and be.batch_exists(hv) == 3
        got = be.batch_get(hv, [pool.get_dummy_flat_data_page() for _ in hv])
        for g, p in zip(got, pages):
            assert g is not None and torch.equal(g.view(torch.uint8), p.view(torch.uint8))
        assert be.get("0" * 64, pool.get_dummy_flat_data_page()) is None
        be.close()
    finally:
        st.close()
