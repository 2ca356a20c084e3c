"""The replicated membership log: pysyncobj underneath, our state machine on top.

Design. ``RaftNode`` is the one place that knows pysyncobj (so it can be
replaced): every membership change is one ``apply_op`` log entry, applied by
``Membership.apply`` on every replica in log order.

* Exactly-once application. pysyncobj replays its journal on restart and may
  re-send entries; the state machine stores the Raft index of the last entry
  it applied in the same RocksDB write batch as the state, and skips any entry
  at or below it. Ops are also idempotent on their own (a write whose caller
  timed out may still commit).
* Durability. RocksDB writes are synced (survive an OS crash); pysyncobj's
  journal is an mmap file without fsync, so after an OS crash a node may lose
  its log tail and catches up from its peers. Snapshots (log compaction and
  catch-up of a wiped node) carry the whole membership and the applied index;
  the snapshot file is written and fsynced before pysyncobj drops the log
  entries it covers.
* Always run with a password: pysyncobj uses pickle on the wire. The password is
  the masters' own secret (see ``master/cli.py``), and, as a second wall, the
  frames pysyncobj receives are unpickled by ``master/plain_pickle.py``: only
  plain data (dict, list, tuple, str, bytes, numbers, set), never a lookup of
  anything callable, so even a peer holding the secret cannot run code by a
  frame. The commands frames carry (pickled bytes) are unpickled the same way
  when applied, and so is the journal's ``.meta`` file at start.
* Snapshots are not pickle (``master/raft_snapshot.py``: magic + msgpack, our
  membership and pysyncobj's two entries and node addresses as plain fields),
  whether our own file at start or one a peer sends to catch this master up.
  Older pickled (format 1) files are read as plain data with pysyncobj's node
  class mapped to an inert stand-in. A refused file at start stops the master
  with what to do (``check_snapshot_file``): pysyncobj would only log it and
  then run on a compacted journal it can never apply. A refused file from a peer
  is logged and not loaded; this master stays behind.
* ``is_leader`` is pysyncobj's own view; two nodes may briefly both believe
  it, which is safe because every decision is a log write that only a real
  majority can commit.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import pysyncobj.journal
import pysyncobj.serializer
import pysyncobj.syncobj
import pysyncobj.tcp_connection
from pysyncobj import SyncObj, SyncObjConf, replicated
from pysyncobj.config import FAIL_REASON
from pysyncobj.node import TCPNode

from gcache.master import raft_snapshot
from gcache.master.membership import Membership
from gcache.master.plain_pickle import PlainPickle
from gcache.master.raft_snapshot import LogEntry, RaftSnapshot, SnapshotRefused
from gcache.master.store import Store

log = logging.getLogger("gcache.master.raft")


def _restrict_pysyncobj_unpickling() -> None:
    """Make pysyncobj unpickle as plain data only, everywhere it unpickles (idempotent).

    pysyncobj has no hook for this: its ``tcp_connection`` module calls
    ``pickle.loads`` on every decrypted frame, its ``syncobj`` module on every
    command it applies (ours are ``(func id, args, kwargs)`` of plain dicts), its
    ``serializer`` module on a full dump when no deserializer is configured (we
    always configure one; closed anyway) and its ``journal`` module (``loads``) on
    the journal's ``.meta`` file at start; so those names are replaced. Checked, so
    a pysyncobj that changed shape fails loudly here. (Dynamic membership commands
    carry node objects; they are off: ``dynamicMembershipChange=False``.)
    """
    for mod, attrs in ((pysyncobj.tcp_connection, ("loads", "dumps")),
                       (pysyncobj.syncobj, ("loads", "dumps")),
                       (pysyncobj.serializer, ("load", "dump", "to_bytes"))):
        current = getattr(mod, "pickle", None)
        if current is PlainPickle:
            continue
        if not all(callable(getattr(current, a, None)) for a in attrs):
            raise RuntimeError(f"{mod.__name__} no longer unpickles through a module named "
                               "pickle: re-check gcache.master.raft_node before upgrading "
                               "pysyncobj")
        mod.pickle = PlainPickle
    journal = pysyncobj.journal
    if journal.loads is not PlainPickle.loads:
        if not callable(getattr(journal, "loads", None)):
            raise RuntimeError("pysyncobj.journal no longer reads its meta file through "
                               "loads: re-check gcache.master.raft_node before upgrading "
                               "pysyncobj")
        journal.loads = PlainPickle.loads


def check_snapshot_file(path: str) -> RaftSnapshot | None:
    """Read and check the snapshot file at ``path`` (None if there is none).

    Raises ``SnapshotRefused`` naming the file and what to do. Used at start, before
    pysyncobj loads the file itself: pysyncobj only logs a snapshot it failed to load
    and would then run on a compacted journal it can never apply.
    """
    if not os.path.exists(path):
        return None
    try:
        snap = raft_snapshot.read(path)
        Membership.restore(snap.membership)  # its own checks (no store: parse only)
    except (OSError, ValueError) as exc:
        raise SnapshotRefused(
            f"the Raft snapshot {path} is refused ({exc}); it was not loaded and ran no "
            "code. Move this master's data directory aside and start it again: it then "
            "catches up from its peers (a lone master starts empty and servers "
            "re-register)") from None
    return snap


class RaftNode(SyncObj):
    def __init__(self, self_addr: str, partners: list[str], data_dir: str, password: str,
                 *, on_leader_change: Callable[[bool], None] | None = None,
                 min_timeout: float = 0.15, max_timeout: float = 0.35,
                 append_period: float = 0.03, compaction_min_entries: int = 5000) -> None:
        _restrict_pysyncobj_unpickling()
        os.makedirs(data_dir, exist_ok=True)
        snapshot_file = os.path.join(data_dir, "raft.snapshot")
        found = check_snapshot_file(snapshot_file)  # before any state is opened
        if found is not None and found.format != raft_snapshot.FORMAT:
            log.info("read the format-%d (pickled) Raft snapshot %s as plain data; the next "
                     "log compaction rewrites it as format %d", found.format, snapshot_file,
                     raft_snapshot.FORMAT)
        self._store = Store(os.path.join(data_dir, "state.rocksdb"))
        self.membership = Membership(self._store)
        self._changed = threading.Condition()
        self._on_leader_change = on_leader_change
        conf = SyncObjConf(
            password=password or None,
            journalFile=os.path.join(data_dir, "raft.journal"),
            fullDumpFile=snapshot_file,
            serializer=self._save_snapshot, deserializer=self._load_snapshot,
            dynamicMembershipChange=False,
            raftMinTimeout=min_timeout, raftMaxTimeout=max_timeout,
            appendEntriesPeriod=append_period, connectionTimeout=1.0,
            # pysyncobj's default 5 s retry left a peer link down for seconds when a peer
            # started a moment later, stalling the next election; DNS is re-resolved often
            # so a rescheduled master pod with a new IP is found again quickly.
            connectionRetryTime=0.3, dnsCacheTime=5.0,
            logCompactionMinEntries=compaction_min_entries, logCompactionMinTime=300,
            onStateChanged=self._state_changed,
        )
        super().__init__(self_addr, partners, conf)

    # ------------------------------------------------------------------ replicated
    @replicated
    def apply_op(self, op: dict) -> dict:
        index = self.raftLastApplied + 1  # the entry being applied (pysyncobj increments after)
        res = self.membership.apply(op, index=index)
        if res.get("changed"):
            with self._changed:
                self._changed.notify_all()
        return res

    def submit(self, op: dict, timeout: float = 3.0) -> dict:
        """Replicate one op and wait for its result. Raises TimeoutError/RuntimeError.

        Callers must tolerate "timed out but committed later": ops are idempotent.
        """
        done = threading.Event()
        box: dict[str, Any] = {}

        def cb(res: Any, err: int) -> None:
            box["res"], box["err"] = res, err
            done.set()

        self.apply_op(op, callback=cb)
        if not done.wait(timeout):
            raise TimeoutError("the Raft group did not commit in time (no quorum?)")
        if box["err"] != FAIL_REASON.SUCCESS:
            raise RuntimeError(f"Raft write failed: reason {box['err']} (leader changed?)")
        return box["res"]

    # ------------------------------------------------------------------ queries
    @property
    def is_leader(self) -> bool:
        return self._isLeader()

    def readiness(self) -> tuple[bool, str]:
        """``(ready, why)``: ready while a leader is known and this master is connected
        to a quorum (pysyncobj keeps a dead leader's name on a follower connected to
        nobody, so a known leader alone is not enough)."""
        if not self.hasQuorum:
            return False, "no quorum of masters reachable"
        if self._getLeader() is None:
            return False, "no Raft leader (an election is under way)"
        return True, "Raft leader" if self._isLeader() else "follower of a Raft leader"

    @property
    def leader(self) -> str | None:
        lead = self._getLeader()
        return None if lead is None else str(getattr(lead, "address", lead))

    def wait_epoch(self, since: int, timeout: float) -> None:
        """Block until the applied epoch moves past ``since`` or ``timeout`` passes."""
        with self._changed:
            self._changed.wait_for(lambda: self.membership.epoch > since, timeout)

    def close(self) -> None:
        self.destroy()
        self._store.close()

    # ------------------------------------------------------------------ snapshots
    def _save_snapshot(self, filename: str, raft_meta: Any) -> None:
        """pysyncobj's serializer (its thread, which also applies entries, so the
        membership is exactly at ``last``): ``raft_meta`` is (last applied entry, the
        entry before it, the cluster's nodes)."""
        try:
            last, prev, cluster = raft_meta
            raft_snapshot.write(filename, RaftSnapshot(
                membership=self.membership.snapshot(),
                applied_index=self.membership.applied_index,
                last=LogEntry(*last), prev=LogEntry(*prev),
                cluster=tuple(sorted(str(node.id) for node in cluster))))
        except Exception:  # pysyncobj only counts the failure: say why
            log.exception("could not write the Raft snapshot %s", filename)
            raise

    def _load_snapshot(self, filename: str) -> Any:
        """pysyncobj's deserializer: our own file at start, or one a peer sent to catch
        this master up. Returns pysyncobj's part as it gave it to ``_save_snapshot``."""
        try:
            snap = raft_snapshot.read(filename)
        except (OSError, ValueError) as exc:
            log.error("refused the Raft snapshot %s (%s): not loaded, no code run; this "
                      "master stays behind until a valid one or the log catches it up",
                      filename, exc)
            raise
        if snap.applied_index > self.membership.applied_index:
            # a peer's snapshot (catch-up) or our own newer one: adopt it
            self.membership = Membership.restore(snap.membership, self._store,
                                                 applied_index=snap.applied_index)
        return tuple(snap.last), tuple(snap.prev), {TCPNode(a) for a in snap.cluster}

    def _state_changed(self, old: int, new: int) -> None:
        leader = new == 2  # pysyncobj _RAFT_STATE.LEADER
        log.info("raft state %s -> %s", old, new)
        if self._on_leader_change is not None:
            self._on_leader_change(leader)
