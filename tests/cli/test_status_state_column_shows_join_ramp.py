"""`gcache status` shows a joining member with its capacity ramp, a drained member
that went down as drained, and every other state as it is."""

from __future__ import annotations

import pytest

from gcache.cli.status import state_cell

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_joining_shows_its_ramp_percent() -> None:
    assert state_cell({"state": "joining", "ramp": 0.25}) == "[cyan]joining 25%[/]"
    assert state_cell({"state": "joining", "ramp": 0.75}) == "[cyan]joining 75%[/]"
    assert state_cell({"state": "joining"}) == "[cyan]joining 100%[/]"  # an older master


def test_other_states() -> None:
    assert state_cell({"state": "up", "ramp": 1.0}) == "[green]up[/]"
    assert state_cell({"state": "down", "drained": True}) == "[red]down (drained)[/]"
    assert state_cell({"state": "draining", "drained": True}) == "[yellow]draining[/]"
