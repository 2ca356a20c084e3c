"""``pread_spans``: the C version and its pure-Python twin give the same results.

For random files and span lists (good and hostile: offsets past the end, negative or
huge, read-only, non-contiguous or non-buffer objects, malformed tuples), both
functions end the same way (the same digests and short spans, or the same exception
type) and leave every buffer the same. Plus: digests are xxh3_64 of the bytes read,
values larger than the hash chunk read intact, a file that ends mid-span reports that
span short, and a bad descriptor is an OSError.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from gcache import native

from native_buffers import SETTINGS, draw_span_specs, snapshot, spans_of

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@st.composite
def cases(draw):
    size = draw(st.integers(0, 5000))
    content = draw(st.binary(min_size=size, max_size=size))
    return content, draw_span_specs(draw, size, 900,
                                    ("ok", "ok", "ok", "ok", "two", "list", "badint"))


def run(fn, content: bytes, specs):
    with tempfile.TemporaryFile() as f:
        f.write(content)
        f.flush()
        spans, bufs = spans_of(specs)
        try:
            got = ("ok", fn(f.fileno(), spans))
        except Exception as exc:  # the type is what must match
            got = ("raised", type(exc))
        return got, [snapshot(b) for b in bufs]


@SETTINGS
@given(cases())
def test_native_and_twin_agree_on_any_span_list(case):
    content, specs = case
    c = run(_native.pread_spans, content, specs)
    p = run(native.twins.pread_spans, content, specs)
    assert c == p


def test_digests_are_xxh3_of_the_bytes_read_and_large_spans_land_intact():
    data = np.random.default_rng(3).bytes(3 << 20)
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        for fn in (_native.pread_spans, native.twins.pread_spans):
            big = np.empty((1 << 20) + 12345, dtype=np.uint8)  # several hash chunks
            small, none = bytearray(70_000), bytearray(10)
            digests, short = fn(f.fileno(), [(big, 777, True), (small, 5, True),
                                             (none, 9, False), (bytearray(0), 0, True)])
            assert short == []
            assert big.tobytes() == data[777:777 + big.nbytes]
            assert bytes(small) == data[5:70_005] and bytes(none) == data[9:19]
            assert digests == [xxhash.xxh3_64_intdigest(data[777:777 + big.nbytes]),
                               xxhash.xxh3_64_intdigest(data[5:70_005]), None,
                               xxhash.xxh3_64_intdigest(b"")]


def test_a_file_that_ends_mid_span_reports_that_span_short():
    with tempfile.TemporaryFile() as f:
        f.write(b"x" * 1000)
        f.flush()
        for fn in (_native.pread_spans, native.twins.pread_spans):
            a, b, c = bytearray(500), bytearray(600), bytearray(10)
            digests, short = fn(f.fileno(), [(a, 0, True), (b, 500, True), (c, 2000, False)])
            assert short == [1, 2]
            assert digests[0] == xxhash.xxh3_64_intdigest(b"x" * 500)
            assert digests[1:] == [None, None]
            assert bytes(b[:500]) == b"x" * 500  # what was there landed


def test_a_bad_descriptor_is_an_oserror():
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    for fn in (_native.pread_spans, native.twins.pread_spans):
        with pytest.raises(OSError):
            fn(fd, [(bytearray(10), 0, True)])
        assert fn(fd, []) == ([], [])  # nothing to read: no syscall, no error
