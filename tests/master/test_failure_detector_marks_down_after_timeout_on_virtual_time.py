"""The masters' failure detector on virtual time: a member is marked down only once its
heartbeats have stopped for more than the timeout, never before, and a heartbeat starts
its clock again.

In process: one real single-master Raft group (``RaftNode`` with no peers, so it leads
alone) and the real ``FailureDetector``, stepped by hand on a ``VirtualClock``.
"""

from __future__ import annotations

import pytest

from gcache.clock import VirtualClock
from gcache.master.detector import FailureDetector
from gcache.master.raft_node import RaftNode
from gcache.view import MemberState

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TIMEOUT_S = 3.0


def _register(node: RaftNode, mid: str) -> None:
    node.submit({"op": "register", "id": mid, "address": "127.0.0.1:1",
                 "capacity_bytes": 1 << 20, "boot_id": f"boot-{mid}"})


def _state(node: RaftNode, mid: str) -> MemberState:
    return node.membership.get(mid).state


def test_marked_down_after_the_timeout_not_before_and_a_heartbeat_resets_it(leader):
    _register(leader, "s1")
    _register(leader, "s2")
    clock = VirtualClock()
    det = FailureDetector(leader, TIMEOUT_S, clock)
    assert det.step() == []  # becoming leader starts every clock now

    clock.advance(TIMEOUT_S)  # silent for exactly the timeout: not yet
    assert det.step() == []
    assert _state(leader, "s1") is _state(leader, "s2") is MemberState.UP

    det.seen("s1")  # s1 heartbeats; s2 stays silent
    clock.advance(0.5)
    epoch = leader.membership.epoch
    assert det.step() == ["s2"]
    assert _state(leader, "s2") is MemberState.DOWN
    assert _state(leader, "s1") is MemberState.UP
    assert leader.membership.epoch == epoch + 1

    clock.advance(TIMEOUT_S - 0.5)  # s1: exactly the timeout since its heartbeat
    assert det.step() == []
    assert _state(leader, "s1") is MemberState.UP
    clock.advance(0.5)
    assert det.step() == ["s1"]
    assert _state(leader, "s1") is MemberState.DOWN


def test_status_reports_heartbeat_age_on_the_clock(leader):
    _register(leader, "s1")
    clock = VirtualClock()
    det = FailureDetector(leader, TIMEOUT_S, clock)
    det.seen("s1", {"objects": 7})
    clock.advance(1.25)
    members = [{"id": "s1"}, {"id": "never-seen"}]
    det.annotate(members)
    assert members == [{"id": "s1", "last_heartbeat_s": 1.25, "stats": {"objects": 7}},
                       {"id": "never-seen", "last_heartbeat_s": None, "stats": {}}]
