"""Every side pool SGLang 0.5.23 builds on CPU, backed up and prefetched byte for byte
through the real HybridCacheController.

Mamba state (``trailing_pages``, one key; with PLE slot side states too, which
have no zero-copy pointers and travel as whole flat pages), the QSA, MiniMax-sparse and DSA indexers (``all_pages`` sidecar
on the KV indices), draft KV (``draft``), draft SWA (``draft_swa``, trailing on the
SWA indices), the DSA draft pair (``draft`` + ``draft_indexer``) and DeepSeek-V4
(a logical KV anchor stored as one-byte markers, paged SWA, the compressed C1, C2
and C4 pools with their indexers, C128, the C4 compressor states, and an MTP draft
worker's SWA). The pools are
built by SGLang's own assembler; a second engine (fresh host pools, other random
bytes) restores what the first stored, and every restored page of every pool is
compared with the producer's through SGLang's ``get_data_page``.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# kind -> the pools whose pages must come back, {pool: page positions of a 6-page chain}
N = 6
EXPECTED = {
    "mamba": {"kv": range(N), "mamba": [N - 1]},
    "mamba_ple": {"kv": range(N), "mamba": [N - 1]},  # whole flat pages (no zero-copy)
    "qsa": {"kv": range(N), "mamba": [N - 1], "indexer": range(N)},
    "minimax": {"kv": range(N), "indexer": range(N)},
    "minimax_nvfp4": {"kv": range(N), "indexer": range(N)},  # NVFP4-packed K, V, index K
    "dsa": {"kv": range(N), "indexer": range(N)},
    "draft": {"kv": range(N), "draft": range(N)},
    "swa_draft": {"kv": range(N), "swa": [N - 2, N - 1], "draft_swa": [N - 2, N - 1]},
    "dsa_draft": {"kv": range(N), "indexer": range(N), "draft": range(N),
                  "draft_indexer": range(N)},
    # window 128 tokens < one 256-token page: SWA, draft SWA and the compressor states
    # keep 1 page
    "dsv4_draft": {"kv": range(N), "swa": [N - 1], "draft_swa": [N - 1],
                   "deepseek_v4_c4": range(N),
                   "deepseek_v4_c4_indexer": range(N), "deepseek_v4_c128": range(N),
                   "deepseek_v4_c4_state": [N - 1], "deepseek_v4_c4_indexer_state": [N - 1],
                   "deepseek_v4_c1": range(N), "deepseek_v4_c1_indexer": range(N),
                   "deepseek_v4_c2": range(N), "deepseek_v4_c2_indexer": range(N)},
}


def _positions(slots):
    return {p: sorted(m) for p, m in slots.items()}


def _assert_same_bytes(prod, cons, backed_up, restored, what):
    for pool, positions in backed_up.items():
        for pos, slot in positions.items():
            assert cons.page_bytes(pool, restored[pool][pos]) == prod.page_bytes(pool, slot), \
                f"{what}: pool {pool} page {pos} differs"


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_side_pools_backup_then_prefetch_restore_every_byte(l3, kind):
    from sglang_harness import stack_pair

    want = {p: list(pos) for p, pos in EXPECTED[kind].items()}
    with stack_pair(kind, l3.addresses, (1, 2)) as (prod, cons):
        assert set(prod.controller.mem_pool_host.entry_map) == set(EXPECTED[kind])
        start = 1_000_000 * (list(EXPECTED).index(kind) + 1)  # other tests stay below 1M
        seq = list(range(start, start + N * prod.page_size))
        bk = prod.backup_pools(seq)
        assert bk.completed_tokens == len(seq)
        assert _positions(bk.slots) == want

        cons.prefetch(seq, f"side-{kind}")
        got = cons.restored_pools(seq)
        assert _positions(got) == want, "every pool's pages must land"
        _assert_same_bytes(prod, cons, bk.slots, got, kind)
        st = cons.backend.gcache_stats()["counters"]
        for pool, positions in EXPECTED[kind].items():
            assert st[f"get_pages_ok.{pool}"] == len(positions)
        assert st.get("errors", 0) == 0


def test_missing_mamba_state_gives_no_hit_and_loads_nothing(l3):
    """Mamba is trailing_pages with one key: KV alone (the state evicted or never
    written) is not restorable, so the hit is 0 and no KV page is fetched."""
    from sglang.srt.mem_cache import hicache_storage as hs
    from sglang_harness import seq_of, stack_pair

    with stack_pair("mamba", l3.addresses, (3, 4)) as (prod, cons):
        seq = seq_of(900_000, 3)
        hv, _kv, _swa, done = prod.backup(seq)  # KV only: no Mamba state handed over
        assert done == len(seq)
        q = [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["__placeholder__"],
                             hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)]
        no_prefix = hs.HiCacheStorageExtraInfo(prefix_keys=None)
        res = cons.backend.batch_exists_v2(hv, q, no_prefix)
        assert (res.kv_hit_pages, res.restorable_prefix_pages) == (0, [])
        assert res.extra_pool_hit_pages["kv"] == 3

        bk = prod.backup_pools(seq)  # now with the state at the last page: 3 is restorable
        assert bk.completed_tokens == len(seq)
        res = cons.backend.batch_exists_v2(hv, q, no_prefix)
        assert (res.kv_hit_pages, res.restorable_prefix_pages) == (3, [3])


@pytest.mark.parametrize("kind", ["mamba", "qsa", "dsa_draft", "swa_draft", "dsv4_draft"])
def test_every_pool_page_lies_in_a_buffer_the_plugin_registers(l3, kind):
    """The plugin maps (and, over nixl, registers) each pool's host buffers; a page
    outside them would be read through a raw pointer and staged, never one-sided."""
    import torch
    from sglang_harness import build_stack

    s = build_stack(kind, "page_first", l3.addresses, seed=5)
    try:
        for name, b in s.backend.bindings().items():
            if b.logical:  # DeepSeek-V4's anchor has no bytes (one marker object a page)
                assert name == "kv" and b.spec.comp_bytes == (1,) and not b.arrays
                continue
            spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in b.arrays]
            idx = torch.arange(2 * b.page_size, dtype=torch.int64)
            ptrs, sizes = b.pool.get_page_buffer_meta(idx)
            for p, n in zip(ptrs, sizes):
                assert any(lo <= int(p) and int(p) + int(n) <= hi for lo, hi in spans), \
                    f"{kind}: pool {name} page at {int(p):#x} is in no registered buffer"
    finally:
        s.close()


def test_dsa_indexer_written_by_rank0_is_read_by_every_tp_rank(l3):
    """DSA is rank-replicated (SGLang's is_mla_model): only the storage writer backs up
    KV and the indexer, every TP rank reads them. A rank-sharded indexer key would miss
    on rank 1 and, all_pages, zero the hit of every rank after the MIN reduce."""
    from sglang_harness import stack_pair

    with stack_pair("dsa", l3.addresses, (6, 7), tps=((0, 2), (1, 2))) as (prod, cons):
        assert not cons.controller.storage_backend.storage_config.is_storage_writer
        seq = list(range(700_000, 700_000 + 3 * prod.page_size))
        bk = prod.backup_pools(seq)
        assert bk.completed_tokens == len(seq)
        cons.prefetch(seq, "dsa-rank1")
        got = cons.restored_pools(seq)
        assert _positions(got) == {"kv": [0, 1, 2], "indexer": [0, 1, 2]}
        _assert_same_bytes(prod, cons, bk.slots, got, "dsa rank 1")


def test_hit_keeps_all_pages_sidecars_alive_with_the_kv(l3):
    """An all_pages sidecar (DSA indexer) gates the hit like KV, so the keep-alive that
    refreshes the KV chain on a hit must refresh it too, or the indexer ages out
    under LRU while its KV stays and every later hit is 0."""
    from sglang_harness import stack_pair

    with stack_pair("dsa", l3.addresses, (8, 9)) as (prod, cons):
        seq = list(range(800_000, 800_000 + 4 * prod.page_size))
        assert prod.backup_pools(seq).completed_tokens == len(seq)
        cons.prefetch(seq, "keepalive")
        st = cons.backend.gcache_stats()["counters"]
        assert st["get_pages_ok.indexer"] == 4
        assert st["touch_keys_sent"] == 4 + 4, "4 KV objects and 4 indexer objects"
