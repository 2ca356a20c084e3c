"""Shared by the membership-chaos tests (a server killed or restarted, every master down,
changes back to back, all under the oracle workload): which keys a lost server explains,
the foreground p99 of a phase, and the one summary line each test prints and asserts.

Every chaos test reports the same four numbers (issue 12, item 8): wrong values (must be
0), the retention of keys acknowledged before the change (every such key that is not
explained must read back), every miss explained (a key of a killed or removed server's
share), and the oracle's batch-get p99 during the change against quiet, in the same run.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, NamedTuple

from gcache.hashing import placement_hash
from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from gcache.view import View
from handoffops import TOKEN, OracleLoad, ReadBack, put_all


QUIET_S = 1.5  # the oracle's quiet phase, before the change


def quiet_load(c: Client, n_servers: int, keys: list[bytes], size: int
               ) -> tuple[OracleLoad, float]:
    """Once ``c`` routes by ``n_servers`` servers: every key put, then the oracle started
    (its writes paced, 8 every 0.1 s, so memory holds every key) and run quiet for
    ``QUIET_S``. The load (running) and the start of its quiet phase."""
    wait_for(lambda: len(c.view.members) == n_servers, 10)
    put_all(c, keys, size)
    load = OracleLoad(c, keys, size, write_every_s=0.1).start()
    t0 = time.monotonic()
    time.sleep(QUIET_S)
    return load, t0


def owner_ids(view: View, ns: bytes, keys: Iterable[bytes]) -> list[str]:
    """Each key's owner (member id) in ``view``'s ring ('' for an empty ring)."""
    keys = list(keys)
    ring = view.ring
    if not len(ring):
        return [""] * len(keys)
    return [m.id for m in ring.owners([placement_hash(ns, k) for k in keys])]


def share(views: Iterable[View], ns: bytes, keys: Iterable[bytes], member_id: str
          ) -> set[bytes]:
    """The keys ``member_id`` owns in any of ``views``: what its loss explains."""
    keys = list(keys)
    out: set[bytes] = set()
    for v in views:
        out.update(k for k, o in zip(keys, owner_ids(v, ns, keys)) if o == member_id)
    return out


def evictions(addresses: list[str]) -> int:
    """Objects the servers at ``addresses`` evicted (both tiers): a retention claim needs
    0, memory big enough for every key."""
    with Client(addresses, token=TOKEN) as direct:
        return sum(st.get("evictions", 0) + st.get("disk_evictions", 0)
                   for st in direct.stats().values())


def p99_ms(load: OracleLoad, t0: float, t1: float = math.inf) -> float:
    """The p99 (ms) of the oracle's read batches started in ``[t0, t1)``; nan if none."""
    lat = sorted(s for t, s, _ in load.lat if t0 <= t < t1)
    if not lat:
        return math.nan
    return 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def misses_in(load: OracleLoad, t0: float, t1: float = math.inf) -> int:
    """Keys the oracle's read batches started in ``[t0, t1)`` missed."""
    return sum(m for t, _, m in load.lat if t0 <= t < t1)


def missed_between(load: OracleLoad, t0: float, t1: float) -> list[bytes]:
    """Keys the oracle's read batches that started at ``t0`` or later and ended before
    ``t1`` missed (a batch under way at ``t1`` may have seen what happened then)."""
    ends = {t: t + s for t, s, _ in load.lat}
    return [k for t, k in zip(load.missed_at, load.missed) if t >= t0 and ends[t] < t1]


class Report(NamedTuple):
    wrong: int  # wrong values, read back at the end and by the oracle
    acked: int  # keys acknowledged before the change
    expected: int  # ... of those, not explained by a lost server
    retained: int  # ... of those, read back byte-exact at the end
    unexplained_missing: list[bytes]  # acknowledged, not explained, not read back
    misses: int  # the oracle's misses during the run
    unexplained_misses: list[bytes]  # ... of keys no lost server explains
    quiet_p99_ms: float
    during_p99_ms: float

    @property
    def retention(self) -> float:
        return self.retained / self.expected if self.expected else 1.0


def report(name: str, load: OracleLoad, final: ReadBack, acked: list[bytes],
           lost: set[bytes], quiet: tuple[float, float], during: tuple[float, float],
           explained: set[bytes] | None = None) -> Report:
    """Fold a chaos test's run into its ``Report`` and print its summary line: ``final``
    (every acknowledged key read back at the end), ``acked`` (the keys acknowledged
    before the change), ``lost`` (those a lost server's share explains missing at the
    end: empty for a graceful change), ``explained`` (keys whose misses during the run a
    server's absence explains; default ``lost``), ``quiet`` and ``during`` (the phases,
    ``time.monotonic()`` bounds)."""
    explained = lost if explained is None else explained
    missing = set(final.missing)
    wrong = set(final.wrong)
    expected = [k for k in acked if k not in lost]
    retained = sum(1 for k in expected if k not in missing and k not in wrong)
    r = Report(wrong=len(final.wrong) + len(load.wrong), acked=len(acked),
               expected=len(expected), retained=retained,
               unexplained_missing=[k for k in final.missing if k not in lost],
               misses=load.misses,
               unexplained_misses=[k for k in load.missed if k not in explained],
               quiet_p99_ms=p99_ms(load, *quiet), during_p99_ms=p99_ms(load, *during))
    ratio = r.during_p99_ms / r.quiet_p99_ms if r.quiet_p99_ms else math.nan
    gone = sum(1 for k in acked if k in lost and k in missing)
    print(f"\nCHAOS {name}: wrong={r.wrong} retention={100 * r.retention:.1f}% "
          f"({r.retained}/{r.expected} acknowledged before; {r.acked - r.expected} more in a "
          f"lost share, {gone} of them missing) misses={r.misses} of {load.reads} reads "
          f"({r.misses - len(r.unexplained_misses)} explained) "
          f"p99 quiet={r.quiet_p99_ms:.1f}ms during={r.during_p99_ms:.1f}ms (x{ratio:.2f})",
          flush=True)
    return r
