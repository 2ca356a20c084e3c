"""The masters' Raft snapshot file: written at log compaction, sent to a lagging
master, read back at start. Never pickle.

Layout (format 2)::

    b"GCACHE-RAFT-SNAPSHOT\\n"     magic, 21 bytes
    msgpack map {
      "version":       2,
      "membership":    bin,   Membership.snapshot() (msgpack, checked by its own parser)
      "applied_index": int,   Raft index of the last op the membership applied
      "last":          [bin command, int index, int term],  pysyncobj's last applied entry
      "prev":          [bin command, int index, int term],  the entry before it
      "cluster":       [str, ...],   pysyncobj's node ids (the masters' Raft addresses)
    }

pysyncobj hands its part of a snapshot to our serializer as ``(last, prev,
cluster)``; it is written out field by field and read back as the same plain
values (``raft_node`` turns addresses back into pysyncobj nodes), so reading a
snapshot, whether our own file at start or one a peer sent, runs no code.

Format 1 (older masters) was a pickle of ``{"membership", "applied_index",
"raft": pickle of (last, prev, cluster)}``. It is still read, for upgrades (the
next compaction rewrites the file as format 2), but only with the plain-data
unpickler: the one class allowed is the one pysyncobj puts there,
``pysyncobj.node.TCPNode``, and it is loaded as an inert stand-in of which only
the id (a string) is kept; any other global is refused.

Whatever fails these checks raises ``SnapshotRefused`` (a ``ValueError``); a
file over ``MAX_SNAPSHOT_BYTES`` is refused before it is read.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, NamedTuple

import msgpack

from gcache.errors import SnapshotRefused
from gcache.master.plain_pickle import PlainDataUnpickler

__all__ = ["FORMAT", "MAGIC", "MAX_SNAPSHOT_BYTES", "LogEntry", "RaftSnapshot",
           "SnapshotRefused", "decode", "encode", "read", "write"]

MAGIC = b"GCACHE-RAFT-SNAPSHOT\n"
FORMAT = 2
LEGACY_FORMAT = 1
MAX_SNAPSHOT_BYTES = 64 << 20  # the membership of ~100k members is ~20 MiB
_MAX_CLUSTER = 1024

_KEYS = ("version", "membership", "applied_index", "last", "prev", "cluster")
_LEGACY_KEYS = ("membership", "applied_index", "raft")


class LogEntry(NamedTuple):
    """One pysyncobj journal entry: the command bytes, its Raft index and term."""

    command: bytes
    index: int
    term: int


class RaftSnapshot(NamedTuple):
    membership: bytes   # Membership.snapshot()
    applied_index: int  # the membership's applied Raft index
    last: LogEntry      # pysyncobj's last applied entry ...
    prev: LogEntry      # ... and the one before it (index - 1)
    cluster: tuple[str, ...]  # pysyncobj node ids: the masters' Raft addresses
    format: int = FORMAT  # the format it was read from


def encode(snap: RaftSnapshot) -> bytes:
    doc = {"version": FORMAT, "membership": bytes(snap.membership),
           "applied_index": snap.applied_index,
           "last": list(snap.last), "prev": list(snap.prev), "cluster": list(snap.cluster)}
    _check(doc, FORMAT)  # never write what we would refuse to read
    return MAGIC + msgpack.packb(doc, use_bin_type=True)


def decode(data: bytes) -> RaftSnapshot:
    """A snapshot from file bytes (format 2, or format 1 read as plain data only)."""
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotRefused(f"{len(data)} bytes, over the {MAX_SNAPSHOT_BYTES} limit")
    if data.startswith(MAGIC):
        try:
            doc = msgpack.unpackb(data[len(MAGIC):], raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise SnapshotRefused(f"not valid msgpack: {exc}") from None
        return _check(doc, FORMAT)
    if data[:1] == pickle.PROTO:
        return _decode_legacy(data)
    raise SnapshotRefused("not a gcache Raft snapshot (no magic, not a format-1 pickle)")


def read(path: str) -> RaftSnapshot:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_SNAPSHOT_BYTES:
            raise SnapshotRefused(f"{size} bytes, over the {MAX_SNAPSHOT_BYTES} limit")
        return decode(f.read(MAX_SNAPSHOT_BYTES + 1))


def write(path: str, snap: RaftSnapshot) -> None:
    """Write and fsync (pysyncobj renames the file into place, then drops the log
    entries it covers, so a torn snapshot after an OS crash would lose them)."""
    data = encode(snap)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------- checks
def _check(doc: Any, version: int) -> RaftSnapshot:
    if not isinstance(doc, dict):
        raise SnapshotRefused("not a mapping")
    keys = _KEYS if version == FORMAT else ("membership", "applied_index", "last", "prev",
                                            "cluster")
    if set(doc) != set(keys):
        raise SnapshotRefused(f"fields {sorted(map(str, doc))}, want {sorted(keys)}")
    if version == FORMAT and doc["version"] != FORMAT:
        raise SnapshotRefused(f"unsupported version {doc['version']!r} (this master reads "
                              f"{LEGACY_FORMAT} and {FORMAT}: upgrade it)")
    if not isinstance(doc["membership"], bytes):
        raise SnapshotRefused("membership must be bytes")
    last, prev = _entry("last", doc["last"]), _entry("prev", doc["prev"])
    if prev.index + 1 != last.index or prev.term > last.term:
        raise SnapshotRefused(f"entries {prev.index}/{prev.term} and {last.index}/{last.term} "
                              "are not consecutive")
    cluster = doc["cluster"]
    if (not isinstance(cluster, (list, tuple)) or len(cluster) > _MAX_CLUSTER
            or not all(isinstance(a, str) for a in cluster)):
        raise SnapshotRefused("cluster must be a list of node addresses")
    return RaftSnapshot(doc["membership"], _int("applied_index", doc["applied_index"]),
                        last, prev, tuple(cluster), version)


def _int(name: str, v: Any) -> int:
    if type(v) is not int or v < 0:
        raise SnapshotRefused(f"{name} must be an integer >= 0, got {v!r}")
    return v


def _entry(name: str, v: Any) -> LogEntry:
    if not isinstance(v, (list, tuple)) or len(v) != 3 or not isinstance(v[0], bytes):
        raise SnapshotRefused(f"{name} entry must be [command bytes, index, term]")
    return LogEntry(v[0], _int(f"{name} index", v[1]), _int(f"{name} term", v[2]))


# ---------------------------------------------------------------------- format 1
class _LegacyNode:
    """Stands in for ``pysyncobj.node.TCPNode`` in a format-1 snapshot: no code of its
    own runs (``__new__`` then ``__setstate__``); only the node id, a str, is kept."""

    __slots__ = ("id",)

    def __setstate__(self, state: Any) -> None:
        node_id = state.get("_id") if isinstance(state, dict) else None
        if not isinstance(node_id, str):
            raise pickle.UnpicklingError("format-1 snapshot node without a string id")
        self.id = node_id


class _LegacySnapshotUnpickler(PlainDataUnpickler):
    WHAT = "Raft snapshot"
    _ALLOWED = {**PlainDataUnpickler._ALLOWED, ("pysyncobj.node", "TCPNode"): _LegacyNode}


def _unpickle(data: bytes) -> Any:
    try:
        return _LegacySnapshotUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # UnpicklingError, EOFError, ValueError... on a bad pickle
        raise SnapshotRefused(f"format-1 pickle refused: {exc}") from None


def _decode_legacy(data: bytes) -> RaftSnapshot:
    blob = _unpickle(data)
    if not isinstance(blob, dict) or set(blob) != set(_LEGACY_KEYS):
        raise SnapshotRefused(f"format-1 fields must be {sorted(_LEGACY_KEYS)}")
    if not isinstance(blob["raft"], bytes):
        raise SnapshotRefused("format-1 raft part must be bytes")
    meta = _unpickle(blob["raft"])
    if not isinstance(meta, tuple) or len(meta) != 3 or not isinstance(meta[2], (set, frozenset)):
        raise SnapshotRefused("format-1 raft part must be (last entry, prev entry, nodes)")
    if not all(isinstance(getattr(n, "id", None), str) for n in meta[2]):
        raise SnapshotRefused("format-1 cluster must hold pysyncobj nodes")
    return _check({"membership": blob["membership"], "applied_index": blob["applied_index"],
                   "last": meta[0], "prev": meta[1],
                   "cluster": sorted(n.id for n in meta[2])}, LEGACY_FORMAT)
