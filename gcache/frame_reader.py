"""A per-connection buffered frame reader: prefix and header in one ``recv``.

Design. Reading a request as ``read_prefix`` then ``read_header`` costs two ``recv``
syscalls (and two GIL round trips) per frame, even when the client's one write put the
36-byte prefix and the header in one segment. ``FrameReader`` owns a fixed buffer
(``capacity`` bytes, 16 KiB by default) and, once ``read_ahead`` is on, fills it with
whatever the socket holds, up to its capacity, in one call. The bytes it holds beyond
the current frame's header belong to the stream in order, so every later read of this
connection must go through the reader:

* ``read_prefix`` / ``read_header``: the next frame's prefix and header, served from the
  buffer first, then from the socket;
* ``recv_into_many``: a frame's payload (a PUT's values), the buffered bytes copied into
  the first views, the rest received straight into them (``recvmsg_into``, or with a
  deadline one ``native.recv_views`` call), each flagged view hashed as it lands;
* a client that pipelines several frames in one write gets every one of them answered:
  the leftover bytes after one frame are the start of the next.

Bounds. The buffer never grows: a header longer than ``capacity`` is assembled from the
buffered part and then received as ``protocol.recv_header`` does (growing only as bytes
arrive, up to the prefix's checked ``header_len``). With ``read_ahead`` off (before
AUTH) the reader asks the socket for exactly the bytes the caller asked for, so a
stranger's prefix is judged before one header byte is read, as before.

Threads. One reader per connection, used only by the thread that owns the connection;
no locks. Every call may block in ``recv`` up to ``deadline`` (``protocol._io``: armed on
a socket with a timeout, polled for on a non-blocking one; ``None``: the socket's own
mode, e.g. the server's watchdog-bounded blocking socket). A view returned by
``read_header`` is valid until the next call on the reader.
"""

from __future__ import annotations

import select
import socket
from typing import Sequence

from gcache.native import checksums
from gcache.protocol import (PREFIX_SIZE, FrameHeader, Limits, _io, check_crc, decode_prefix,
                             recv_header, recv_into_many)

__all__ = ["FrameReader", "READ_AHEAD_BYTES"]

READ_AHEAD_BYTES = 16 << 10
"""Default buffer: a prefix plus the header of a frame of a few hundred keys."""


class FrameReader:
    """Buffered reads of one connection's frames (see the module docstring)."""

    __slots__ = ("sock", "limits", "buf", "view", "start", "end", "read_ahead")

    def __init__(self, sock: socket.socket, limits: Limits, capacity: int = READ_AHEAD_BYTES,
                 *, read_ahead: bool = True) -> None:
        if capacity < PREFIX_SIZE:
            raise ValueError(f"capacity {capacity} is below the {PREFIX_SIZE}-byte prefix")
        self.sock, self.limits = sock, limits
        self.buf = bytearray(capacity)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # buffered stream bytes are buf[start:end]
        self.read_ahead = read_ahead

    @property
    def buffered(self) -> int:
        """Stream bytes read from the socket and not yet consumed."""
        return self.end - self.start

    def _fill(self, need: int, deadline: float | None) -> None:
        """Hold at least ``need`` (<= capacity) bytes; ConnectionError on EOF."""
        have = self.end - self.start
        if have >= need:
            return
        cap = len(self.buf)
        if self.start + need > cap:  # slide what is held to the front
            self.view[:have] = self.view[self.start:self.end]
            self.start, self.end = 0, have
        sock, view = self.sock, self.view
        while self.end - self.start < need:
            want = cap - self.end if self.read_ahead else need - (self.end - self.start)
            k = _io(sock, deadline, select.POLLIN, sock.recv_into, view[self.end:], want)
            if k == 0:
                raise ConnectionError(f"peer closed the connection after "
                                      f"{self.end - self.start} of {need} bytes")
            self.end += k

    def read_prefix(self, *, deadline: float | None = None) -> tuple[FrameHeader, bytes]:
        """The next frame's 36-byte prefix, bound-checked (``decode_prefix``), and its
        raw bytes (for ``read_header``'s CRC check). Nothing of the header is consumed."""
        self._fill(PREFIX_SIZE, deadline)
        s = self.start
        prefix = bytes(self.view[s:s + PREFIX_SIZE])
        self.start = s + PREFIX_SIZE
        return decode_prefix(prefix, self.limits), prefix

    def read_header(self, fh: FrameHeader, prefix: bytes, *,
                    deadline: float | None = None) -> bytes | bytearray | memoryview:
        """The header after ``prefix``, its CRC verified over both. A short header is a
        view of the buffer, valid until the next call on this reader."""
        n = fh.header_len
        if not n:
            header: bytes | bytearray | memoryview = b""
        elif n <= len(self.buf):
            self._fill(n, deadline)
            s = self.start
            header = self.view[s:s + n]
            self.start = s + n
        else:  # longer than the buffer: what is held, then the rest as it arrives
            header = bytearray(self.view[self.start:self.end])
            self.start = self.end = 0
            header += recv_header(self.sock, n - len(header), deadline)
        check_crc(prefix, header)
        return header

    def recv_into_many(self, views: Sequence[memoryview], deadline: float | None = None,
                       want: Sequence[bool] | None = None) -> list[int | None] | None:
        """Fill every view in order (a frame's payload): buffered bytes first, then
        ``protocol.recv_into_many`` for the rest. ConnectionError on EOF. ``want`` (one
        flag per view): return each flagged view's xxh3_64 (None for the others), the
        views received from the socket hashed as their bytes land, the few that took
        buffered bytes hashed once whole."""
        rest = list(views)
        i = 0
        while i < len(rest) and self.start < self.end:
            v = rest[i]
            k = min(len(v), self.end - self.start)
            v[:k] = self.view[self.start:self.start + k]
            self.start += k
            if k == len(v):
                i += 1
            else:
                rest[i] = v[k:]
        if self.start == self.end:
            self.start = self.end = 0
        # views [0, first) took buffered bytes (all of view first - 1 or part of it)
        first = i + 1 if i < len(rest) and len(rest[i]) < len(views[i]) else i
        got: list[int | None] | None = None
        if i < len(rest):
            w = None if want is None else [j >= first and bool(want[j])
                                           for j in range(i, len(rest))]
            got = recv_into_many(self.sock, rest[i:], deadline, w)
        if want is None:
            return None
        out: list[int | None] = [None] * len(rest)
        if got is not None:
            out[i:] = got
        early = [j for j in range(first) if want[j]]
        for j, d in zip(early, checksums([views[j] for j in early])):
            out[j] = d
        return out
