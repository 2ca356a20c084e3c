"""``checksums``: the C version, its twin and ``gcache.hashing.checksum`` agree.

Both give the xxh3_64 of every buffer (the checksum each object carries end to end), for
bytes, bytearrays, memoryviews and numpy arrays of any contiguous shape and dtype; on bad
input (an object without the buffer protocol, a strided view, a sequence that is not
one) both raise the same exception type, wherever in the batch the bad buffer sits.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import native
from gcache.hashing import checksum

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def _array(data: bytes, dtype: str, cols: int, order: str) -> np.ndarray:
    a = np.frombuffer(data, dtype=np.uint8)
    a = a[: len(a) - len(a) % (np.dtype(dtype).itemsize * cols)].view(dtype)
    return np.array(a.reshape(-1, cols), order=order)


def _big(n: int, seed: int) -> bytes:
    """``n`` random bytes (hypothesis is slow to draw large binaries itself)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


good = st.one_of(
    st.binary(max_size=300),
    st.builds(_big, st.integers(60_000, 140_000), st.integers(0, 2**32 - 1)),
    st.builds(bytearray, st.binary(max_size=100)),
    st.builds(lambda b, a: memoryview(b)[a:], st.binary(max_size=100), st.integers(0, 50)),
    st.builds(_array, st.binary(min_size=0, max_size=400),
              st.sampled_from(["u1", "i2", "f4", "u8"]), st.integers(1, 3),
              st.just("C")),
)
bad = st.one_of(
    st.text(max_size=4), st.integers(), st.none(),
    st.builds(lambda b: memoryview(b)[::2], st.binary(min_size=3, max_size=40)),
    st.builds(lambda b: np.frombuffer(b, dtype=np.uint8).reshape(-1, 2).T,
              st.binary(min_size=4, max_size=40).filter(lambda b: len(b) % 2 == 0)),
)


def outcome(fn, bufs):
    try:
        return ("ok", fn(bufs))
    except Exception as exc:
        return ("raised", type(exc))


@settings(max_examples=300, deadline=None)
@given(st.lists(good, max_size=10))
def test_both_are_the_checksum_of_every_buffer(bufs):
    want = [checksum(np.ascontiguousarray(b).view(np.uint8).reshape(-1)
                     if isinstance(b, np.ndarray) else b) for b in bufs]
    assert _native.checksums(bufs) == want
    assert native.twins.checksums(bufs) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(good, max_size=6), bad, st.integers(0, 6), st.sampled_from([list, tuple]))
def test_native_and_twin_refuse_alike(bufs, wrong, at, kind):
    bufs = kind(bufs[:at] + [wrong] + bufs[at:])
    assert outcome(_native.checksums, bufs) == outcome(native.twins.checksums, bufs)
    assert outcome(_native.checksums, bufs)[0] == "raised"


@pytest.mark.parametrize("arg", [5, None, b"not a sequence of buffers"[0]])
def test_a_batch_that_is_not_a_sequence_is_a_type_error(arg):
    for fn in (_native.checksums, native.twins.checksums):
        with pytest.raises(TypeError):
            fn(arg)
