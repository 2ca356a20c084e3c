"""Durable copy of the master's replicated membership state, in RocksDB (rocksdict).

Design. The store is a dumb, crash-safe mirror of ``Membership``: it never decides
anything, it only writes what the state machine computed, and every write is one
``WriteBatch`` committed with ``WriteOptions.sync = True``. A batch is atomic, so a
crash leaves either the state before an op or the state after it, never a mix.

Durability split. The sync write fsyncs RocksDB's WAL, so the *applied* state
survives a process crash and an OS crash / power loss. pysyncobj's own journal is an
mmap file that is never fsynced, so after an OS crash a node can come back with
applied state that is ahead of (or behind) its Raft log; it must then catch up from
its peers (log entries or a snapshot). That is safe because every op is idempotent
(re-applying entries the store already holds changes nothing) and ``replace_all``
installs a snapshot atomically.

Layout (raw mode: bytes keys, msgpack values)::

    meta/epoch     -> int     membership epoch
    meta/applied   -> int     ops applied through this store (diagnostics only;
                              local, monotonically increasing, not replicated state)
    meta/applied_index -> int Raft log index of the last applied entry (0: none /
                              untracked); written in the same batch as the state it
                              produced, so replays of entries at or below it are skipped
    member/<id>    -> dict    MemberRecord.to_dict()
    fence/<id>     -> int     last incarnation of a *removed* member, so that a
                              re-registered id starts above it (see membership.py);
                              present only while member/<id> is absent

rocksdict caveat: a live iterator keeps the DB's LOCK file after ``close()``, so
every scan here drops its iterator before returning, and ``close`` is idempotent.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType
from typing import Any

import msgpack
from rocksdict import Options, Rdict, WriteBatch, WriteOptions

__all__ = ["Store"]

EPOCH_KEY = b"meta/epoch"
APPLIED_KEY = b"meta/applied"
INDEX_KEY = b"meta/applied_index"
MEMBER_PREFIX = b"member/"
FENCE_PREFIX = b"fence/"


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])  # our prefixes end in b"/" (0x2f)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def _key(prefix: bytes, member_id: str) -> bytes:
    if not isinstance(member_id, str) or not member_id:
        raise ValueError(f"member id must be a non-empty string, got {member_id!r}")
    return prefix + member_id.encode("utf-8")


class Store:
    """RocksDB-backed durable membership state. One process may open a path at a time."""

    __slots__ = ("_path", "_db", "_sync", "_applied", "_applied_index", "_lock")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        os.makedirs(self._path, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db: Rdict | None = Rdict(self._path, opts)
        self._sync = WriteOptions()
        self._sync.sync = True
        self._lock = threading.Lock()
        raw = self._db.get(APPLIED_KEY)
        self._applied = int(_unpack(raw)) if raw is not None else 0
        raw = self._db.get(INDEX_KEY)
        self._applied_index = int(_unpack(raw)) if raw is not None else 0

    # ------------------------------------------------------------ lifecycle
    @property
    def path(self) -> str:
        return self._path

    @property
    def closed(self) -> bool:
        return self._db is None

    @property
    def applied(self) -> int:
        """How many ``write`` calls (one per applied op, including no-ops) this store has seen."""
        return self._applied

    @property
    def applied_index(self) -> int:
        """Raft index of the last entry whose result is stored (0 if none or untracked)."""
        return self._applied_index

    def close(self) -> None:
        """Flush and release the DB lock. Idempotent."""
        with self._lock:
            db, self._db = self._db, None
            if db is not None:
                db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _open_db(self) -> Rdict:
        if self._db is None:
            raise ValueError(f"store {self._path!r} is closed")
        return self._db

    # ------------------------------------------------------------ reads
    def _scan_dict(self, db: Rdict, prefix: bytes) -> dict[str, Any]:
        out: dict[str, Any] = {}
        it = db.items(from_key=prefix)
        try:
            for key, value in it:
                if not key.startswith(prefix):
                    break
                out[key[len(prefix):].decode("utf-8")] = _unpack(value)
        finally:
            del it  # a live iterator would keep the DB lock after close()
        return out

    def load(self) -> tuple[int, dict[str, dict]]:
        """``(epoch, {id: record dict})`` as last written; ``(0, {})`` for a fresh store."""
        with self._lock:
            db = self._open_db()
            raw = db.get(EPOCH_KEY)
            epoch = int(_unpack(raw)) if raw is not None else 0
            members = self._scan_dict(db, MEMBER_PREFIX)
        for member_id, record in members.items():
            if not isinstance(record, dict) or record.get("id") != member_id:
                raise ValueError(f"store {self._path!r}: corrupt record under member/{member_id}")
        return epoch, members

    def load_fences(self) -> dict[str, int]:
        """``{id: last incarnation}`` for removed members (see the module docstring)."""
        with self._lock:
            fences = self._scan_dict(self._open_db(), FENCE_PREFIX)
        for member_id, inc in fences.items():
            if isinstance(inc, bool) or not isinstance(inc, int):
                raise ValueError(f"store {self._path!r}: corrupt value under fence/{member_id}")
        return fences

    # ------------------------------------------------------------ writes
    def write(self, epoch: int, upserts: dict[str, dict], deletes: list[str], *,
              fences: dict[str, int] | None = None, applied_index: int | None = None) -> None:
        """Persist one applied op atomically and durably (one synced ``WriteBatch``).

        ``upserts`` are full record dicts by id, ``deletes`` are ids to drop, ``fences``
        maps removed ids to their last incarnation. Upserting an id clears its fence.
        ``meta/applied`` is bumped in the same batch, so call this for no-ops too;
        ``applied_index`` (if given) is recorded in it as well.
        """
        _check_epoch(epoch)
        if applied_index is not None:
            _check_epoch(applied_index, "applied_index")
        fences = fences or {}
        overlap = set(upserts) & (set(deletes) | set(fences))
        if overlap:
            raise ValueError(f"ids both upserted and deleted/fenced: {sorted(overlap)}")
        with self._lock:
            db = self._open_db()
            batch = WriteBatch(raw_mode=True)
            batch.put(EPOCH_KEY, _pack(epoch))
            batch.put(APPLIED_KEY, _pack(self._applied + 1))
            if applied_index is not None:
                batch.put(INDEX_KEY, _pack(applied_index))
            for member_id, record in upserts.items():
                if not isinstance(record, dict) or record.get("id") != member_id:
                    raise ValueError(f"upsert for {member_id!r} is not its record dict")
                batch.put(_key(MEMBER_PREFIX, member_id), _pack(record))
                batch.delete(_key(FENCE_PREFIX, member_id))
            for member_id in deletes:
                batch.delete(_key(MEMBER_PREFIX, member_id))
            for member_id, inc in fences.items():
                batch.put(_key(FENCE_PREFIX, member_id), _pack(int(inc)))
            db.write(batch, self._sync)
            self._applied += 1
            if applied_index is not None:
                self._applied_index = applied_index

    def replace_all(self, epoch: int, members: dict[str, dict],
                    fences: dict[str, int] | None = None, *, applied_index: int = 0) -> None:
        """Atomically replace every member and fence (installing a Raft snapshot).

        ``applied_index`` is replaced too (the snapshot's log position). ``meta/applied``
        is left alone: it counts local applies, not replicated state.
        """
        _check_epoch(epoch)
        _check_epoch(applied_index, "applied_index")
        with self._lock:
            db = self._open_db()
            batch = WriteBatch(raw_mode=True)
            batch.delete_range(MEMBER_PREFIX, _prefix_end(MEMBER_PREFIX))
            batch.delete_range(FENCE_PREFIX, _prefix_end(FENCE_PREFIX))
            batch.put(EPOCH_KEY, _pack(epoch))
            batch.put(INDEX_KEY, _pack(applied_index))
            for member_id, record in members.items():
                if not isinstance(record, dict) or record.get("id") != member_id:
                    raise ValueError(f"record for {member_id!r} is not its record dict")
                batch.put(_key(MEMBER_PREFIX, member_id), _pack(record))
            for member_id, inc in (fences or {}).items():
                batch.put(_key(FENCE_PREFIX, member_id), _pack(int(inc)))
            db.write(batch, self._sync)
            self._applied_index = applied_index


def _check_epoch(value: object, name: str = "epoch") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
