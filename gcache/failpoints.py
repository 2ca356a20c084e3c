"""Failpoints: named fault injection for tests, off by default and ~free when off.

Design. Code that can fail in production (disk writes, reads, space
allocation) asks ``failpoint("disk_write")`` at the spot where the fault
would surface. With no failpoints configured that is one dict truthiness
test. Tests switch points on through the ``failpoints`` option (env
``GCACHE_FAILPOINTS``, flag ``--failpoints``), which real server processes
read at start, or in-process through ``configure``.

Spec grammar (comma-separated entries; an entry may repeat a name to replace it)::

    entry  := NAME [ "=" arg { ":" arg } ]
    arg    := ACTION           a word: eio, enospc, corrupt, ... (default "on")
            | PROBABILITY      a number in (0, 1]: fire with this chance (default 1)
            | COUNT "x"        fire at most COUNT times, then stay quiet ("3x")

    GCACHE_FAILPOINTS="disk_write=eio,disk_full,disk_read_corrupt=0.5,disk_write=eio:3x"

The random draws come from one ``random.Random`` seeded with 0 (or the
``seed=N`` entry), so a test run is reproducible. ``os_error`` maps the
errno-like actions (``eio``, ``enospc``) to the ``OSError`` a real disk
would raise, so injected faults take exactly the production error path.
"""

from __future__ import annotations

import errno
import os
import random
import re
import threading
from dataclasses import dataclass

from gcache.errors import ConfigError

__all__ = ["configure", "failpoint", "fired", "os_error", "parse", "Failpoint"]

_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
_ACTION_RE = re.compile(r"[a-z][a-z0-9_]*")
_COUNT_RE = re.compile(r"([0-9]+)x")
_ERRNOS = {"eio": errno.EIO, "enospc": errno.ENOSPC, "erofs": errno.EROFS,
           "enodev": errno.ENODEV}


@dataclass(slots=True)
class Failpoint:
    """One armed failpoint: what it does, how often, how many times it may still fire."""

    name: str
    action: str = "on"
    probability: float = 1.0
    remaining: int | None = None  # None = unlimited
    fired: int = 0


_points: dict[str, Failpoint] = {}
_fired_total: dict[str, int] = {}
_rng = random.Random(0)
_lock = threading.Lock()


def parse(spec: str | None) -> tuple[dict[str, Failpoint], int]:
    """Parse a spec into ``({name: Failpoint}, seed)``; raise ConfigError saying what to fix."""
    points: dict[str, Failpoint] = {}
    seed = 0
    for raw in (spec or "").split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, _, args = entry.partition("=")
        name = name.strip()
        if name == "seed":
            if not args.strip().isdigit():
                raise ConfigError(f"failpoint seed {args!r} is not a whole number; "
                                  "write seed=N")
            seed = int(args)
            continue
        if not _NAME_RE.fullmatch(name):
            raise ConfigError(f"bad failpoint name {name!r} in {spec!r}; use lower_case names "
                              "such as disk_write")
        fp = Failpoint(name)
        for arg in (a.strip() for a in args.split(":")) if args else ():
            if m := _COUNT_RE.fullmatch(arg):
                fp.remaining = int(m[1])
            elif _ACTION_RE.fullmatch(arg):
                fp.action = arg
            else:
                try:
                    p = float(arg)
                except ValueError:
                    p = -1.0
                if not 0.0 < p <= 1.0:
                    raise ConfigError(f"bad failpoint argument {arg!r} for {name}; use an "
                                      "action word (eio), a probability in (0, 1] or a "
                                      "count such as 3x")
                fp.probability = p
        points[name] = fp
    return points, seed


def configure(spec: str | None) -> None:
    """Replace every failpoint with ``spec`` (None or "" switches them all off)."""
    global _rng
    points, seed = parse(spec)
    with _lock:
        _points.clear()
        _points.update(points)
        _fired_total.clear()
        _rng = random.Random(seed)


def failpoint(name: str) -> str | None:
    """The failpoint's action if it fires now, else None. One dict test when all are off."""
    if not _points:
        return None
    with _lock:
        fp = _points.get(name)
        if fp is None or fp.remaining == 0:
            return None
        if fp.probability < 1.0 and _rng.random() >= fp.probability:
            return None
        if fp.remaining is not None:
            fp.remaining -= 1
        fp.fired += 1
        _fired_total[name] = _fired_total.get(name, 0) + 1
        return fp.action


def os_error(name: str, default: str = "eio", what: str = "") -> None:
    """Raise the OSError a failing disk would raise if ``name`` fires now.

    The action picks the errno (``eio``, ``enospc``, ...); other actions use ``default``.
    """
    action = failpoint(name)
    if action is None:
        return
    code = _ERRNOS.get(action, _ERRNOS[default])
    raise OSError(code, f"{os.strerror(code)} (failpoint {name}{': ' + what if what else ''})")


def fired(name: str) -> int:
    """How many times ``name`` fired since the last ``configure``."""
    with _lock:
        return _fired_total.get(name, 0)
