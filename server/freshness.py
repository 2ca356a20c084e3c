"""The freshness rule: a server never serves a ``mutable`` namespace's value older than
one acknowledged elsewhere while it was away or while the key had another owner.

Namespace kinds (``gcache.namespace_kinds``): a ``content`` namespace's key names its
value, so any held copy is correct after any change and is always kept (a restart is
warm). The rule below applies to ``mutable`` namespaces (``mutable_namespaces``) of a
server with masters; without masters there is no membership and nothing to reconcile.

Versions. The memory tier hands out increasing versions (``MemoryTier.next_version``;
the disk tier's records carry theirs), so "the objects held before moment T" is
"version < the mark taken at T". The rule never drops an object put after the view it
reconciles was adopted.

1. Restart (the first view adopted, the one registration returns). The server persists
   the epoch of the last view it adopted while it was in the ring (``EpochFile``, a
   small file next to the arena; written after each adoption). Registering under a new
   process always bumps the master's epoch by one (new incarnation), so the epoch just
   before our registration is the register answer's ``member.changed_epoch - 1``. When
   that equals the persisted epoch and the view returned is our registration's own
   epoch, nothing happened to the membership while the server was away: nobody else
   owned its ranges, and its objects are kept. Otherwise (a member went down or came
   up, ours included, the file was missing, or the masters were never reached before
   the first view) every object of a mutable namespace held from the old life (version
   below the boot mark) is dropped from both tiers (``stale_dropped``) before the view
   is routed by.
2. Running. When a view is adopted after view ``old`` (adopted at version mark ``m``),
   every held mutable object with version < ``m`` whose key this server owns in the new
   view but did not own in ``old`` (a range came back: ``old`` gave it to someone
   else, or ``old`` did not have this server in its ring at all) is dropped from both
   tiers. When the new epoch is not ``old``'s plus one, views were skipped (the watcher
   only sees the latest), so any owned range may have been away and back: every owned
   mutable object with version < ``m`` is dropped. Objects put while ``old`` was current
   into ranges ``old`` did not give us came from clients with a newer view, so they are
   newer than anything written elsewhere: kept.
3. Reads. A GET, EXISTS or LEASE item of a mutable namespace is answered only when this
   server has reconciled a view, the client's epoch (``ep``) is not newer than it (a
   newer view may give back a range this server has not reconciled yet), and, when the
   client sends placement hashes (``ph``), this server owns the key in that view; else
   MISS. So a ``"ho": 1`` read (a client asking a key's previous owner) of a mutable
   namespace is a MISS at a server that no longer owns the key: the new owner's miss may
   be the eviction of a newer value. A client without ``ph`` (a static server list)
   skips the ownership part.

Which range a held object belongs to: the placement hash it was put with (``HeldObject.ph``,
its group's for ``group=`` keys), else ``placement_hash(ns, key)``, as the handoff does.

Threads. ``adopt`` runs on the membership agent's view thread (which also adopts the
view a registration returned), serialised by the agent, before the agent routes by the
view; it walks ``Tier.held()`` and may take time in proportion to the objects held
(only when mutable namespaces are configured); heartbeats go on meanwhile. ``readable`` and ``is_mutable`` run
on connection threads and never block. ``stats`` runs on any thread.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Sequence

from gcache.hashing import placement_hash
from gcache.namespace_kinds import NamespaceKinds
from gcache.view import View

log = logging.getLogger("gcache.server.freshness")


class EpochFile:
    """The last ring epoch this server adopted while it was in the ring: a decimal in a
    small file, replaced atomically (write a temporary, rename). -1: unknown (no file,
    unreadable). A write failure is logged and leaves the old file (the next restart then
    finds an older epoch and drops its mutable objects: the safe side)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def load(self) -> int:
        try:
            with open(self.path, "rb") as fh:
                text = fh.read(32)
            value = int(text.decode("ascii").strip())
            return value if value >= 0 else -1
        except (OSError, ValueError, UnicodeDecodeError):
            return -1

    def store(self, epoch: int) -> None:
        tmp = self.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"%d\n" % epoch)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("cannot persist the ring epoch to %s: %s (a restart will drop the "
                      "mutable namespaces' objects)", self.path, exc)

    def remove(self) -> None:
        for p in (self.path, self.path + ".tmp"):
            try:
                os.unlink(p)
            except OSError:
                pass


class Freshness:
    """The freshness rule of one server (see the module docstring).

    ``tier``: the server's ``Tier`` (``held``, ``delete_if_version``); ``kinds``: which
    namespaces are mutable; ``member_id``: this server's name; ``epoch_file``: where
    the last member epoch persists; ``version_mark``: the memory tier's
    ``next_version`` (read once here: the boot mark, and at each adoption).
    """

    def __init__(self, tier: Any, kinds: NamespaceKinds, member_id: str,
                 epoch_file: EpochFile, version_mark: Callable[[], int]) -> None:
        self.tier, self.kinds, self.member_id = tier, kinds, member_id
        self.epoch_file = epoch_file
        self._version_mark = version_mark
        self._boot_mark = version_mark()
        self._persisted = epoch_file.load()
        self._view: View | None = None  # the last view reconciled
        self._mark = self._boot_mark  # the version mark when _view was adopted
        self._lock = threading.Lock()  # the counter
        self._dropped = 0

    # ------------------------------------------------------------------ connection threads
    def is_mutable(self, ns: bytes) -> bool:
        return self.kinds.is_mutable(ns)

    def readable(self, client_epoch: int | None, hashes: Sequence[int] | None, n: int
                 ) -> list[bool]:
        """Per item of a mutable namespace's read frame: may this server answer it (rule
        3)? ``client_epoch``: the frame's ``ep`` (None: a static client); ``hashes``: its
        checked ``ph`` (None: not sent)."""
        view = self._view
        if view is None or (client_epoch is not None and client_epoch > view.epoch):
            return [False] * n
        if hashes is None:
            return [True] * n
        ring = view.ring
        if len(ring) == 0:
            return [False] * n
        return [m.id == self.member_id for m in ring.owners(hashes)]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"stale_dropped": self._dropped}

    # ------------------------------------------------------------------ agent's thread
    def adopt(self, view: View, registered_before: int | None = None) -> None:
        """Reconcile the tier with ``view`` before the agent routes by it (rules 1, 2),
        then persist its epoch if this server is in its ring. ``registered_before``: for
        a view a registration returned, the master's epoch just before it."""
        old, mark = self._view, self._mark
        new_mark = self._version_mark()
        me = self.member_id
        if self.kinds.any_mutable:
            if old is None:
                keep = (registered_before is not None and self._persisted >= 0
                        and registered_before == self._persisted
                        and view.epoch == registered_before + 1)
                if keep:
                    log.info("restart at epoch %d: no membership change since epoch %d, "
                             "mutable namespaces kept", view.epoch, self._persisted)
                else:
                    n = self._drop(lambda objs: [True] * len(objs), self._boot_mark)
                    log.warning(
                        "restart at epoch %d (last epoch as a ring member: %s, before our "
                        "registration: %s): the membership may have changed while this "
                        "server was away; dropped %d objects of mutable namespaces",
                        view.epoch, self._persisted if self._persisted >= 0 else "unknown",
                        registered_before if registered_before is not None else "unknown", n)
            elif me in view.ring:
                skipped = view.epoch != old.epoch + 1
                new_ring, old_ring = view.ring, old.ring

                def came_back(objs: list) -> list[bool]:
                    hashes = [placement_hash(h.ns, h.key) if h.ph is None else h.ph for h in objs]
                    now = [m.id == me for m in new_ring.owners(hashes)]
                    if skipped or me not in old_ring:
                        return now
                    before = old_ring.owners(hashes)
                    return [a and b.id != me for a, b in zip(now, before)]

                n = self._drop(came_back, mark)
                if n:
                    log.warning("epoch %d (after %d%s): dropped %d objects of mutable "
                                "namespaces whose range came back to this server", view.epoch,
                                old.epoch, ", views skipped" if skipped else "", n)
        self._view, self._mark = view, new_mark
        if me in view.ring:
            self.epoch_file.store(view.epoch)
            self._persisted = view.epoch

    def _drop(self, which: Callable[[list], list[bool]], below: int) -> int:
        """Drop the held mutable objects with version < ``below`` that ``which`` picks
        (called with batches of ``HeldObject``); the number dropped."""
        batch: list = []
        dropped = 0

        def flush() -> int:
            n = 0
            for h, pick in zip(batch, which(batch)):
                if pick and self.tier.delete_if_version(h.ns, h.key, h.version):
                    n += 1
            batch.clear()
            return n

        for h in self.tier.held():
            if h.version < below and self.kinds.is_mutable(h.ns):
                batch.append(h)
                if len(batch) >= 1024:
                    dropped += flush()
        dropped += flush()
        with self._lock:
            self._dropped += dropped
        return dropped


__all__ = ["EpochFile", "Freshness"]
