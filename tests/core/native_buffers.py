"""Destination buffers of every kind, good and hostile, for the differential tests of the
native read functions (``pread_spans``, ``pread_records``), and their hypothesis
settings."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings

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
