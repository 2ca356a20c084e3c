"""Each object keeps the placement hash its writer routed it by (``begin_put(ph=)``): in
the arena chunk header (FLAG_PLACED) and the disk record (its flag), across a restart
(clean: the disk's index file; crash: the scans), demotion, promotion and compaction, and
``held()`` yields it. Objects put without one yield None, and an arena chunk written in
the format from before FLAG_PLACED still recovers."""

from __future__ import annotations

import struct
import zlib

import pytest

from gcache.hashing import checksum
from gcache.server.arena import (CHUNK_MAGIC, FLAG_COMMITTED, FLAG_PLACED, HDR, HDR_FIXED,
                                 Arena, header_len)
from gcache.server.disk import SegmentLog
from gcache.server.memory_tier import MemoryTier
from gcache.server.tiered_store import TieredStore
from gcache.server.tiering import make_promote_policy
from gcache.testing.oracle import value_for

from tierops import put_value, read_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20
SIZE = 200_000  # 5 per 1 MiB slab page
PH = (1 << 64) - 12345  # a high bit set: the full u64 range survives


def _arena(tmp_path) -> Arena:
    return Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False)


def _store(tmp_path, policy: str = "never") -> TieredStore:
    mem = MemoryTier(_arena(tmp_path), high_watermark=0.8, low_watermark=0.5)
    disk = SegmentLog(str(tmp_path), "t", capacity_bytes=64 * MIB, segment_bytes=4 * MIB,
                      max_value_bytes=MIB)
    return TieredStore(mem, disk, make_promote_policy(policy, 1, lambda: 0.0),
                       room_wait_s=0.0)


def _held(tier) -> dict[bytes, int | None]:
    return {h.key: h.ph for h in tier.held()}


@pytest.mark.parametrize("clean", [True, False], ids=["clean-stop", "crash"])
def test_memory_objects_keep_their_placement_hash_across_a_restart(tmp_path, clean):
    m = MemoryTier(_arena(tmp_path))
    put_value(m, NS, b"placed", 1000, ph=PH)
    put_value(m, NS, b"zero", 1000, ph=0)  # 0 is a hash, not "none"
    put_value(m, NS, b"plain", 1000)
    # a key whose header is exactly 64 bytes without the hash: the hash takes 64 more
    edge = b"e" * (64 - HDR_FIXED - len(NS) + 64)
    put_value(m, NS, edge, 1000, ph=7)
    want = {b"placed": PH, b"zero": 0, b"plain": None, edge: 7}
    assert _held(m) == want
    m.close(clean=clean)
    m = MemoryTier(_arena(tmp_path))
    try:
        assert m.recovery["reused"] and m.recovery["objects"] == 4
        assert m.recovery["corrupt"] == 0
        assert _held(m) == want
        for k in want:
            assert read_value(m, NS, k) == value_for(k, 1000)  # data offset still right
    finally:
        m.close()


def test_a_flipped_placement_hash_fails_the_header_crc(tmp_path):
    m = MemoryTier(_arena(tmp_path))
    put_value(m, NS, b"placed", 1000, ph=PH)
    off = m._index[(NS, b"placed")].offset
    at = off + HDR_FIXED + len(NS) + len(b"placed")
    m.close()
    a = _arena(tmp_path)
    a.mm[at] ^= 0x01  # one bit of the stored hash
    a.close(clean=True, next_version=a.next_version)
    m = MemoryTier(_arena(tmp_path))
    try:
        assert m.recovery["corrupt"] == 1 and _held(m) == {}
    finally:
        m.close()


def _write_old_format_chunk(a: Arena, ns: bytes, key: bytes, data: bytes, version: int
                            ) -> None:
    """Lay out one committed chunk exactly as arenas did before FLAG_PLACED: flags is
    COMMITTED alone and the header CRC covers the fixed fields, namespace and key."""
    hl = (HDR_FIXED + len(ns) + len(key) + 63) & ~63
    off = a.granule_offset(0)
    a.starts[0] = 1
    HDR.pack_into(a.mm, off, CHUNK_MAGIC, 0, hl, len(ns), len(key), 0, version, len(data),
                  checksum(data), 123, 0, 0)
    a.mm[off + HDR_FIXED:off + HDR_FIXED + len(ns) + len(key)] = ns + key
    a.mm[off + hl:off + hl + len(data)] = data
    crc = zlib.crc32(a.mm[off + 8:off + 48])
    crc = zlib.crc32(a.mm[off + HDR_FIXED:off + HDR_FIXED + len(ns) + len(key)], crc)
    struct.pack_into("<I", a.mm, off + 48, crc)
    struct.pack_into("<I", a.mm, off + 4, FLAG_COMMITTED)


def test_an_arena_written_before_the_placed_flag_still_recovers(tmp_path):
    a = _arena(tmp_path)
    data = value_for(b"old", 5000)
    _write_old_format_chunk(a, NS, b"old", data, 5)
    a.close(clean=False, next_version=6)
    m = MemoryTier(_arena(tmp_path))
    try:
        assert m.recovery["reused"] and m.recovery["objects"] == 1, m.recovery
        assert _held(m) == {b"old": None}
        assert read_value(m, NS, b"old") == data
        assert header_len(len(NS), 3) == header_len(len(NS), 3, False)
    finally:
        m.close()


def test_the_commit_keeps_the_placed_flag(tmp_path):
    a = _arena(tmp_path)
    try:
        off = a.granule_offset(0)
        a.write_header(off, NS, b"k", 1, 10, 0, ph=PH)
        assert struct.unpack_from("<I", a.mm, off + 4)[0] == FLAG_PLACED  # uncommitted
        a.commit(off, checksum(bytes(10)))
        assert struct.unpack_from("<I", a.mm, off + 4)[0] == FLAG_PLACED | FLAG_COMMITTED
    finally:
        a.close(clean=False, next_version=2)


def _fill(st: TieredStore, n: int) -> dict[bytes, int | None]:
    """``n`` objects through the store (most of them demoted): every third without a
    placement hash. Returns key -> placement hash."""
    want = {}
    for i in range(n):
        k = b"k%d" % i
        want[k] = None if i % 3 == 0 else (i * 0x9E3779B97F4A7C15) % (1 << 64)
        put_value(st, NS, k, SIZE, ph=want[k])
        st.step()
    return want


@pytest.mark.parametrize("clean", [True, False], ids=["clean-stop", "crash"])
def test_disk_objects_keep_their_placement_hash_across_demotion_and_restart(tmp_path, clean):
    st = _store(tmp_path)
    want = _fill(st, 60)  # 12 MB through 7 MiB of memory
    assert st.stats()["demoted"] > 20
    on_disk = {h.key: h.ph for h in st.disk.held()}
    assert on_disk and all(on_disk[k] == want[k] for k in on_disk)
    assert _held(st) == want
    st.close(clean=clean)
    st = _store(tmp_path)
    try:
        assert st.disk.recovery["source"] == ("index" if clean else "scan"), st.disk.recovery
        assert _held(st) == want
        for k in list(want)[::7]:  # sliced and whole reads still find the data
            assert read_value(st, NS, k) == value_for(k, SIZE)
    finally:
        st.close()


def test_promotion_and_compaction_keep_the_placement_hash(tmp_path):
    st = _store(tmp_path, policy="first")
    try:
        want = _fill(st, 60)
        disk_keys = [h.key for h in st.disk.held() if want[h.key] is not None]
        k = disk_keys[0]
        assert read_value(st, NS, k) == value_for(k, SIZE)  # a disk hit: promoted
        assert st.memory.exists(NS, k)
        assert {h.key: h.ph for h in st.memory.held()}[k] == want[k]
        for h in list(st.disk.held()):
            st.disk.touch(NS, h.key)  # hot: compaction carries (rewrites) them
        assert st.disk.compact_one()["carried"] > 0
        assert all(want[h.key] == h.ph for h in st.disk.held())
        assert _held(st) == want
    finally:
        st.close()


def test_a_sliced_disk_read_finds_the_chunk_checksums_after_the_placement_hash(tmp_path):
    st = _store(tmp_path)
    try:
        big = 300_000  # 2 chunks of 256 KiB: the record carries per-chunk checksums
        keys = [b"big%d" % i for i in range(40)]
        for i, k in enumerate(keys):
            put_value(st, NS, k, big, ph=PH - i)
            st.step()
        on_disk = [h for h in st.disk.held()]
        assert on_disk and all(h.ph == PH - keys.index(h.key) for h in on_disk)
        k = on_disk[0].key
        p = st.pin_read(NS, k, 270_000, 20_000, 0)  # inside chunk 1 only
        try:
            assert bytes(p.view) == value_for(k, big)[270_000:290_000]
        finally:
            st.unpin(p)
    finally:
        st.close()
