"""Tests for gcache.testing.oracle: value = f(key), checkable without a shadow copy."""

from __future__ import annotations

import time

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.testing.oracle import GOLDEN, check_value, fill_value, key_hash, value_for

pytestmark = pytest.mark.unit

MASK = (1 << 64) - 1


def reference(key: bytes, size: int) -> bytes:
    """Slow pure-Python definition of the value stream."""
    h = xxhash.xxh3_64_intdigest(key)
    words = b"".join(((h + i * GOLDEN) & MASK).to_bytes(8, "little") for i in range(size // 8 + 1))
    return words[:size]


def test_key_hash_is_xxh3_64() -> None:
    assert key_hash(b"abc") == xxhash.xxh3_64_intdigest(b"abc")


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4097])
def test_value_for_matches_reference(size: int) -> None:
    assert value_for(b"page:1", size) == reference(b"page:1", size)


def test_value_for_is_deterministic_and_key_dependent() -> None:
    assert value_for(b"a", 256) == value_for(b"a", 256)
    assert value_for(b"a", 256) != value_for(b"b", 256)
    assert value_for(b"", 16) == reference(b"", 16)


def test_prefix_consistency() -> None:
    big = value_for(b"k", 5000)
    for n in (0, 1, 8, 13, 4096, 4999):
        assert value_for(b"k", n) == big[:n]


def test_large_value_crosses_internal_chunks() -> None:
    size = (1 << 20) * 3 + 5  # several 1 MiB word chunks plus a tail
    v = value_for(b"big", size)
    assert len(v) == size
    # spot-check words far into the stream against the formula
    h = key_hash(b"big")
    for i in (0, 1, 131071, 131072, 131073, 393215):
        assert v[i * 8 : i * 8 + 8] == ((h + i * GOLDEN) & MASK).to_bytes(8, "little")
    tail_word = size // 8
    assert v[-5:] == ((h + tail_word * GOLDEN) & MASK).to_bytes(8, "little")[:5]
    assert check_value(b"big", v)


@pytest.mark.parametrize("size", [0, 1, 5, 8, 13, 64, 1023])
def test_fill_value_buffer_kinds(size: int) -> None:
    want = value_for(b"kinds", size)
    ba = bytearray(size)
    fill_value(b"kinds", ba)
    assert bytes(ba) == want

    backing = bytearray(size + 3)
    mv = memoryview(backing)[3:]  # unaligned start
    fill_value(b"kinds", mv)
    assert bytes(mv) == want
    assert backing[:3] == b"\0\0\0"

    arr = np.zeros(size, dtype=np.uint8)
    fill_value(b"kinds", arr)
    assert arr.tobytes() == want


def test_fill_value_typed_arrays_and_memoryviews() -> None:
    arr = np.zeros((4, 6), dtype=np.float32)  # 96 bytes, 2-D, non-byte dtype
    fill_value(b"typed", arr)
    assert arr.tobytes() == value_for(b"typed", 96)
    assert check_value(b"typed", arr)

    mv = memoryview(bytearray(40)).cast("I")
    fill_value(b"typed", mv)
    assert mv.tobytes() == value_for(b"typed", 40)


def test_fill_value_torch_bfloat16() -> None:
    torch = pytest.importorskip("torch")
    t = torch.empty((3, 7), dtype=torch.bfloat16)
    fill_value(b"kv", t)
    assert bytes(t.view(torch.uint8).reshape(-1).numpy()) == value_for(b"kv", 42)
    assert check_value(b"kv", t)
    assert not check_value(b"kv2", t)


def test_fill_value_does_not_write_outside() -> None:
    backing = bytearray(b"\xee" * 64)
    fill_value(b"x", memoryview(backing)[5:30])
    assert backing[:5] == b"\xee" * 5
    assert backing[30:] == b"\xee" * 34
    assert bytes(backing[5:30]) == value_for(b"x", 25)


def test_check_value_accepts_good_data() -> None:
    for size in (0, 1, 7, 8, 9, 100, 4096 + 3):
        v = value_for(b"ok", size)
        assert check_value(b"ok", v)
        assert check_value(b"ok", bytearray(v))
        assert check_value(b"ok", memoryview(v))
        assert check_value(b"ok", np.frombuffer(v, dtype=np.uint8))


@pytest.mark.parametrize("pos", [0, 3, 7, 8, 500, 4095, 4096, 4098])
def test_check_value_detects_single_bit_flip(pos: int) -> None:
    v = bytearray(value_for(b"flip", 4099))
    v[pos] ^= 0x10
    assert not check_value(b"flip", v)


def test_check_value_detects_wrong_key_and_shift() -> None:
    v = value_for(b"a", 256)
    assert not check_value(b"b", v)
    assert not check_value(b"a", v[8:])  # shifted by a whole word
    assert not check_value(b"a", v[1:])
    assert not check_value(b"a", b"\0" * 256)
    assert not check_value(b"a", v[:255] + b"\0")  # tail only


def test_offset_slices() -> None:
    big = value_for(b"s", 300)
    for off in range(0, 20):
        for n in (0, 1, 3, 7, 8, 9, 16, 23, 100):
            out = bytearray(n)
            fill_value(b"s", out, offset=off)
            assert bytes(out) == big[off : off + n], (off, n)
            assert check_value(b"s", big[off : off + n], offset=off)
            if n:
                assert not check_value(b"s", big[off : off + n], offset=off + 1)


@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(max_size=64),
    offset=st.integers(min_value=0, max_value=4096),
    size=st.integers(min_value=0, max_value=600),
)
def test_property_slices_match_reference(key: bytes, offset: int, size: int) -> None:
    want = reference(key, offset + size)[offset:]
    out = bytearray(size)
    fill_value(key, out, offset=offset)
    assert bytes(out) == want
    assert check_value(key, want, offset=offset)
    if offset == 0:
        assert value_for(key, size) == want


def test_rejects_bad_buffers_and_arguments() -> None:
    with pytest.raises(ValueError):
        fill_value(b"k", b"immutable")
    with pytest.raises(ValueError):
        fill_value(b"k", memoryview(bytearray(16)).toreadonly())
    with pytest.raises(ValueError):
        fill_value(b"k", np.zeros((4, 4), dtype=np.uint8)[:, 1])  # non-contiguous
    with pytest.raises(ValueError):
        check_value(b"k", memoryview(bytearray(16))[::2])
    with pytest.raises(TypeError):
        fill_value(b"k", [0, 1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        value_for(b"k", -1)
    with pytest.raises(ValueError):
        fill_value(b"k", bytearray(4), offset=-1)


def test_speed_1mib() -> None:
    """fill and check must run at > 1 GB/s on 1 MiB buffers (real speed is ~10x)."""
    buf = bytearray(1 << 20)
    rounds = 50

    def best_rate(fn) -> float:
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(rounds):
                fn(i)
            dt = time.perf_counter() - t0
            best = max(best, rounds * len(buf) / dt / 1e9)
        return best

    assert best_rate(lambda i: fill_value(b"speed", buf)) > 1.0
    assert best_rate(lambda i: check_value(b"speed", buf)) > 1.0
