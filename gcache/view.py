"""The membership view a client or server routes by: an epoch and its members.

Today a view comes from a static server list; the Raft master (a later issue)
feeds the same type. SDK and servers compute identical owners from identical
``(epoch, members)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from gcache.ring import Member, Ring


class MemberState(str, enum.Enum):
    """A member's state in the master's view (wire-stable strings)."""

    JOINING = "joining"
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"


@dataclass(frozen=True)
class View:
    """``members``: the ring (UP and JOINING members). ``holders``: the addresses of
    every member that still serves what it holds (UP, JOINING and DRAINING; a master
    view only): where a client may re-ask a key's previous owner after a membership
    change."""

    epoch: int
    members: tuple[Member, ...]
    holders: frozenset[str] = field(default=frozenset(), compare=False)

    @cached_property
    def ring(self) -> Ring:
        return Ring(self.members, epoch=self.epoch)

    @classmethod
    def static(cls, addresses: list[str]) -> "View":
        """A view from a plain server list: equal weights, id = address."""
        seen = []
        for a in addresses:
            a = a.strip()
            if a and a not in seen:
                seen.append(a)
        return cls(0, tuple(Member(id=a, address=a) for a in seen))


#: The states whose members are in the ring, and those that serve what they hold.
PLACED = (MemberState.UP, MemberState.JOINING)
HOLDING = (MemberState.UP, MemberState.JOINING, MemberState.DRAINING)


def view_from_wire(doc: dict) -> View:
    """The routing rule, the only copy of it: the ring is built from the UP and JOINING
    members of a master view document, sorted by id and weighted by capacity relative
    to the largest of their full capacities (equal capacities give equal weights; none
    drops below 0.05); a JOINING member's weight is then scaled by its ``ramp`` (absent:
    1.0). The ring's vnodes depend only on their own member, so a rising ramp only adds
    the newcomer's vnodes: keys only move toward it. DRAINING members take no new
    placements; DOWN members are skipped."""
    placed = [m for m in doc.get("members", []) if m.get("state") in PLACED]
    top = max((int(m.get("capacity_bytes") or 0) for m in placed), default=0)
    members = tuple(
        Member(id=m["id"], address=m["address"],
               weight=(max(0.05, int(m.get("capacity_bytes") or 0) / top) if top else 1.0)
               * (float(m.get("ramp", 1.0)) if m.get("state") == MemberState.JOINING
                  else 1.0))
        for m in sorted(placed, key=lambda m: m["id"]))
    holders = frozenset(m["address"] for m in doc.get("members", [])
                        if m.get("state") in HOLDING)
    return View(int(doc.get("epoch", 0)), members, holders)
