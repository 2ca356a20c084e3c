"""The server's link to the masters: register, heartbeat, follow the view.

Design. Runs in background threads and never blocks serving: with every
master down the server keeps serving on the last view it saw. It registers
under its ``--name`` with a fresh ``boot_id`` per process start (so the
master gives a restart a new incarnation; the shared-memory data of content
namespaces stays valid because their keys are content-addressed, that of mutable
namespaces is reconciled by ``reconcile``, see ``freshness.py``), heartbeats every
``heartbeat_interval_ms`` with its usage, re-registers when told its
incarnation is stale, and long-polls the view so it can answer ``NOT_OWNER``
for keys placed by a client with an older view.

Threads. ``start`` / ``stop`` / ``join`` run on the owner's thread (``Server``):
``start`` spawns the heartbeat and view threads; ``stop`` only signals them and never
blocks; ``join`` waits for them until its deadline (the heartbeat thread ends within
one master request, the view thread may sit in a long poll until that poll's own
deadline and is then left to end alone: it is a daemon and holds no port of ours).
``not_owned`` runs on connection threads, reads the current ring and never blocks.
``leave`` (the server's self-drain: its monitor thread, or the owner's thread at a
graceful stop) asks the masters to drain or remove this member, under the caller's
deadline. ``on_view`` (given at construction: the server's handoff worker) is called with each
view the agent adopts, on the view thread; it must not block. ``reconcile`` (the server's ``Freshness.adopt``) is called with each
view *before* the agent routes by it (``ring``/``epoch``), with the master's epoch just
before our registration for a view a registration returned; it may block (it walks the
tier). Every view is adopted on the view thread, the one a registration returned too (the
heartbeat thread hands it over), so a long reconcile never delays a heartbeat; the view
thread adopts nothing before the first registration, whose view is the first adopted.
Adoptions are serialised (one lock).
"""

from __future__ import annotations

import logging
import ssl
import random
import threading
import time
import uuid
from collections import deque
from typing import Callable, Sequence

from gcache.backoff import Backoff
from gcache.discovery import MasterClient, MasterError, MasterUnavailable, view_from_wire
from gcache.ring import Ring
from gcache.view import View

log = logging.getLogger("gcache.server.agent")


class MembershipAgent:
    def __init__(self, masters: Sequence[str] | str, token: str, member_id: str, address: str,
                 capacity_bytes: int, stats_fn: Callable[[], dict],
                 heartbeat_interval_ms: int = 500, tls: ssl.SSLContext | None = None,
                 on_view: Callable[[View], None] | None = None,
                 reconcile: Callable[[View, int | None], None] | None = None) -> None:
        # short per-try timeouts: a paused master must not delay a heartbeat past the
        # masters' heartbeat timeout; the client moves on to the next master instead.
        # ``tls``: a dialer context, the masters speak https
        self.client = MasterClient(masters, token, timeout_s=0.5, tls=tls)
        self.watcher = MasterClient(masters, token, timeout_s=2.0, tls=tls)
        self.member_id, self.address = member_id, address
        self.capacity_bytes = capacity_bytes
        self.stats_fn = stats_fn
        self.on_view = on_view
        self.reconcile = reconcile
        self._adopt_lock = threading.Lock()  # one adoption at a time
        # a registration's (view document, epoch before it), for the view thread to adopt
        # (append and popleft are atomic: the heartbeat thread hands over, the view takes)
        self._registration: deque[tuple[dict | None, int | None]] = deque(maxlen=1)
        self.interval = heartbeat_interval_ms / 1000.0
        self.boot_id = uuid.uuid4().hex
        self.incarnation = 0
        self.epoch = -1
        self.ring: Ring | None = None
        self.registered = threading.Event()
        self.state = ""  # this member's state in the last view adopted ("" before one)
        self._stop = threading.Event()
        self._warned = False
        self._threads = (
            threading.Thread(target=self._heartbeat_loop, name="gcache-agent-hb", daemon=True),
            threading.Thread(target=self._watch_loop, name="gcache-agent-view", daemon=True))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Tell both loops to end (no wait; see ``join``)."""
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` in all (after ``stop``) for the heartbeat loop and for
        a view adoption under way; True when the heartbeat loop ended (no register or
        heartbeat of ours can reach a master any more). The view loop may still sit in
        its long poll (up to 5 s): not waited for, since once stopped it adopts nothing
        (waiting for it made every stop take the whole timeout)."""
        deadline = time.monotonic() + timeout_s
        hb = self._threads[0]
        if hb.is_alive():
            hb.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._adopt_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._adopt_lock.release()
        return not hb.is_alive()

    def leave(self, op: str, deadline: float) -> dict:
        """Ask the masters to ``drain`` or ``remove`` this member (``POST /self``, proven by
        this process's boot id), retrying while no master answers, until ``deadline``
        (``time.monotonic()``). The masters' answer (``{"changed", "epoch", "member"}``);
        MasterUnavailable when the deadline passes first, MasterError when refused."""
        backoff = Backoff(0.1, 1.0)
        while True:
            try:
                return self.client.self_op(op, self.member_id, self.boot_id, deadline=deadline)
            except MasterUnavailable:
                pause = backoff.next()
                if time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)

    # ------------------------------------------------------------------ ownership
    def not_owned(self, client_epoch: int, hashes: Sequence[int]) -> list[bool] | None:
        """Per item: True when this server is not the owner and the client is stale.

        None when no check applies (no view yet, or the client's view is as new as ours:
        then the client knows better than we do).
        """
        ring = self.ring
        if ring is None or len(ring) == 0 or client_epoch >= self.epoch:
            return None
        return [m.id != self.member_id for m in ring.owners(hashes)]

    # ------------------------------------------------------------------ loops
    def _register(self) -> None:
        res = self.client.register(self.member_id, self.address, self.capacity_bytes,
                                   self.boot_id)
        member = res.get("member") or {}
        self.incarnation = int(member["incarnation"]) if member else \
            int(res.get("incarnation", self.incarnation))
        # every op bumps the epoch by one: the state before our registration's
        before = int(member["changed_epoch"]) - 1 if "changed_epoch" in member else None
        view = res.get("view")
        self._registration.append((view, before))  # adopted by the view thread
        self.registered.set()
        log.info("registered with the masters", extra={"fields": {
            "id": self.member_id, "incarnation": self.incarnation,
            "epoch": int((view or {}).get("epoch", -1))}})

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    self._register()
                else:
                    self.client.heartbeat(self.member_id, self.incarnation, self.boot_id,
                                          self.stats_fn())
                self._warned = False
            except MasterError as exc:
                if exc.code == 409:
                    self.registered.clear()  # stale incarnation: register again now
                    continue
                self._warn(str(exc))
            except (MasterUnavailable, OSError, ValueError, KeyError) as exc:
                self._warn(str(exc))
            # +-10 %: servers restarted together do not heartbeat in lockstep
            self._stop.wait(self.interval * random.uniform(0.9, 1.1))

    def _watch_loop(self) -> None:
        backoff = Backoff(0.5, 5.0)
        while not self._stop.is_set():
            if not self.registered.is_set():  # the first view is registration's
                self._stop.wait(0.05)
                continue
            if self._registration:
                self._adopt(*self._registration.popleft())
                continue
            try:
                doc = self.watcher.view(since=self.epoch, wait_ms=5000)
                self._adopt(doc)
                backoff.reset()
            except (MasterUnavailable, MasterError, OSError, ValueError):
                self._stop.wait(backoff.next())  # keep serving on the last view

    def _adopt(self, doc: dict | None, registered_before: int | None = None) -> None:
        with self._adopt_lock:
            if self._stop.is_set() or not doc or int(doc.get("epoch", -1)) <= self.epoch:
                return  # stopped: the owner may be closing what a view change touches
            view = view_from_wire(doc)
            self.state = next((str(m.get("state", "")) for m in doc.get("members", [])
                               if m.get("id") == self.member_id), "")
            if self.reconcile is not None:
                self.reconcile(view, registered_before)
            self.ring = view.ring
            self.epoch = view.epoch
            log.info("view epoch %d: %d routable servers", view.epoch, len(view.members))
            if self.on_view is not None:
                self.on_view(view)

    def _warn(self, msg: str) -> None:
        if not self._warned:
            log.warning("masters unreachable, serving on the last view: %s", msg)
            self._warned = True
