"""A resident object as an eviction policy sees it (identity, read-only fields), for
tests that drive a policy alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Obj:
    ns: bytes
    key: bytes
    length: int = 100
    chunk: int = 4096
    version: int = 1
    parent: bytes | None = None


def keys_of(it) -> list[bytes]:  # noqa: ANN001 - any iterable of objects
    return [o.key for o in it]
