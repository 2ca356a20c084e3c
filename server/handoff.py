"""The handoff worker: a server pushes the objects it holds but no longer owns to their
owners, so a drain or a join loses no acknowledged key.

Design. Owned by ``app.Server`` (masters configured only). The membership agent calls
``view_changed`` each time it adopts a view (also the first one, at registration); the
worker thread then runs a *pass* over that view:

1. walk ``Tier.held()`` (the committed objects of both tiers, a snapshot) and keep
   every object when this server is not in the ring (draining, or removed); with
   ``handoff_on_join`` (on by default) also, while it stays in the ring, those whose
   owner in the view's ring is another member (a join took them). An object's owner is
   the ring owner of its placement hash (``HeldObject.ph``, the one its writer routed
   it by; see Groups), or of ``placement_hash(ns, key)`` when it was put without one;
2. per namespace, through the project's own SDK (``gcache.sdk.Client`` on the masters'
   view, transport tcp, checksums verified, the server's credential or token), in
   batches of about ``BATCH_BYTES`` (``CAPPED_BATCH_BYTES`` under a cap; ``WINDOW``
   batches in flight): copy each object
   out of the tier at the version the walk saw (``pin_read`` .. ``unpin`` around the copy
   only; memory or disk), check the copy against the object's checksum, and
   ``put_batch_from_async(..., if_absent=True, placement=hashes)`` the copies (so a
   foreground put that reached the owner first wins; ``placement``: each goes to its
   hash's owner and carries that hash, which the owner's NOT_OWNER check agrees with
   and which it stores in turn). The SDK never gets arena memory: it may keep views of
   what it sent for a while, and an arena view alive at close would stop the arena
   from closing;
3. after an OK put, and only if the client routed it by this very view (its epoch
   equals the pass's before and after the put, and the key's owner there is not this
   server), delete the local copy with ``Tier.delete_if_version`` (a newer local object
   is never lost), ``grace_s`` later (``handoff_grace_ms``, default 2 s) and only while
   the view still holds: a reader that missed at the new owner just before the put
   still finds the key here when it falls back to the previous owner (the SDK's
   ``"ho"`` read), which it does within its op deadline, so the grace is the longest
   reader deadline (the SDK's default ``timeout_ms``). A fixed 200 ms grace lost such a
   read under load (1 in ~9,000 in a loaded CI run).

A failed put (timeout, target unreachable, refused) keeps the object; it counts as
*waiting* and the pass is retried after ``RETRY_S`` (doubling up to ``RETRY_MAX_S``). An
object whose own bytes fail their checksum is dropped and counted lost (``handoff_lost``);
the tier already drops and counts what it finds corrupt itself. A newer view abandons the
pass at the next batch and starts a new one. A server outside the ring re-checks every
``IDLE_OUT_S`` so a straggler put still leaves; inside the ring only views and retries
start passes. Bytes are capped by a token bucket (``migrate_mbps``, MB/s; 0 = no cap).
Under a cap the worker thread, its clients' dispatch threads and the owners' threads
serving their connections run at background CPU priority (``gcache.sched``:
``SCHED_IDLE``), so a foreground request never waits behind a handoff burst for the CPU;
uncapped, the operator asked for speed and they keep normal priority (SCHED_IDLE cost
a third of the uncapped rate: any normal thread's wake-up preempts it).

Groups: every object keeps the placement hash its writer's client routed it by (the
``ph`` of a master-routed put: its group's hash for ``group=`` keys and the SGLang
plugin's ``chain`` placement; ``Tier`` docstring), in both tiers and across restarts.
The worker places each object by that hash, so a drain or a join moves a grouped key to
its group's owner, where its readers ask, and the copy there keeps the same hash (a
later drain of that server moves it right again). An object put by a static-view client
(no ``ph``) is placed by ``placement_hash(ns, key)``, as such a client reads it. So join
handoff is on by default (``handoff_on_join``); turned off, a join moves nothing and
readers of moved keys fall back to this server for ``handoff_read_window_ms`` (the SDK's
``"ho"`` read) instead.

Threads. ``view_changed`` runs on the agent's threads and never blocks (it stores the
view and sets an event). ``start`` / ``stop`` / ``join`` run on the owner's thread:
``stop`` signals, closes the SDK clients (a put in flight ends at once as CLOSED) and
returns; ``join`` waits for the worker until its deadline. ``stats`` runs on any thread
(heartbeats, /metrics) and never blocks beyond a short lock. Everything else runs on the
one worker thread ("gcache-handoff"); every wait in it is bounded (the put's deadline,
the bucket's, the client's catch-up deadline) and ends early on ``stop``.

Rights: the SDK clients authenticate with the server's ``credential`` (else its token),
so that credential needs ``write`` on every namespace the server may hold (``"*"``),
besides ``server = true`` for the masters.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any, NamedTuple, Sequence

from gcache.clock import SYSTEM, Clock
from gcache.errors import GCacheError
from gcache.hashing import checksum, placement_hash
from gcache.protocol import Limits
from gcache.sched import background_thread
from gcache.status import Status
from gcache.view import View

log = logging.getLogger("gcache.server.handoff")

BATCH_BYTES = 8 << 20  # one put batch (the SDK's frame target)
# one put batch under --migrate-mbps: the operator asked for foreground latency, and a
# shorter burst holds the caches and a core for less (p99 at half the handoff rate
# 1.2-1.4x quiet against 1.5-1.7x with 8 MiB batches; bench/RESULTS.md)
CAPPED_BATCH_BYTES = 2 << 20
BATCH_ITEMS = 512
PUT_TIMEOUT_MS = 5000  # one batch put's deadline
WINDOW = 3  # batches in flight per pass
CATCH_UP_S = 5.0  # how long a pass waits for its clients to route by the pass's view
RETRY_S, RETRY_MAX_S = 0.5, 8.0  # a pass that left objects waiting runs again after
IDLE_OUT_S = 2.0  # outside the ring, a finished pass runs again after (stragglers)
MAX_CLIENTS = 16  # SDK clients kept, one per namespace (least recently used closed)
GRACE_S = 2.0  # a moved object's local copy is deleted this long after its put (default)


class TokenBucket:
    """A cap of ``rate`` bytes per second (0 = none), at most ``burst`` bytes saved up.

    It starts empty (a pass never opens with a burst) and ``take`` waits until the
    bucket holds the bytes asked for, however many (a batch larger than ``burst`` waits
    for all of them), so over time the rate holds exactly. Worker thread only.
    """

    def __init__(self, rate: float, burst: int, clock: Clock = SYSTEM) -> None:
        self.rate, self.burst, self.clock = rate, max(1, burst), clock
        self._tokens = 0.0
        self._last = clock.monotonic()

    def take(self, n: int, stop: threading.Event, deadline: float) -> bool:
        """Spend ``n`` bytes, first waiting (on the clock) until the bucket holds them.
        False when ``stop`` is set, or at once (nothing spent) when the wait would pass
        ``deadline``."""
        if self.rate <= 0:
            return not stop.is_set()
        now = self.clock.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        wait = max(0.0, (n - self._tokens) / self.rate)
        if now + wait > deadline:
            return False
        self._tokens -= n  # below zero until the wait has earned it back
        return not (wait > 0 and self.clock.wait(stop, wait)) and not stop.is_set()


class _Flight(NamedTuple):
    """One batch on its way: what stays here, the put and what it carries."""

    ns: bytes
    batch: list  # HeldObject
    kept: list  # objects staying here (waiting)
    put: Future | None
    out: list  # the objects put (copied, not routed to this server)
    buf: bytearray | None  # the copies, back to the pass's pool once the put is done


class _PassStats(NamedTuple):
    moved: int
    waiting: int  # objects kept for the next pass
    waiting_bytes: int


class Handoff:
    """The handoff worker of one server (see the module docstring)."""

    def __init__(self, tier: Any, member_id: str, address: str, *, masters: Sequence[str] | str,
                 credential: str = "", token: str = "", tls: ssl.SSLContext | None = None,
                 limits: Limits | None = None, migrate_mbps: float = 0.0,
                 on_join: bool = True, grace_s: float = GRACE_S,
                 clock: Clock = SYSTEM) -> None:
        """``tier``: the server's ``Tier`` (``held``, ``pin_read``, ``unpin``,
        ``delete_if_version``); ``member_id``/``address``: this server's name and the
        address clients reach it at; ``masters``, ``credential``/``token``, ``tls`` (a
        dialer context: the other servers and masters speak TLS), ``limits``: what the
        SDK clients are built with; ``migrate_mbps``: the cap in MB/s (0 = none);
        ``on_join``: also move what a join took from this server while it stays in the
        ring (``handoff_on_join``, default on; off: only a server out of the ring hands
        off); ``grace_s``: how long a moved object's local copy stays after its put
        (``handoff_grace_ms``: the longest reader deadline, see the module docstring)."""
        from gcache.sdk import Client  # the SDK only where a server has masters

        self.tier, self.member_id, self.address = tier, member_id, address
        self.on_join = on_join
        self.grace_s = grace_s
        self.masters = list(masters.split(",") if isinstance(masters, str) else masters)
        self._auth = {"credential": credential or None, "token": token or None}
        self._tls, self._limits, self.clock = tls, limits, clock
        rate = float(migrate_mbps) * 1e6
        self.bucket = TokenBucket(rate, min(CAPPED_BATCH_BYTES, max(64 << 10, int(rate / 10)))
                                  if rate > 0 else BATCH_BYTES, clock)
        self.batch_bytes = self.bucket.burst
        self._new_client = Client
        self._clients: dict[bytes, Any] = {}  # namespace -> client, least recent first
        self._clients_lock = threading.Lock()
        self._view: View | None = None
        # a pass's moved objects whose local copy goes after grace_s: (due, ns, object)
        self._doomed: deque[tuple[float, bytes, Any]] = deque()
        self._replaced: list = []  # ... and those replaced here meanwhile (not deleted)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the counters
        self._c = {"handoff_objects_moved": 0, "handoff_bytes_moved": 0,
                   "handoff_objects_left": 0, "handoff_bytes_left": 0, "handoff_waiting": 0,
                   "handoff_lost": 0, "handoff_passes": 0, "handoff_active": 0,
                   "handoff_epoch": -1}
        self._thread = threading.Thread(target=self._run, name="gcache-handoff", daemon=True)

    # ------------------------------------------------------------------ owner's thread
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Signal the worker and close the SDK clients (a put in flight ends CLOSED)."""
        self._stop.set()
        self._wake.set()
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def join(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the worker (after ``stop``); True if it ended."""
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ any thread
    def view_changed(self, view: View) -> None:
        """The agent adopted ``view``: (re)start a pass over it (an older epoch than the
        current one is ignored). Never blocks beyond a short lock."""
        with self._lock:
            if self._view is not None and view.epoch <= self._view.epoch:
                return
            self._view = view
        self._wake.set()

    def stats(self) -> dict[str, int]:
        """The ``handoff_*`` numbers (server stats, heartbeats, /metrics): moved objects
        and bytes, lost objects and passes (counters); the current pass's objects and
        bytes left, waiting objects, active (0/1) and the epoch of the last finished
        pass (-1: none)."""
        with self._lock:
            return dict(self._c)

    # ------------------------------------------------------------------ worker
    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self._c["handoff_" + k] += v

    def _set(self, **values: int) -> None:
        with self._lock:
            for k, v in values.items():
                self._c["handoff_" + k] = v

    def _run(self) -> None:
        if self.bucket.rate > 0:  # capped: foreground first (gcache.sched)
            background_thread()
        retry = RETRY_S
        next_wait: float | None = None
        try:
            while not self._stop.is_set():
                self.clock.wait(self._wake, next_wait)
                self._wake.clear()
                view = self._view
                if self._stop.is_set() or view is None:
                    continue
                self._set(active=1)
                try:
                    done = self._pass(view)
                except Exception:  # a bug or a tier fault: keep the server up, retry later
                    log.exception("handoff pass failed; retrying")
                    done = None
                finally:
                    self._set(active=0)
                if done is None:  # abandoned (a newer view, stop) or failed
                    next_wait = 0.0 if self._view is not view else retry
                    continue
                with self._lock:
                    self._c["handoff_passes"] += 1
                    self._c["handoff_epoch"] = view.epoch
                if done.waiting:
                    next_wait, retry = retry, min(retry * 2, RETRY_MAX_S)
                else:
                    retry = RETRY_S
                    next_wait = IDLE_OUT_S if self.member_id not in view.ring else None
        finally:
            self.stop()

    def _superseded(self, view: View) -> bool:
        return self._stop.is_set() or self._view is not view

    def _pass(self, view: View) -> _PassStats | None:
        """One pass over ``view``; None when abandoned (newer view, stop)."""
        ring = view.ring
        mine = self.member_id in ring
        todo: dict[bytes, list] = {}
        if mine and not self.on_join:  # joins: readers fall back to us (the SDK's "ho")
            self._set(objects_left=0, bytes_left=0, waiting=0)
            return _PassStats(0, 0, 0)
        for h in self.tier.held():
            if self._stop.is_set():
                return None
            if h.ph is None:  # put without one: placed by its key, as its readers ask
                h = h._replace(ph=placement_hash(h.ns, h.key))
            todo.setdefault(h.ns, []).append(h)
        if mine:  # keep only what another member owns
            for ns, objs in todo.items():
                owners = ring.owners([h.ph for h in objs])
                todo[ns] = [h for h, m in zip(objs, owners) if m.id != self.member_id]
        n = sum(len(objs) for objs in todo.values())
        nbytes = sum(h.length for objs in todo.values() for h in objs)
        self._set(objects_left=n, bytes_left=nbytes, waiting=0)
        if n:
            log.info("handoff pass at epoch %d: %d objects (%d bytes) to move%s", view.epoch,
                     n, nbytes, "" if mine else " (this server is not in the ring)")
        total = _PassStats(0, 0, 0)
        failed: Counter[str] = Counter()
        self._doomed.clear()
        self._replaced.clear()
        for ns, objs in todo.items():
            if not objs:
                continue
            client = self._client_for(ns, view) if len(ring) else None
            if client is None:
                if self._superseded(view):
                    return None
                why = "no owner" if not len(ring) else "no client on this view"
                total = _add(total, self._keep(objs, failed, why))
                continue
            res = self._move_all(client, ns, objs, view, failed)
            if res is None:
                return None
            total = _add(total, res)
        if n:  # every put answered; the old copies go after the grace (the pass ends then)
            log.info("handoff pass at epoch %d copied: %d moved; the old copies go %.1f s "
                     "after their put", view.epoch, total.moved, self.grace_s)
        if not self._reap(view, wait=True):
            return None
        if self._replaced:  # replaced here after the walk: the next pass moves them
            total = _add(total, self._keep(self._replaced, failed, "replaced"))
        self._set(objects_left=total.waiting, bytes_left=total.waiting_bytes,
                  waiting=total.waiting)
        if n:
            log.info("handoff pass at epoch %d done: %d moved, %d waiting%s", view.epoch,
                     total.moved, total.waiting, f" {dict(failed)}" if failed else "")
        return total

    def _reap(self, view: View, wait: bool = False) -> bool:
        """Delete the local copies whose grace has passed (``wait``: all of them, waiting
        for the last grace), each only if still the version that was put
        (``delete_if_version``; a replaced one goes to ``_replaced``). False, deleting
        nothing more, once the pass is superseded: the copies stay (the next pass puts
        them if absent, which the owner skips, and deletes them then)."""
        doomed = self._doomed
        while doomed:
            if self._superseded(view):
                doomed.clear()
                return False
            due, ns, h = doomed[0]
            left = due - self.clock.monotonic()
            if left > 0:
                if not wait:
                    return True
                self.clock.wait(self._stop, left)
                continue
            doomed.popleft()
            if not self.tier.delete_if_version(ns, h.key, h.version):
                self._replaced.append(h)
        return not self._superseded(view)

    def _keep(self, objs: list, failed: Counter, why: str) -> _PassStats:
        """``objs`` stay here for the next pass (counted as waiting)."""
        failed[why] += len(objs)
        nbytes = sum(h.length for h in objs)
        self._count(waiting=len(objs))
        return _PassStats(0, len(objs), nbytes)

    def _client_for(self, ns: bytes, view: View) -> Any:
        """The namespace's SDK client, once it routes by ``view``'s epoch (waits up to
        ``CATCH_UP_S``); None if it does not (or cannot be built, or we stop)."""
        with self._clients_lock:
            client = self._clients.pop(ns, None)
            if client is not None:
                self._clients[ns] = client  # most recently used last
        if client is None:
            try:
                client = self._new_client(masters=self.masters, namespace=ns,
                                          transport="tcp", verify_checksums=True,
                                          tls=self._tls, limits=self._limits,
                                          timeout_ms=PUT_TIMEOUT_MS,
                                          background=self.bucket.rate > 0,
                                          **self._auth)
            except (GCacheError, ValueError, OSError) as exc:
                log.error("handoff: cannot build a client for namespace %r: %s", ns, exc)
                return None
            old = []
            with self._clients_lock:
                if not self._stop.is_set():
                    self._clients[ns] = client
                    while len(self._clients) > MAX_CLIENTS:
                        old.append(self._clients.pop(next(iter(self._clients))))
                else:
                    old.append(client)
            for o in old:
                o.close()
            if self._stop.is_set():
                return None
        end = self.clock.monotonic() + CATCH_UP_S
        while client.view.epoch < view.epoch:  # its watcher follows the masters' epoch
            if self._superseded(view) or self.clock.monotonic() >= end:
                return None
            self.clock.wait(self._stop, 0.02)
        return client if client.view.epoch == view.epoch else None

    def _move_all(self, client: Any, ns: bytes, objs: list, view: View, failed: Counter
                  ) -> _PassStats | None:
        """Move one namespace's objects, ``WINDOW`` batches in flight; None when the pass
        is abandoned (what is in flight is waited for and counted first)."""
        total = _PassStats(0, 0, 0)
        flight: deque[_Flight] = deque()
        # copy buffers, reused: a fresh 8 MiB buffer per batch costs more page faults
        # than the copy itself (a buffer the SDK still reads after a put's deadline is
        # refused by the owner's checksum check, never published)
        pool: list[bytearray] = []
        try:
            for batch in _batches(objs, self.batch_bytes):
                if self._superseded(view) or not self._reap(view):
                    return None
                f = self._send(client, ns, batch, pool, failed)
                if f is None:  # stopped in the rate cap's wait
                    return None
                flight.append(f)
                if len(flight) >= WINDOW:
                    total = _add(total, self._finish(client, flight.popleft(), view, pool,
                                                     failed))
            while flight:
                total = _add(total, self._finish(client, flight.popleft(), view, pool, failed))
            return total
        finally:  # abandoned or failing: what is in flight is still counted
            while flight:
                self._finish(client, flight.popleft(), view, pool, failed)

    def _send(self, client: Any, ns: bytes, batch: list, pool: list[bytearray],
              failed: Counter) -> _Flight | None:
        """Wait for the rate cap, copy the batch out of the tier (into a buffer of
        ``pool``, or a new one), start its put; None when stopped."""
        want = sum(h.length for h in batch)
        deadline = self.clock.monotonic() + want / max(self.bucket.rate, 1.0) + 5.0
        if not self.bucket.take(want, self._stop, deadline):
            if self._stop.is_set():
                return None
            failed["rate cap"] += len(batch)
            return _Flight(ns, batch, list(batch), None, [], None)
        buf = pool.pop() if pool and want <= len(pool[-1]) else bytearray(
            max(want, self.batch_bytes))
        kept, copied = self._copy(ns, batch, memoryview(buf), failed)
        # never to ourselves (a client view that still routes here): an if-absent put would
        # find our own copy, answer OK, and the delete would lose the object
        owners = (client.owners([h.key for h, _ in copied],
                                placement=[h.ph for h, _ in copied]) if copied else [])
        out = [(h, v) for (h, v), a in zip(copied, owners) if a != self.address]
        for (h, _), a in zip(copied, owners):
            if a == self.address:
                kept.append(h)
                failed["routed here"] += 1
        fut = (client.put_batch_from_async([h.key for h, _ in out], [v for _, v in out],
                                           if_absent=True, timeout_ms=PUT_TIMEOUT_MS,
                                           placement=[h.ph for h, _ in out])
               if out else None)
        return _Flight(ns, batch, kept, fut, [h for h, _ in out], buf)

    def _copy(self, ns: bytes, batch: list, mv: memoryview, failed: Counter
              ) -> tuple[list, list]:
        """Copy each object of ``batch`` (at the version the walk saw) out of the tier into
        ``mv``, pinned only for the copy, and check the copy against the object's
        checksum: ``(objects kept, [(object, its copy)])``."""
        tier = self.tier
        kept, copied, at = [], [], 0
        for h in batch:
            p = tier.pin_read(ns, h.key, 0, h.length, h.version)
            if p.status == Status.OK:
                try:
                    n = len(p.view) if p.view is not None else -1
                    good = n == p.total_len == h.length
                    if good:
                        dst = mv[at:at + n]
                        dst[:] = p.view
                        good = checksum(dst) == p.checksum
                finally:
                    tier.unpin(p)
                if good:
                    copied.append((h, dst))
                    at += n
                    continue
                tier.delete_if_version(ns, h.key, h.version)  # never pass those bytes on
                self._count(lost=1)
                log.error("handoff: %r/%r failed its checksum; dropped", ns, h.key)
            elif p.status == Status.CORRUPT:  # the tier dropped and counted it
                self._count(lost=1)
            elif p.status == Status.CONFLICT:  # replaced meanwhile: the next pass
                kept.append(h)
                failed["replaced"] += 1
            # else MISS: deleted or evicted meanwhile, nothing to move
        return kept, copied

    def _finish(self, client: Any, f: _Flight, view: View, pool: list[bytearray],
                failed: Counter) -> _PassStats:
        """Wait for a batch's put; after an OK, delete the local copy if this very view
        placed it elsewhere and it is still that version; count; its buffer back to
        ``pool``."""
        kept = f.kept
        moved = nbytes = 0
        if f.put is not None:
            try:
                statuses = f.put.result(timeout=PUT_TIMEOUT_MS / 1000 + 5.0)
            except Exception:  # defensive: the SDK completes every put by its deadline
                statuses = [Status.TIMEOUT] * len(f.out)
            # epochs only grow: an equal epoch after the put means it was routed by it
            same_view = client.view.epoch == view.epoch and not self._superseded(view)
            due = self.clock.monotonic() + self.grace_s
            for h, st in zip(f.out, statuses):
                if st == Status.OK:
                    moved += 1
                    nbytes += h.length
                    if same_view:
                        self._doomed.append((due, f.ns, h))
                        continue
                    failed["view changed"] += 1
                else:
                    failed[Status(st).name.lower()] += 1
                kept.append(h)
        if f.buf is not None and len(f.buf) == self.batch_bytes:
            pool.append(f.buf)
        kept_bytes = sum(h.length for h in kept)
        with self._lock:
            c = self._c
            c["handoff_objects_moved"] += moved
            c["handoff_bytes_moved"] += nbytes
            c["handoff_objects_left"] -= len(f.batch) - len(kept)
            c["handoff_bytes_left"] -= sum(h.length for h in f.batch) - kept_bytes
            c["handoff_waiting"] += len(kept)
        return _PassStats(moved, len(kept), kept_bytes)


def _add(a: _PassStats, b: _PassStats) -> _PassStats:
    return _PassStats(a.moved + b.moved, a.waiting + b.waiting, a.waiting_bytes + b.waiting_bytes)


def _batches(objs: list, max_bytes: int):
    """``objs`` cut into runs of at most ``max_bytes`` (at least one object) and
    ``BATCH_ITEMS`` objects."""
    batch: list = []
    size = 0
    for h in objs:
        if batch and (size + h.length > max_bytes or len(batch) >= BATCH_ITEMS):
            yield batch
            batch, size = [], 0
        batch.append(h)
        size += h.length
    if batch:
        yield batch
