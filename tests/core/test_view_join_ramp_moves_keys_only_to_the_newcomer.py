"""The routing rule during a join (``view_from_wire``): a JOINING member is in the ring
from its first view, its weight scaled by its ramp; across ramp steps keys only ever
move toward the newcomer (never between old members, never away from it), and the
normalisation uses full capacities, so the old members' weights do not move with the
ramp. JOINING members are holders (a client may re-ask them)."""

from __future__ import annotations

import random

import pytest

from gcache.view import view_from_wire

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GIB = 1 << 30


def doc(epoch: int, ramp: float | None, new_cap: int = 2 * GIB) -> dict:
    members = [{"id": f"s{i}", "address": f"10.0.0.{i}:7400", "capacity_bytes": c,
                "state": "up"} for i, c in ((1, GIB), (2, 2 * GIB), (3, GIB))]
    members.append({"id": "s9", "address": "10.0.0.9:7400", "capacity_bytes": 1,
                    "state": "down"})
    members.append({"id": "s5", "address": "10.0.0.5:7400", "capacity_bytes": GIB,
                    "state": "draining"})
    if ramp is not None:
        members.append({"id": "s4", "address": "10.0.0.4:7400", "capacity_bytes": new_cap,
                        "state": "joining" if ramp < 1.0 else "up", "ramp": ramp})
    return {"epoch": epoch, "members": members}


def test_a_joining_member_is_placed_with_its_weight_times_its_ramp_and_holds():
    v = view_from_wire(doc(2, 0.25))
    weights = {m.id: m.weight for m in v.members}
    assert weights == {"s1": 0.5, "s2": 1.0, "s3": 0.5, "s4": 0.25}
    assert "10.0.0.4:7400" in v.holders and "10.0.0.5:7400" in v.holders
    assert "10.0.0.9:7400" not in v.holders
    # the top capacity is the newcomer's full one, not its ramped one
    big = {m.id: m.weight for m in view_from_wire(doc(2, 0.25, new_cap=4 * GIB)).members}
    assert big == {"s1": 0.25, "s2": 0.5, "s3": 0.25, "s4": 0.25}
    # a record without a ramp (an older master) is at full weight
    plain = doc(2, 0.25)
    del plain["members"][-1]["ramp"]
    assert {m.id: m.weight for m in view_from_wire(plain).members}["s4"] == 1.0


@pytest.mark.parametrize("new_cap", [GIB, 2 * GIB, 4 * GIB])
def test_ramp_steps_move_keys_only_toward_the_newcomer(new_cap):
    rng = random.Random(12)
    hashes = [rng.getrandbits(64) for _ in range(40_000)]
    steps = [None, 0.25, 0.5, 0.75, 1.0]
    owners = [[m.id for m in view_from_wire(doc(e, r, new_cap)).ring.owners(hashes)]
              for e, r in enumerate(steps, 1)]
    shares = []
    for before, after in zip(owners[1:], owners[2:]):  # during the ramp: monotone
        moved = [(b, a) for b, a in zip(before, after) if b != a]
        assert moved and all(a == "s4" for _, a in moved), set(moved)
        shares.append(after.count("s4") / len(hashes))
    assert shares == sorted(shares) and shares[-1] > 0.15
    first = [(b, a) for b, a in zip(owners[0], owners[1]) if b != a]
    if new_cap <= 2 * GIB:  # the top capacity did not change: the join only adds s4
        assert first and all(a == "s4" for _, a in first)
