"""The vLLM connector's hit rule (gcache.sdk.vllm.matching), without vLLM: against a
brute-force oracle that tries every end, full groups need every block and sliding-window
groups only the blocks their window still sees; and the connector's config refuses
unknown keys and missing addresses with a message that names them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.errors import ConfigError
from gcache.sdk.vllm import ConnectorConfig
from gcache.sdk.vllm.matching import (GroupKind, GroupPlan, blocks_to_load, longest_hit,
                                      plan_lookup, window_blocks)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _oracle(plans, start, end, present_of):
    """The longest hit by trying every end from the longest down."""
    unit = plans[0].block_size
    for e in range(end, start, -unit):
        ok = True
        for p in plans:
            lo = start // p.block_size
            hi = e // p.block_size
            if p.kind is GroupKind.WINDOW:
                lo = max(lo, hi - p.window_blocks)
            ok &= all(present_of(p.gid, j) for j in range(lo, hi))
        if ok:
            return e - start
    return 0


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 6), st.integers(1, 40), st.integers(1, 5), st.booleans(),
       st.data())
def test_longest_hit_is_the_brute_force_answer(start_blocks, n_blocks, window, hybrid, data):
    bs = 16
    plans = [GroupPlan(0, GroupKind.FULL, bs, 0, 1, False)]
    if hybrid:
        plans.append(GroupPlan(1, GroupKind.WINDOW, bs, window_blocks(window * bs, bs), 1,
                               False))
    start = start_blocks * bs
    num_tokens = start + n_blocks * bs + 1
    lk = plan_lookup(plans, num_tokens // bs, bs, start, num_tokens)
    assert lk is not None
    bits = {(p.gid, j): data.draw(st.booleans()) for p, blocks in zip(plans, lk.blocks)
            for j in blocks}
    present = [[bits[(p.gid, j)] for j in blocks] for p, blocks in zip(plans, lk.blocks)]
    got = longest_hit(plans, lk, present)
    assert got == _oracle(plans, start, lk.end_tokens, lambda g, j: bits[(g, j)])
    for p in plans:  # what a hit loads is what the rule checked
        assert all(bits[(p.gid, j)] for j in blocks_to_load(p, start, start + got))


def test_window_loads_only_the_window_and_other_groups_never_hit():
    full = GroupPlan(0, GroupKind.FULL, 16, 0, 1, False)
    swa = GroupPlan(1, GroupKind.WINDOW, 16, window_blocks(4096, 16), 1, False)
    assert window_blocks(4096, 16) == 256 and window_blocks(32, 16) == 2
    assert list(blocks_to_load(swa, 0, 16 * 1000)) == list(range(744, 1000))
    assert len(blocks_to_load(full, 0, 16 * 1000)) == 1000
    replica = GroupPlan(3, GroupKind.SKIP, 16, 0, 1, False)  # not transferable: ignored
    lk = plan_lookup([full, replica], 100, 16, 0, 1601)
    assert lk.blocks[1] == () and len(lk.blocks[0]) == 100
    assert longest_hit([full, replica], lk, [[True] * 100, []]) == 1600
    assert len(blocks_to_load(replica, 0, 1600)) == 0
    mamba = GroupPlan(2, GroupKind.OTHER, 16, 0, 1, False)
    assert plan_lookup([full, mamba], 100, 16, 0, 1601) is None
    assert plan_lookup([full], 100, 16, 8, 1601) is None  # unaligned local prefix
    assert plan_lookup([full], 1, 16, 16, 33) is None  # nothing past the local prefix


def test_config_names_unknown_keys_and_needs_an_address():
    with pytest.raises(ConfigError, match="did you mean 'masters'"):
        ConnectorConfig.from_extra({"master": "h:1"})
    with pytest.raises(ConfigError, match="needs 'masters'"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ConfigError, match="load_timeout_ms must be an integer"):
        ConnectorConfig.from_extra({"servers": "h:1", "load_timeout_ms": "soon"})
    c = ConnectorConfig.from_extra({"masters": ["a:1", "b:2"], "save": "false"})
    assert c.masters == "a:1,b:2" and c.save is False


def test_config_takes_sizes_and_a_layout():
    c = ConnectorConfig.from_extra({"servers": "h:1", "staging_keep_bytes": "1024",
                                    "kv_layout": "LBHNC"})
    assert c.staging_keep_bytes == 1024 and c.kv_layout == "LBHNC"
    assert ConnectorConfig.from_extra({"servers": "h:1"}).kv_layout == "BLHNC"
    # sizes and booleans take the project's spellings
    c = ConnectorConfig.from_extra({"servers": "h:1", "staging_keep_bytes": "2GiB",
                                    "save": "off"})
    assert c.staging_keep_bytes == 2 << 30 and c.save is False
    with pytest.raises(ConfigError, match="staging_keep_bytes"):
        ConnectorConfig.from_extra({"servers": "h:1", "staging_keep_bytes": "lots"})
