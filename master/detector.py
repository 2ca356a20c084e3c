"""The masters' failure detector: heartbeats as soft state on the leader.

Design. Heartbeats are never Raft writes: the leader keeps ``last seen`` per member in
memory, on the injected ``Clock``. ``step`` turns a member whose heartbeats stopped for
more than ``heartbeat_timeout_s`` into ``down`` (one replicated ``mark_down`` carrying
the incarnation it saw, which moves the epoch; ``Membership`` ignores it if the member
came back meanwhile). A master that becomes leader starts every member's clock afresh,
so a failover never marks healthy servers down. Only UP, DRAINING and JOINING members
are watched.

Threads. ``seen`` and ``annotate`` are called by the master API's request threads,
``last_stats`` by the join driver's (``master/joiner.py``); they only take the
detector's lock. ``step`` is called by the monitor thread (``run``, every
``period_s`` on the clock) or by a test on a ``VirtualClock``; it may block on one Raft
write (``RaftNode.submit``, a few seconds at most) per member it marks down.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from gcache.clock import SYSTEM, Clock
from gcache.view import MemberState

if TYPE_CHECKING:
    from gcache.master.raft_node import RaftNode

log = logging.getLogger("gcache.master")

#: The states a member must heartbeat in (a DOWN member has nothing left to lose).
WATCHED = (MemberState.UP, MemberState.DRAINING, MemberState.JOINING)


class FailureDetector:
    """Last-seen times and stats per member, and the missed-heartbeat rule."""

    def __init__(self, node: RaftNode, heartbeat_timeout_s: float, clock: Clock = SYSTEM,
                 on_down: Callable[[str], None] | None = None) -> None:
        """``on_down(member_id)``: called on the monitor thread after a ``mark_down``
        committed (``down_events.DownPublisher.member_gone``); must not block."""
        self.node = node
        self.on_down = on_down
        self.heartbeat_timeout = heartbeat_timeout_s
        self.clock = clock
        self._last_seen: dict[str, float] = {}
        self._stats: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._was_leader = False

    def seen(self, member_id: str, stats: dict | None = None) -> None:
        """A sign of life from ``member_id`` (register, heartbeat, admin undrain); a
        heartbeat also brings the member's ``stats``."""
        now = self.clock.monotonic()
        with self._lock:
            self._last_seen[member_id] = now
            if stats is not None:
                self._stats[member_id] = stats

    def last_stats(self, member_id: str) -> dict | None:
        """The stats of ``member_id``'s last heartbeat to this leader (None: none yet)."""
        with self._lock:
            return self._stats.get(member_id)

    def annotate(self, members: list[dict[str, Any]]) -> None:
        """Add ``last_heartbeat_s`` (None if never seen) and ``stats`` to each member
        document of a view (``/status``)."""
        now = self.clock.monotonic()
        with self._lock:
            for m in members:
                seen = self._last_seen.get(m["id"])
                m["last_heartbeat_s"] = None if seen is None else round(now - seen, 2)
                m["stats"] = self._stats.get(m["id"], {})

    def step(self) -> list[str]:
        """One pass: on becoming leader, start every clock afresh; as leader, mark down
        each watched member silent for more than the timeout. Returns the ids whose
        ``mark_down`` committed (a no-op if the member came back meanwhile)."""
        leader = self.node.is_leader
        now = self.clock.monotonic()
        if leader and not self._was_leader:
            with self._lock:  # fresh clocks for everyone: soft state died with the old leader
                self._last_seen = {mid: now for mid in self.node.membership.members()}
            log.info("became leader: epoch %d", self.node.membership.epoch)
        self._was_leader = leader
        if not leader:
            return []
        down = []
        for mid, rec in self.node.membership.members().items():
            if rec.state not in WATCHED:
                continue
            with self._lock:
                seen = self._last_seen.setdefault(mid, now)
            if now - seen > self.heartbeat_timeout:
                log.warning("member %s missed heartbeats for %.1fs: marking down", mid,
                            now - seen)
                try:
                    self.node.submit({"op": "mark_down", "id": mid,
                                      "incarnation": rec.incarnation})
                    down.append(mid)
                    if self.on_down is not None:
                        self.on_down(mid)
                except (TimeoutError, RuntimeError) as exc:
                    log.warning("mark_down %s not committed: %s", mid, exc)
        return down

    def run(self, stop: threading.Event, period_s: float = 0.1) -> None:
        """The monitor loop: ``step`` every ``period_s`` on the clock until ``stop``."""
        while not self.clock.wait(stop, period_s):
            self.step()
