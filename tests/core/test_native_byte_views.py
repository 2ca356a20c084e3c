"""``byte_views``: the C version, its twin and ``as_view`` agree on every buffer kind.

For batches of bytes, bytearrays, memoryviews, numpy arrays of any dtype and shape
(contiguous, strided, Fortran-ordered, read-only) and non-buffers, both give views of
the same bytes with the same format, shape and writability, or raise the same type;
where ``as_view`` takes the batch one by one it agrees too.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache import native
from gcache.sdk.buffers import as_view

_native = pytest.importorskip("gcache._native", reason="the C extension is not built here "
                              "(no compiler or Python headers): nothing to compare")

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@st.composite
def buffer(draw):
    kind = draw(st.sampled_from(["bytes", "bytearray", "mv", "np", "np2d", "strided",
                                 "fortran", "readonly", "empty", "int", "str"]))
    data = draw(st.binary(min_size=0, max_size=64))
    dtype = draw(st.sampled_from([np.uint8, np.int16, np.float32, np.uint64]))
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    if kind == "mv":
        return memoryview(bytearray(data))
    if kind == "empty":
        return np.empty(0, dtype=dtype)
    if kind == "int":
        return 7
    if kind == "str":
        return "text"
    a = np.arange(12, dtype=dtype)
    if kind == "np":
        return a
    if kind == "np2d":
        return a.reshape(3, 4)
    if kind == "strided":
        return a[::2]
    if kind == "fortran":
        return np.asfortranarray(a.reshape(3, 4))
    a.flags.writeable = False
    return a


def outcome(fn, objs, writable):
    try:
        views = fn(objs, writable)
    except Exception as exc:
        return ("raised", type(exc))
    return ("ok", [(v.tobytes(), v.format, v.shape, v.readonly, type(v)) for v in views])


@settings(max_examples=400, deadline=None)
@given(st.lists(buffer(), max_size=6), st.booleans())
def test_native_twin_and_as_view_agree(objs, writable):
    c = outcome(_native.byte_views, objs, writable)
    assert c == outcome(native.twins.byte_views, objs, writable)
    assert c == outcome(lambda o, w: [as_view(b, w) for b in o], objs, writable)
