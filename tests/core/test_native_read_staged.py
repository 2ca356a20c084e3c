"""``read_staged``: ``pread_spans`` that copies from a mapping of the file, and survives
the file shrinking under it.

The C version copies each span inside the mapping with a memcpy; a file shrunk under
the mapping faults (SIGBUS), which its guard turns into a short span. The twin preads
every span. For random files, mappings and span lists (good and hostile), the C
version, the twin and ``pread_spans`` end the same way and leave every buffer the same.
A file cut under the mapping reports exactly the spans past its end short, in the C
version and the twin. Threads copying while another thread cuts and regrows the file
never bring the process down, and a SIGBUS that is no copy's still ends it (these two
in a child process, so a broken guard cannot take the test runner with it).
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

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
    size = draw(st.integers(0, 20_000))
    content = draw(st.binary(min_size=size, max_size=size))
    mapped = draw(st.integers(0, size))  # the mapping covers the file's first bytes
    return content, mapped, draw_span_specs(draw, size, 9000,
                                            ("ok", "ok", "ok", "ok", "two", "badint"))


def run(fn, content: bytes, mapped: int, specs):
    """``fn`` over a file of ``content`` (``read_staged`` with a mapping of its first
    ``mapped`` bytes, or None when that is 0; ``pread_spans`` without): what it returned
    or the type it raised, and every buffer's bytes after."""
    with tempfile.TemporaryFile() as f:
        f.write(content)
        f.flush()
        m = mmap.mmap(f.fileno(), mapped, mmap.MAP_SHARED, mmap.PROT_READ) if mapped else None
        spans, bufs = spans_of(specs)
        try:
            if fn is _native.pread_spans:
                got = ("ok", fn(f.fileno(), spans))
            else:
                got = ("ok", fn(f.fileno(), m, spans))
        except Exception as exc:  # the type is what must match
            got = ("raised", type(exc))
        finally:
            if m is not None:
                m.close()
        return got, [snapshot(b) for b in bufs]


@SETTINGS
@given(cases())
def test_native_twin_and_pread_spans_agree_on_any_span_list(case):
    content, mapped, specs = case
    c = run(_native.read_staged, content, mapped, specs)
    assert c == run(native.twins.read_staged, content, mapped, specs)
    assert c == run(_native.pread_spans, content, mapped, specs)


def test_a_mapping_that_is_no_contiguous_buffer_is_a_typeerror():
    with tempfile.TemporaryFile() as f:
        f.write(b"x" * 100)
        f.flush()
        for fn in (_native.read_staged, native.twins.read_staged):
            for bad in (12345, "text", np.zeros(10, dtype=np.uint8)[::2]):
                with pytest.raises(TypeError, match="mapping"):
                    fn(f.fileno(), bad, [(bytearray(10), 0, True)])
            assert fn(f.fileno(), None, [(bytearray(10), 0, False)]) == ([None], [])


def _cut_file(path: str, data: bytes, cut: int):
    """``data`` written to ``path``, mapped whole, then the file cut to ``cut`` bytes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data)
    m = mmap.mmap(fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ)
    os.ftruncate(fd, cut)
    return fd, m


@pytest.mark.parametrize("where", ["/dev/shm", None])  # tmpfs (staging files) and /tmp
def test_a_file_cut_under_the_mapping_reports_the_spans_past_its_end_short(where):
    data = np.random.default_rng(5).bytes(1 << 20)
    with tempfile.TemporaryDirectory(dir=where) as d:
        fd, m = _cut_file(os.path.join(d, "stage"), data, 5 << 16)  # page-aligned cut
        try:
            before = signal.getsignal(signal.SIGBUS)
            for fn in (_native.read_staged, native.twins.read_staged):
                bufs = [bytearray(1 << 16) for _ in range(16)]
                digests, short = fn(fd, m, [(b, i << 16, True) for i, b in enumerate(bufs)])
                assert short == list(range(5, 16))
                assert digests[5:] == [None] * 11
                for i in range(5):
                    want = data[i << 16:(i + 1) << 16]
                    assert bytes(bufs[i]) == want
                    assert digests[i] == xxhash.xxh3_64_intdigest(want)
            # the guard's handler is there only while a copy runs
            assert signal.getsignal(signal.SIGBUS) == before
        finally:
            m.close()
            os.close(fd)


def _child(code: str, timeout: float) -> subprocess.CompletedProcess:
    """``code`` in a child Python, its files in a /dev/shm directory (``sys.argv[1]``)
    that this process removes whatever the child did, crash included."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), d],
                              capture_output=True, text=True, timeout=timeout)


def test_threads_copying_while_the_file_is_cut_and_regrown_stay_alive():
    """Four threads copy 64 KiB spans from one mapping while a fifth cuts the file and
    grows it back, 3,000 times: the process lives, every span is whole or short, and
    each whole span's digest is of the bytes that landed."""
    r = _child("""
        import mmap, os, sys, threading, xxhash
        from gcache import _native
        size = 16 << 16
        path = os.path.join(sys.argv[1], "stage")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, os.urandom(size))
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        stop = threading.Event()
        seen = {"short": 0, "whole": 0, "bad": 0}
        lock = threading.Lock()
        def copier():
            bufs = [bytearray(1 << 16) for _ in range(16)]
            while not stop.is_set():
                digests, short = _native.read_staged(
                    fd, m, [(b, i << 16, True) for i, b in enumerate(bufs)])
                with lock:
                    seen["short"] += len(short)
                    for i, dg in enumerate(digests):
                        if i not in short:
                            seen["whole"] += 1
                            seen["bad"] += dg != xxhash.xxh3_64_intdigest(bufs[i])
        threads = [threading.Thread(target=copier) for _ in range(4)]
        for t in threads:
            t.start()
        for k in range(3000):
            os.ftruncate(fd, (k % 16) << 16)
            os.ftruncate(fd, size)
        stop.set()
        for t in threads:
            t.join()
        m.close(); os.close(fd)
        print(seen["short"], seen["whole"], seen["bad"])
    """, 90)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    short, whole, bad = (int(x) for x in r.stdout.split())
    assert short > 0 and whole > 0 and bad == 0, r.stdout


def test_a_sigbus_that_is_no_copys_still_ends_the_process():
    """While threads copy from a mapping (the guard's handler installed), the main thread
    touches a cut mapping of another file outside any copy: the fault is not the
    guard's, so the process dies of SIGBUS as it would have without the guard (it must
    not hang re-faulting, nor go on as if nothing happened)."""
    r = _child("""
        import mmap, os, sys, threading
        from gcache import _native
        d = sys.argv[1]
        fd = os.open(os.path.join(d, "busy"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 64 << 20)
        m = mmap.mmap(fd, 64 << 20, mmap.MAP_SHARED, mmap.PROT_READ)
        go = threading.Event()
        def copier():
            buf = bytearray(1 << 20)
            spans = [(buf, i << 20, True) for i in range(64)]
            go.set()
            while True:
                _native.read_staged(fd, m, spans)
        threading.Thread(target=copier, daemon=True).start()
        go.wait()
        other = os.open(os.path.join(d, "other"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(other, 1 << 16)
        victim = mmap.mmap(other, 1 << 16, mmap.MAP_SHARED, mmap.PROT_READ)
        os.ftruncate(other, 0)
        print("touching", flush=True)
        print(memoryview(victim)[100], flush=True)  # past the cut file's end: SIGBUS
        print("survived", flush=True)
    """, 60)
    assert "touching" in r.stdout and "survived" not in r.stdout, r.stdout
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stderr[-2000:])
