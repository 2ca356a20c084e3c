"""A frame's puts reserved and finished in one tier call each (``begin_puts`` /
``finish_puts``, what PUT and PUT_STAGED use) give the same statuses, the same index and
the same bytes as one ``begin_put`` / ``finish_put`` per item, in the same order.

Two fresh tiers get the same hypothesis-made frames: whole values, halves of sliced
values (in one frame or across frames, charged to a connection's holder with a small
bound, so some are BUSY), values too large for a slab, values whose writer's checksum
does not match, replaces of the same key in one frame, if-absent frames, and enough
bytes to evict. A memory tier alone, and a tiered store (memory NO_SPACE falls back to
the one-by-one path, which evicts when no room comes).
"""

from __future__ import annotations

import xxhash
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gcache.server import memory_tier
from gcache.server.arena import Arena
from gcache.server.memory_tier import Holder, MemoryTier
from gcache.server.tier import PutRequest, Tier
from gcache.status import Status
from gcache.testing.oracle import value_for
from tierops import read_value, small_tiered_store

pytestmark = [pytest.mark.unit, pytest.mark.timeout(240)]

NS = b"ns"
KEYS = [b"k%d" % i for i in range(40)]  # up to 12 MB of values: past 8 MiB of memory
SIZES = [100, 5_000, 70_000, 300_000, 2 << 20]  # the last is past a 1 MiB slab

# one item: (key index, size index, part: 0 whole / 1 first half / 2 second half,
# writer's checksum wrong, put id)
item = st.tuples(st.integers(0, len(KEYS) - 1), st.integers(0, len(SIZES) - 1),
                 st.sampled_from([0, 0, 0, 1, 2]), st.sampled_from([False] * 9 + [True]),
                 st.integers(0, 2))
frames = st.lists(st.tuples(st.lists(item, min_size=1, max_size=12), st.booleans()),
                  min_size=1, max_size=12)
# three frames of twelve 300 KB values: past memory, so it must evict (or demote)
FULL = [([(k, 3, 0, False, 0) for k in range(f * 12, f * 12 + 12)], False) for f in range(3)]


def _request(it: tuple, holder: Holder) -> tuple[PutRequest, bytes]:
    k, s, part, bad, pid = it
    key, total = KEYS[k], SIZES[s]
    value = value_for(key + b"/%d" % pid, total)
    csum = xxhash.xxh3_64_intdigest(value) ^ (1 if bad else 0)
    half = total // 2
    off, ln = (0, total) if part == 0 else (0, half) if part == 1 else (half, total - half)
    sliced = part != 0
    return (PutRequest(key, total, off, ln, pid, csum, holder if sliced else None),
            value[off:off + ln])


def _digest(slot, req: PutRequest) -> int | None:
    whole = req.offset == 0 and req.length == req.total_len
    return xxhash.xxh3_64_intdigest(slot.view) if whole else None


def _one_by_one(tier: Tier, reqs: list[tuple[PutRequest, bytes]], if_absent: bool
                ) -> list[Status]:
    out, slots = [], []
    for r, data in reqs:
        slot = tier.begin_put(NS, r.key, r.total_len, r.offset, r.length, r.put_id,
                              csum=r.csum, holder=r.holder, ph=r.ph, parent=r.parent)
        out.append(slot.status)
        if slot.status == Status.OK:
            slot.view[:] = data
            slots.append((len(out) - 1, slot, _digest(slot, r)))
    for i, slot, d in slots:
        out[i] = tier.finish_put(slot, if_absent=if_absent, digest=d)
    return out


def _batched(tier: Tier, reqs: list[tuple[PutRequest, bytes]], if_absent: bool
             ) -> list[Status]:
    got = tier.begin_puts(NS, [r for r, _ in reqs])
    out = [s.status for s in got]
    ok = [(i, s, r) for i, (s, (r, _)) in enumerate(zip(got, reqs)) if s.status == Status.OK]
    for i, s, _ in ok:
        s.view[:] = reqs[i][1]
    done = tier.finish_puts([s for _, s, _ in ok], if_absent=if_absent,
                            digests=[_digest(s, r) for _, s, r in ok])
    for (i, _, _), d in zip(ok, done):
        out[i] = d
    return out


def _state(tier: Tier, mem: MemoryTier) -> tuple:
    held = sorted((h.ns, h.key, h.version, h.length) for h in tier.held())
    values = {k: read_value(tier, NS, k) for k in KEYS}
    return (held, values, mem.live_bytes, mem.uncommitted_bytes, mem.reserved_bytes,
            dict(mem.counters))


def _memory(path) -> tuple[Tier, MemoryTier]:
    m = MemoryTier(Arena(str(path / "m.arena"), 8 << 20, 1 << 20, prefault=False),
                   max_held_bytes=600_000)
    m.reserve_wait_s = 0.0  # past its bound a holder is BUSY at once, never waits
    return m, m


def _tiered(path) -> tuple[Tier, MemoryTier]:
    t = small_tiered_store(path)
    t.memory.max_held = 600_000
    t.memory.reserve_wait_s = 0.0
    return t, t.memory


def _check(make, tmp_path_factory, fs) -> None:
    a, am = make(tmp_path_factory.mktemp("one"))
    b, bm = make(tmp_path_factory.mktemp("batch"))
    ha, hb = Holder(), Holder()
    try:
        for n, (items, if_absent) in enumerate(fs):
            sa = _one_by_one(a, [_request(it, ha) for it in items], if_absent)
            sb = _batched(b, [_request(it, hb) for it in items], if_absent)
            assert sa == sb, f"frame {n}: {items}"
        assert _state(a, am) == _state(b, bm)
        assert (ha.held, len(ha.pendings)) == (hb.held, len(hb.pendings))
    finally:
        for t, m in ((a, am), (b, bm)):
            if t is not m:
                t.close()
            else:
                m.close()


@pytest.mark.parametrize("lock_batch", [memory_tier.LOCK_BATCH, 3])
@pytest.mark.parametrize("make", [_memory, _tiered], ids=["memory", "tiered"])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fs=frames)
@example(fs=FULL)
def test_batched_puts_match_one_by_one(make, lock_batch, tmp_path_factory, fs):
    """(``lock_batch`` 3: frames span several lock holds of the batched calls.)"""
    saved, memory_tier.LOCK_BATCH = memory_tier.LOCK_BATCH, lock_batch
    try:
        _check(make, tmp_path_factory, fs)
    finally:
        memory_tier.LOCK_BATCH = saved
