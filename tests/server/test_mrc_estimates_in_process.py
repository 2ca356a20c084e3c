"""The miss-ratio curve (server/mrc.py) in-process: its estimates match exact LRU
replays, its memory stays bounded by lowering the sample rate, namespaces are counted
apart, and a MemoryTier feeds it every whole-object read (hit or miss), EXISTS and put."""

from __future__ import annotations

import os
import random

import pytest

from gcache.bench.mrc_check import ExactLRU, check
from gcache.errors import ConfigError
from gcache.server.arena import Arena
from gcache.server.memory_tier import MemoryTier
from gcache.server.mrc import FACTORS, MissRatioCurve
from tierops import put_value, read_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TRACE = "/work/shared/traces/mooncake_fast25_synthetic_trace.jsonl"
PAGE = 4096


def _zipf_stream(n_keys: int, n: int, seed: int, alpha: float = 0.9) -> list[bytes]:
    """Zipf-like; a heavy head (alpha near 1) is spatial sampling's worst case: a few keys
    sampled in or out move the estimate, so the sampled test uses a milder one."""
    rnd = random.Random(seed)
    weights = [1 / (i + 1) ** alpha for i in range(n_keys)]
    return [b"k%d" % i for i in rnd.choices(range(n_keys), weights, k=n)]


def _replay(curve: MissRatioCurve, stream: list[bytes], capacity: int) -> list[float]:
    """Drive ``curve`` like a server of ``capacity`` bytes (a miss is put right after);
    returns the exact LRU hit ratios at every factor."""
    server = ExactLRU(capacity)
    exact = [ExactLRU(f * capacity) for f in FACTORS]
    for k in stream:
        hit = server.get(k, PAGE, insert=False)
        curve.on_get(b"ns", k, PAGE if hit else None)
        if not hit:
            server.put(k, PAGE)
            curve.on_put(b"ns", k, PAGE)
        for e in exact:
            e.get(k, PAGE)
    return [e.hit_ratio for e in exact]


def test_unsampled_curve_equals_exact_lru_at_every_factor():
    capacity = 300 * PAGE
    curve = MissRatioCurve(capacity, tracked_keys=100_000, sample_rate=1.0)
    exact = _replay(curve, _zipf_stream(5000, 20_000, seed=1), capacity)
    est = curve.snapshot()["namespaces"]["ns"]["hit_ratio"]
    assert est == [round(x, 4) for x in exact]
    assert est[0] < est[1] < est[2] < est[3] < est[4]


def test_sampled_curve_within_003_of_exact():
    capacity = 400 * PAGE
    curve = MissRatioCurve(capacity, tracked_keys=512)  # samples 1/8 of the keys
    exact = _replay(curve, _zipf_stream(20_000, 80_000, seed=2, alpha=0.6), capacity)
    est = curve.snapshot()["namespaces"]["*"]["hit_ratio"]
    assert max(abs(a - b) for a, b in zip(est, exact)) <= 0.03, (est, exact)
    assert curve.sampled < 80_000 * 0.125 * 2  # most accesses never took the sampled path


def test_tracked_keys_bounded_by_lowering_the_sample_rate():
    curve = MissRatioCurve(1 << 40, tracked_keys=64, sample_rate=1.0)  # room for all
    for i in range(20_000):
        k = b"k%d" % i
        curve.on_put(b"ns", k, PAGE)
        curve.on_get(b"ns", k, PAGE)
    snap = curve.snapshot()
    assert snap["tracked_keys"] <= 64
    assert snap["sample_rate"] < 64 / 20_000 * 2  # settled near tracked / distinct keys
    assert len(curve._heap) <= 4 * 64 + 1
    assert snap["namespaces"]["ns"]["hit_ratio"] == [1.0] * 5  # every get followed its put


@pytest.mark.skipif(not os.path.exists(TRACE), reason="synthetic trace not present")
def test_mooncake_trace_estimate_within_003_of_exact():
    rows, snap = check(TRACE, capacity_fraction=0.1, limit=2000)
    assert all(abs(r.error) <= 0.03 for r in rows), rows
    assert snap["tracked_keys"] <= 8192


@pytest.mark.skipif(not os.path.exists(TRACE), reason="synthetic trace not present")
def test_exists_then_read_prefix_flow_within_003_of_exact():
    """SGLang's flow: EXISTS every page, GET the prefix that exists, put the missing."""
    rows, _ = check(TRACE, capacity_fraction=0.1, limit=2000, flow="exists")
    assert all(abs(r.error) <= 0.03 for r in rows), rows


def test_exists_then_get_counts_one_access():
    curve = MissRatioCurve(100 * PAGE, sample_rate=1.0)
    curve.on_put(b"ns", b"x", PAGE)
    curve.on_exists(b"ns", b"x", True)
    curve.on_get(b"ns", b"x", PAGE)  # the read its EXISTS decided: not counted again
    curve.on_exists(b"ns", b"y", False)  # a miss: the engine puts it
    curve.on_put(b"ns", b"y", PAGE)
    curve.on_get(b"ns", b"y", PAGE)  # a read without an EXISTS: counted
    d = curve.snapshot()["namespaces"]["ns"]
    assert d["gets"] == 3
    assert d["hit_ratio"] == [round(2 / 3, 4)] * 5


def test_namespaces_counted_apart_and_star_is_their_sum():
    curve = MissRatioCurve(100 * PAGE, sample_rate=1.0, max_namespaces=2)
    for ns in (b"a", b"b", b"c"):
        curve.on_put(ns, b"x", PAGE)
    for _ in range(3):
        curve.on_get(b"a", b"x", PAGE)  # hits
    curve.on_get(b"b", b"missing", None)  # a miss at every factor
    curve.on_get(b"c", b"x", PAGE)  # past max_namespaces: counted as "other"
    ns = curve.snapshot()["namespaces"]
    assert ns["a"]["hit_ratio"] == [1.0] * 5
    assert ns["b"]["gets"] == 1 and ns["b"]["hit_ratio"] == [0.0] * 5
    assert ns["other"]["hit_ratio"] == [1.0] * 5
    assert ns["*"]["gets"] == 5 and ns["*"]["hit_ratio"] == [0.8] * 5
    assert ns["*"]["actual_hit_ratio"] == 0.8


def test_byte_hit_ratio_weighs_by_size():
    curve = MissRatioCurve(1 << 30, sample_rate=1.0)
    curve.on_put(b"ns", b"big", 3 * PAGE)
    curve.on_get(b"ns", b"big", 3 * PAGE)  # hit: 3 pages
    curve.on_get(b"ns", b"small", None)  # unknown: sized by the mean put (3 pages)
    curve.on_put(b"ns", b"small", PAGE)
    curve.on_get(b"ns", b"small", PAGE)  # hit: 1 page
    d = curve.snapshot()["namespaces"]["ns"]
    assert d["hit_ratio"] == [round(2 / 3, 4)] * 5
    assert d["byte_hit_ratio"] == [round(4 / 7, 4)] * 5


def test_bad_sizes_refused_with_the_option_name():
    with pytest.raises(ConfigError, match="mrc_tracked_keys"):
        MissRatioCurve(1 << 20, tracked_keys=3)
    with pytest.raises(ConfigError, match="mrc_sample_rate"):
        MissRatioCurve(1 << 20, sample_rate=0)


def test_memory_tier_feeds_whole_reads_hits_and_misses_and_puts(tmp_path):
    arena = Arena(str(tmp_path / "a.arena"), 8 << 20, 1 << 20, prefault=False)
    curve = MissRatioCurve(arena.npages * arena.slab_bytes, sample_rate=1.0)
    m = MemoryTier(arena, access_observer=curve)
    try:
        put_value(m, b"ns", b"k", 10_000)
        assert read_value(m, b"ns", b"k") is not None  # a hit
        assert read_value(m, b"ns", b"absent") is None  # a miss
        p = m.pin_read(b"ns", b"k", 5000, 100, 0)  # a later slice: not counted again
        m.unpin(p)
        d = curve.snapshot()["namespaces"]["ns"]
        assert d["gets"] == 2
        assert d["hit_ratio"] == [0.5] * 5
        assert d["actual_hit_ratio"] == 0.5
        assert curve.sampled == 3  # the put, the hit, the miss (sized by the mean put)
        assert m.exists(b"ns", b"k") and not m.exists(b"ns", b"nope")
        assert curve.snapshot()["namespaces"]["ns"]["gets"] == 4
        # a TCP GET frame pins all its items at once: each whole read counts the same
        # (k2: a key no EXISTS decided, whose GET is the access)
        put_value(m, b"ns", b"k2", 10_000)
        pins = m.pin_read_many(b"ns", [(b"k2", 0, 1 << 20, 0), (b"gone", 0, 1 << 20, 0),
                                       (b"k2", 5000, 100, 0)])
        m.unpin_many(pins)
        d = curve.snapshot()["namespaces"]["ns"]
        assert d["gets"] == 6 and d["actual_hit_ratio"] == 0.5
    finally:
        m.close()
