"""Consistent-hash ring with weighted virtual nodes.

Design: each member owns ``max(1, round(vnodes_per_weight * weight))``
virtual nodes at ``vnode_hash(member.id, i)``. A vnode's position depends only
on its own member, so a join moves exactly the keys the new member takes and a
leave moves exactly the keys the old member had (minimal movement). A key with
placement hash ``h`` belongs to the first vnode clockwise whose position is
``>= h``, wrapping past 2**64 - 1 to the smallest position.

Positions live in one sorted numpy ``uint64`` array with a parallel array of
member indices, so lookups are a binary search and batches are one
``searchsorted`` call. Members are kept sorted by id; equal positions (64-bit
collisions, practically never) are ordered by member id, so the smallest id
wins. The result is independent of the order members are passed in. Rings are
immutable: ``with_member`` / ``without`` build a new ring at ``epoch + 1``.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from gcache.hashing import vnode_hash

__all__ = ["Member", "Ring"]

_SPACE = 2**64  # size of the hash space
_SMALL = 8  # ``owners`` of at most this many hashes (a list) bisects Python lists
_EMPTY = "ring is empty: no servers in the view"


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Member:
    """A cache server in the view. ``weight`` is its relative capacity (> 0)."""

    id: str
    address: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"member id must be a non-empty string, got {self.id!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"member {self.id!r}: weight must be finite and > 0, got {w!r}")


class Ring:
    """Immutable consistent-hash ring over a set of ``Member``s."""

    __slots__ = ("_members", "_by_id", "_positions", "_owners", "_vnodes_per_weight", "_epoch",
                 "_lists")

    def __init__(
        self, members: Sequence[Member], vnodes_per_weight: int = 160, epoch: int = 0
    ) -> None:
        _check_int("vnodes_per_weight", vnodes_per_weight, 1)
        _check_int("epoch", epoch, 0)
        members = tuple(members)  # accept any iterable; it is walked twice
        for m in members:
            if not isinstance(m, Member):
                raise ValueError(f"ring members must be Member instances, got {m!r}")
        ordered = tuple(sorted(members, key=lambda m: m.id))
        for a, b in zip(ordered, ordered[1:]):
            if a.id == b.id:
                raise ValueError(f"duplicate member id {a.id!r}")
        counts = [max(1, round(vnodes_per_weight * m.weight)) for m in ordered]
        positions = np.fromiter(
            (vnode_hash(m.id, i) for m, c in zip(ordered, counts) for i in range(c)),
            dtype=np.uint64,
            count=sum(counts),
        )
        owners = np.repeat(
            np.arange(len(ordered), dtype=np.intp), np.asarray(counts, dtype=np.intp)
        )
        order = np.lexsort((owners, positions))  # by position, ties by member id rank
        self._positions = positions[order]
        self._owners = owners[order]
        self._positions.flags.writeable = False
        self._owners.flags.writeable = False
        self._members = ordered
        self._by_id = {m.id: m for m in ordered}
        self._vnodes_per_weight = vnodes_per_weight
        self._epoch = epoch
        self._lists: tuple[list[int], list[Member]] | None = None  # made on first use

    # -- view ---------------------------------------------------------------
    @property
    def members(self) -> tuple[Member, ...]:
        """Members sorted by id."""
        return self._members

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def vnodes_per_weight(self) -> int:
        return self._vnodes_per_weight

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member_id: object) -> bool:
        return isinstance(member_id, str) and member_id in self._by_id

    def member(self, member_id: str) -> Member:
        """Return the member with this id; KeyError if absent."""
        try:
            return self._by_id[member_id]
        except KeyError:
            raise KeyError(f"no member {member_id!r} in ring epoch {self._epoch}") from None

    def __repr__(self) -> str:
        ids = [m.id for m in self._members]
        return f"Ring(epoch={self._epoch}, members={ids}, vnodes={len(self._positions)})"

    # -- lookup -------------------------------------------------------------
    def _index(self, h: int) -> int:
        if not self._members:
            raise LookupError(_EMPTY)
        h = operator.index(h)
        if not 0 <= h < _SPACE:
            raise ValueError(f"hash must be in [0, 2**64), got {h}")
        i = int(np.searchsorted(self._positions, np.uint64(h), side="left"))
        return 0 if i == len(self._positions) else i

    def owner(self, h: int) -> Member:
        """Return the owner of placement hash ``h``; LookupError if the ring is empty."""
        return self._members[self._owners[self._index(h)]]

    def owners(self, hashes: Sequence[int]) -> list[Member]:
        """Vectorized ``[self.owner(h) for h in hashes]``."""
        if type(hashes) is list and len(hashes) <= _SMALL:
            return self._owners_small(hashes)
        if isinstance(hashes, np.ndarray):
            kind = hashes.dtype.kind
            if kind not in "ui" or (kind == "i" and bool((hashes < 0).any())):
                raise ValueError("hashes must be non-negative integers")
            arr = hashes.astype(np.uint64, copy=False).ravel()
        else:
            try:
                arr = np.array(hashes, dtype=np.uint64).ravel()
            except (OverflowError, TypeError, ValueError) as exc:
                raise ValueError(f"hashes must be integers in [0, 2**64): {exc}") from None
        if arr.size == 0:
            return []
        if not self._members:
            raise LookupError(_EMPTY)
        idx = np.searchsorted(self._positions, arr, side="left")
        idx[idx == len(self._positions)] = 0
        members = self._members
        return [members[i] for i in self._owners[idx].tolist()]

    def _owners_small(self, hashes: list) -> list[Member]:
        """``owners`` of a few hashes by ``bisect`` over Python lists: a single-key call
        pays ~1 µs here instead of numpy's ~5 µs per-call setup. Same rule, same checks."""
        lists = self._lists
        if lists is None:
            lists = self._lists = (self._positions.tolist(),
                                   [self._members[i] for i in self._owners.tolist()])
        positions, members = lists
        n = len(positions)
        out = []
        for h in hashes:
            if type(h) is not int:
                try:
                    h = operator.index(h)
                except TypeError as exc:
                    raise ValueError(f"hashes must be integers in [0, 2**64): {exc}") from None
            if not 0 <= h < _SPACE:
                raise ValueError(f"hashes must be integers in [0, 2**64), got {h}")
            if not n:
                raise LookupError(_EMPTY)
            i = bisect_left(positions, h)
            out.append(members[0 if i == n else i])
        return out

    def successors(self, h: int, n: int) -> list[Member]:
        """Return the first ``n`` distinct members clockwise from ``h``.

        The first is ``owner(h)``; fewer than ``n`` are returned when the ring
        has fewer members. Used for replication and fallback placement.
        """
        _check_int("n", n, 0)
        if n == 0:
            return []
        rolled = np.roll(self._owners, -self._index(h))
        ids, first = np.unique(rolled, return_index=True)
        picked = ids[np.argsort(first, kind="stable")][:n]
        return [self._members[i] for i in picked.tolist()]

    def load_shares(self) -> dict[str, float]:
        """Fraction of the hash space owned by each member (sums to 1.0)."""
        if not self._members:
            return {}
        pos = self._positions
        arcs = np.empty(len(pos), dtype=np.float64)
        arcs[1:] = np.diff(pos)  # exact in uint64: positions are sorted
        arcs[0] = _SPACE - int(pos[-1]) + int(pos[0])  # wrap-around arc
        owned = np.bincount(self._owners, weights=arcs, minlength=len(self._members))
        return {m.id: float(s) for m, s in zip(self._members, owned / owned.sum())}

    # -- derived rings ------------------------------------------------------
    def with_member(self, member: Member) -> Ring:
        """Return a new ring (epoch + 1) that also contains ``member``."""
        if member.id in self._by_id:
            raise ValueError(f"duplicate member id {member.id!r}")
        return Ring((*self._members, member), self._vnodes_per_weight, self._epoch + 1)

    def without(self, member_id: str) -> Ring:
        """Return a new ring (epoch + 1) without ``member_id``; KeyError if absent."""
        self.member(member_id)
        rest = [m for m in self._members if m.id != member_id]
        return Ring(rest, self._vnodes_per_weight, self._epoch + 1)
