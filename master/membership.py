"""The master's replicated state machine: cluster membership and the ring epoch.

Design. ``Membership.apply`` is called by the Raft wrapper for every committed log
entry, on every master, in log order. It is a pure function of (state, op): no clock,
no randomness, no I/O other than persisting the result, so all masters stay identical.

Idempotency. pysyncobj can re-apply an entry and can commit a write whose caller timed
out and retried, so every op is written as "make it so" rather than "do this":

* Each op checks the state it expects and is a no-op (``changed`` False, epoch
  unchanged) when the state has already moved there or past it. Unknown ids are no-ops
  for every op but ``register``, never errors, so a re-applied entry after a ``remove``
  cannot raise on one node and not on another.
* ``mark_down`` carries the incarnation the failure detector saw and only fires if it
  is still current. The incarnation goes up on every restart (new ``boot_id``) *and*
  whenever a member leaves DOWN (a healed partition or an admin ``undrain``), so a
  ``mark_down`` issued before a recovery can never take effect after it.
* ``remove`` leaves a fence (the last incarnation) so that re-registering the id starts
  above it: a delayed ``mark_down`` for the removed incarnation cannot hit the new one.
  A never-seen id starts at incarnation 1.

Replays. Re-applying an *old* op after later ops is not always a no-op (an old
``register`` after ``remove`` re-creates the member), and pysyncobj replays its journal
from the start on restart while the Store already holds the result. So the Raft wrapper
passes each entry's log index: ``apply(op, index=i)`` records ``i`` as ``applied_index``
in the same atomic write as the state, and skips (no write, no change) any entry with
``i <= applied_index``. Without ``index`` every op is applied (tests, tools).

Every state-changing op bumps ``epoch`` by exactly 1 and stamps the touched record's
``changed_epoch``; no-ops leave both alone. The changes are written to the ``Store``
(if any) in one atomic synced batch *before* the in-memory state is updated, so a
failed write leaves memory and disk at the old state.

Routing: the ring is built from UP and JOINING members (``gcache.view.view_from_wire``,
the one copy of that rule), a JOINING member's weight scaled by its ``ramp``. DRAINING
members keep serving reads of what they already hold but take no new placements; DOWN
members are skipped.

Joins. A ``register`` may carry ``ramp`` (the master's API adds it when its
``join_ramp_s`` > 0): the first registration of an id then enters JOINING at that ramp
fraction if another member is UP (otherwise, bootstrapping a cluster, UP at once). The
leader's join driver (``master/joiner.py``) raises it with ``ramp`` ops (only upwards: a
lower or equal ramp is a no-op, so keys only ever move toward the newcomer) and ends the
join with ``joined`` (JOINING -> UP, ramp 1.0). Both carry the incarnation the driver saw
and are no-ops for any other. A known id that registers again (a restart, a healed
partition) comes back UP or DRAINING as before, at ramp 1.0, unless its join was cut
short: a JOINING record (or a DOWN one with a ramp below 1) comes back JOINING at its
ramp under a new incarnation, which the driver then ramps and ends. Every other
op treats a JOINING member as it treats an UP one. Records and snapshots written before
the field existed read as ramp 1.0.

Drain intent. ``drain`` sets the record's ``drained`` flag, which only ``undrain``
clears: a drained member that goes DOWN (crash, partition) and comes back, under the
same or a new process, comes back DRAINING, not UP; draining a DOWN member records the
intent for when it returns. Records written before the flag existed read as not drained.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping

import msgpack

from gcache.view import MemberState

if TYPE_CHECKING:
    from gcache.master.store import Store

__all__ = [
    "MemberState", "MemberRecord", "Membership", "OpKind", "validate_op",
    "SNAPSHOT_FORMAT",
]

SNAPSHOT_FORMAT = 1
MAX_ID_LEN = 256
MAX_BOOT_ID_LEN = 128


class OpKind(str, enum.Enum):
    REGISTER = "register"
    MARK_DOWN = "mark_down"
    DRAIN = "drain"
    UNDRAIN = "undrain"
    REMOVE = "remove"
    RAMP = "ramp"
    JOINED = "joined"


# ------------------------------------------------------------------ validation
def _check_text(name: str, value: object, max_len: int) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len or not value.isprintable():
        raise ValueError(f"{name} must be a non-empty printable string of at most {max_len} "
                         f"characters, got {value!r}")
    return value


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_ramp(value: object) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0.0 < value <= 1.0):  # NaN fails the comparison too
        raise ValueError(f"ramp must be a number in (0, 1], got {value!r}")
    return float(value)


def _check_address(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"address must be a 'host:port' string, got {value!r}")
    host, _, port = value.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if (not host or bare_ipv6 or not host.isprintable() or any(c.isspace() for c in host)
            or not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535):
        raise ValueError(f"address must be 'host:port' with a port in 1..65535, got {value!r}")
    return value


def _check_keys(what: str, doc: Mapping[str, Any], required: tuple[str, ...],
                optional: tuple[str, ...] = ()) -> None:
    missing = [k for k in required if k not in doc and k not in optional]
    extra = sorted(str(k) for k in doc if k not in required)
    if missing or extra:
        raise ValueError(f"{what}: missing fields {missing}, unknown fields {extra}")


_RECORD_FIELDS = ("id", "address", "capacity_bytes", "incarnation", "state", "boot_id",
                  "changed_epoch", "drained", "ramp")
_RECORD_OPTIONAL = ("drained", "ramp")  # absent in records written by older masters

_OP_FIELDS: dict[OpKind, tuple[str, ...]] = {
    OpKind.REGISTER: ("op", "id", "address", "capacity_bytes", "boot_id", "ramp"),
    OpKind.MARK_DOWN: ("op", "id", "incarnation"),
    OpKind.DRAIN: ("op", "id"),
    OpKind.UNDRAIN: ("op", "id"),
    OpKind.REMOVE: ("op", "id"),
    OpKind.RAMP: ("op", "id", "incarnation", "ramp"),
    OpKind.JOINED: ("op", "id", "incarnation"),
}
_OP_OPTIONAL = {OpKind.REGISTER: ("ramp",)}  # register: absent = join UP at once


def validate_op(op: object) -> dict[str, Any]:
    """Check an op and return a normalized copy (``"op"`` as a plain string).

    Raises ValueError for anything ``apply`` would reject, so the Raft wrapper can call
    this before proposing and keep bad ops out of the log. Unknown fields are rejected.
    """
    if not isinstance(op, Mapping):
        raise ValueError(f"op must be a mapping, got {type(op).__name__}")
    try:
        kind = OpKind(op.get("op"))
    except ValueError:
        raise ValueError(f"unknown op {op.get('op')!r}; expected one of "
                         f"{[k.value for k in OpKind]}") from None
    _check_keys(f"op {kind.value!r}", op, _OP_FIELDS[kind], _OP_OPTIONAL.get(kind, ()))
    out: dict[str, Any] = {"op": kind.value, "id": _check_text("id", op["id"], MAX_ID_LEN)}
    if kind is OpKind.REGISTER:
        out["address"] = _check_address(op["address"])
        out["capacity_bytes"] = _check_int("capacity_bytes", op["capacity_bytes"], 0)
        out["boot_id"] = _check_text("boot_id", op["boot_id"], MAX_BOOT_ID_LEN)
        if "ramp" in op:
            out["ramp"] = _check_ramp(op["ramp"])
    elif kind in (OpKind.MARK_DOWN, OpKind.RAMP, OpKind.JOINED):
        out["incarnation"] = _check_int("incarnation", op["incarnation"], 0)
        if kind is OpKind.RAMP:
            out["ramp"] = _check_ramp(op["ramp"])
    return out


# ------------------------------------------------------------------ records
@dataclass(frozen=True, slots=True)
class MemberRecord:
    """One cache server as the master knows it. ``address`` is its data port."""

    id: str
    address: str
    capacity_bytes: int
    incarnation: int
    state: MemberState
    boot_id: str
    changed_epoch: int
    drained: bool = False  # an admin drain not yet undone (survives down and restarts)
    ramp: float = 1.0  # a JOINING member's share of its capacity weight, in (0, 1]

    def __post_init__(self) -> None:
        _check_text("id", self.id, MAX_ID_LEN)
        _check_address(self.address)
        _check_int("capacity_bytes", self.capacity_bytes, 0)
        _check_int("incarnation", self.incarnation, 1)
        if not isinstance(self.state, MemberState):
            raise ValueError(f"state must be a MemberState, got {self.state!r}")
        _check_text("boot_id", self.boot_id, MAX_BOOT_ID_LEN)
        _check_int("changed_epoch", self.changed_epoch, 0)
        if not isinstance(self.drained, bool):
            raise ValueError(f"drained must be a bool, got {self.drained!r}")
        object.__setattr__(self, "ramp", _check_ramp(self.ramp))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "address": self.address,
            "capacity_bytes": self.capacity_bytes,
            "incarnation": self.incarnation,
            "state": self.state.value,
            "boot_id": self.boot_id,
            "changed_epoch": self.changed_epoch,
            "drained": self.drained,
            "ramp": self.ramp,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> MemberRecord:
        if not isinstance(doc, Mapping):
            raise ValueError(f"member record must be a mapping, got {type(doc).__name__}")
        _check_keys("member record", doc, _RECORD_FIELDS, _RECORD_OPTIONAL)
        try:
            state = MemberState(doc["state"])
        except ValueError:
            raise ValueError(f"unknown member state {doc['state']!r}") from None
        return cls(id=doc["id"], address=doc["address"], capacity_bytes=doc["capacity_bytes"],
                   incarnation=doc["incarnation"], state=state, boot_id=doc["boot_id"],
                   changed_epoch=doc["changed_epoch"], drained=doc.get("drained", False),
                   ramp=doc.get("ramp", 1.0))


# ------------------------------------------------------------------ state machine
@dataclass(frozen=True, slots=True)
class _Change:
    """What one op does: the record to write (or None) and whether to delete the id."""

    record: MemberRecord | None
    removed: MemberRecord | None = None


class Membership:
    """Deterministic, idempotent membership state machine with an optional durable Store.

    Thread-safe: ``apply`` / ``install_snapshot`` and the readers take one lock, so a
    reader never sees an epoch that does not match the members.
    """

    __slots__ = ("_store", "_epoch", "_members", "_fences", "_applied_index", "_lock")

    def __init__(self, store: Store | None = None) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._epoch = 0
        self._members: dict[str, MemberRecord] = {}
        self._fences: dict[str, int] = {}
        self._applied_index = 0
        if store is not None:
            epoch, raw = store.load()
            self._install(epoch, [MemberRecord.from_dict(d) for d in raw.values()],
                          store.load_fences(), store.applied_index)

    # -------------------------------------------------------------- reads
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def applied_index(self) -> int:
        """Raft index of the last entry applied with ``index=`` (0 if none)."""
        return self._applied_index

    @property
    def store(self) -> Store | None:
        return self._store

    def members(self) -> dict[str, MemberRecord]:
        with self._lock:
            return dict(self._members)

    def get(self, member_id: str) -> MemberRecord | None:
        with self._lock:
            return self._members.get(member_id)

    def view(self) -> dict[str, Any]:
        """``{"epoch", "members": [record dicts sorted by id]}`` (all states)."""
        with self._lock:
            return {"epoch": self._epoch,
                    "members": [self._members[k].to_dict() for k in sorted(self._members)]}

    # -------------------------------------------------------------- apply
    def apply(self, op: Mapping[str, Any], *, index: int | None = None) -> dict[str, Any]:
        """Apply one committed op; returns ``{"changed", "epoch", "member"}``.

        ``member`` is the record dict after the op, or None if the id does not exist
        (unknown, or just removed). Bad ops raise ValueError and change nothing.
        ``index`` is the op's Raft log index: an entry at or below ``applied_index`` was
        already applied (a journal replay) and is skipped with ``changed`` False.
        """
        norm = validate_op(op)
        if index is not None:
            _check_int("index", index, 1)
        with self._lock:
            member_id = norm["id"]
            replayed = index is not None and index <= self._applied_index
            new_epoch = self._epoch + 1
            change = None if replayed else self._plan(norm, new_epoch)
            if self._store is not None and not replayed:
                if change is None:  # bumps meta/applied (and the index) only
                    self._store.write(self._epoch, {}, [], applied_index=index)
                elif change.record is not None:
                    self._store.write(new_epoch, {member_id: change.record.to_dict()}, [],
                                      applied_index=index)
                else:
                    self._store.write(new_epoch, {}, [member_id], applied_index=index,
                                      fences={member_id: self._fence_for(change)})
            # Persisted (or no store, or a replay): now commit in memory.
            if index is not None and not replayed:
                self._applied_index = index
            if change is None:
                cur = self._members.get(member_id)
                return {"changed": False, "epoch": self._epoch,
                        "member": cur.to_dict() if cur is not None else None}
            if change.record is not None:
                self._members[member_id] = change.record
                self._fences.pop(member_id, None)
            else:
                self._fences[member_id] = self._fence_for(change)
                del self._members[member_id]
            self._epoch = new_epoch
            return {"changed": True, "epoch": new_epoch,
                    "member": change.record.to_dict() if change.record is not None else None}

    @staticmethod
    def _fence_for(change: _Change) -> int:
        if change.removed is None:
            raise ValueError("internal: removal without a removed record")
        return change.removed.incarnation

    def _plan(self, op: dict[str, Any], new_epoch: int) -> _Change | None:
        """The change ``op`` makes to the current state, or None for a no-op. Pure."""
        kind = OpKind(op["op"])
        cur = self._members.get(op["id"])
        if kind is OpKind.REGISTER:
            return self._plan_register(op, cur, new_epoch)
        if cur is None:
            return None
        if kind is OpKind.MARK_DOWN:
            if cur.incarnation != op["incarnation"] or cur.state is MemberState.DOWN:
                return None
            return _Change(replace(cur, state=MemberState.DOWN, changed_epoch=new_epoch))
        if kind is OpKind.DRAIN:
            if cur.state in (MemberState.UP, MemberState.JOINING):
                return _Change(replace(cur, state=MemberState.DRAINING, drained=True,
                                       changed_epoch=new_epoch))
            if cur.drained:
                return None
            # DOWN (or a DRAINING record from before the flag): keep the intent for later
            return _Change(replace(cur, drained=True, changed_epoch=new_epoch))
        if kind is OpKind.UNDRAIN:
            if cur.state not in (MemberState.DRAINING, MemberState.DOWN):
                return None
            inc = cur.incarnation + (1 if cur.state is MemberState.DOWN else 0)
            return _Change(replace(cur, state=MemberState.UP, incarnation=inc, drained=False,
                                   changed_epoch=new_epoch, ramp=1.0))
        if kind is OpKind.REMOVE:
            return _Change(None, removed=cur)
        if cur.state is not MemberState.JOINING or cur.incarnation != op["incarnation"]:
            return None  # RAMP, JOINED: only the join the driver saw
        if kind is OpKind.RAMP:
            if op["ramp"] <= cur.ramp:  # only upwards: keys only move toward the newcomer
                return None
            return _Change(replace(cur, ramp=op["ramp"], changed_epoch=new_epoch))
        if kind is OpKind.JOINED:
            return _Change(replace(cur, state=MemberState.UP, ramp=1.0, changed_epoch=new_epoch))
        raise ValueError(f"unhandled op {kind.value!r}")  # unreachable: validate_op checked

    def _plan_register(self, op: dict[str, Any], cur: MemberRecord | None,
                       new_epoch: int) -> _Change | None:
        address, capacity, boot_id = op["address"], op["capacity_bytes"], op["boot_id"]
        if cur is None:
            inc = self._fences.get(op["id"], 0) + 1
            ramp = op.get("ramp", 1.0)
            joins = ramp < 1.0 and any(m.state is MemberState.UP
                                       for m in self._members.values())
            return _Change(MemberRecord(id=op["id"], address=address, capacity_bytes=capacity,
                                        incarnation=inc,
                                        state=MemberState.JOINING if joins else MemberState.UP,
                                        boot_id=boot_id, changed_epoch=new_epoch,
                                        ramp=ramp if joins else 1.0))
        # the state a returning member takes: a join cut short (a JOINING record, or a DOWN
        # one whose ramp never reached 1) goes on from its ramp, so a cold restart does not
        # take its full share of writes at once; the driver sees a new incarnation
        rejoin = (not cur.drained and cur.ramp < 1.0
                  and cur.state in (MemberState.JOINING, MemberState.DOWN)
                  and any(m.state is MemberState.UP for m in self._members.values()))
        back = (MemberState.DRAINING if cur.drained or cur.state is MemberState.DRAINING
                else MemberState.JOINING if rejoin else MemberState.UP)
        ramp = cur.ramp if rejoin else 1.0
        if cur.boot_id != boot_id:  # the server restarted
            return _Change(replace(cur, address=address, capacity_bytes=capacity,
                                   incarnation=cur.incarnation + 1, state=back,
                                   boot_id=boot_id, changed_epoch=new_epoch, ramp=ramp))
        if cur.state is MemberState.DOWN:  # same process back from a partition
            return _Change(replace(cur, address=address, capacity_bytes=capacity,
                                   incarnation=cur.incarnation + 1, state=back,
                                   changed_epoch=new_epoch, ramp=ramp))
        if cur.address != address or cur.capacity_bytes != capacity:
            return _Change(replace(cur, address=address, capacity_bytes=capacity,
                                   changed_epoch=new_epoch))
        return None

    # -------------------------------------------------------------- snapshots
    def snapshot(self) -> bytes:
        """The full replicated state as msgpack (deterministic bytes for equal states)."""
        with self._lock:
            doc = {
                "format": SNAPSHOT_FORMAT,
                "epoch": self._epoch,
                "members": [self._members[k].to_dict() for k in sorted(self._members)],
                "fences": {k: self._fences[k] for k in sorted(self._fences)},
                "applied_index": self._applied_index,
            }
        return msgpack.packb(doc, use_bin_type=True)

    @classmethod
    def restore(cls, data: bytes, store: Store | None = None, *,
                applied_index: int | None = None) -> Membership:
        """A Membership from ``snapshot()`` bytes; replaces ``store``'s contents atomically.

        ``applied_index`` overrides the index recorded in the snapshot (for a wrapper that
        tracks the snapshot's log position itself).
        """
        m = cls(None)
        m._store = store
        m.install_snapshot(data, applied_index=applied_index)
        return m

    def install_snapshot(self, data: bytes, *, applied_index: int | None = None) -> None:
        """Replace this instance's state (and its store's) with ``snapshot()`` bytes, in place.

        The state is replaced as a whole, even if its epoch or index is lower than the
        current one: Raft decides which snapshot is authoritative, not this class.
        """
        epoch, records, fences, index = _parse_snapshot(data)
        if applied_index is not None:
            index = _check_int("applied_index", applied_index, 0)
        with self._lock:
            if self._store is not None:
                self._store.replace_all(epoch, {r.id: r.to_dict() for r in records}, fences,
                                        applied_index=index)
            self._install(epoch, records, fences, index)

    def _install(self, epoch: int, records: list[MemberRecord], fences: dict[str, int],
                 applied_index: int) -> None:
        members = {r.id: r for r in records}
        _check_state(epoch, members, fences)
        _check_int("applied_index", applied_index, 0)
        self._epoch = epoch
        self._members = members
        self._fences = dict(fences)
        self._applied_index = applied_index


def _check_state(epoch: int, members: dict[str, MemberRecord], fences: dict[str, int]) -> None:
    _check_int("epoch", epoch, 0)
    for rec in members.values():
        if rec.changed_epoch > epoch:
            raise ValueError(f"member {rec.id!r} changed at epoch {rec.changed_epoch} "
                             f"> state epoch {epoch}")
    for member_id, inc in fences.items():
        _check_text("fenced id", member_id, MAX_ID_LEN)
        _check_int(f"fence for {member_id!r}", inc, 1)
        if member_id in members:
            raise ValueError(f"member {member_id!r} is both present and fenced")


def _parse_snapshot(data: bytes) -> tuple[int, list[MemberRecord], dict[str, int], int]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"snapshot must be bytes, got {type(data).__name__}")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"snapshot is not valid msgpack: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("snapshot is not a mapping")
    _check_keys("snapshot", doc, ("format", "epoch", "members", "fences", "applied_index"))
    if doc["format"] != SNAPSHOT_FORMAT:
        raise ValueError(f"unsupported snapshot format {doc['format']!r}")
    if not isinstance(doc["members"], list) or not isinstance(doc["fences"], dict):
        raise ValueError("snapshot members must be a list and fences a mapping")
    records = [MemberRecord.from_dict(d) for d in doc["members"]]
    if len({r.id for r in records}) != len(records):
        raise ValueError("snapshot has duplicate member ids")
    fences = dict(doc["fences"])
    _check_state(doc["epoch"], {r.id: r for r in records}, fences)
    index = _check_int("applied_index", doc["applied_index"], 0)
    return doc["epoch"], records, fences, index
