"""shm gets check a whole object's checksum as its bytes land, and still refuse a flip.

A slice that holds a whole object is hashed by ``copy_spans`` right after it lands
(``ItemResult.landed``), so ``get_batch_into`` does not read it again. Pinned against
a real server: those keys are counted as hashed on landing and come back OK; a byte
flipped in the live arena is still a CORRUPT miss, counted once, on the landing check
(single-slice keys) and on the finalize check (a key in several slices); and with
``verify_checksums=False`` nothing is hashed.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from gcache.sdk import Client, Status
from gcache.sdk.transports.onesided import STATS
from gcache.testing.oracle import check_value, value_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 512 << 10  # one-sided (>= one_sided_min_bytes), one slice (<= slice_bytes)
BIG = 3 << 20  # three slices


def _flip(path: str, value: bytes) -> None:
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = mm.find(value[:4096])
        assert at > 0 and mm[at:at + 4096] == value[:4096]
        mm[at + len(value) // 2] ^= 0x01


def test_landing_check_passes_good_bytes_and_refuses_a_flip(make_cluster):
    c = make_cluster(1, "256MiB", slab="4MiB")
    addr = c.addresses[0]
    keys = [f"land-{i}".encode() for i in range(8)]
    vals = [value_for(k, SIZE) for k in keys]
    big_key = b"land-big"
    big = value_for(big_key, BIG)
    with Client([addr], transport="shm", timeout_ms=5000) as cl:
        assert cl.put_batch_from(keys + [big_key], vals + [big]) == [Status.OK] * 9
        before = STATS["landed_hashes"]
        outs = [np.zeros(SIZE, np.uint8) for _ in keys]
        assert cl.get_batch_into(keys, outs) == [Status.OK] * len(keys)
        assert all(check_value(k, o) for k, o in zip(keys, outs))
        assert STATS["landed_hashes"] - before == len(keys)
        _flip(c.servers[0].arena_path, vals[3])
        _flip(c.servers[0].arena_path, big)
        outs = [np.zeros(SIZE, np.uint8) for _ in keys]
        big_out = np.zeros(BIG, np.uint8)
        got = cl.get_batch_into(keys + [big_key], outs + [big_out])
        assert got == [Status.OK] * 3 + [Status.CORRUPT] + [Status.OK] * 4 + [Status.CORRUPT]
        assert cl.counters["checksum_mismatch"] == 2
    with Client([addr], transport="shm", timeout_ms=5000, verify_checksums=False) as cl:
        before = STATS["landed_hashes"]
        out = np.zeros(SIZE, np.uint8)
        assert cl.get_batch_into([keys[3]], [out]) == [Status.OK]  # unverified: the flip
        assert not check_value(keys[3], out)
        assert STATS["landed_hashes"] == before
