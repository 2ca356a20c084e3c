"""``copy_spans``: the C version and its pure-Python twin give the same results.

For random regions, span lists (good and hostile: out of bounds, negative, too long for
the buffer, read-only destinations, non-contiguous or non-buffer objects, malformed
tuples), both directions and an expired or open deadline, both functions end the same
way (the same digests, or the same exception type) and leave every byte of the region
and of every buffer the same. Plus: the digests are xxh3_64 of the landed bytes, a
deadline in the past copies nothing, and spans past the clock-check stride copy intact.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcache import native

from native_buffers import snapshot

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

KINDS = ("bytearray", "numpy", "numpy_u32", "bytes", "memoryview", "strided", "not_a_buffer")


def make_buffer(kind: str, content: bytes):
    if kind == "bytearray":
        return bytearray(content)
    if kind == "numpy":
        return np.frombuffer(bytearray(content), dtype=np.uint8)
    if kind == "numpy_u32":
        pad = content + b"\0" * (-len(content) % 4)
        return np.frombuffer(bytearray(pad), dtype=np.uint32)
    if kind == "bytes":
        return bytes(content)
    if kind == "memoryview":
        return memoryview(bytearray(content))
    if kind == "strided":  # not C-contiguous
        return np.frombuffer(bytearray(content * 2 or b"\0\0"), dtype=np.uint8)[::2]
    return 12345


@st.composite
def cases(draw):
    size = draw(st.integers(0, 4096))
    region = draw(st.binary(min_size=size, max_size=size))
    specs = []
    for _ in range(draw(st.integers(0, 6))):
        shape = draw(st.sampled_from(("ok", "ok", "ok", "ok", "short", "list", "badint")))
        kind = draw(st.sampled_from(KINDS[:5] * 3 + KINDS[5:]))
        content = draw(st.binary(max_size=600))
        off = draw(st.one_of(st.integers(0, size), st.integers(-5, size + 50)))
        n = draw(st.one_of(st.integers(0, max(0, min(len(content), size - max(off, 0)))),
                           st.integers(-3, 700)))
        want = draw(st.booleans())
        specs.append((shape, kind, content, off, n, want))
    into = draw(st.booleans())
    stop_at = draw(st.sampled_from((0.0, math.inf, math.inf)))
    return region, specs, into, stop_at


def run(fn, region_bytes: bytes, specs, into: bool, stop_at: float):
    region = np.frombuffer(bytearray(region_bytes), dtype=np.uint8)
    base = int(region.ctypes.data) if len(region) else 0
    spans, bufs = [], []
    for shape, kind, content, off, n, want in specs:
        buf = make_buffer(kind, content)
        bufs.append(buf)
        if shape == "short":
            spans.append((buf, off, n))
        elif shape == "list":
            spans.append([buf, off, n, want])
        elif shape == "badint":
            spans.append((buf, float(off), n, want))
        else:
            spans.append((buf, off, n, want))
    try:
        got = ("ok", fn(spans, base, len(region), into, stop_at))
    except Exception as exc:  # the type is what must match
        got = ("raised", type(exc))
    return got, region.tobytes(), [snapshot(b) for b in bufs]


@SETTINGS
@given(cases())
def test_native_and_twin_agree_on_any_span_list(case):
    region, specs, into, stop_at = case
    c = run(_native.copy_spans, region, specs, into, stop_at)
    p = run(native.twins.copy_spans, region, specs, into, stop_at)
    assert c == p


def test_digests_are_xxh3_of_the_landed_bytes_both_ways():
    region = np.frombuffer(bytearray(np.random.default_rng(1).bytes(1 << 20)), dtype=np.uint8)
    base = int(region.ctypes.data)
    for fn in (_native.copy_spans, native.twins.copy_spans):
        dst = [bytearray(70_000), bytearray(10), bytearray(0)]
        spans = [(dst[0], 1000, 70_000, True), (dst[1], 5, 10, False), (dst[2], 0, 0, True)]
        got = fn(spans, base, len(region), True, math.inf)
        assert got == [xxhash.xxh3_64_intdigest(region[1000:71_000].tobytes()), None,
                       xxhash.xxh3_64_intdigest(b"")]
        assert bytes(dst[0]) == region[1000:71_000].tobytes()
        assert bytes(dst[1]) == region[5:15].tobytes()


def test_scatter_writes_the_region_and_hashes_what_landed():
    for fn in (_native.copy_spans, native.twins.copy_spans):
        region = np.zeros(1 << 16, dtype=np.uint8)
        src = bytes(range(256)) * 40
        got = fn([(src, 100, len(src), True)], int(region.ctypes.data), len(region), False,
                 math.inf)
        assert region[100:100 + len(src)].tobytes() == src
        assert got == [xxhash.xxh3_64_intdigest(src)]


def test_expired_deadline_copies_nothing():
    for fn in (_native.copy_spans, native.twins.copy_spans):
        region = np.full(4096, 7, dtype=np.uint8)
        dst = bytearray(100)
        with pytest.raises(TimeoutError):
            fn([(dst, 0, 100, True)], int(region.ctypes.data), len(region), True, 0.0)
        assert dst == bytearray(100)


def test_spans_past_the_clock_stride_copy_intact():
    """More than CHECK_BYTES in one call: the clock is read again mid-call, bytes intact."""
    assert native.CHECK_BYTES == _native.CHECK_BYTES
    rng = np.random.default_rng(2)
    region = np.frombuffer(bytearray(rng.bytes(6 << 20)), dtype=np.uint8)
    for fn in (_native.copy_spans, native.twins.copy_spans):
        dst = [np.empty(1 << 20, dtype=np.uint8) for _ in range(5)]
        got = fn([(d, i << 20, 1 << 20, i % 2 == 0) for i, d in enumerate(dst)],
                 int(region.ctypes.data), len(region), True, math.inf)
        for i, d in enumerate(dst):
            assert d.tobytes() == region[i << 20:(i + 1) << 20].tobytes()
        assert got[1] is None and got[0] == xxhash.xxh3_64_intdigest(dst[0])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_streamed_spans_land_and_hash_like_the_twin(data):
    """Spans of 32 KiB and more take the C version's streaming copy (non-temporal
    stores, an unaligned head and tail copied plainly): at any source or destination
    alignment, both directions, the bytes and digests match the twin's."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    region_bytes = rng.bytes(400_000)
    into = data.draw(st.booleans())
    specs = []
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers((32 << 10) - 70, 150_000))
        off = data.draw(st.integers(0, len(region_bytes) - n))
        skew = data.draw(st.integers(0, 63))  # the destination's (or source's) alignment
        specs.append((n, off, skew, data.draw(st.booleans())))
    results = []
    for fn in (_native.copy_spans, native.twins.copy_spans):
        region = np.frombuffer(bytearray(region_bytes), dtype=np.uint8)
        backing = [bytearray(rng.bytes(n + skew)) if not into else bytearray(n + skew)
                   for n, _, skew, _ in specs]
        bufs = [memoryview(b)[skew:] for b, (_, _, skew, _) in zip(backing, specs)]
        if not into:  # both functions send the same bytes
            for b, (n, off, _, _) in zip(bufs, specs):
                b[:] = region_bytes[off:off + n][::-1]
        got = fn([(b, off, n, w) for b, (n, off, _, w) in zip(bufs, specs)],
                 int(region.ctypes.data), len(region), into, math.inf)
        results.append((got, region.tobytes(), [bytes(b) for b in bufs]))
    assert results[0] == results[1]
    got, region_after, landed = results[0]
    for (n, off, _, w), b, h in zip(specs, landed, got):
        if into:
            assert b == region_bytes[off:off + n]
        assert h == (xxhash.xxh3_64_intdigest(b) if w else None)
