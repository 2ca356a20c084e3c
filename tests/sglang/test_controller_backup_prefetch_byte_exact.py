"""SGLang's real HybridCacheController backs up to gcache and prefetches back byte for byte.

Full+SWA hybrid (MHA pools), plain MHA and MLA host pools, each in the
page_first and page_first_direct layouts; a second engine (fresh host pools)
restores what the first one stored.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CASES = [(k, lay) for k in ("swa", "mha", "mla") for lay in ("page_first", "page_first_direct")]


@pytest.mark.parametrize("kind,layout", CASES, ids=[f"{k}-{lay}" for k, lay in CASES])
def test_backup_then_prefetch_restores_every_byte(l3, kind, layout):
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang_harness import PAGE, WINDOW_PAGES, build_stack, seq_of

    prod = build_stack(kind, layout, l3.addresses, seed=1)
    cons = build_stack(kind, layout, l3.addresses, seed=2)
    try:
        n = 6
        seq = seq_of(1000 * (CASES.index((kind, layout)) + 1), n)
        hv, kv_slots, swa_slots, done = prod.backup(seq)
        assert done == n * PAGE
        assert len(hv) == n

        cons.prefetch(seq, "r-" + kind + layout)
        got_kv, got_swa = cons.restored(seq)
        assert len(got_kv) == n, "the whole chain must come back"
        for i in range(n):
            assert cons.page_bytes(PoolName.KV, got_kv[i]) == prod.page_bytes(PoolName.KV,
                                                                              kv_slots[i])
        if kind == "swa":
            assert sorted(got_swa) == list(range(n - WINDOW_PAGES, n))
            for p, slot in got_swa.items():
                assert cons.page_bytes(PoolName.SWA, slot) == prod.page_bytes(PoolName.SWA,
                                                                              swa_slots[p])
        st = cons.backend.gcache_stats()["counters"]
        assert st["get_pages_ok.kv"] == n
        assert st.get("errors", 0) == 0
    finally:
        prod.close()
        cons.close()


def test_swa_hit_is_window_safe_length(l3):
    """KV for 6 pages but the SWA window only at pages 2-3: the engine may stop at 4, not 6."""
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang_harness import PAGE, WINDOW_PAGES, build_stack, seq_of

    prod = build_stack("swa", "page_first", l3.addresses, seed=3)
    cons = build_stack("swa", "page_first", l3.addresses, seed=4)
    try:
        seq = seq_of(50_000, 6)
        hv, kv_slots, swa_slots, done = prod.backup(seq, swa_pages=[2, 3])
        assert done == 6 * PAGE
        q = [PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * WINDOW_PAGES,
                          hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        res = cons.backend.batch_exists_v2(hv, q, HiCacheStorageExtraInfo(prefix_keys=None))
        assert res.restorable_prefix_pages == [4]
        assert res.kv_hit_pages == 4
        assert res.extra_pool_hit_pages["kv"] == 6

        cons.prefetch(seq, "window-safe")
        got_kv, got_swa = cons.restored(seq)
        assert len(got_kv) == 4
        assert sorted(got_swa) == [2, 3]
        for p in (2, 3):
            assert cons.page_bytes(PoolName.SWA, got_swa[p]) == prod.page_bytes(
                PoolName.SWA, swa_slots[p])
        for i in range(4):
            assert cons.page_bytes(PoolName.KV, got_kv[i]) == prod.page_bytes(PoolName.KV,
                                                                              kv_slots[i])

        # a second window at the chain's end: pages 2-5 hold SWA, so 4, 5 and 6 are safe
        prod.backup(seq, swa_pages=[4, 5])
        res = cons.backend.batch_exists_v2(hv, q, HiCacheStorageExtraInfo(prefix_keys=None))
        assert res.restorable_prefix_pages == [4, 5, 6]
        assert res.kv_hit_pages == 6
    finally:
        prod.close()
        cons.close()


def test_rewrite_is_idempotent_and_skips_stored_pages(l3):
    from sglang_harness import PAGE, build_stack, seq_of

    s = build_stack("swa", "page_first", l3.addresses, seed=5)
    try:
        seq = seq_of(70_000, 5)
        s.backup(seq)
        before = s.backend.gcache_stats()["counters"]
        _hv, _kv, _swa, done = s.backup(seq)
        after = s.backend.gcache_stats()["counters"]
        assert done == 5 * PAGE
        assert after["set_pages_written"] == before["set_pages_written"]
        assert after["set_pages_skipped"] - before.get("set_pages_skipped", 0) == 5 + 2
    finally:
        s.close()


def test_backup_then_prefetch_over_nixl_registers_the_host_pools(make_cluster, monkeypatch):
    """GCACHE_TRANSPORT=nixl: SGLang's host pools are registered, so pages move by
    one-sided NIXL READ/WRITE straight between pool and arena (nothing staged)."""
    from gcache.nixl_lib import available

    if available():
        pytest.skip(available())
    import os

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang_harness import PAGE, build_stack, seq_of

    from gcache.sdk.transports import onesided

    c = make_cluster(2, "64MiB", extra=["--nixl", "on"])
    monkeypatch.setenv("GCACHE_TRANSPORT", "nixl")
    monkeypatch.setenv("GCACHE_ONE_SIDED_MIN_BYTES", "1")  # small test pages: still one-sided
    before = dict(onesided.STATS)
    prod = build_stack("mha", "page_first", c.addresses, seed=1)
    cons = build_stack("mha", "page_first", c.addresses, seed=2)
    try:
        seq = seq_of(9000, 4)
        hv, kv_slots, _swa, done = prod.backup(seq)
        assert done == 4 * PAGE
        cons.prefetch(seq, "r-nixl")
        got_kv, _ = cons.restored(seq)
        assert len(got_kv) == 4
        for i in range(4):
            assert cons.page_bytes(PoolName.KV, got_kv[i]) == prod.page_bytes(PoolName.KV,
                                                                              kv_slots[i])
    finally:
        prod.close()
        cons.close()
    d = {k: v - before.get(k, 0) for k, v in onesided.STATS.items()}
    assert d["nixl_put_items"] >= 4 and d["nixl_get_items"] >= 4
    assert d["nixl_staged_bytes"] == 0
