"""`gcache status` says why a member drained itself (its heartbeat's ``self_drain``:
stop, unhealthy_file, disk_degraded), next to its handoff progress."""

from __future__ import annotations

import pytest

from gcache.cli.status import handoff_cell

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

IDLE = {"handoff_passes": 1, "handoff_active": 0, "handoff_objects_left": 0,
        "handoff_bytes_left": 0, "handoff_objects_moved": 0, "handoff_lost": 0,
        "self_drain": ""}


def test_self_drain_reason_follows_the_handoff_progress() -> None:
    assert handoff_cell(IDLE) == "-"
    assert handoff_cell(dict(IDLE, self_drain="unhealthy_file")) == \
        "[yellow]self-drained: unhealthy_file[/]"
    done = dict(IDLE, handoff_objects_moved=40, self_drain="disk_degraded")
    assert handoff_cell(done) == "done, 40 moved, [yellow]self-drained: disk_degraded[/]"
