"""Stable hashes for placement, virtual nodes and payload integrity.

Design: every hash in gcache is xxh3_64, never Python ``hash()`` (which is
salted per process). Placement and virtual-node hashes share the fixed
``PLACEMENT_SEED`` so every SDK, server and master process, on any host and
any Python version, computes the same key -> server mapping. Checksums use
seed 0 and hash the caller's buffer in place (no copy).

Placement input is ``namespace + b"\\x00" + key`` (or ``+ group``): the NUL
separator keeps ``(b"a", b"bc")`` and ``(b"ab", b"c")`` apart as long as
namespaces contain no NUL byte.
"""

from __future__ import annotations

from typing import Any

import xxhash

__all__ = ["PLACEMENT_SEED", "placement_hash", "checksum", "vnode_hash"]

#: Seed of every placement and virtual-node hash (ASCII ``"gcacheV1"``).
#: Stable forever: changing it moves every key of every cluster to a new
#: owner (a full reshuffle, i.e. a cluster-wide cold cache), and mixed
#: versions during a rollout would disagree on owners.
PLACEMENT_SEED: int = 0x6763616368655631

_SEP = b"\x00"


def placement_hash(namespace: bytes, key: bytes, group: bytes | None = None) -> int:
    """Return the 64-bit ring position of ``key`` in ``namespace``.

    When ``group`` is given (even ``b""``) the key itself is ignored and the
    hash covers ``namespace`` and ``group`` only, so all keys of one group in
    one namespace land on the same owner. Groups are namespace-scoped: the
    same group name in two namespaces may map to different owners.
    """
    tail = key if group is None else group
    return xxhash.xxh3_64_intdigest(bytes(namespace) + _SEP + bytes(tail), seed=PLACEMENT_SEED)


def checksum(buf: Any) -> int:
    """Return xxh3_64 (seed 0) of a buffer-protocol object, without copying.

    Accepts bytes, bytearray, memoryview and C-contiguous numpy arrays (the
    raw bytes are hashed, so dtype/shape do not matter, only the bytes).
    Raises ValueError for non-contiguous buffers and TypeError for objects
    without the buffer protocol (e.g. ``str``).
    """
    if isinstance(buf, str):
        raise TypeError("checksum() needs a bytes-like object, not str")
    try:
        return xxhash.xxh3_64_intdigest(buf)
    except ValueError as exc:  # e.g. "ndarray is not C-contiguous"
        raise ValueError(f"checksum() needs a C-contiguous buffer: {exc}") from None


def vnode_hash(member_id: str, index: int) -> int:
    """Return the ring position of virtual node ``index`` of ``member_id``.

    Depends only on the member and the index, so a member's vnodes never move
    when other members join or leave (minimal key movement). The encoding
    ``f"{member_id}#{index}"`` is unambiguous because the index is an integer.
    """
    return xxhash.xxh3_64_intdigest(f"{member_id}#{index}".encode(), seed=PLACEMENT_SEED)
