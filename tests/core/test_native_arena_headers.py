"""``header_write`` / ``header_commit``: the C versions and their twins write the same
bytes, return the same data offset, and refuse the same bad input with the same
exception type, leaving the buffer as it was.

Each case writes a header (any namespace, key, version, length, time, with or without a
placement hash, anywhere a header fits, with its start mark anywhere) into two copies
of one random buffer, one per implementation, commits it with a checksum, and compares
the buffers byte for byte. A committed header also passes the arena's own recovery
check (``Arena._header_crc``, zlib's CRC32), and a read-only, strided or too-small
buffer, an out-of-range offset or value, a namespace that is not bytes: both raise the
same exception type before writing a byte.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import native

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

U64 = st.integers(0, 2**64 - 1)
SIZE = 2048


def _outcome(fn, buf, *args):
    try:
        return ("ok", fn(buf, *args))
    except Exception as exc:  # the type is what must match
        return ("raised", type(exc))


@st.composite
def headers(draw):
    ns = draw(st.binary(max_size=40))
    key = draw(st.binary(min_size=1, max_size=300))
    ph = draw(st.none() | U64)
    hl = (64 + len(ns) + len(key) + (8 if ph is not None else 0) + 63) & ~63
    off = draw(st.integers(0, SIZE - hl))
    mark = draw(st.integers(0, SIZE - 1).filter(lambda m: not off <= m < off + hl))
    return off, ns, key, draw(U64), draw(U64), draw(U64), ph, mark


@settings(max_examples=300)
@given(h=headers(), seed=st.integers(0, 2**32 - 1), csum=U64)
def test_header_write_and_commit_match_the_twins(h, seed, csum):
    base = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    a, b = bytearray(base), bytearray(base)
    assert _native.header_write(a, *h) == native.twins.header_write(b, *h)
    assert a == b
    off, ns, key, version, length, created, ph, mark = h
    assert a[mark] == 1
    assert struct.unpack_from("<IIHHHHQQ", a, off) == (
        0x4F434347, 2 if ph is not None else 0, (64 + len(ns) + len(key)
                                                + (8 if ph is not None else 0) + 63) & ~63,
        len(ns), len(key), 0, version, length)
    _native.header_commit(a, off, csum)
    native.twins.header_commit(b, off, csum)
    assert a == b
    flags, = struct.unpack_from("<I", a, off + 4)
    assert flags & 1 and struct.unpack_from("<Q", a, off + 32)[0] == csum
    tail = off + 64 + len(ns) + len(key) + (8 if ph is not None else 0)
    want = zlib.crc32(bytes(a[off + 64:tail]), zlib.crc32(bytes(a[off + 8:off + 48])))
    assert struct.unpack_from("<I", a, off + 48)[0] == want


anything = st.one_of(st.integers(-2**70, 2**70), st.none(), st.text(max_size=2),
                     st.binary(max_size=3), st.floats(allow_nan=False), st.booleans())


@settings(max_examples=400)
@given(buf=st.sampled_from(["rw", "ro", "strided", "small", "none"]),
       h=headers(), bad_at=st.integers(0, 7), bad=anything)
def test_bad_input_raises_the_same_type_and_writes_nothing(buf, h, bad_at, bad):
    def make():
        raw = bytearray(range(256)) * (SIZE // 256)
        return {"rw": raw, "ro": bytes(raw), "strided": memoryview(raw)[::2],
                "small": bytearray(40), "none": None}[buf], raw
    args = list(h)
    args[bad_at] = bad
    (x, xraw), (y, yraw) = make(), make()
    got_c = _outcome(_native.header_write, x, *args)
    got_py = _outcome(native.twins.header_write, y, *args)
    assert got_c == got_py, (buf, bad_at, bad)
    if got_c[0] == "raised":
        assert xraw == yraw == bytearray(range(256)) * (SIZE // 256)
    off = args[0]
    got_c = _outcome(_native.header_commit, x, off, bad if bad_at == 1 else 7)
    got_py = _outcome(native.twins.header_commit, y, off, bad if bad_at == 1 else 7)
    assert got_c == got_py, (buf, bad_at, bad)
    assert xraw == yraw
