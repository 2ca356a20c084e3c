"""ExtentAllocator alone: runs never overlap, a freed run merges with its free
neighbours at once (so no free space stays split), any mix of sizes packs the space
completely, ``fits`` agrees with ``alloc``, and ``from_used`` rebuilds the map a restart
needs (the complement of the surviving chunks)."""

from __future__ import annotations

import random

import pytest

from gcache.server.extents import ExtentAllocator

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _check(a: ExtentAllocator, used: dict[int, int]) -> None:
    """Free runs and used runs tile [0, total) exactly; no two free runs touch."""
    free = a.runs()
    spans = sorted([(s, n, "f") for s, n in free] + [(s, n, "u") for s, n in used.items()])
    at = 0
    for s, n, _ in spans:
        assert s == at, f"gap or overlap at {at}: {spans}"
        at = s + n
    assert at == a.total
    for (s1, n1), (s2, _) in zip(free, free[1:]):
        assert s1 + n1 < s2, "two free runs touch: a free was not merged"
    assert a.free == sum(n for _, n in free)


def test_random_alloc_and_release_keep_the_space_tiled_and_merged() -> None:
    rng = random.Random(7)
    a = ExtentAllocator(4096)
    used: dict[int, int] = {}
    for step in range(4000):
        if used and (rng.random() < 0.45 or a.free < 64):
            s = rng.choice(list(used))
            a.release(s, used.pop(s))
        else:
            n = rng.choice((1, 2, 3, 16, 17, 64, 100, 700))
            fits = a.fits(n)
            s = a.alloc(n)
            assert (s is not None) == fits, "fits and alloc disagree"
            if s is not None:
                used[s] = n
        if step % 50 == 0:
            _check(a, used)
    for s, n in list(used.items()):
        a.release(s, n)
    assert a.runs() == [(0, 4096)] and a.free == 4096


def test_mixed_sizes_pack_the_whole_space() -> None:
    rng = random.Random(3)
    a = ExtentAllocator(10_000)
    left = 10_000
    while left:  # sizes from 1 granule (4 KiB) to 768 (3 MiB): every one fits
        n = min(left, rng.randint(1, 768))
        assert a.fits(n) and a.alloc(n) is not None, (n, left)
        left -= n
    assert a.free == 0 and not a.fits(1) and a.alloc(1) is None


def test_a_freed_run_is_reused_for_a_request_that_fits_it() -> None:
    a = ExtentAllocator(100)
    s1, s2, s3 = a.alloc(30), a.alloc(30), a.alloc(40)
    assert (s1, s2, s3) == (0, 30, 60) and a.alloc(1) is None
    a.release(s2, 30)
    assert not a.fits(31) and a.alloc(31) is None
    assert a.alloc(10) == 30 and a.alloc(20) == 40 and a.free == 0
    a.release(0, 30)
    a.release(30, 10)
    a.release(40, 20)  # merges with both neighbours
    assert a.runs() == [(0, 60)] and a.largest() == 60


def test_from_used_is_the_complement_of_the_survivors() -> None:
    a = ExtentAllocator.from_used(100, [(50, 10), (0, 5), (90, 10)])
    assert a.runs() == [(5, 45), (60, 30)] and a.free == 75
    _check(a, {50: 10, 0: 5, 90: 10})
    assert a.alloc(45) == 5 and a.alloc(30) == 60 and a.alloc(1) is None
    assert ExtentAllocator.from_used(8, []).runs() == [(0, 8)]


def test_requests_beyond_the_space_never_fit() -> None:
    a = ExtentAllocator(16)
    assert not a.fits(17) and a.alloc(17) is None and a.alloc(1 << 20) is None
