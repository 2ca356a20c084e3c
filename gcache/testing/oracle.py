"""Value oracle: the value stored under a key is a pure function of the key.

Design: tests and benchmarks never keep a shadow copy of what they wrote.
Every value is generated from ``h = xxh3_64(key)`` as a stream of
little-endian uint64 words ``w[i] = (h + i * 0x9E3779B97F4A7C15) mod 2**64``,
truncated to the requested length, so any read can be checked against the key
alone. Word ``i`` depends only on its position, which gives two properties:

* prefix consistency: ``value_for(k, n)[:m] == value_for(k, m)`` for m <= n;
* slices are checkable on their own (``offset=`` on fill/check), which is
  what a sliced read of a large object needs.

The length is deliberately *not* mixed into the hash: a caller that expects
``size`` bytes compares the length itself (the SDK reports SIZE_MISMATCH).

Everything is vectorised with numpy: one ``np.add`` of a cached
``arange * K`` block per chunk, so filling or checking runs at memory speed
(tens of GB/s for 1 MiB buffers) and never loops over bytes in Python.
Buffers can be anything exposing the buffer protocol (bytes, bytearray,
memoryview, mmap), numpy arrays of any dtype, or CPU torch tensors of any
dtype (bfloat16 included; torch is only used if already imported); they must
be C-contiguous.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import xxhash

__all__ = ["GOLDEN", "check_value", "fill_value", "key_hash", "value_for"]

GOLDEN = 0x9E3779B97F4A7C15
"""Per-word increment (2**64 / golden ratio, odd, so words never repeat)."""

_WORD = np.dtype("<u8")
_CHUNK_WORDS = 1 << 17  # 1 MiB of words per vectorised step
_MASK = (1 << 64) - 1

# K * arange(_CHUNK_WORDS) mod 2**64, built once (uint64 multiply wraps).
_BASE: np.ndarray = np.arange(_CHUNK_WORDS, dtype=np.uint64) * np.uint64(GOLDEN)
_BASE.flags.writeable = False


def key_hash(key: bytes) -> int:
    """The 64-bit seed of a key's value stream (xxh3_64 of the key)."""
    return xxhash.xxh3_64_intdigest(key)


def _word(h: int, i: int) -> int:
    return (h + i * GOLDEN) & _MASK


def _as_bytes_array(buf: Any, *, writable: bool) -> np.ndarray:
    """View ``buf`` as a flat uint8 array without copying."""
    torch = sys.modules.get("torch")
    if isinstance(buf, np.ndarray):
        arr = buf
        if arr.dtype.hasobject:
            raise TypeError("object arrays have no byte representation")
    elif torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"tensor must live on the CPU, not {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("buffer must be C-contiguous")
        # view as uint8 first: .numpy() rejects bfloat16 and friends.
        arr = buf.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        try:
            mv = memoryview(buf)
        except TypeError as exc:
            raise TypeError(
                f"expected a buffer, numpy array or CPU tensor, got {type(buf).__name__}"
            ) from exc
        if not mv.c_contiguous:
            raise ValueError("buffer must be C-contiguous")
        arr = np.frombuffer(mv.cast("B"), dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("buffer is read-only")
    return arr.reshape(-1).view(np.uint8)


def _check_offset(offset: int) -> None:
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")


def _tail_bytes(h: int, word_index: int, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` (0 <= start <= stop <= 8) of word ``word_index``."""
    return _word(h, word_index).to_bytes(8, "little")[start:stop]


def _fill_words(h: int, first_word: int, out_words: np.ndarray) -> None:
    """out_words[j] = w[first_word + j] for the whole (possibly unaligned) view."""
    n = out_words.shape[0]
    done = 0
    while done < n:
        m = min(_CHUNK_WORDS, n - done)
        start = np.uint64(_word(h, first_word + done))
        np.add(_BASE[:m], start, out=out_words[done : done + m])
        done += m


def _words_equal(h: int, first_word: int, words: np.ndarray) -> bool:
    n = words.shape[0]
    done = 0
    while done < n:
        m = min(_CHUNK_WORDS, n - done)
        start = np.uint64(_word(h, first_word + done))
        if not np.array_equal(words[done : done + m], _BASE[:m] + start):
            return False
        done += m
    return True


def _split(offset: int, length: int) -> tuple[int, int, int, int]:
    """Split byte range [offset, offset+length) of the stream into
    (head_len, first_full_word, n_full_words, tail_len)."""
    misalign = offset % 8
    head = 0 if misalign == 0 else min(8 - misalign, length)
    first_word = (offset + head) // 8
    n_words = (length - head) // 8
    tail = length - head - n_words * 8
    return head, first_word, n_words, tail


def fill_value(key: bytes, out: memoryview | np.ndarray | Any, *, offset: int = 0) -> None:
    """Fill ``out`` with bytes ``[offset, offset + len(out))`` of the key's value.

    ``out`` may have any length (not necessarily a multiple of 8) and any
    alignment. With the default ``offset=0`` the result equals
    ``value_for(key, nbytes(out))``.
    """
    _check_offset(offset)
    dst = _as_bytes_array(out, writable=True)
    length = dst.shape[0]
    if length == 0:
        return
    h = key_hash(key)
    head, first_word, n_words, tail = _split(offset, length)
    if head:
        m = offset % 8
        dst[:head] = np.frombuffer(_tail_bytes(h, offset // 8, m, m + head), np.uint8)
    if n_words:
        words = dst[head : head + n_words * 8].view(_WORD)
        _fill_words(h, first_word, words)
    if tail:
        dst[length - tail :] = np.frombuffer(
            _tail_bytes(h, first_word + n_words, 0, tail), np.uint8
        )


def value_for(key: bytes, size: int) -> bytes:
    """The ``size``-byte value of ``key`` as a new ``bytes`` object."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    n_words = -(-size // 8)
    words = np.empty(n_words, dtype=_WORD)
    _fill_words(key_hash(key), 0, words)
    return words.view(np.uint8)[:size].tobytes()


def check_value(key: bytes, buf: Any, *, offset: int = 0) -> bool:
    """True when ``buf`` holds exactly bytes ``[offset, offset + len(buf))``
    of the key's value. The caller checks the length it expected."""
    _check_offset(offset)
    src = _as_bytes_array(buf, writable=False)
    length = src.shape[0]
    if length == 0:
        return True
    h = key_hash(key)
    head, first_word, n_words, tail = _split(offset, length)
    if head:
        m = offset % 8
        if src[:head].tobytes() != _tail_bytes(h, offset // 8, m, m + head):
            return False
    if tail:
        if src[length - tail :].tobytes() != _tail_bytes(h, first_word + n_words, 0, tail):
            return False
    if n_words:
        words = src[head : head + n_words * 8].view(_WORD)
        if not _words_equal(h, first_word, words):
            return False
    return True
