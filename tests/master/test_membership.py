"""The master's membership state machine and its RocksDB store.

Example tests pin each op's transitions; a hypothesis stateful test drives random
op sequences (with restarts, stale mark_downs, re-applies, store reopens and snapshot
restores) and checks the idempotency and epoch invariants after every step.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile

import msgpack
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gcache.master.membership import (
    MemberRecord,
    Membership,
    MemberState,
    validate_op,
)
from gcache.master.store import Store
from gcache.view import view_from_wire

pytestmark = pytest.mark.unit


def reg(member_id: str = "s1", boot: str = "b1", address: str = "10.0.0.1:7400",
        capacity: int = 1 << 30) -> dict:
    return {"op": "register", "id": member_id, "address": address, "capacity_bytes": capacity,
            "boot_id": boot}


def down(member_id: str = "s1", incarnation: int = 1) -> dict:
    return {"op": "mark_down", "id": member_id, "incarnation": incarnation}


def admin(op: str, member_id: str = "s1") -> dict:
    return {"op": op, "id": member_id}


def snap_doc(**kw) -> bytes:
    """Hand-made snapshot bytes: an empty state at epoch 0 with ``kw`` overriding fields."""
    return msgpack.packb({"format": 1, "epoch": 0, "members": [], "fences": {},
                          "applied_index": 0, **kw})


def state(m: Membership) -> dict:
    """The replicated state without the Raft index (which no-op entries also advance)."""
    doc = msgpack.unpackb(m.snapshot())
    del doc["applied_index"]
    return doc


def state_of(m: Membership, member_id: str = "s1") -> tuple[MemberState, int] | None:
    rec = m.get(member_id)
    return None if rec is None else (rec.state, rec.incarnation)


# ------------------------------------------------------------------ register
def test_register_new_member_is_up_at_incarnation_1():
    m = Membership()
    out = m.apply(reg())
    assert out["changed"] is True and out["epoch"] == 1 == m.epoch
    assert out["member"] == {"id": "s1", "address": "10.0.0.1:7400", "capacity_bytes": 1 << 30,
                             "incarnation": 1, "state": "up", "boot_id": "b1",
                             "changed_epoch": 1, "drained": False, "ramp": 1.0}
    assert m.get("s1") == MemberRecord.from_dict(out["member"])
    # a record written by an older master (no "drained" or "ramp" field) still reads
    old = {k: v for k, v in out["member"].items() if k not in ("drained", "ramp")}
    assert MemberRecord.from_dict(old) == m.get("s1")


def test_register_same_boot_is_noop_but_updates_address_and_capacity():
    m = Membership()
    m.apply(reg())
    out = m.apply(reg())
    assert out == {"changed": False, "epoch": 1, "member": m.get("s1").to_dict()}
    out = m.apply(reg(address="10.0.0.9:7401", capacity=5))
    assert out["changed"] and out["epoch"] == 2
    rec = m.get("s1")
    assert (rec.address, rec.capacity_bytes, rec.incarnation, rec.state) == \
        ("10.0.0.9:7401", 5, 1, MemberState.UP)
    assert rec.changed_epoch == 2


def test_register_new_boot_is_a_restart():
    m = Membership()
    m.apply(reg())
    out = m.apply(reg(boot="b2", address="10.0.0.2:7400"))
    assert out["changed"] and m.epoch == 2
    rec = m.get("s1")
    assert (rec.incarnation, rec.state, rec.boot_id, rec.address) == \
        (2, MemberState.UP, "b2", "10.0.0.2:7400")


def test_drain_intent_survives_down_and_restarts_until_undrain():
    m = Membership()
    m.apply(reg())
    m.apply(admin("drain"))
    m.apply(reg(boot="b2"))
    assert state_of(m) == (MemberState.DRAINING, 2)
    m.apply(down(incarnation=2))
    assert state_of(m) == (MemberState.DOWN, 2)
    m.apply(reg(boot="b3"))  # a drained server that crashed and restarted stays drained
    assert state_of(m) == (MemberState.DRAINING, 3)
    m.apply(down(incarnation=3))
    m.apply(reg(boot="b3"))  # same process back from a partition: still drained
    assert state_of(m) == (MemberState.DRAINING, 4)
    m.apply(admin("undrain"))
    assert state_of(m) == (MemberState.UP, 4) and m.get("s1").drained is False
    m.apply(down(incarnation=4))
    m.apply(reg(boot="b4"))  # undrained: back up as before
    assert state_of(m) == (MemberState.UP, 5)


def test_drain_while_down_takes_effect_when_it_returns():
    m = Membership()
    m.apply(reg())
    m.apply(down(incarnation=1))
    out = m.apply(admin("drain"))
    assert out["changed"] and out["member"]["state"] == "down" and out["member"]["drained"]
    assert m.apply(admin("drain"))["changed"] is False
    m.apply(reg(boot="b2"))
    assert state_of(m) == (MemberState.DRAINING, 2)


def test_same_boot_register_heals_down_with_a_new_incarnation():
    m = Membership()
    m.apply(reg())
    m.apply(down(incarnation=1))
    out = m.apply(reg())
    assert out["changed"] and state_of(m) == (MemberState.UP, 2)
    # A retried mark_down from before the heal (incarnation 1) cannot take it down again.
    assert m.apply(down(incarnation=1))["changed"] is False
    assert state_of(m) == (MemberState.UP, 2)


# ------------------------------------------------------------------ mark_down
def test_mark_down_only_for_current_incarnation():
    m = Membership()
    m.apply(reg())
    assert m.apply(down(incarnation=2))["changed"] is False  # from the future: no-op
    assert m.apply(down(incarnation=0))["changed"] is False
    out = m.apply(down(incarnation=1))
    assert out["changed"] and out["epoch"] == 2 and out["member"]["state"] == "down"
    assert m.apply(down(incarnation=1)) == {"changed": False, "epoch": 2,
                                             "member": m.get("s1").to_dict()}


def test_stale_mark_down_after_restart_does_nothing():
    m = Membership()
    m.apply(reg())
    m.apply(reg(boot="b2"))  # restarted before the detector's mark_down committed
    before = m.snapshot()
    out = m.apply(down(incarnation=1))
    assert out["changed"] is False and m.snapshot() == before
    assert state_of(m) == (MemberState.UP, 2)


def test_unknown_ids_are_noops_not_errors():
    m = Membership()
    for op in (down("ghost", 1), admin("drain", "ghost"), admin("undrain", "ghost"),
               admin("remove", "ghost")):
        assert m.apply(op) == {"changed": False, "epoch": 0, "member": None}
    assert m.view() == {"epoch": 0, "members": []}


# ------------------------------------------------------------------ drain / undrain / remove
def test_drain_and_undrain_transitions():
    m = Membership()
    m.apply(reg())
    assert m.apply(admin("drain"))["member"]["state"] == "draining"
    assert m.apply(admin("drain"))["changed"] is False
    assert m.apply(admin("undrain"))["member"]["state"] == "up"
    assert m.apply(admin("undrain"))["changed"] is False
    assert state_of(m) == (MemberState.UP, 1)  # draining -> up keeps the incarnation
    m.apply(down(incarnation=1))
    out = m.apply(admin("drain"))  # down stays down, the intent is recorded
    assert out["changed"] and state_of(m) == (MemberState.DOWN, 1) and m.get("s1").drained
    out = m.apply(admin("undrain"))  # admin "add" of a down member clears it
    assert out["changed"] and state_of(m) == (MemberState.UP, 2) and not m.get("s1").drained
    assert m.epoch == 6


def test_drain_from_joining():
    joining = MemberRecord("s1", "h:1", 1, 1, MemberState.JOINING, "b", 3)
    m = Membership.restore(snap_doc(epoch=3, members=[joining.to_dict()]))
    assert m.apply(admin("drain"))["member"]["state"] == "draining"
    assert m.epoch == 4


# ------------------------------------------------------------------ joins
def ramp(member_id: str = "s2", incarnation: int = 1, value: float = 0.5) -> dict:
    return {"op": "ramp", "id": member_id, "incarnation": incarnation, "ramp": value}


def returning_state(before: MemberRecord, others_up: bool) -> MemberState:
    """The state a known member comes back in (restart, or healed partition): DRAINING
    if it was drained; JOINING (at its ramp) if its join was cut short while another
    member is up; else UP."""
    if before.state is MemberState.DRAINING or before.drained:
        return MemberState.DRAINING
    if (before.ramp < 1.0 and others_up
            and before.state in (MemberState.JOINING, MemberState.DOWN)):
        return MemberState.JOINING
    return MemberState.UP


def joined(member_id: str = "s2", incarnation: int = 1) -> dict:
    return {"op": "joined", "id": member_id, "incarnation": incarnation}


def test_first_member_bootstraps_up_even_when_asked_to_ramp():
    m = Membership()
    out = m.apply({**reg(), "ramp": 0.25})
    assert out["member"]["state"] == "up" and out["member"]["ramp"] == 1.0


def test_a_newcomer_joins_ramps_only_upwards_and_becomes_up():
    m = Membership()
    m.apply(reg("s1"))
    out = m.apply({**reg("s2", address="10.0.0.2:7400"), "ramp": 0.25})
    assert out["member"]["state"] == "joining" and out["member"]["ramp"] == 0.25
    assert m.epoch == 2
    assert m.apply(ramp(value=0.5))["changed"] and m.get("s2").ramp == 0.5 and m.epoch == 3
    assert m.get("s2").changed_epoch == 3
    for stale in (ramp(value=0.5), ramp(value=0.25), ramp(incarnation=9, value=0.75),
                  ramp("ghost"), joined(incarnation=2), joined("ghost")):
        assert m.apply(stale)["changed"] is False  # idempotent, monotone, this join only
    assert m.epoch == 3
    assert m.apply(ramp(value=1))["member"]["ramp"] == 1.0  # an int is stored as a float
    out = m.apply(joined())
    assert out["changed"] and out["member"]["state"] == "up" and out["member"]["ramp"] == 1.0
    assert m.apply(joined())["changed"] is False and m.apply(ramp(value=1.0))["changed"] is False
    assert m.epoch == 5


def test_join_needs_another_member_up_and_a_ramp_below_one():
    m = Membership()
    m.apply(reg("s1"))
    assert m.apply({**reg("s2"), "ramp": 1.0})["member"]["state"] == "up"
    m.apply(down("s1"))
    m.apply(down("s2"))
    assert m.apply({**reg("s3"), "ramp": 0.25})["member"]["state"] == "up"  # nobody up


@pytest.mark.parametrize("then, state", [
    (admin("drain", "s2"), "draining"), (down("s2"), "down"),
    (reg("s2", boot="b2"), "joining"), (admin("remove", "s2"), None),
])
def test_a_joining_member_drains_goes_down_restarts_or_is_removed(then, state):
    m = Membership()
    m.apply(reg("s1"))
    m.apply({**reg("s2"), "ramp": 0.25})
    out = m.apply(then)
    assert out["changed"]
    assert (out["member"] or {}).get("state") == state
    if state == "joining":  # a restart mid-join goes on from its ramp, not at full weight
        assert out["member"]["ramp"] == 0.25 and out["member"]["incarnation"] == 2
    assert m.apply(joined())["changed"] is False  # the driver's op for the old incarnation


@pytest.mark.parametrize("back", [reg("s2", boot="b2"), reg("s2")])
def test_a_join_cut_short_by_a_crash_resumes_from_its_ramp(back):
    """Down mid-join, then back (restarted, or the same process after a partition):
    JOINING at the ramp it had, a new incarnation the driver's ops then act on."""
    m = Membership()
    m.apply(reg("s1"))
    m.apply({**reg("s2"), "ramp": 0.25})
    m.apply(ramp(value=0.5))
    m.apply(down("s2"))
    out = m.apply(back)
    assert out["member"]["state"] == "joining" and out["member"]["ramp"] == 0.5
    assert out["member"]["incarnation"] == 2
    assert m.apply(ramp(incarnation=2, value=0.75))["member"]["ramp"] == 0.75
    assert m.apply(joined(incarnation=2))["member"]["state"] == "up"
    # a member that had finished its join comes back UP at full weight
    m.apply(down("s2", incarnation=2))
    out = m.apply(reg("s2", boot="b3"))
    assert out["member"]["state"] == "up" and out["member"]["ramp"] == 1.0


def test_undrain_after_a_drained_join_is_up_at_full_weight():
    m = Membership()
    m.apply(reg("s1"))
    m.apply({**reg("s2"), "ramp": 0.25})
    m.apply(admin("drain", "s2"))
    out = m.apply(admin("undrain", "s2"))
    assert out["member"]["state"] == "up" and out["member"]["ramp"] == 1.0


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), True, "0.5", None])
def test_bad_ramps_are_refused(bad):
    with pytest.raises(ValueError):
        validate_op(ramp(value=bad))
    with pytest.raises(ValueError):
        validate_op({**reg(), "ramp": bad})
    with pytest.raises(ValueError):
        MemberRecord("s1", "h:1", 1, 1, MemberState.JOINING, "b", 3, ramp=bad)
    with pytest.raises(ValueError):
        validate_op({"op": "joined", "id": "s1"})  # no incarnation


def test_snapshot_round_trips_the_ramp_and_an_old_snapshot_reads_as_full(tmp_path):
    src = Membership()
    src.apply(reg("s1"))
    src.apply({**reg("s2"), "ramp": 0.25})
    src.apply(ramp(value=0.75))
    data = src.snapshot()
    back = Membership.restore(data)
    assert back.snapshot() == data and back.get("s2").ramp == 0.75
    assert back.get("s2").state is MemberState.JOINING
    with Store(tmp_path / "db") as store:
        Membership.restore(data, store)
    with Store(tmp_path / "db") as store:
        assert Membership(store).get("s2").ramp == 0.75
    # a snapshot written before the field existed: every member at full weight
    old = msgpack.unpackb(data)
    for rec in old["members"]:
        del rec["ramp"]
    restored = Membership.restore(msgpack.packb(old))
    assert {r.id: r.ramp for r in restored.members().values()} == {"s1": 1.0, "s2": 1.0}
    assert restored.get("s2").state is MemberState.JOINING


def test_remove_then_reregister_starts_above_the_old_incarnation():
    m = Membership()
    m.apply(reg())
    m.apply(reg(boot="b2"))
    out = m.apply(admin("remove"))
    assert out == {"changed": True, "epoch": 3, "member": None}
    assert m.get("s1") is None and m.view()["members"] == []
    assert m.apply(admin("remove")) == {"changed": False, "epoch": 3, "member": None}
    m.apply(reg(boot="b3"))
    assert state_of(m) == (MemberState.UP, 3)
    assert m.apply(down(incarnation=2))["changed"] is False  # aimed at the removed one
    assert m.apply(reg("fresh"))["member"]["incarnation"] == 1


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("op", [
    None, [], {}, {"op": "explode", "id": "s1"}, {"op": "drain"},
    {"op": "drain", "id": ""}, {"op": "drain", "id": 7}, {"op": "drain", "id": "s\n1"},
    {"op": "drain", "id": "x" * 257}, {"op": "drain", "id": "s1", "extra": 1},
    {"op": "mark_down", "id": "s1"}, {"op": "mark_down", "id": "s1", "incarnation": True},
    {"op": "mark_down", "id": "s1", "incarnation": -1},
    {"op": "mark_down", "id": "s1", "incarnation": "1"},
    reg(address="nohost"), reg(address=":7400"), reg(address="h:0"), reg(address="h:65536"),
    reg(address="::1:7400"), reg(address="h:x"), reg(capacity=-1), reg(boot=""),
    {**reg(), "capacity_bytes": 1.5},
])
def test_bad_ops_raise_and_change_nothing(op, tmp_path):
    with Store(tmp_path / "db") as store:
        m = Membership(store)
        m.apply(reg())
        before, applied = m.snapshot(), store.applied
        with pytest.raises(ValueError):
            m.apply(op)
        assert m.snapshot() == before and store.applied == applied


def test_validate_op_normalizes():
    assert validate_op(reg()) == reg()
    assert validate_op({"op": "mark_down", "id": "s1", "incarnation": 0})["incarnation"] == 0
    assert validate_op(reg(address="[::1]:7400"))["address"] == "[::1]:7400"


def test_record_round_trips_and_validates():
    rec = MemberRecord("s1", "h:1", 0, 1, MemberState.DOWN, "b", 0)
    doc = rec.to_dict()
    assert doc["state"] == "down" and MemberRecord.from_dict(json.loads(json.dumps(doc))) == rec
    assert MemberRecord.from_dict(msgpack.unpackb(msgpack.packb(doc))) == rec
    with pytest.raises(ValueError):
        MemberRecord.from_dict({**doc, "state": "gone"})
    with pytest.raises(ValueError):
        MemberRecord.from_dict({**doc, "incarnation": 0})
    with pytest.raises(ValueError):
        MemberRecord("s1", "h:1", 0, 1, "down", "b", 0)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.state = MemberState.UP  # type: ignore[misc]


def test_routable_is_up_only_sorted():
    m = Membership()
    for i in "dcba":
        m.apply(reg(i))
    m.apply(admin("drain", "b"))
    m.apply(down("c", 1))
    view = view_from_wire(m.view())
    assert [x.id for x in view.members] == ["a", "d"]
    assert view.epoch == m.view()["epoch"]


# ------------------------------------------------------------------ idempotency
SEQUENCE = [
    reg("a"), reg("b", "b1", "10.0.0.2:7400"), down("a", 1), reg("a"), admin("drain", "b"),
    reg("b", "b2", "10.0.0.2:7400"), down("b", 1), down("b", 2), admin("undrain", "b"),
    admin("remove", "a"), reg("a", "a2"), reg("a", "a2", "10.0.0.3:7400", 7), down("a", 2),
    admin("undrain", "a"), admin("drain", "a"), admin("remove", "b"), admin("remove", "b"),
]


def test_applying_every_op_twice_equals_once(tmp_path):
    once, twice = Membership(), Membership()
    for op in SEQUENCE:
        first = once.apply(op)
        a, b = twice.apply(op), twice.apply(op)
        assert a == first
        assert b["changed"] is False and b["epoch"] == a["epoch"]
    assert twice.snapshot() == once.snapshot() and twice.view() == once.view()
    assert once.epoch == sum(1 for _ in SEQUENCE) - 4  # 4 no-ops in SEQUENCE


# ------------------------------------------------------------------ persistence
def test_state_survives_store_close_and_reopen(tmp_path):
    path = tmp_path / "db"
    with Store(path) as store:
        m = Membership(store)
        for op in SEQUENCE:
            m.apply(op)
        view, snap, applied = m.view(), m.snapshot(), store.applied
    assert applied == len(SEQUENCE)  # no-ops count too
    with Store(path) as store:
        again = Membership(store)
        assert again.view() == view and again.snapshot() == snap
        assert store.applied == applied
        # Fences persist too: "a" is at incarnation 3; removed and re-registered -> 4.
        assert again.get("a").incarnation == 3
        again.apply(admin("remove", "a"))
    with Store(path) as store:
        assert Membership(store).apply(reg("a", "a9"))["member"]["incarnation"] == 4


def test_store_close_releases_lock_and_is_idempotent(tmp_path):
    path = tmp_path / "db"
    store = Store(path)
    Membership(store).apply(reg())
    store.load()
    store.load_fences()
    store.close()
    store.close()
    with pytest.raises(ValueError):
        store.load()
    with Store(path) as again:  # would fail with "lock hold by current process"
        assert again.load()[0] == 1


def test_failed_store_write_leaves_memory_untouched(tmp_path):
    store = Store(tmp_path / "db")
    m = Membership(store)
    m.apply(reg())
    before = m.snapshot()
    store.close()
    with pytest.raises(ValueError):
        m.apply(reg(boot="b2"))
    assert m.snapshot() == before


def test_store_write_is_one_batch(tmp_path):
    with Store(tmp_path / "db") as store:
        rec = MemberRecord("x", "h:1", 1, 4, MemberState.UP, "b", 2).to_dict()
        store.write(2, {"x": rec}, [], fences=None)
        store.write(3, {}, ["x"], fences={"x": 4})
        assert store.load() == (3, {}) and store.load_fences() == {"x": 4}
        store.write(4, {"x": {**rec, "incarnation": 5}}, [])
        assert store.load_fences() == {}  # an upsert clears the fence
        with pytest.raises(ValueError):
            store.write(5, {"x": rec}, ["x"])
        with pytest.raises(ValueError):
            store.write(5, {"y": rec}, [])  # record under the wrong id
        assert store.load()[0] == 4


# ------------------------------------------------------------------ snapshots
def test_snapshot_restore_round_trip_and_replaces_store(tmp_path):
    src = Membership()
    for op in SEQUENCE:
        src.apply(op)
    data = src.snapshot()
    assert Membership.restore(data).snapshot() == data
    with Store(tmp_path / "db") as store:
        stale = Membership(store)
        stale.apply(reg("zz"))
        stale.apply(admin("remove", "zz"))
        restored = Membership.restore(data, store)
        assert restored.view() == src.view() and restored.snapshot() == data
    with Store(tmp_path / "db") as store:
        assert Membership(store).snapshot() == data  # "zz" and its fence are gone


def test_install_snapshot_in_place(tmp_path):
    src = Membership()
    src.apply(reg("a"))
    with Store(tmp_path / "db") as store:
        m = Membership(store)
        for op in SEQUENCE:
            m.apply(op)
        m.install_snapshot(src.snapshot())
        assert m.view() == src.view() and m.store is store
        assert Membership(store).view() == src.view()


A1 = MemberRecord("a", "h:1", 1, 1, MemberState.UP, "b", 1).to_dict()


@pytest.mark.parametrize("data", [
    b"", b"\xc1", msgpack.packb([1, 2]), snap_doc(format=2), snap_doc(x=1),
    msgpack.packb({"format": 1, "epoch": 0, "members": [], "fences": {}}),  # no applied_index
    snap_doc(epoch=-1), snap_doc(applied_index=-1), snap_doc(applied_index=True),
    snap_doc(epoch=1, fences={"a": 0}), snap_doc(epoch=0, members=[A1]),  # changed after epoch
    snap_doc(epoch=1, members=[A1], fences={"a": 1}), snap_doc(epoch=1, members=[A1, A1]),
    snap_doc(epoch=1, members=[{**A1, "state": "gone"}]), snap_doc(members={}),
])
def test_bad_snapshot_raises_and_leaves_store_alone(data, tmp_path):
    with Store(tmp_path / "db") as store:
        m = Membership(store)
        m.apply(reg())
        before = m.snapshot()
        with pytest.raises(ValueError):
            Membership.restore(data, store)
        with pytest.raises(ValueError):
            m.install_snapshot(data)
        assert m.snapshot() == before and Membership(store).snapshot() == before


# ------------------------------------------------------------------ Raft log indexes
def test_index_skips_replayed_entries_and_survives_reopen(tmp_path):
    path = tmp_path / "db"
    # The journal: pysyncobj's own no-op sits at index 1, ours start at 2 (gaps allowed).
    journal = [(i + 2 + (i > 5), op) for i, op in enumerate(SEQUENCE)]
    with Store(path) as store:
        m = Membership(store)
        for index, op in journal:
            m.apply(op, index=index)
        snap, applied = m.snapshot(), store.applied
        assert m.applied_index == journal[-1][0] == store.applied_index
    with Store(path) as store:
        m = Membership(store)
        assert m.applied_index == journal[-1][0] and m.snapshot() == snap
        # pysyncobj replays its whole journal on restart: every entry is skipped, even
        # the old register("a") that would otherwise re-create a removed member.
        for index, op in journal:
            assert m.apply(op, index=index)["changed"] is False
        assert m.snapshot() == snap and store.applied == applied  # skipped: no writes
        out = m.apply(admin("remove", "a"), index=journal[-1][0] + 1)
        assert out["changed"] and m.applied_index == journal[-1][0] + 1


def test_without_index_an_old_register_after_remove_recreates():
    m = Membership()
    m.apply(reg("a"), index=2)
    m.apply(admin("remove", "a"), index=3)
    assert m.apply(reg("a"), index=2)["changed"] is False  # a replay: skipped
    assert m.apply(reg("a"))["changed"] is True  # inherent: why the index matters


def test_no_op_entries_still_advance_the_index(tmp_path):
    with Store(tmp_path / "db") as store:
        m = Membership(store)
        m.apply(admin("drain", "ghost"), index=7)
        assert m.applied_index == 7 == store.applied_index and m.epoch == 0


@pytest.mark.parametrize("index", [0, -1, True, 1.0, "2"])
def test_bad_index_raises(index):
    m = Membership()
    with pytest.raises(ValueError):
        m.apply(reg(), index=index)
    assert m.epoch == 0 and m.applied_index == 0


def test_snapshot_carries_the_index_and_restore_can_override_it(tmp_path):
    src = Membership()
    src.apply(reg(), index=41)
    assert Membership.restore(src.snapshot()).applied_index == 41
    with Store(tmp_path / "db") as store:
        m = Membership(store)
        m.apply(reg("zz"), index=100)
        restored = Membership.restore(src.snapshot(), store, applied_index=50)
        assert restored.applied_index == 50 == store.applied_index
    with Store(tmp_path / "db") as store:
        again = Membership(store)
        assert again.applied_index == 50 and again.view() == src.view()
        assert again.apply(reg("zz"), index=50)["changed"] is False  # covered by the snapshot
        assert again.apply(reg("zz"), index=51)["changed"] is True


# ------------------------------------------------------------------ stateful
IDS = st.sampled_from(["s1", "s2", "s3"])
ADDRS = st.sampled_from(["10.0.0.1:7400", "10.0.0.2:7400", "[::1]:7401"])
CAPS = st.sampled_from([0, 1 << 20, 1 << 30])


class MembershipMachine(RuleBasedStateMachine):
    """Random op sequences against a store-backed Membership, checked after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="gcache-membership-")
        self.store = Store(self.dir)
        self.m = Membership(self.store)
        self.boots: dict[str, str] = {}      # id -> boot_id of its current process
        self.max_inc: dict[str, int] = {}    # id -> highest incarnation ever seen
        self.seen_incs: dict[str, set[int]] = {}
        self.next_boot = 0
        self.last_op: dict | None = None
        self.journal: list[tuple[int, dict]] = []  # (Raft index, op) as applied
        self.next_index = 2

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -------------------------------------------------------------- helpers
    def do(self, op: dict) -> dict:
        epoch, snap = self.m.epoch, state(self.m)
        index = self.next_index
        self.next_index += 1
        out = self.m.apply(op, index=index)
        self.journal.append((index, op))
        assert self.m.applied_index == index
        if out["changed"]:
            assert out["epoch"] == self.m.epoch == epoch + 1
            if out["member"] is not None:
                assert out["member"]["changed_epoch"] == self.m.epoch
        else:
            assert out["epoch"] == self.m.epoch == epoch and state(self.m) == snap
        # Applying the same op again right away is always a no-op, as a new log entry
        # (a retried write that committed twice) or as a replay of the same entry.
        after = state(self.m)
        again = self.m.apply(op)
        assert again["changed"] is False and again["epoch"] == self.m.epoch
        assert self.m.apply(op, index=index)["changed"] is False
        assert state(self.m) == after
        rec = self.m.get(op["id"])
        if rec is not None:
            self.seen_incs.setdefault(op["id"], set()).add(rec.incarnation)
            self.max_inc[op["id"]] = max(self.max_inc.get(op["id"], 0), rec.incarnation)
        self.last_op = op
        return out

    def new_boot(self) -> str:
        self.next_boot += 1
        return f"boot-{self.next_boot}"

    # -------------------------------------------------------------- rules
    @rule(member_id=IDS, address=ADDRS, capacity=CAPS, join=st.booleans())
    def register(self, member_id: str, address: str, capacity: int, join: bool) -> None:
        boot = self.boots.setdefault(member_id, self.new_boot())
        before = self.m.get(member_id)
        others_up = any(r.state is MemberState.UP for i, r in self.m.members().items()
                        if i != member_id)
        self.do({"op": "register", "id": member_id, "address": address,
                 "capacity_bytes": capacity, "boot_id": boot, **({"ramp": 0.25} if join else {})})
        rec = self.m.get(member_id)
        assert rec is not None and rec.boot_id == boot
        assert (rec.address, rec.capacity_bytes) == (address, capacity)
        if before is None:
            assert rec.state is (MemberState.JOINING if join and others_up else MemberState.UP)
            assert rec.ramp == (0.25 if rec.state is MemberState.JOINING else 1.0)
        if before is not None and before.boot_id == boot and before.state is MemberState.DOWN:
            assert rec.state is returning_state(before, others_up)
            assert rec.incarnation == before.incarnation + 1

    @rule(member_id=IDS, address=ADDRS, capacity=CAPS)
    def restart(self, member_id: str, address: str, capacity: int) -> None:
        prev_max = self.max_inc.get(member_id, 0)
        before = self.m.get(member_id)
        others_up = any(r.state is MemberState.UP for i, r in self.m.members().items()
                        if i != member_id)
        boot = self.boots[member_id] = self.new_boot()
        out = self.do({"op": "register", "id": member_id, "address": address,
                       "capacity_bytes": capacity, "boot_id": boot})
        rec = self.m.get(member_id)
        assert out["changed"] and rec is not None
        assert rec.incarnation > prev_max  # a new process always outranks every old one
        expected = MemberState.UP if before is None else returning_state(before, others_up)
        assert rec.state is expected and rec.drained == (before is not None and before.drained)
        assert rec.ramp == (before.ramp if expected is MemberState.JOINING else 1.0)

    @rule(member_id=IDS, stale=st.booleans(), data=st.data())
    def mark_down(self, member_id: str, stale: bool, data: st.DataObject) -> None:
        rec = self.m.get(member_id)
        if stale or rec is None:
            current = rec.incarnation if rec is not None else None
            olds = sorted(i for i in self.seen_incs.get(member_id, set()) if i != current)
            inc = data.draw(st.sampled_from(olds)) if olds else 0
            before = state(self.m)
            out = self.do({"op": "mark_down", "id": member_id, "incarnation": inc})
            assert out["changed"] is False and state(self.m) == before
        else:
            out = self.do({"op": "mark_down", "id": member_id, "incarnation": rec.incarnation})
            assert out["changed"] is (rec.state is not MemberState.DOWN)
            assert self.m.get(member_id).state is MemberState.DOWN

    @rule(member_id=IDS)
    def drain(self, member_id: str) -> None:
        before = self.m.get(member_id)
        self.do({"op": "drain", "id": member_id})
        after = self.m.get(member_id)
        if before is not None and before.state in (MemberState.UP, MemberState.JOINING):
            assert after.state is MemberState.DRAINING and after.drained
        elif before is not None:  # down or draining: the intent is kept, the state is not
            assert after.state is before.state and after.drained
            assert after.incarnation == before.incarnation
        else:
            assert after is None

    @rule(member_id=IDS)
    def undrain(self, member_id: str) -> None:
        before = self.m.get(member_id)
        self.do({"op": "undrain", "id": member_id})
        after = self.m.get(member_id)
        if before is not None and before.state in (MemberState.DRAINING, MemberState.DOWN):
            assert after.state is MemberState.UP and not after.drained
        else:
            assert after == before

    @rule(member_id=IDS, value=st.sampled_from([0.25, 0.5, 1.0]), stale=st.booleans())
    def ramp(self, member_id: str, value: float, stale: bool) -> None:
        before = self.m.get(member_id)
        inc = before.incarnation + stale if before is not None else 1
        out = self.do({"op": "ramp", "id": member_id, "incarnation": inc, "ramp": value})
        grows = (before is not None and not stale and before.state is MemberState.JOINING
                 and value > before.ramp)
        assert out["changed"] is grows
        if grows:
            assert self.m.get(member_id) == dataclasses.replace(
                before, ramp=value, changed_epoch=self.m.epoch)

    @rule(member_id=IDS, stale=st.booleans())
    def joined(self, member_id: str, stale: bool) -> None:
        before = self.m.get(member_id)
        inc = before.incarnation + stale if before is not None else 1
        out = self.do({"op": "joined", "id": member_id, "incarnation": inc})
        ends = before is not None and not stale and before.state is MemberState.JOINING
        assert out["changed"] is ends
        if ends:
            after = self.m.get(member_id)
            assert after.state is MemberState.UP and after.ramp == 1.0

    @rule(member_id=IDS)
    def remove(self, member_id: str) -> None:
        self.do({"op": "remove", "id": member_id})
        assert self.m.get(member_id) is None

    @rule()
    def reapply_last_op(self) -> None:
        if self.last_op is not None:
            snap = self.m.snapshot()
            assert self.m.apply(self.last_op)["changed"] is False
            assert self.m.snapshot() == snap

    @rule()
    def replay_journal(self) -> None:
        """pysyncobj's restart replay: every entry is skipped, nothing is written."""
        snap, applied = self.m.snapshot(), self.store.applied
        for index, op in self.journal:
            assert self.m.apply(op, index=index)["changed"] is False
        assert self.m.snapshot() == snap and self.store.applied == applied

    @rule()
    def rebuild_from_journal(self) -> None:
        """A wiped node applying the same log from scratch reaches the same state."""
        fresh = Membership()
        for index, op in self.journal:
            fresh.apply(op, index=index)
        assert fresh.snapshot() == self.m.snapshot()

    @rule()
    def reopen_store(self) -> None:
        view, snap, applied = self.m.view(), self.m.snapshot(), self.store.applied
        self.store.close()
        self.store = Store(self.dir)
        self.m = Membership(self.store)
        assert self.m.view() == view and self.m.snapshot() == snap
        assert self.store.applied == applied

    @rule()
    def snapshot_restore(self) -> None:
        snap = self.m.snapshot()
        assert Membership.restore(snap).snapshot() == snap

    # -------------------------------------------------------------- invariants
    @invariant()
    def records_are_sane(self) -> None:
        epoch = self.m.epoch
        assert epoch >= 0
        members = self.m.view()["members"]
        assert [d["id"] for d in members] == sorted(d["id"] for d in members)
        for doc in members:
            rec = MemberRecord.from_dict(doc)
            assert rec.incarnation >= 1 and rec.changed_epoch <= epoch
            assert rec.incarnation == self.max_inc[rec.id]  # never goes backwards
            assert rec.ramp == 1.0 or rec.state is not MemberState.UP  # UP: full weight
        assert self.store.applied >= 0


MembershipMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=30,
                                               deadline=None)
TestMembershipMachine = MembershipMachine.TestCase
