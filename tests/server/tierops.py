"""Oracle puts and reads straight on a Tier object (in-process tests of the tiers)."""

from __future__ import annotations

from gcache.server.tier import Tier
from gcache.status import Status
from gcache.testing.oracle import value_for


def put_value(tier: Tier, ns: bytes, key: bytes, n: int, ph: int | None = None) -> int:
    """Put ``value_for(key, n)`` in one slot (``ph``: its placement hash); returns the
    version it committed under."""
    slot = tier.begin_put(ns, key, n, 0, n, 0, ph=ph)
    assert slot.status == Status.OK, slot.status
    slot.view[:] = value_for(key, n)
    version = slot.token.obj.version
    assert tier.finish_put(slot) == Status.OK
    return version


def read_value(tier: Tier, ns: bytes, key: bytes) -> bytes | None:
    """The whole value of ``key``, or None when the read is not OK."""
    p = tier.pin_read(ns, key, 0, 1 << 40, 0)
    try:
        return bytes(p.view) if p.status == Status.OK else None
    finally:
        tier.unpin(p)
