"""``placement_hashes``: the C version, its twin and the one placement rule agree.

Both give ``gcache.hashing.placement_hash`` of every key (the rule every SDK, server
and master routes by), and on bad input (a str namespace, a key that is not bytes)
both raise the same exception type.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import native
from gcache.hashing import PLACEMENT_SEED, placement_hash

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

key = st.one_of(st.binary(max_size=40), st.binary(min_size=500, max_size=2000),
                st.text(max_size=5), st.integers(), st.builds(bytearray, st.binary(max_size=5)))
namespace = st.one_of(st.binary(max_size=64), st.builds(bytearray, st.binary(max_size=8)),
                      st.text(max_size=4))


def outcome(fn, ns, keys, seed):
    try:
        return ("ok", fn(ns, keys, seed))
    except Exception as exc:
        return ("raised", type(exc))


@settings(max_examples=400, deadline=None)
@given(namespace, st.lists(key, max_size=12), st.sampled_from([PLACEMENT_SEED, 0, 2**64 - 1]))
def test_native_and_twin_agree(ns, keys, seed):
    assert outcome(_native.placement_hashes, ns, keys, seed) == \
        outcome(native.twins.placement_hashes, ns, keys, seed)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.lists(st.binary(min_size=1, max_size=600), max_size=20))
def test_both_are_the_placement_rule(ns, keys):
    want = [placement_hash(ns, k) for k in keys]
    assert _native.placement_hashes(ns, keys, PLACEMENT_SEED) == want
    assert native.twins.placement_hashes(ns, keys, PLACEMENT_SEED) == want
