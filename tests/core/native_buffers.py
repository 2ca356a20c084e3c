"""Destination buffers of every kind, good and hostile, for the differential tests of the
native read functions (``pread_spans``, ``read_staged``, ``pread_records``), the span
lists of the first two, and their hypothesis settings."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# the first four are writable C-contiguous buffers; the rest are refused
KINDS = ("bytearray", "numpy", "numpy_u32", "memoryview", "bytes", "strided", "not_a_buffer")


def make_buffer(kind: str, n: int):
    """A buffer of ``kind`` with at least ``n`` bytes, every byte 0xAA (``bytes``: zeros)."""
    if kind == "bytearray":
        return bytearray(b"\xaa" * n)
    if kind == "numpy":
        return np.full(n, 0xAA, dtype=np.uint8)
    if kind == "numpy_u32":
        return np.full((n + 3) // 4, 0xAAAAAAAA, dtype=np.uint32)
    if kind == "memoryview":
        return memoryview(bytearray(b"\xaa" * n))
    if kind == "bytes":  # read-only
        return bytes(n)
    if kind == "strided":  # not C-contiguous
        return np.full(2 * n + 2, 0xAA, dtype=np.uint8)[::2]
    return 12345


def snapshot(obj) -> bytes | None:
    """The buffer's bytes now (None for a non-buffer)."""
    try:
        return memoryview(obj).tobytes()
    except TypeError:
        return None


def draw_span_specs(draw, size: int, max_n: int, shapes: tuple[str, ...]) -> list[tuple]:
    """Up to 6 ``(shape, kind, n, offset, want_hash)`` specs of spans read from a file of
    ``size`` bytes (``draw``: a hypothesis ``st.composite``'s): offsets inside the file,
    around its ends, or past 2**63; ``shape`` from ``shapes`` (see ``spans_of``)."""
    specs = []
    for _ in range(draw(st.integers(0, 6))):
        shape = draw(st.sampled_from(shapes))
        kind = draw(st.sampled_from(KINDS[:4] * 3 + KINDS[4:]))
        n = draw(st.integers(0, max_n))
        off = draw(st.one_of(st.integers(0, max(0, size - n)), st.integers(-5, size + 50),
                             st.just(1 << 63)))
        specs.append((shape, kind, n, off, draw(st.booleans())))
    return specs


def spans_of(specs: list[tuple]) -> tuple[list, list]:
    """The spans of ``draw_span_specs``'s specs and their buffers: ``(buffer, offset,
    want_hash)``, or malformed by shape (``two``: no want_hash; ``list``: a list, not a
    tuple; ``badint``: a float offset)."""
    spans, bufs = [], []
    for shape, kind, n, off, want in specs:
        buf = make_buffer(kind, n)
        bufs.append(buf)
        spans.append((buf, off) if shape == "two" else [buf, off, want] if shape == "list"
                     else (buf, float(off), want) if shape == "badint" else (buf, off, want))
    return spans, bufs
