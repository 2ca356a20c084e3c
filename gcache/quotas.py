"""Per-namespace quotas: how many memory and disk bytes a namespace may hold on a server.

Design. Servers read one quota file (``--quota-file``, ``GCACHE_QUOTA_FILE``), TOML,
one ``[[quota]]`` table per namespace glob::

    [[quota]]
    namespaces = "team-a/*"      # fnmatch glob, case-sensitive; '*' also matches '/'
    memory_bytes = "256MiB"      # chunk bytes in the memory tier (optional)
    disk_bytes = "4GiB"          # record bytes in the NVMe tier (optional)

    [[quota]]
    namespaces = "scratch/*"
    memory_bytes = "64MiB"       # no disk_bytes: unlimited on disk (within the tier)

The first table whose glob matches a namespace decides both of its limits (a missing
field is unlimited on that tier); a namespace no table matches is unlimited. Sizes are
parsed strictly (``gcache.config.parse_size``). Quotas are per server: each server
enforces its own copy of the file on what it stores.

What counts: in memory, the slab chunk of every object of the namespace, committed or
not (puts in flight, ALLOC slots and quarantined chunks: reservations count against
the writer's quota); on disk, the 4 KiB-aligned record bytes of its live records.

``QuotaStore`` holds the current table; ``reload()`` (SIGHUP, with the credentials)
swaps in a new one only if the file parses, and bumps ``generation`` so the tiers
re-check who is over. Lookups are memoised per namespace in a bounded table
(namespaces are client-chosen strings): at most ``_CACHE_MAX`` answers, cleared when full.

Only the stdlib and the core are imported (the core is the bottom layer).
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import os
import threading
import tomllib
from typing import Any, NamedTuple

from gcache.config import parse_size
from gcache.errors import ConfigError

log = logging.getLogger("gcache.quotas")

_CACHE_MAX = 4096  # memoised namespace -> limits answers per table
_KEYS = ("namespaces", "memory_bytes", "disk_bytes")


class QuotaLimits(NamedTuple):
    """One namespace's limits in bytes; None = unlimited on that tier."""

    memory_bytes: int | None = None
    disk_bytes: int | None = None
    pattern: str = ""  # the glob that matched ('' = none)


UNLIMITED = QuotaLimits()


class Quota(NamedTuple):
    pattern: str
    memory_bytes: int | None
    disk_bytes: int | None


def _err(path: str, where: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"quota file {path}: {where}: {problem}; {fix}")


def parse_quotas(data: Any, path: str = "<quotas>") -> tuple[Quota, ...]:
    """Validate a parsed quota document; ConfigError names the entry and the fix."""
    if not isinstance(data, dict):
        raise _err(path, "top level", "not a table", "write [[quota]] tables")
    for key in data:
        if key != "quota":
            close = difflib.get_close_matches(key, ("quota",), n=1)
            raise _err(path, "top level", f"unknown key {key!r}",
                       f"did you mean {close[0]!r}?" if close else "write [[quota]] tables")
    entries = data.get("quota", [])
    if not isinstance(entries, list):
        raise _err(path, "top level", "quota is not a list of tables", "write [[quota]] tables")
    out: list[Quota] = []
    for i, ent in enumerate(entries, 1):
        where = f"quota #{i}"
        if not isinstance(ent, dict):
            raise _err(path, where, "not a table", "write it as a [[quota]] table")
        for key in ent:
            if key not in _KEYS:
                close = difflib.get_close_matches(key, _KEYS, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(_KEYS)}"
                raise _err(path, where, f"unknown key {key!r}", f"{hint} (remove or rename it)")
        pattern = ent.get("namespaces")
        if not isinstance(pattern, str) or not pattern or len(pattern) > 256:
            raise _err(path, where, f"namespaces {pattern!r} is missing or not a glob",
                       'give one glob string such as "team-a/*" (or "*" for all)')
        where = f"quota #{i} (namespaces {pattern!r})"
        limits: dict[str, int | None] = {}
        for name in ("memory_bytes", "disk_bytes"):
            raw = ent.get(name)
            if raw is None:
                limits[name] = None
                continue
            try:
                limits[name] = parse_size(raw)
            except ConfigError as exc:
                raise _err(path, where, f"{name}: {exc}",
                           "use a byte count or a size such as '256MiB' or '4GiB'") from None
        if limits["memory_bytes"] is None and limits["disk_bytes"] is None:
            raise _err(path, where, "limits nothing",
                       "give memory_bytes and/or disk_bytes, or remove the table")
        out.append(Quota(pattern, limits["memory_bytes"], limits["disk_bytes"]))
    return tuple(out)


def load_quotas(path: str | os.PathLike[str]) -> tuple[Quota, ...]:
    """Read and validate a quota file (ConfigError saying what to fix)."""
    label = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read quota file {label}: {exc.strerror}; "
                          "fix the path or the permissions") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"quota file {label} is not valid TOML ({exc}); fix it") from None
    return parse_quotas(data, label)


class QuotaTable:
    """One immutable generation of quotas, with a bounded per-namespace memo."""

    def __init__(self, quotas: tuple[Quota, ...] = ()) -> None:
        self.quotas = quotas
        self._memo: dict[bytes, QuotaLimits] = {}

    def limits(self, ns: bytes) -> QuotaLimits:
        hit = self._memo.get(ns)
        if hit is None:
            hit = UNLIMITED
            if self.quotas:
                name = ns.decode("utf-8", "surrogateescape")
                for q in self.quotas:
                    if fnmatch.fnmatchcase(name, q.pattern):
                        hit = QuotaLimits(q.memory_bytes, q.disk_bytes, q.pattern)
                        break
            if len(self._memo) >= _CACHE_MAX:
                self._memo.clear()
            self._memo[ns] = hit
        return hit


class QuotaStore:
    """The live quotas of one server. ``limits(ns)`` never locks; ``reload()`` on SIGHUP."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self.table = QuotaTable(load_quotas(path) if path else ())
        self.generation = 0  # bumped by every successful reload
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self.table.quotas)

    def limits(self, ns: bytes) -> QuotaLimits:
        return self.table.limits(ns)

    def reload(self) -> bool:
        """Re-read the file; on any error keep the current quotas and log why."""
        if not self.path:
            return False
        with self._lock:
            try:
                quotas = load_quotas(self.path)
            except ConfigError as exc:
                log.error("quota reload failed, keeping the previous %d quotas: %s",
                          len(self.table.quotas), exc)
                return False
            self.table = QuotaTable(quotas)
            self.generation += 1
        log.info("quotas reloaded from %s: %d quotas (%s)", self.path, len(quotas),
                 ", ".join(q.pattern for q in quotas))
        return True


__all__ = ["Quota", "QuotaLimits", "QuotaStore", "QuotaTable", "UNLIMITED", "load_quotas",
           "parse_quotas"]
