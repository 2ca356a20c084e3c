"""Oracle puts and reads straight on a Tier object (in-process tests of the tiers)."""

from __future__ import annotations

from gcache.server.arena import Arena
from gcache.server.disk import SegmentLog
from gcache.server.memory_tier import MemoryTier
from gcache.server.tier import Tier
from gcache.server.tiered_store import TieredStore
from gcache.server.tiering import make_promote_policy
from gcache.status import Status
from gcache.testing.oracle import value_for


def put_value(tier: Tier, ns: bytes, key: bytes, n: int, ph: int | None = None,
              parent: bytes | None = None) -> int:
    """Put ``value_for(key, n)`` in one slot (``ph``: its placement hash; ``parent``: its
    chain parent's key); returns the version it committed under."""
    slot = tier.begin_put(ns, key, n, 0, n, 0, ph=ph, parent=parent)
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


def small_tiered_store(tmp_path, promote: str = "never") -> TieredStore:
    """An 8 MiB memory tier (watermarks 0.8 / 0.5, 1 MiB slabs) in front of a 64 MiB
    segment log of 4 MiB segments under ``tmp_path``; the mover is stepped by hand."""
    arena = Arena(str(tmp_path / "t.arena"), 8 << 20, 1 << 20, prefault=False)
    mem = MemoryTier(arena, high_watermark=0.8, low_watermark=0.5)
    disk = SegmentLog(str(tmp_path), "t", capacity_bytes=64 << 20, segment_bytes=4 << 20,
                      max_value_bytes=1 << 20)
    return TieredStore(mem, disk, make_promote_policy(promote, 1000, lambda: 0.0),
                       room_wait_s=0.0)


def fill_past_memory(st: TieredStore, ns: bytes, n: int, size: int
                     ) -> tuple[list[bytes], list[bytes]]:
    """Put ``n`` oracle values ``k0``.. of ``size`` bytes, stepping the mover after each so
    the oldest are demoted; returns (keys in memory, keys on disk only)."""
    keys = [f"k{i}".encode() for i in range(n)]
    for k in keys:
        put_value(st, ns, k, size)
        st.step()  # demote past the watermark as we go
    on_disk = [k for k in keys if not st.memory.exists(ns, k) and st.disk.exists(ns, k)]
    return [k for k in keys if st.memory.exists(ns, k)], on_disk
