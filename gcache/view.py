"""The membership view a client or server routes by: an epoch and its members.

Today a view comes from a static server list; the Raft master (a later issue)
feeds the same type. SDK and servers compute identical owners from identical
``(epoch, members)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from gcache.ring import Member, Ring


@dataclass(frozen=True)
class View:
    epoch: int
    members: tuple[Member, ...]

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
