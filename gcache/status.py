"""Result statuses shared by the wire protocol, the server and the SDK.

Runtime faults are values, not exceptions: every SDK result and every per-item
wire reply carries one of these. The integer values are part of wire protocol
v1 (docs/protocol.md) and must never be renumbered.

Which statuses a caller may treat as a cache miss: everything except ``OK``.
An inference engine simply recomputes on any non-OK status.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    OK = 0
    MISS = 1  # key not present (never stored, evicted, deleted)
    TIMEOUT = 2  # the deadline passed before the server answered
    BUSY = 3  # server refused for load reasons; retry later
    QUEUE_FULL = 4  # the SDK dispatch queue is full; the op was not sent
    CLOSED = 5  # the client was closed before the op finished
    TOO_LARGE = 6  # key, value or batch exceeds a configured limit
    AUTH = 7  # missing or wrong token
    CORRUPT = 8  # checksum failure; the bytes were dropped, never served
    UNAVAILABLE = 9  # owner server is down or suspect; treated as a miss
    NO_SPACE = 10  # the server could not make room for the object
    BAD_REQUEST = 11  # malformed request (wrong sizes, bad arguments)
    SIZE_MISMATCH = 12  # object length differs from the destination buffer
    CONFLICT = 13  # object was replaced while a sliced read was in flight
    ERROR = 14  # internal error; the server log says more
    NOT_OWNER = 15  # the server does not own the key in the current epoch

    @property
    def ok(self) -> bool:
        return self is Status.OK

    @property
    def is_miss(self) -> bool:
        """True for every status an engine should treat as 'recompute'."""
        return self is not Status.OK


_BY_CODE: dict[int, Status] = {int(s): s for s in Status}


def status_of(code: int) -> Status:
    """Map a wire code to a Status; unknown codes (and values that are no code at all)
    become ERROR. A dict lookup: ``Status(code)`` goes through the enum's metaclass
    ``__call__`` (~1 us, once per key of every reply)."""
    try:
        return _BY_CODE.get(code, Status.ERROR)
    except TypeError:  # unhashable: no code
        return Status.ERROR
