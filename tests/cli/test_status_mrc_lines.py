"""`gcache status --mrc` shows each member's miss-ratio curve in at most 80 columns:
per namespace, the hit rate now and its change with +X GiB (or -X) of memory."""

from __future__ import annotations

import pytest

from gcache.cli.status import mrc_lines

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _ns(hits: list[float]) -> dict:
    return {"gets": 1000, "hit_ratio": hits, "byte_hit_ratio": hits, "actual_hit_ratio": 0.2}


def test_curve_lines_show_deltas_per_capacity_step_within_80_columns() -> None:
    doc = {"capacity_bytes": 1 << 30, "factors": [0.5, 1.0, 2.0, 4.0, 8.0],
           "sample_rate": 0.125, "tracked_keys": 10, "max_tracked_keys": 8192,
           "namespaces": {"*": _ns([0.15, 0.26, 0.395, 0.54, 0.63]),
                          "a-namespace-with-a-very-long-name": _ns([0.1, 0.2, 0.3, 0.4, 0.5])}}
    lines = mrc_lines("gcache-0", {"mrc": doc})
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].startswith("gcache-0: memory 1.00 GiB, 1,000 GETs")
    assert lines[1].split() == ["namespace", "now", "-512", "MiB", "+1", "GiB", "+3", "GiB",
                                "+7", "GiB"]
    assert lines[2].split() == ["*", "26.0%", "-11.0%", "+13.5%", "+28.0%", "+37.0%"]
    assert lines[3].split()[0] == "a-namespace-with-~"


def test_member_without_a_curve_says_why() -> None:
    assert "no miss-ratio curve" in mrc_lines("gcache-1", {})[0]
