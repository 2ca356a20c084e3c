"""A server draining itself: on a graceful stop (``--drain-on-stop``), and when it finds
itself unhealthy (``--unhealthy-file``, a degraded disk tier: ``--auto-drain-after-ms``).

Design. Owned by ``app.Server`` (masters configured only). A drain is always the
masters' ``drain`` of this member, asked through the membership agent (``POST /self``,
proven by this process's boot id, so the server's own ``server = true`` credential
suffices and can drain no other member). The masters mark the member DRAINING in a new
epoch; the agent adopts that view, and the handoff worker (``handoff.py``) pushes what
this server holds, from both tiers, to the new owners while the server keeps serving
(readers that miss at a new owner fall back to this one). The drain is sticky: the
masters keep it across restarts until ``gcache admin undrain ID``.

* ``drain(budget_s, abort)`` (graceful stop): ask for the drain, then wait until
  ``drained``: the agent follows a view at or after the drain's epoch without this
  member, and the handoff finished a pass over such a view with nothing left (nothing
  waiting for a retry). It ends at the budget, or at once when ``abort`` is set (a
  second SIGTERM), and logs what was left. ``deregister`` then removes the member (only
  after a full drain; a member left DRAINING hands the rest off when it restarts under
  the same name).
* The monitor (one thread, a tick per ``TICK_S`` on the injected clock) drains the
  server, once, when ``unhealthy_file`` exists (a platform hook: a hardware detector
  touches it), or when the tier's ``disk_degraded`` stat has held for
  ``disk_degraded_after_s`` (writes failing with EIO or ENOSPC: the tier already serves
  from memory only; 0 = never). One log line per decision; ``stats`` says why
  (``self_drain``: the reason, '' when none).
* Neither drains the last server in the ring (the clients would have no server at all):
  the stop then stops at once, the monitor waits for another server to join.

Threads. ``start`` / ``stop`` / ``join`` and ``drain`` / ``deregister`` run on the
owner's thread; ``drain`` blocks until its budget at most, ``deregister`` until its
deadline (the masters' answer). The monitor runs on its own thread
("gcache-self-drain"); every wait in it is bounded (a tick, a master request's deadline)
and ends early on ``stop``. ``stats`` and ``drained`` run on any thread and never block
beyond a short lock (they read the agent's view and the handoff's stats).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from typing import Any, Callable, NamedTuple

from gcache.clock import SYSTEM, Clock
from gcache.errors import MasterError, MasterUnavailable

log = logging.getLogger("gcache.server.self_drain")

TICK_S = 1.0  # the monitor's period (the unhealthy file is checked this often)
REQUEST_S = 5.0  # one monitor tick's drain request ends by this (masters away: next tick)
DEREGISTER_S = 3.0  # the remove after a full drain ends by this


class DrainReason(str, enum.Enum):
    """Why a server drained itself (stats, logs, ``gcache_self_drain{reason}``)."""

    STOP = "stop"  # a graceful stop with --drain-on-stop
    UNHEALTHY_FILE = "unhealthy_file"  # the platform hook's file exists
    DISK_DEGRADED = "disk_degraded"  # the disk tier stayed degraded too long


class DrainOutcome(NamedTuple):
    """How a ``drain`` ended: ``done`` (nothing left here), else ``why`` it stopped and
    what was left (the handoff's last pass: objects and bytes; the tiers' objects)."""

    done: bool
    why: str
    objects_left: int
    bytes_left: int
    held: int
    seconds: float


class SelfDrain:
    """The self-drain of one server (see the module docstring)."""

    def __init__(self, agent: Any, handoff: Any, tier_stats: Callable[[], dict], *,
                 unhealthy_file: str = "", disk_degraded_after_s: float = 0.0,
                 clock: Clock = SYSTEM) -> None:
        """``agent``: the ``MembershipAgent`` (``leave``, ``registered``, ``epoch``,
        ``ring``, ``member_id``); ``handoff``: the ``Handoff`` (``stats``);
        ``tier_stats``: the tier's ``stats`` (``disk_degraded``, ``objects``,
        ``disk_objects``); ``unhealthy_file``: the hook's path ('' = off);
        ``disk_degraded_after_s``: how long a degraded disk tier is borne (0 = always)."""
        self.agent, self.handoff, self.tier_stats = agent, handoff, tier_stats
        self.unhealthy_file = unhealthy_file
        self.disk_after_s = disk_degraded_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._reason: DrainReason | None = None
        self._stop = threading.Event()
        self._failed_once = False  # a monitor drain the masters did not take (logged once)
        self._thread = threading.Thread(target=self._run, name="gcache-self-drain",
                                        daemon=True)

    @property
    def monitors(self) -> bool:
        """True when the monitor has anything to watch."""
        return bool(self.unhealthy_file) or self.disk_after_s > 0

    # ------------------------------------------------------------------ owner's thread
    def start(self) -> None:
        if self.monitors:
            self._thread.start()

    def stop(self) -> None:
        """Signal the monitor (no wait; see ``join``)."""
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def drain(self, budget_s: float, abort: threading.Event) -> DrainOutcome:
        """Drain this server before a stop: at most ``budget_s`` seconds, less when
        ``abort`` is set. Logs how it ended (what was left, when anything was)."""
        start = self.clock.monotonic()
        end = start + budget_s
        log.info("draining before the stop: budget %.1f s (a second SIGTERM stops at once)",
                 budget_s)
        epoch, why = ((None, "this server is the only one in the ring: no one to hand off "
                             "to") if self._alone()
                      else self._request(DrainReason.STOP, end, abort))
        while epoch is not None and not self.drained(epoch):
            if abort.is_set():
                why = "a second signal"
                break
            ring = self.agent.ring
            if self.agent.epoch >= epoch and ring is not None and len(ring) == 0:
                why = "no server is left in the ring to hand off to"
                break
            if self.clock.monotonic() >= end:
                why = f"the budget of {budget_s:.1f} s ran out"
                break
            self.clock.wait(abort, 0.05)
        out = self._outcome(epoch is not None and not why, why, start)
        if out.done:
            log.info("drained before the stop in %.1f s: nothing left here", out.seconds)
        else:
            log.warning("stopping undrained after %.1f s (%s): %d objects (%d bytes) left in "
                        "the handoff pass, %d objects held in the tiers; the member stays "
                        "draining: restart it under the same name to hand off the rest, or "
                        "gcache admin remove %s to give them up", out.seconds, out.why,
                        out.objects_left, out.bytes_left, out.held, self.agent.member_id)
        return out

    def deregister(self) -> bool:
        """Remove this (fully drained) member from the masters, once the agent's heartbeats
        have stopped (else a heartbeat would register it again). True when removed."""
        try:
            self.agent.leave("remove", time.monotonic() + DEREGISTER_S)
        except (MasterError, MasterUnavailable) as exc:
            log.warning("drained, but not deregistered (%s): the member stays draining; "
                        "gcache admin remove %s forgets it", exc, self.agent.member_id)
            return False
        log.info("drained and deregistered: member %s removed from the masters",
                 self.agent.member_id)
        return True

    # ------------------------------------------------------------------ any thread
    def drained(self, epoch: int) -> bool:
        """True when the agent follows a view at or after ``epoch`` without this member and
        the handoff finished a pass over such a view with nothing left or waiting."""
        agent = self.agent
        ring = agent.ring
        if agent.epoch < epoch or ring is None or agent.member_id in ring:
            return False
        h = self.handoff.stats()
        return (h["handoff_epoch"] >= epoch and not h["handoff_active"]
                and h["handoff_objects_left"] == 0 and h["handoff_waiting"] == 0)

    def stats(self) -> dict[str, str]:
        """``{"self_drain": reason}`` ('' while the server has not drained itself)."""
        with self._lock:
            return {"self_drain": self._reason.value if self._reason else ""}

    # ------------------------------------------------------------------ internals
    def _alone(self) -> bool:
        """True when this server is the only one in the ring: draining it would leave
        the clients no server at all."""
        ring = self.agent.ring
        return ring is not None and len(ring) == 1 and self.agent.member_id in ring

    def _request(self, reason: DrainReason, deadline: float, stop: threading.Event
                 ) -> tuple[int | None, str]:
        """Ask the masters to drain this member (waiting first for the agent's
        registration) until ``deadline``: ``(the drain's epoch, '')``, or ``(None, why
        not)``."""
        while not self.agent.registered.is_set():
            if stop.is_set() or self.clock.monotonic() >= deadline:
                return None, "this server never registered with the masters"
            self.clock.wait(stop, 0.05)
        left = deadline - self.clock.monotonic()
        try:
            res = self.agent.leave("drain", time.monotonic() + max(0.0, left))
        except (MasterError, MasterUnavailable) as exc:
            return None, f"the masters did not take the drain: {exc}"
        with self._lock:
            if self._reason is None:
                self._reason = reason
        return int(res["epoch"]), ""

    def _outcome(self, done: bool, why: str, start: float) -> DrainOutcome:
        h = self.handoff.stats()
        t = self.tier_stats()
        return DrainOutcome(done, why, h["handoff_objects_left"], h["handoff_bytes_left"],
                            int(t.get("objects", 0)) + int(t.get("disk_objects", 0)),
                            self.clock.monotonic() - start)

    def _run(self) -> None:
        degraded_since: float | None = None
        while not self._stop.is_set():
            try:
                now = self.clock.monotonic()
                why = ""
                reason: DrainReason | None = None
                if self.unhealthy_file and os.path.exists(self.unhealthy_file):
                    reason, why = DrainReason.UNHEALTHY_FILE, \
                        f"the unhealthy file {self.unhealthy_file} exists"
                if self.disk_after_s > 0:
                    degraded = self.tier_stats().get("disk_degraded")
                    degraded_since = (degraded_since or now) if degraded else None
                    if reason is None and degraded_since is not None \
                            and now - degraded_since >= self.disk_after_s:
                        reason, why = DrainReason.DISK_DEGRADED, (
                            f"the disk tier has been degraded for {now - degraded_since:.0f} s")
                if reason is not None and self._auto(reason, why, now):
                    return  # decided: the drain is the masters' now (sticky)
            except Exception:  # never take the server down; try again next tick
                log.exception("self-drain monitor tick failed")
            self.clock.wait(self._stop, TICK_S)

    def _auto(self, reason: DrainReason, why: str, now: float) -> bool:
        """Drain for ``reason``; True once the masters took it."""
        if self._alone():
            epoch, refused = None, ("not drained: this server is the only one in the ring "
                                    "(it keeps serving; it drains once another server joins)")
        else:
            epoch, refused = self._request(reason, now + REQUEST_S, self._stop)
        if epoch is None:
            if not self._failed_once:
                log.error("self-drain (%s): %s; retrying every %.0f s", why, refused, TICK_S)
                self._failed_once = True
            return False
        log.warning("self-drain (%s): this server asked the masters to drain it (epoch %d); "
                    "it keeps serving while it hands off what it holds; gcache admin undrain "
                    "%s brings it back once healthy", why, epoch, self.agent.member_id)
        return True
