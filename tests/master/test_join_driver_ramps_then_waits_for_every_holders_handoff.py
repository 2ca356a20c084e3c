"""The masters' join driver on virtual time: a newcomer registers JOINING at 1/4 of its
weight, its ramp rises one step per interval (never sooner), reaches 1.0 at
``join_ramp_s``, and the member turns UP only once every other holder's last heartbeat
reports a handoff pass finished at or after the ramp's last epoch with nothing left; a
holder still reporting objects left (or an older pass, or no heartbeat) holds it
JOINING until ``join_timeout_s``. A stale incarnation's join is never ended.

In process: one real single-master Raft group (``RaftNode`` with no peers), the real
``FailureDetector`` (for the heartbeat stats) and the real ``JoinDriver``, stepped by
hand on a ``VirtualClock``.
"""

from __future__ import annotations

import pytest

from gcache.clock import VirtualClock
from gcache.master.detector import FailureDetector
from gcache.master.joiner import JoinDriver
from gcache.master.raft_node import RaftNode
from gcache.view import MemberState

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

RAMP_S, TIMEOUT_S = 6.0, 60.0  # steps every 2 s: 0.25 at 0, 0.5 at 2, 0.75 at 4, 1.0 at 6


def _register(node: RaftNode, mid: str, ramp: float | None, boot: str = "") -> None:
    op = {"op": "register", "id": mid, "address": "127.0.0.1:1", "capacity_bytes": 1 << 20,
          "boot_id": boot or f"boot-{mid}"}
    if ramp is not None:
        op["ramp"] = ramp
    node.submit(op)


def _done(epoch: int, left: int = 0) -> dict:
    return {"handoff_passes": 3, "handoff_epoch": epoch, "handoff_objects_left": left,
            "handoff_active": 0}


def _rec(node: RaftNode, mid: str):
    return node.membership.get(mid)


def _setup(leader: RaftNode):
    clock = VirtualClock()
    det = FailureDetector(leader, 3.0, clock)
    drv = JoinDriver(leader, det, RAMP_S, TIMEOUT_S, clock)
    for mid in ("s1", "s2"):
        _register(leader, mid, drv.initial_ramp)
    return clock, det, drv


def test_ramp_rises_in_steps_then_up_only_after_every_holder_handed_off(leader):
    clock, det, drv = _setup(leader)
    assert drv.initial_ramp == 0.25
    assert _rec(leader, "s1").state is MemberState.UP  # the first member bootstraps
    _register(leader, "s3", drv.initial_ramp)
    assert _rec(leader, "s2").state is MemberState.JOINING  # s2 joined s1: ramping too
    rec = _rec(leader, "s3")
    assert (rec.state, rec.ramp) == (MemberState.JOINING, 0.25)
    assert drv.step() == []  # becoming leader: every join's clock starts now
    ramps = []
    for _ in range(6):  # 6 s in half-second ticks
        clock.advance(0.5)
        drv.step()
        ramps.append(_rec(leader, "s3").ramp)
    assert ramps == [0.25, 0.25, 0.25, 0.5, 0.5, 0.5], ramps  # never before the interval
    clock.advance(4.0)
    drv.step()
    clock.advance(2.0)
    drv.step()
    final = _rec(leader, "s3")
    assert final.ramp == 1.0 and final.state is MemberState.JOINING
    assert _rec(leader, "s2").ramp == 1.0
    # s1 finished a pass at the final epoch with nothing left, s2 has not heartbeated
    det.seen("s1", _done(final.changed_epoch))
    clock.advance(1.0)
    assert drv.step() == []
    assert _rec(leader, "s3").state is MemberState.JOINING
    # s2 reports objects still left, then a pass from before the ramp ended
    epoch = leader.membership.epoch
    det.seen("s2", _done(epoch, left=12))
    clock.advance(1.0)
    drv.step()
    assert _rec(leader, "s3").state is MemberState.JOINING
    det.seen("s2", _done(final.changed_epoch - 1))
    clock.advance(1.0)
    drv.step()
    assert _rec(leader, "s3").state is MemberState.JOINING
    # s2 finished: s2 and s3 each wait only for the others' passes
    det.seen("s2", _done(leader.membership.epoch))
    det.seen("s3", _done(leader.membership.epoch))
    assert sorted(drv.step()) == [("s2", "joined"), ("s3", "joined")]
    rec = _rec(leader, "s3")
    assert (rec.state, rec.ramp) == (MemberState.UP, 1.0)
    assert drv.step() == []


def test_a_holder_that_never_finishes_holds_the_join_until_the_timeout(leader):
    clock, det, drv = _setup(leader)
    drv.step()
    for _ in range(10):
        clock.advance(RAMP_S / 3)
        det.seen("s1", _done(leader.membership.epoch, left=5))
        drv.step()
    assert _rec(leader, "s2").ramp == 1.0 and _rec(leader, "s2").state is MemberState.JOINING
    clock.advance(TIMEOUT_S - 10 * RAMP_S / 3 - 0.1)
    drv.step()
    assert _rec(leader, "s2").state is MemberState.JOINING
    clock.advance(0.1)
    assert drv.step() == [("s2", "joined")]
    assert _rec(leader, "s2").state is MemberState.UP


def test_a_restarted_joiner_resumes_its_ramp_and_old_incarnation_ops_change_nothing(leader):
    clock, det, drv = _setup(leader)
    drv.step()
    old = _rec(leader, "s2")
    # a restart mid-join: JOINING again at the ramp it had, under a new incarnation
    _register(leader, "s2", drv.initial_ramp, boot="boot-again")
    rec = _rec(leader, "s2")
    assert (rec.state, rec.ramp, rec.incarnation) == (MemberState.JOINING, old.ramp,
                                                      old.incarnation + 1)
    epoch = leader.membership.epoch
    leader.submit({"op": "ramp", "id": "s2", "incarnation": old.incarnation, "ramp": 0.5})
    leader.submit({"op": "joined", "id": "s2", "incarnation": old.incarnation})
    assert leader.membership.epoch == epoch
    # the driver starts the new incarnation's clocks afresh and ramps it from there
    assert drv.step() == []
    clock.advance(RAMP_S)
    assert ("s2", "ramp") in drv.step()
    assert _rec(leader, "s2").ramp > old.ramp


def test_no_ramp_means_newcomers_are_up_at_once(leader):
    clock = VirtualClock()
    drv = JoinDriver(leader, FailureDetector(leader, 3.0, clock), 0.0, TIMEOUT_S, clock)
    assert drv.initial_ramp is None
    _register(leader, "s1", drv.initial_ramp)
    _register(leader, "s2", drv.initial_ramp)
    assert _rec(leader, "s2").state is MemberState.UP
    with pytest.raises(ValueError):
        JoinDriver(leader, FailureDetector(leader, 3.0, clock), -1.0, TIMEOUT_S, clock)
    with pytest.raises(ValueError):
        JoinDriver(leader, FailureDetector(leader, 3.0, clock), 1.0, 0.0, clock)
