"""``pread_records``: the C version and its pure-Python twin give the same results.

For random files and span lists (good and hostile: offsets past the end, negative or
huge, descriptors closed or out of range, hash ranges outside the buffer, read-only,
non-contiguous or non-buffer objects, malformed tuples), both functions end the same
way (the same digests and failures, or the same exception type) and leave every buffer
the same. Plus: each digest is xxh3_64 of the span's hash range of the bytes read, a
failed span does not stop the others, and the disk tier's O_DIRECT reads land intact.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from gcache import native

from native_buffers import KINDS, SETTINGS, make_buffer, snapshot

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]
FNS = (_native.pread_records, native.twins.pread_records)


@st.composite
def cases(draw):
    sizes = [draw(st.integers(0, 3000)) for _ in range(2)]
    contents = [draw(st.binary(min_size=n, max_size=n)) for n in sizes]
    specs = []
    for _ in range(draw(st.integers(0, 6))):
        shape = draw(st.sampled_from(("ok", "ok", "ok", "ok", "four", "list", "badint",
                                      "badfd")))
        kind = draw(st.sampled_from(KINDS[:4] * 3 + KINDS[4:]))
        fd = draw(st.sampled_from(("a", "b", "a", "b", "closed", "huge", "negative")))
        n = draw(st.integers(0, 900))
        off = draw(st.one_of(st.integers(0, 3000), st.integers(-5, 3050), st.just(1 << 63)))
        hfrom = draw(st.integers(-2, n + 2))
        hto = draw(st.one_of(st.integers(max(0, hfrom), max(0, hfrom, n)),
                             st.integers(-2, n + 50)))
        specs.append((shape, kind, fd, n, off, hfrom, hto))
    return contents, specs


def run(fn, contents: list[bytes], specs):
    files = [tempfile.TemporaryFile() for _ in contents]
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    try:
        fds = {}
        for name, f, content in zip("ab", files, contents):
            f.write(content)
            f.flush()
            fds[name] = f.fileno()
        fds.update(closed=closed, huge=1 << 40, negative=-3)
        spans, bufs = [], []
        for shape, kind, fd, n, off, hfrom, hto in specs:
            buf = make_buffer(kind, n)
            bufs.append(buf)
            t = (fds[fd], buf, off, hfrom, hto)
            if shape == "four":
                t = t[:4]
            elif shape == "list":
                t = list(t)
            elif shape == "badint":
                t = (fds[fd], buf, float(off), hfrom, hto)
            elif shape == "badfd":
                t = (str(fds[fd]), buf, off, hfrom, hto)
            spans.append(t)
        try:
            got = ("ok", fn(spans))
        except Exception as exc:  # the type is what must match
            got = ("raised", type(exc))
        return got, [snapshot(b) for b in bufs]
    finally:
        for f in files:
            f.close()


@SETTINGS
@given(cases())
def test_native_and_twin_agree_on_any_span_list(case):
    contents, specs = case
    assert run(_native.pread_records, *case) == run(native.twins.pread_records, contents,
                                                    specs)


def test_digests_cover_the_hash_range_and_a_failed_span_does_not_stop_the_others():
    data = np.random.default_rng(5).bytes(1 << 20)
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        closed = os.open(os.devnull, os.O_RDONLY)  # after the file: its number is free
        os.close(closed)
        for fn in FNS:
            a, b, c, d = bytearray(70_000), bytearray(100), bytearray(10), bytearray(4096)
            digests, failed = fn([(f.fileno(), a, 123, 40, 70_000), (closed, b, 0, 0, 100),
                                  (f.fileno(), c, (1 << 20) - 4, 0, 10),
                                  (f.fileno(), d, 4096, 0, 0)])
            assert failed == [(1, errno.EBADF), (2, 0)]  # a bad fd; the file ended first
            assert bytes(a) == data[123:70_123] and bytes(d) == data[4096:8192]
            assert bytes(c[:4]) == data[-4:]  # what was there landed
            assert digests == [xxhash.xxh3_64_intdigest(data[163:70_123]), None, None,
                               xxhash.xxh3_64_intdigest(b"")]


def test_o_direct_reads_into_page_aligned_buffers_land_intact(tmp_path):
    data = np.random.default_rng(6).bytes(256 << 10)
    path = tmp_path / "segment"
    path.write_bytes(data)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:  # tmpfs and some overlay filesystems refuse O_DIRECT
        pytest.skip(f"O_DIRECT is not supported here: {exc}")
    try:
        for fn in FNS:
            bufs = [mmap.mmap(-1, 64 << 10) for _ in range(3)]
            digests, failed = fn([(fd, bufs[0], 0, 0, 65536), (fd, bufs[1], 128 << 10, 512,
                                                                  60000),
                                  (fd, bufs[2], 192 << 10, 0, 4096)])
            assert failed == []
            assert bufs[1][:] == data[128 << 10:192 << 10]
            assert digests == [xxhash.xxh3_64_intdigest(data[:65536]),
                               xxhash.xxh3_64_intdigest(data[(128 << 10) + 512:
                                                             (128 << 10) + 60000]),
                               xxhash.xxh3_64_intdigest(data[192 << 10:(192 << 10) + 4096])]
            for b in bufs:
                b.close()
    finally:
        os.close(fd)
