"""`gcache status` shows each member's handoff: what is left (moving, or waiting for a
retry), what moved, what was lost; a dash for a member that reports none."""

from __future__ import annotations

import pytest

from gcache.cli.status import handoff_cell

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

IDLE = {"handoff_passes": 1, "handoff_active": 0, "handoff_objects_left": 0,
        "handoff_bytes_left": 0, "handoff_objects_moved": 0, "handoff_lost": 0}


def test_members_without_handoff_numbers_or_moves_show_a_dash() -> None:
    assert handoff_cell({}) == "-"
    assert handoff_cell({"objects": 3}) == "-"
    assert handoff_cell(IDLE) == "-"


def test_moving_waiting_done_and_lost() -> None:
    moving = dict(IDLE, handoff_active=1, handoff_objects_left=1500,
                  handoff_bytes_left=3 << 29, handoff_objects_moved=20)
    assert handoff_cell(moving) == "[cyan]moving: 1,500 left (1.50 GiB)[/], 20 moved"
    waiting = dict(moving, handoff_active=0, handoff_objects_left=7, handoff_bytes_left=7000)
    assert handoff_cell(waiting) == "[yellow]7 waiting (6.84 KiB)[/], 20 moved"
    done = dict(IDLE, handoff_objects_moved=12345)
    assert handoff_cell(done) == "done, 12,345 moved"
    assert handoff_cell(dict(done, handoff_lost=2)) == "done, 12,345 moved, [red]2 lost[/]"
