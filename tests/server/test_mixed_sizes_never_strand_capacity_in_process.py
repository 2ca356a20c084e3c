"""MemoryTier in-process with values of many sizes (slab calcification, issue 14): they
fill the arena to its watermark with no eviction, an overfill evicts strictly in the
policy's order (never for a size), a large put after small-value churn compacts (moves
objects, and survives a restart) instead of evicting ten times its size, a pinned chunk
is never reused or moved, the allocator comes back whole after a restart, and a value
whose bytes look like a committed chunk header is never taken for an object."""

from __future__ import annotations

import random
import struct
import zlib

import pytest

from gcache.hashing import checksum
from gcache.server.arena import (CHUNK_MAGIC, FLAG_COMMITTED, GRANULE, HDR, HDR_FIXED, Arena,
                                 arena_bytes_for, header_len)
from gcache.server.memory_tier import MemoryTier
from gcache.status import Status
from gcache.testing.oracle import value_for
from tierops import put_value, read_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20


def _tier(tmp_path, **kw) -> MemoryTier:
    arena = Arena(str(tmp_path / "a.arena"), 64 * MIB, 4 * MIB, prefault=False)
    return MemoryTier(arena, **kw)


def _sizes(total: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(rng.randint(1 << 10, 3 * MIB))
    return out


def test_values_of_many_sizes_fill_90_percent_with_no_eviction(tmp_path) -> None:
    m = _tier(tmp_path)
    try:
        sizes = _sizes(int(0.9 * m.capacity) - 3 * MIB)
        keys = [b"k%d" % i for i in range(len(sizes))]
        for k, n in zip(keys, sizes):
            put_value(m, NS, k, n)
        assert m.stats()["evictions"] == 0 and m.stats()["no_space"] == 0
        assert all(read_value(m, NS, k) == value_for(k, n) for k, n in zip(keys, sizes))
    finally:
        m.close()


def test_an_overfill_evicts_only_in_the_policy_order(tmp_path) -> None:
    m = _tier(tmp_path)
    try:
        sizes = _sizes(3 * m.capacity, seed=2)
        keys = [b"k%d" % i for i in range(len(sizes))]
        for k, n in zip(keys, sizes):
            put_value(m, NS, k, n)
        here = [m.exists(NS, k) for k in keys]
        first = here.index(True)
        assert all(here[first:]), "only the least recently used were given up"
        resident = sum(sizes[first:])
        assert resident > 0.75 * m.capacity, (resident, m.capacity)
        assert all(read_value(m, NS, k) == value_for(k, n)
                   for k, n in zip(keys[first:], sizes[first:]))
    finally:
        m.close()


def test_a_pinned_chunk_is_never_reused_by_an_overfill(tmp_path) -> None:
    m = _tier(tmp_path)
    try:
        put_value(m, NS, b"pinned", 3 * MIB)
        lease = m.pin_read(NS, b"pinned", 0, 1 << 40, 0)
        assert m.delete(NS, b"pinned")
        for i, n in enumerate(_sizes(3 * m.capacity, seed=3)):
            put_value(m, NS, b"o%d" % i, n)
        assert bytes(lease.view) == value_for(b"pinned", 3 * MIB)
        m.unpin(lease)
    finally:
        m.close()


def test_the_allocator_comes_back_whole_after_a_restart(tmp_path) -> None:
    m = _tier(tmp_path)
    sizes = _sizes(int(0.6 * m.capacity), seed=4)
    keys = [b"k%d" % i for i in range(len(sizes))]
    for k, n in zip(keys, sizes):
        put_value(m, NS, k, n)
    for k in keys[::3]:  # holes between survivors
        m.delete(NS, k)
    live = {k: n for i, (k, n) in enumerate(zip(keys, sizes)) if i % 3}
    used, free = m.stats()["used_bytes"], m.stats()["free_bytes"]
    m.close(clean=True)
    m = _tier(tmp_path)
    try:
        assert m.recovery["objects"] == len(live)
        assert (m.stats()["used_bytes"], m.stats()["free_bytes"]) == (used, free)
        more = _sizes(free - 8 * MIB, seed=5)  # into the holes: no survivor overwritten
        for i, n in enumerate(more):
            put_value(m, NS, b"new%d" % i, n)
        assert m.stats()["evictions"] == 0
        assert all(read_value(m, NS, k) == value_for(k, n) for k, n in live.items())
        assert all(read_value(m, NS, b"new%d" % i) == value_for(b"new%d" % i, n)
                   for i, n in enumerate(more))
    finally:
        m.close()


def test_a_value_that_looks_like_a_chunk_header_is_never_recovered(tmp_path) -> None:
    m = _tier(tmp_path)
    fake_key, fake = b"victim", b"not written by any put"
    hl = header_len(len(NS), len(fake_key))
    raw = bytearray(hl)
    HDR.pack_into(raw, 0, CHUNK_MAGIC, FLAG_COMMITTED, hl, len(NS), len(fake_key), 0, 1,
                  len(fake), checksum(fake), 0, 0, 0)
    raw[HDR_FIXED:HDR_FIXED + len(NS) + len(fake_key)] = NS + fake_key
    crc = zlib.crc32(raw[HDR_FIXED:HDR_FIXED + len(NS) + len(fake_key)],
                     zlib.crc32(raw[8:48]))
    struct.pack_into("<I", raw, 48, crc)
    forged = bytes(raw) + fake  # a valid committed chunk, header CRC and all
    carrier_hl = header_len(len(NS), len(b"carrier"))
    value = bytearray(3 * GRANULE)
    at = GRANULE - carrier_hl  # lands on a granule boundary of the arena
    value[at:at + len(forged)] = forged
    put_value_bytes(m, b"carrier", bytes(value))
    p = m.pin_read(NS, b"carrier", 0, 0, 0)
    carrier_granule = m.arena.granule_of(p.token.offset)
    m.unpin(p)
    m.close(clean=True)
    m = _tier(tmp_path)
    try:
        assert m.recovery["objects"] == 1 and not m.exists(NS, fake_key)
        assert read_value(m, NS, b"carrier") == bytes(value)
    finally:
        m.close()
    a = Arena(str(tmp_path / "a.arena"), 64 * MIB, 4 * MIB, prefault=False)
    try:  # the forgery is sound: were the carrier torn, only the start map would keep
        a.starts[carrier_granule] = 0  # recovery from taking it
        a.starts[carrier_granule + 1] = 1
        assert [r.key for r in a.scan()[0]] == [fake_key]
    finally:
        a.close(clean=False, next_version=a.next_version)


def put_value_bytes(m: MemoryTier, key: bytes, data: bytes) -> None:
    slot = m.begin_put(NS, key, len(data), 0, len(data), 0)
    slot.view[:] = data
    assert m.finish_put(slot) == Status.OK


def test_a_large_put_after_small_churn_compacts_instead_of_evicting_much(tmp_path) -> None:
    m = _tier(tmp_path)
    sizes: dict[bytes, int] = {}
    rng = random.Random(6)
    for _ in range(6000):  # random replaces split the free space into small holes
        k, n = b"s%d" % rng.randrange(3000), rng.randint(1 << 10, 64 << 10)
        put_value(m, NS, k, n)
        sizes[k] = n
    before = m.stats()["evicted_bytes"]
    for i in range(8):
        put_value(m, NS, b"big%d" % i, MIB)
        sizes[b"big%d" % i] = MIB
    per_put = (m.stats()["evicted_bytes"] - before) / 8
    assert per_put < 2 * MIB, f"{per_put / MIB:.1f} MiB evicted per 1 MiB put"
    assert m.stats()["relocated"] > 0
    here = {k: n for k, n in sizes.items() if m.exists(NS, k)}
    assert all(m.exists(NS, b"big%d" % i) for i in range(8))
    m.close(clean=True)
    m = _tier(tmp_path)  # relocated objects come back from their new chunks
    try:
        assert m.recovery["objects"] == len(here)
        assert all(read_value(m, NS, k) == value_for(k, n) for k, n in here.items())
    finally:
        m.close()


def test_evicting_for_a_long_run_never_takes_a_pinned_object(tmp_path) -> None:
    m = _tier(tmp_path)
    try:
        keys = [b"k%d" % i for i in range(m.capacity // (64 << 10))]
        for k in keys:
            put_value(m, NS, k, (64 << 10) - 256)  # one 64 KiB chunk each: the arena full
        leases = [m.pin_read(NS, k, 0, 1 << 40, 0) for k in keys[::2]]
        slot = m.begin_put(NS, b"big", MIB, 0, MIB, 0)
        assert slot.status == Status.NO_SPACE  # every 1 MiB window holds a pinned chunk
        assert all(bytes(p.view) == value_for(k, (64 << 10) - 256)
                   for k, p in zip(keys[::2], leases))
        assert all(m.exists(NS, k) for k in keys[::2])
        for p in leases:
            m.unpin(p)
        put_value(m, NS, b"big", MIB)  # unpinned: now it finds room
    finally:
        m.close()


@pytest.mark.parametrize("npages,slab", [(1, 64 << 10), (1000, 64 << 10), (31, 16 * MIB)])
def test_arena_bytes_for_gives_exactly_that_many_pages(tmp_path, npages, slab) -> None:
    a = Arena(str(tmp_path / "x.arena"), arena_bytes_for(npages, slab), slab, prefault=False)
    try:
        assert a.npages == npages and a.granules * GRANULE == npages * slab
    finally:
        a.close(clean=False, next_version=1)
