"""Namespace kinds: may a held copy of a key go stale when another server writes the key?

* ``content`` (the default): the key names its value (KV-cache keys are content hashes),
  so every copy of a key holds the same bytes and any held copy stays correct across any
  membership change: a server keeps everything and restarts warm.
* ``mutable``: a key may be written again with other bytes. A copy held by a server
  that did not own the key for a while (it was away, or the key's range had another
  owner) may be older than a value acknowledged elsewhere meanwhile; the server's
  freshness rule (``gcache.server.freshness``) drops or refuses such copies.

Servers name their mutable namespaces with ``mutable_namespaces`` (config option,
``--mutable-namespaces``, ``GCACHE_MUTABLE_NAMESPACES``): a comma-separated list of
globs, matched like the quota file's (``fnmatch``, case-sensitive, ``*`` also matches
``/``); ``"*"`` makes every namespace mutable. Every server of a cluster should be given
the same list.

Lookups are memoised per namespace in a bounded table (namespaces are client-chosen
strings). Only the stdlib and the core are imported.
"""

from __future__ import annotations

import enum
import fnmatch

from gcache.errors import ConfigError

_CACHE_MAX = 4096  # memoised namespace -> kind answers, cleared when full
_MAX_GLOB = 256


class NamespaceKind(str, enum.Enum):
    CONTENT = "content"
    MUTABLE = "mutable"


def parse_globs(text: str) -> tuple[str, ...]:
    """The globs of a ``mutable_namespaces`` value (comma-separated; blanks around an
    entry are ignored, so is an empty value). ConfigError for an over-long entry."""
    globs = tuple(g.strip() for g in text.split(",") if g.strip())
    for g in globs:
        if len(g) > _MAX_GLOB:
            raise ConfigError(f"mutable_namespaces entry {g[:40]!r}... is longer than "
                              f"{_MAX_GLOB} characters; give namespace names or globs")
    return globs


class NamespaceKinds:
    """Which namespaces are ``mutable`` (the rest are ``content``). ``is_mutable`` never
    locks (a racing memo write is harmless: both threads compute the same answer)."""

    def __init__(self, mutable_globs: str | tuple[str, ...] = ()) -> None:
        self.globs = (parse_globs(mutable_globs) if isinstance(mutable_globs, str)
                      else tuple(mutable_globs))
        self.all_mutable = "*" in self.globs
        self._memo: dict[bytes, bool] = {}

    @property
    def any_mutable(self) -> bool:
        return bool(self.globs)

    def is_mutable(self, ns: bytes) -> bool:
        if not self.globs:
            return False
        if self.all_mutable:
            return True
        hit = self._memo.get(ns)
        if hit is None:
            name = ns.decode("utf-8", "surrogateescape")
            hit = any(fnmatch.fnmatchcase(name, g) for g in self.globs)
            if len(self._memo) >= _CACHE_MAX:
                self._memo.clear()
            self._memo[ns] = hit
        return hit

    def kind(self, ns: bytes) -> NamespaceKind:
        return NamespaceKind.MUTABLE if self.is_mutable(ns) else NamespaceKind.CONTENT


__all__ = ["NamespaceKind", "NamespaceKinds", "parse_globs"]
