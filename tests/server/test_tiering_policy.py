"""Promotion policies on a hand-ticked clock, and the compaction carry-over rule."""

from __future__ import annotations

import pytest

from gcache.server.disk import Entry
from gcache.server.tiering import SealedSegment, SecondChance, carry_over, make_promote_policy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_never_and_first() -> None:
    assert not make_promote_policy("never", 1000).on_hit(b"n", b"k")
    assert make_promote_policy("first", 1000).on_hit(b"n", b"k")


def test_second_hit_within_the_window_promotes_once() -> None:
    clock = Clock()
    p = make_promote_policy("second-hit", 1000, clock)
    assert not p.on_hit(b"n", b"k")
    clock.t += 0.9
    assert p.on_hit(b"n", b"k")  # second hit inside 1 s
    assert not p.on_hit(b"n", b"k")  # the table forgot it: counting starts over
    clock.t += 5
    assert not p.on_hit(b"n", b"k2")
    clock.t += 1.5
    assert not p.on_hit(b"n", b"k2")  # too late: this is a new first hit
    clock.t += 0.5
    assert p.on_hit(b"n", b"k2")
    assert not p.on_hit(b"other-ns", b"k2")  # namespaces are apart


def test_second_hit_table_is_bounded() -> None:
    clock = Clock()
    p = make_promote_policy("second-hit", 60_000, clock)
    p.max_tracked = 100
    for i in range(1000):
        p.on_hit(b"n", b"%d" % i)
    assert len(p._first) == 100
    assert p.on_hit(b"n", b"999") and not p.on_hit(b"n", b"0")


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="second-hit"):
        make_promote_policy("sometimes", 1)


def test_compaction_carries_only_referenced_records() -> None:
    e = Entry(1, 4096, 8192, 128, 5000, 3, 0, 18)
    assert not carry_over(b"n", b"k", e)
    e.ref = True
    assert carry_over(b"n", b"k", e)


def test_second_chance_reclaims_the_emptiest_segment_oldest_first() -> None:
    p = SecondChance()
    assert p.victim([SealedSegment(3, 500, 0), SealedSegment(1, 900, 0),
                     SealedSegment(2, 100, 0), SealedSegment(4, 100, 0)]) == 2
    e = Entry(1, 4096, 8192, 128, 5000, 3, 0, 18)
    assert not p.carry(b"n", b"k", e)
    e.ref = True
    assert p.carry(b"n", b"k", e)
