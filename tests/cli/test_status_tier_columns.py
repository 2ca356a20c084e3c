"""`gcache status` shows the NVMe tier per member: usage, degraded state, movement."""

from __future__ import annotations

import pytest

from gcache.cli import tier_cells

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_servers_without_a_disk_tier_show_dashes() -> None:
    assert tier_cells({}) == ("-", "-")
    assert tier_cells({"used_bytes": 5, "capacity_bytes": 10}) == ("-", "-")


def test_disk_usage_degraded_flag_and_moves() -> None:
    st = {"disk_capacity_bytes": 16 << 30, "disk_used_bytes": 3 << 29, "disk_degraded": 0,
          "demoted": 1234, "promoted": 56}
    assert tier_cells(st) == ("1.50 GiB / 16.00 GiB", "1,234↓ 56↑")
    disk, _ = tier_cells(dict(st, disk_degraded=1))
    assert "degraded" in disk and disk.startswith("[red]")
