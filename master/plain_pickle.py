"""Pickle restricted to plain data: what the masters accept from pysyncobj's pickles.

pysyncobj pickles everything it sends between masters (frames, the commands they
carry) and its own journal metadata. ``PlainDataUnpickler`` loads such a pickle
only if it is plain data (dict, list, tuple, str, bytes, numbers, None, set,
frozenset) and refuses any other global, which is how a pickle runs code. The
only globals it resolves are the two pickle protocol 2 needs for bytes
(``_codecs.encode`` with latin-1, ``bytes()`` without arguments), each mapped to
a function that can do nothing else.

``PlainPickle`` stands in for the ``pysyncobj.pickle`` module: pickles as
before (protocol 2), unpickles as plain data only. ``raft_node`` installs it.
(Snapshots are not pickle at all: see ``raft_snapshot``.)
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import IO, Any

log = logging.getLogger("gcache.master.raft")

PROTOCOL = 2  # pysyncobj's pickle protocol (masters of older versions read it)


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """Pickle protocol 2 (pysyncobj's) writes bytes as ``_codecs.encode(str, 'latin1')``."""
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"Raft frame asks for codec {encoding!r}: refused")
    return text.encode("latin1")


def _empty_bytes(*args: Any) -> bytes:
    """Protocol 2 writes b'' as ``bytes()``; ``bytes(n)`` would allocate n bytes."""
    if args:
        raise pickle.UnpicklingError("Raft frame calls bytes() with arguments: refused")
    return b""


class PlainDataUnpickler(pickle.Unpickler):
    """Unpickles what pysyncobj sends between masters (plain data only) and refuses any
    other global, which is how a pickle runs code."""

    _ALLOWED: dict[tuple[str, str], Any] = {
        ("_codecs", "encode"): _latin1_encode,
        ("__builtin__", "bytes"): _empty_bytes, ("builtins", "bytes"): _empty_bytes,
        ("__builtin__", "set"): set, ("builtins", "set"): set,
        ("__builtin__", "frozenset"): frozenset, ("builtins", "frozenset"): frozenset,
    }

    WHAT = "Raft frame"  # what is unpickled, for the log line

    def find_class(self, module: str, name: str) -> Any:
        found = self._ALLOWED.get((module, name))
        if found is None:
            log.warning("refused a %s that refers to %s.%s (not plain data)",
                        self.WHAT, module, name)
            raise pickle.UnpicklingError(f"{self.WHAT} refers to {module}.{name}: refused")
        return found


class PlainPickle:
    """Stands in for the ``pysyncobj.pickle`` module wherever pysyncobj unpickles: its
    TCP connection (frames), its SyncObj (committed commands, which arrive inside frames
    from the leader), its journal (the ``.meta`` file: term, vote, commit index) and its
    full-dump serializer (a path our serializer/deserializer callbacks replace, closed
    anyway). Pickled as before, unpickled as plain data only."""

    @staticmethod
    def to_bytes(data: bytes | str) -> bytes:
        return data if isinstance(data, bytes) else data.encode("utf-8")

    @staticmethod
    def dump(obj: Any, file: IO[bytes], protocol: int | None = None) -> None:
        pickle.dump(obj, file, PROTOCOL)

    @staticmethod
    def load(file: IO[bytes]) -> Any:
        return PlainDataUnpickler(file).load()

    @staticmethod
    def dumps(obj: Any, protocol: int | None = None) -> bytes:
        return pickle.dumps(obj, PROTOCOL)  # pysyncobj's, whatever the caller asks

    @staticmethod
    def loads(data: bytes | str) -> Any:
        return PlainDataUnpickler(io.BytesIO(PlainPickle.to_bytes(data))).load()
