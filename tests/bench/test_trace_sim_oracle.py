"""The trace simulator's reference points on a hand-checked trace: the infinite ceiling,
LRU through the real policy class, and the Belady oracle (farthest next use, no
admission of a page needed later than every resident one), which is never below LRU."""

from __future__ import annotations

import pytest

from gcache.bench.trace_sim import Request, belady, ceiling, simulate

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _reqs(*chains: bytes) -> list[Request]:
    return [Request(tuple(bytes([c]) for c in chain), float(i)) for i, chain in enumerate(chains)]


def test_one_off_prompt_flushes_lru_but_not_the_oracle() -> None:
    reqs = _reqs(b"AB", b"C", b"AB")  # C is used once, between two uses of A, B
    assert ceiling(reqs) == pytest.approx(2 / 5)
    lru = simulate(reqs, 2, "lru")
    assert lru.hit_rate == 0.0 and lru.evictions == 3  # C evicts A; A's re-put evicts B, C
    assert belady(reqs, 2) == pytest.approx(2 / 5)  # C never admitted
    assert simulate(reqs, 3, "lru").hit_rate == pytest.approx(2 / 5)


def test_hit_is_the_leading_run_of_resident_pages() -> None:
    reqs = _reqs(b"ABCD", b"ABXD")  # D is resident but after the miss at X
    assert ceiling(reqs) == pytest.approx(2 / 8)
    for policy in ("lru", "reuse", "s3fifo"):
        assert simulate(reqs, 10, policy).hit_rate == pytest.approx(2 / 8)
    assert belady(reqs, 10) == pytest.approx(2 / 8)
