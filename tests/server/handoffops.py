"""Shared by the handoff tests: a cluster with masters, the oracle workload that runs
during a membership change, and waits on the members' handoff numbers (their heartbeats'
stats, read from the masters' /status)."""

from __future__ import annotations

import random
import threading
import time
from typing import NamedTuple

from gcache.discovery import MasterClient
from gcache.sdk import Client, Status
from gcache.testing.cluster import Cluster, ServerProc
from gcache.testing.oracle import check_value, value_for
from gcache.testing.waiting import wait_for

TOKEN = "tok"


def start_cluster(make_cluster, n: int, memory: str, **kw) -> Cluster:
    """``n`` servers and 3 masters, all servers up in the view."""
    cl = make_cluster(n, memory, masters=3, token=TOKEN, **kw)
    wait_for(lambda: len(up_members(cl)) == n, 30)
    return cl


def masters(cl: Cluster) -> MasterClient:
    return MasterClient(cl.master_addresses, TOKEN)


def up_members(cl: Cluster) -> list[str]:
    return [m["id"] for m in masters(cl).view()["members"] if m["state"] == "up"]


def add_server(cl: Cluster, name: str) -> ServerProc:
    """One more server like the cluster's (same flags, same masters), started; closed with
    the cluster."""
    return cl.add_server(name)


def member(cl: Cluster, member_id: str) -> dict:
    """The member's /status row, once it carries its stats (a new leader has none until
    the member's next heartbeat)."""
    def row() -> dict | None:
        m = next(m for m in masters(cl).status()["members"] if m["id"] == member_id)
        return m if "handoff_passes" in (m.get("stats") or {}) else None

    return wait_for(row, 10)


def handoff_done(row: dict, epoch: int) -> bool:
    """A member's /status row: a handoff pass at ``epoch`` or later finished with nothing
    left."""
    st = row.get("stats") or {}
    return (st.get("handoff_epoch", -1) >= epoch and not st.get("handoff_active")
            and st.get("handoff_objects_left", 1) == 0)


def put_all(c: Client, keys: list[bytes], size: int, batch: int = 64) -> None:
    for i in range(0, len(keys), batch):
        ks = keys[i:i + batch]
        st = c.put_batch(ks, [value_for(k, size) for k in ks])
        assert st == [Status.OK] * len(ks), st


class ReadBack(NamedTuple):
    ok: int
    missing: list[bytes]
    wrong: list[bytes]


def read_back(c: Client, keys: list[bytes], size: int, batch: int = 64,
              groups: list | str | None = None) -> ReadBack:
    """Every key read once (``groups``: with each key's group, or one for all): byte-exact
    hits, misses and wrong values."""
    ok, missing, wrong = 0, [], []
    for i in range(0, len(keys), batch):
        ks = keys[i:i + batch]
        g = groups if groups is None or isinstance(groups, str) else groups[i:i + batch]
        for k, v in zip(ks, c.get_batch(ks, group=g)):
            if v is None:
                missing.append(k)
            elif len(v) == size and check_value(k, v):
                ok += 1
            else:
                wrong.append(k)
    return ReadBack(ok, missing, wrong)


class OracleLoad:
    """The continuous oracle: while running, reads random acknowledged keys (every value
    checked against the oracle) and, with ``write``, puts new keys (acknowledged ones join
    the read set), 8 every ``write_every_s`` at most. ``stop`` ends it and returns the
    counts. Each read batch goes to ``lat`` as ``(start (monotonic), seconds, misses)``,
    each missed key to ``missed`` (and the start of its batch to ``missed_at``)."""

    def __init__(self, c: Client, acked: list[bytes], size: int, write: bool = True,
                 write_every_s: float = 0.0) -> None:
        self.c, self.size, self.write = c, size, write
        self.write_every_s = write_every_s
        self.acked = list(acked)
        self.reads = self.hits = self.misses = 0
        self.wrong: list[bytes] = []
        self.missed: list[bytes] = []
        self.missed_at: list[float] = []
        self.lat: list[tuple[float, float, int]] = []
        self.written: list[bytes] = []
        self._stop = threading.Event()
        self._rng = random.Random(7)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> OracleLoad:
        self._thread.start()
        return self

    def _run(self) -> None:
        n, last_write = 0, 0.0
        while not self._stop.is_set():
            ks = self._rng.sample(self.acked, min(32, len(self.acked)))
            t = time.monotonic()
            got = self.c.get_batch(ks)
            self.lat.append((t, time.monotonic() - t, got.count(None)))
            for k, v in zip(ks, got):
                self.reads += 1
                if v is None:
                    self.misses += 1
                    self.missed.append(k)
                    self.missed_at.append(t)
                elif len(v) == self.size and check_value(k, v):
                    self.hits += 1
                else:
                    self.wrong.append(k)
            if self.write and time.monotonic() - last_write >= self.write_every_s:
                last_write = time.monotonic()
                ks = [f"during-{n + i}".encode() for i in range(8)]
                n += len(ks)
                st = self.c.put_batch(ks, [value_for(k, self.size) for k in ks])
                done = [k for k, s in zip(ks, st) if s == Status.OK]
                self.written += done
                self.acked += done
            time.sleep(0.01)

    def stop(self) -> OracleLoad:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive()
        return self


def drain_and_wait(cl: Cluster, s: ServerProc, timeout: float = 60) -> int:
    """``gcache admin drain`` ``s`` and wait until it handed off everything: a pass at or
    after the drain's epoch finished with nothing left, and both its tiers are empty.
    Returns the drain's epoch."""
    m = masters(cl)
    m.admin("drain", s.name)
    epoch = m.view()["epoch"]
    with Client([s.address], token=TOKEN) as direct:
        def empty() -> bool:
            st = direct.stats()[s.address]
            return st["objects"] == 0 and st.get("disk_objects", 0) == 0

        wait_for(lambda: handoff_done(member(cl, s.name), epoch) and empty(), timeout)
    return epoch


def remove(cl: Cluster, s: ServerProc) -> None:
    """Stop ``s`` and forget it (``gcache admin remove``): it serves nothing any more."""
    s.terminate()
    masters(cl).admin("remove", s.name)
    wait_for(lambda: s.name not in [m["id"] for m in masters(cl).view()["members"]], 10)


def grouped_keys(n: int, groups: int) -> tuple[list[bytes], list[str]]:
    """``n`` keys and one placement group each (``groups`` groups, round robin)."""
    return ([f"g-{i}".encode() for i in range(n)],
            [f"session-{i % groups}" for i in range(n)])


def join_and_wait(cl: Cluster, c: Client, timeout: float = 30) -> ServerProc:
    """Add one server (``add_server``), wait until it is up, ``c`` routes by the new
    epoch and every old member finished a handoff pass at it with nothing left."""
    olds = [s.name for s in cl.servers]
    new = add_server(cl, olds[0].rsplit("-", 1)[0] + "-new")
    wait_for(lambda: len(up_members(cl)) == len(olds) + 1, timeout)
    epoch = masters(cl).view()["epoch"]
    wait_for(lambda: c.view.epoch >= epoch, 10)
    wait_for(lambda: all(handoff_done(m, epoch) for m in masters(cl).status()["members"]
                         if m["id"] != new.name), timeout)
    return new
