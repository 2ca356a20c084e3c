"""Pure rules of the plugin: window-safe stop points, chain groups, config parsing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.errors import ConfigError
from gcache.sdk.sglang import PluginConfig, chain_groups, window_safe_stops

pytestmark = pytest.mark.unit


def test_trailing_window_has_holes():
    kv = [True] * 6
    swa = [False, False, True, True, False, True]
    hit, pools, stops = window_safe_stops(kv, [("swa", "trailing_pages", swa, 2)])
    assert stops == [4]  # p=6 needs pages 4,5; page 4 is missing
    assert hit == 4 and pools == {"kv": 6, "swa": 4}


def test_kv_gap_truncates_everything():
    hit, pools, stops = window_safe_stops([True, True, False, True],
                                          [("swa", "trailing_pages", [True] * 4, 2)])
    assert (hit, stops, pools["kv"]) == (2, [1, 2], 2)


def test_all_pages_pool_and_no_pools():
    assert window_safe_stops([True] * 3, []) == (3, {"kv": 3}, [1, 2, 3])
    hit, _, stops = window_safe_stops([True] * 4, [("indexer", "all_pages",
                                                    [True, True, False, True], 0)])
    assert (hit, stops) == (2, [1, 2])
    assert window_safe_stops([], []) == (0, {"kv": 0}, [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=30), st.lists(st.booleans(), max_size=30),
       st.integers(1, 5))
def test_matches_brute_force(kv, swa, w):
    hit, _, stops = window_safe_stops(kv, [("swa", "trailing_pages", swa, w)])
    swa = swa + [False] * (len(kv) - len(swa))
    want = [p for p in range(1, len(kv) + 1)
            if all(kv[:p]) and all(swa[max(0, p - w):p])]
    assert stops == want and hit == (want[-1] if want else 0)


def test_chain_groups_name_runs_by_their_first_page():
    keys = [f"k{i}" for i in range(10)]
    assert chain_groups([], keys, 4) == ["k0"] * 4 + ["k4"] * 4 + ["k8"] * 2
    # a call that starts mid-chain (prefix keys given) gets the same groups
    assert chain_groups(keys[:6], keys[6:], 4) == ["k4", "k4", "k8", "k8"]
    assert chain_groups(None, keys[:3], 4) == ["k0"] * 3


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.integers(1, 64), st.integers(0, 200))
def test_any_split_of_a_chain_agrees(n, g, cut):
    keys = [f"p{i}" for i in range(n)]
    cut = min(cut, n)
    whole = chain_groups([], keys, g)
    assert chain_groups(keys[:cut], keys[cut:], g) == whole[cut:]
    assert len(set(whole)) == math.ceil(n / g)


def test_config_parsing():
    c = PluginConfig.from_extra({"servers": "a:1,b:2", "backend_name": "gcache",
                                 "interface_v1": 1, "group_pages": 8})
    assert c.servers == ("a:1", "b:2") and c.group_pages == 8 and c.group_policy == "chain"
    with pytest.raises(ConfigError, match="masters"):
        PluginConfig.from_extra({})
    with pytest.raises(ConfigError, match="group_pages"):
        PluginConfig.from_extra({"servers": ["a:1"], "group_pages": 0})
    with pytest.raises(ConfigError, match="skip_existing"):
        PluginConfig.from_extra({"servers": ["a:1"], "skip_existing": "yes"})


@pytest.mark.timeout(30)
def test_put_pages_names_the_object_before_a_consecutive_run_of_pages():
    from gcache.sdk.sglang.chain_store import PoolSpec, chain_parent

    spec = PoolSpec("kv", "t", "r", (10, 20))  # two components: the last one ends a page
    keys = ["h1", "h2", "h3"]
    assert chain_parent(spec, keys, [0, 1, 2], "") == ""  # the keys start the chain
    assert chain_parent(spec, keys, [0, 1, 2], "h0") == "kv/t/h0/r/1"  # the last prefix key
    assert chain_parent(spec, keys, [1, 2], "h0") == "kv/t/h1/r/1"  # h1 was stored already
    assert chain_parent(spec, keys, [0, 2], "h0") is None  # not consecutive: nothing said
    assert chain_parent(spec, keys, [0, 1], None) is None  # no prefix keys: unknown
