"""The masters' join driver: a JOINING member's weight ramps up, then its join ends.

Design. Like the failure detector, it acts on the Raft leader only, on the injected
``Clock``, and keeps only soft state (when this leader first saw each join and when it
last raised its ramp); a master that becomes leader starts every join's clocks afresh.
A member registers JOINING at ``initial_ramp`` (``1 / RAMP_STEPS``; the API puts it in
the ``register`` op, so ``Membership.apply`` stays a pure function). ``step`` then:

* raises each JOINING member's ramp by ``1 / RAMP_STEPS`` every
  ``join_ramp_s / (RAMP_STEPS - 1)`` seconds (one replicated ``ramp`` op, one epoch),
  so it reaches 1.0 ``join_ramp_s`` after the join started;
* once the ramp is 1.0, ends the join (``joined``: JOINING -> UP) when every other
  member that holds data (UP, JOINING, DRAINING) reports, in its last heartbeat, a
  finished handoff pass (``handoff_epoch``) at or after the epoch the member's record
  last changed (the ramp's last step, or later) and no objects left to hand off
  (``handoff_objects_left`` 0): what the ring gave the newcomer has reached it, or is
  readable at its previous owner through the SDK's fallback;
* ends it anyway, with a warning naming the members still handing off, when
  ``join_timeout_s`` passed since this leader first saw the join.

Both ops carry the incarnation the driver saw: ``Membership`` ignores them for a
member that restarted, went down or was drained meanwhile.

Threads. ``step`` is called by the join thread (``run``, every ``period_s`` on the
clock) or by a test on a ``VirtualClock``; it may block on one Raft write
(``RaftNode.submit``, a few seconds at most) per member it acts on. It reads the
heartbeat stats through ``FailureDetector.last_stats`` (a short lock).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import TYPE_CHECKING, NamedTuple

from gcache.clock import SYSTEM, Clock
from gcache.view import HOLDING, MemberState

if TYPE_CHECKING:
    from gcache.master.detector import FailureDetector
    from gcache.master.membership import MemberRecord
    from gcache.master.raft_node import RaftNode

log = logging.getLogger("gcache.master")

RAMP_STEPS = 4  # a join's ramp: 1/4, 2/4, 3/4, 1
DEFAULT_JOIN_RAMP_S = 8.0
DEFAULT_JOIN_TIMEOUT_S = 120.0


class _Join(NamedTuple):
    """What this leader knows of one join: the incarnation, when it first saw it and
    when it last raised its ramp (the clock's seconds)."""

    incarnation: int
    started: float
    stepped: float


def handoff_done(stats: dict | None, epoch: int) -> bool:
    """Does a member's last heartbeat (``stats``) report a handoff pass finished at
    ``epoch`` or later with nothing left to move?"""
    if not stats or "handoff_epoch" not in stats:
        return False
    return (int(stats["handoff_epoch"]) >= epoch
            and int(stats.get("handoff_objects_left", 1)) == 0)


class JoinDriver:
    """Ramps JOINING members and ends their joins (see the module docstring)."""

    def __init__(self, node: RaftNode, detector: FailureDetector, join_ramp_s: float,
                 join_timeout_s: float, clock: Clock = SYSTEM) -> None:
        if not (math.isfinite(join_ramp_s) and join_ramp_s >= 0):
            raise ValueError(f"join_ramp_s must be >= 0, got {join_ramp_s!r}")
        if not (math.isfinite(join_timeout_s) and join_timeout_s > 0):
            raise ValueError(f"join_timeout_s must be > 0, got {join_timeout_s!r}")
        self.node, self.detector, self.clock = node, detector, clock
        self.join_ramp_s, self.join_timeout_s = join_ramp_s, join_timeout_s
        self.interval = join_ramp_s / (RAMP_STEPS - 1)
        self._joins: dict[str, _Join] = {}
        self._was_leader = False

    @property
    def initial_ramp(self) -> float | None:
        """The ramp a newcomer registers at (the ``register`` op's ``ramp``), or None
        when joins do not ramp (``join_ramp_s`` 0: a newcomer is UP at once)."""
        return 1.0 / RAMP_STEPS if self.join_ramp_s > 0 else None

    def step(self) -> list[tuple[str, str]]:
        """One pass (as leader): ``[(member id, "ramp" | "joined")]`` for each op that
        committed."""
        leader = self.node.is_leader
        if leader and not self._was_leader:
            self._joins = {}  # soft state died with the old leader: start afresh
        self._was_leader = leader
        if not leader:
            return []
        now = self.clock.monotonic()
        members = self.node.membership.members()
        joining = {mid: rec for mid, rec in members.items() if rec.state is MemberState.JOINING}
        self._joins = {mid: j for mid, j in self._joins.items()
                       if mid in joining and j.incarnation == joining[mid].incarnation}
        done = []
        for mid, rec in joining.items():
            j = self._joins.setdefault(mid, _Join(rec.incarnation, now, now))
            if now - j.started >= self.join_timeout_s:
                log.warning("join of %s timed out after %.0fs (ramp %.2f; still handing off: "
                            "%s): marking it up", mid, now - j.started, rec.ramp,
                            ", ".join(self._pending(rec, members)) or "none")
                if self._submit({"op": "joined", "id": mid, "incarnation": rec.incarnation}):
                    done.append((mid, "joined"))
            elif rec.ramp < 1.0:
                if now - j.stepped >= self.interval:
                    ramp = min(1.0, (math.floor(rec.ramp * RAMP_STEPS + 1e-9) + 1) / RAMP_STEPS)
                    if self._submit({"op": "ramp", "id": mid, "incarnation": rec.incarnation,
                                     "ramp": ramp}):
                        self._joins[mid] = j._replace(stepped=now)
                        done.append((mid, "ramp"))
                        log.info("join of %s: ramp %.2f", mid, ramp)
            elif not self._pending(rec, members):
                if self._submit({"op": "joined", "id": mid, "incarnation": rec.incarnation}):
                    done.append((mid, "joined"))
                    log.info("member %s joined after %.1fs: its ramp is full and every "
                             "holder finished handing off at epoch >= %d", mid,
                             now - j.started, rec.changed_epoch)
        return done

    def _pending(self, rec: MemberRecord, members: dict[str, MemberRecord]) -> list[str]:
        """The other holders whose last heartbeat does not report a finished handoff
        pass at or after ``rec``'s last change."""
        return sorted(mid for mid, m in members.items()
                      if mid != rec.id and m.state in HOLDING
                      and not handoff_done(self.detector.last_stats(mid), rec.changed_epoch))

    def _submit(self, op: dict) -> bool:
        try:
            self.node.submit(op)
            return True
        except (TimeoutError, RuntimeError) as exc:  # retried on the next step
            log.warning("%s %s not committed: %s", op["op"], op["id"], exc)
            return False

    def run(self, stop: threading.Event, period_s: float = 0.25) -> None:
        """The join loop: ``step`` every ``period_s`` on the clock until ``stop``."""
        while not self.clock.wait(stop, period_s):
            try:
                self.step()
            except Exception:  # the loop must outlive a bug: the next step retries
                log.exception("join driver step failed")
