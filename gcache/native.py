"""The native hot loops, or their pure-Python twins: one import for callers.

Each function below exists twice: in C (``gcache._native``, built from
``native/gcache_native.c`` by ``pip install``) and here in Python. Both take the same
arguments and give the same results, raising the same exception types on bad input;
``tests/core/test_native_*.py`` check that with hypothesis. Callers import the names
from this module and never know which one runs.

Which one: the C module when it imports and ``GCACHE_NATIVE`` (read once, at import)
is not false (``0``/``false``/``no``/``off``); otherwise the twins. A missing or broken
build logs ONE line saying so and what to do, never raises. ``ACTIVE`` says which is
in use ("native" or "python"); ``twins`` holds the Python functions for tests.

Functions (contracts; the C file's opening comment has the same):

* ``copy_spans(spans, base, size, into, stop_at) -> list[int | None]``: move N spans
  between caller buffers and the mapped region ``[base, base + size)`` in one call
  (the C version releases the GIL for the whole loop). A span is ``(buffer, offset,
  n, want_hash)``; ``into`` copies region -> buffer, else buffer -> region. Every span
  is checked before any byte moves (``0 <= offset``, ``offset + n <= size``,
  ``0 <= n <= len(buffer)``, a writable destination): ValueError; a non-buffer or a
  non-int: TypeError. The clock (``time.monotonic``) is read before the first span and
  at the first span boundary after every ``CHECK_BYTES`` copied: at or past
  ``stop_at``, TimeoutError. Returns each span's xxh3_64 (seed 0) of the buffer's ``n``
  bytes, read right after they moved, when ``want_hash`` (``into``: the bytes that
  landed; else the bytes that were sent: a staged put's checksum in the same pass as
  its copy), else None.
* ``byte_views(objs, writable) -> list[memoryview]``: ``gcache.sdk.buffers.as_view``
  for host buffers, a whole batch per call: each object's memoryview, cast to flat
  unsigned bytes unless it already is; ValueError for a non-contiguous buffer or
  (``writable``) a read-only one; TypeError for an object without the buffer protocol.
* ``pread_spans(fd, spans) -> (list[int | None], list[int])``: fill N caller buffers
  from ``fd`` (a file a peer may shrink: a read past its end is a short span, never a
  fault) in one call (the C version releases the GIL for the whole loop). A span is
  ``(buffer, file_offset, want_hash)``: all ``len(buffer)`` bytes from ``file_offset``
  on. Returns ``(digests, short)``: each span's xxh3_64 (seed
  0) of its bytes after they landed when ``want_hash``, else None (also None for a
  short span), and the indices of the spans the file ended before filling. Every span
  is checked first (a writable C-contiguous buffer; an int offset >= 0): TypeError /
  ValueError; a read error other than EINTR raises OSError (spans before it landed).
* ``read_staged(fd, mapping, spans)``: ``pread_spans``, where ``mapping`` (None, or a
  read-only mapping of the first ``len(mapping)`` bytes of ``fd``: a client's staging
  file) lets the C version copy each span that lies inside it with a memcpy instead of
  a pread, 2.7-2.9x cheaper from tmpfs (no page-cache lookup per 4 KiB). The file is
  the client's, and one that shrinks under the copy would raise SIGBUS: the C version
  catches that fault in the copying thread and reports the span short, as a pread that
  found the file's end would (the bytes between the new end and its page's end read as
  zeros there, where a pread stops). The twin preads every span. A mapping that is not
  a C-contiguous buffer: TypeError.
* ``pread_records(spans) -> (list[int | None], list[tuple[int, int]])``: the disk
  tier's batched read. Fill N caller buffers, each from its own file descriptor (a
  segment file, maybe ``O_DIRECT``: the caller's buffers and lengths are block-aligned),
  in one call (the C version releases the GIL for the whole loop, so an IO thread reads
  and checksums a group of records without a hand-off per item). A span is ``(fd,
  buffer, file_offset, hash_from, hash_to)``: all ``len(buffer)`` bytes from
  ``file_offset`` on, then the xxh3_64 (seed 0) of ``buffer[hash_from:hash_to]``. A
  failed span does not stop the others. Returns ``(digests, failed)``: each span's
  digest, or None where its read failed; ``(index, errno)`` per failed span, errno 0
  where the file ended before the buffer filled. Every span is checked first (an int
  fd that fits a C int; a writable C-contiguous buffer; an int offset >= 0; ints
  ``0 <= hash_from <= hash_to <= len(buffer)``): TypeError / ValueError.
* ``recv_views(sock, views, want, stop_at) -> list[int | None]``: fill every writable
  buffer in ``views``, in order, from the stream socket ``sock`` (never a TLS socket:
  its descriptor carries ciphertext) in one call (the C version releases the GIL for
  the whole loop and takes any object with ``fileno()``; the twin a ``socket.socket``):
  scatter reads that never block (``MSG_DONTWAIT``), and a poll for the time left to
  ``stop_at`` when one would. ``want`` (None, or one flag per view): each flagged view's
  xxh3_64 (seed 0), hashed right after each read that filled some of it, while its
  bytes are cached; None for the others. The socket's own blocking mode and timeout do
  not matter. The clock (``time.monotonic``) is read before every read: at or past
  ``stop_at``, TimeoutError (``socket.timeout``), so nothing starts after the deadline
  and a trickling peer cannot stretch it; EOF first: ConnectionError; a read error:
  OSError. Every view is checked first (a writable C-contiguous buffer: TypeError /
  ValueError; ``want``'s length: ValueError; a NaN ``stop_at``: ValueError). The C version reads the descriptor once:
  no other thread may close ``sock`` during the call.
* ``exchange(sock, request, view, at_least, stop_at) -> int``: a one-item call's round
  trip on a plain stream socket (never TLS) in one call (the C version releases the GIL
  for all of it): send every byte of ``request``, then receive into the writable
  ``view`` (reads of up to its free room) until at least ``at_least`` bytes landed;
  returns how many did (``at_least..len(view)``). The caller parses them and reads any
  rest itself. Never blocks in a call (``MSG_DONTWAIT``): it polls for the time left
  to ``stop_at``; the clock is read before every send and read: at or past ``stop_at``,
  TimeoutError. EOF before ``at_least`` bytes: ConnectionError; a send or read error:
  OSError (EPIPE, never SIGPIPE). Checked first: a buffer request and a writable
  C-contiguous view (TypeError / ValueError), ``1 <= at_least <= len(view)``
  (ValueError), a NaN ``stop_at`` (ValueError).
* ``checksums(buffers) -> list[int]``: the xxh3_64 (seed 0) of each buffer's bytes, in
  one call (the C version releases the GIL for all of them: a TCP put's value
  checksums, on the server after the bytes landed and on the client before they go,
  while other threads run Python). Every buffer is checked first: TypeError for an
  object without the buffer protocol, ValueError for one that is not C-contiguous.
* ``placement_hashes(namespace, keys, seed) -> list[int]``: ``xxh3_64(namespace +
  b"\\0" + key, seed)`` per key (keys must be ``bytes``: TypeError).
* ``header_write(buf, off, ns, key, version, length, created_ns, ph, mark_at) -> int``:
  an arena chunk's uncommitted header (``server/arena.py``'s layout: the fixed 64
  bytes, the namespace, the key and, when ``ph`` is not None, the 8-byte placement hash
  with FLAG_PLACED) at ``off`` of the writable buffer ``buf``, then ``buf[mark_at] = 1``
  (its start mark, after the header); returns the data offset, ``off`` plus the header
  rounded up to 64 bytes. ``header_commit(buf, off, csum)``: store the value checksum,
  the header's CRC32 (zlib's, over bytes 8-48 and the namespace, key and placement hash)
  and, last, FLAG_COMMITTED. Both check every argument before writing a byte: a
  non-buffer, a non-int, a namespace or key that is not ``bytes``: TypeError; a negative
  or over-64-bit value, an offset past a ssize_t: OverflowError; a read-only or
  non-contiguous buffer, a namespace or key over 65535 bytes, a header or mark outside
  the buffer: ValueError. ~0.2 us each in C, where the struct calls and slices cost
  ~2.7 us each.

Threads: any; no state.
"""

from __future__ import annotations

import ctypes
import logging
import math
import operator
import os
import select
import socket
import struct
import time
import zlib
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import xxhash

log = logging.getLogger("gcache.native")

ENV = "GCACHE_NATIVE"
CHECK_BYTES = 2 << 20  # read the clock at least this often while copying


# ---------------------------------------------------------------------- the twins
def _buffer(obj: Any, i: int, writable: bool, fn: str = "copy_spans") -> memoryview:
    """Span ``i``'s buffer (the checks and exception types of the C ``take_buffer``)."""
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{fn}: span {i}'s buffer is not a C-contiguous buffer") from None
    if not mv.c_contiguous:
        raise TypeError(f"{fn}: span {i}'s buffer is not a C-contiguous buffer")
    if writable and mv.readonly:
        raise ValueError(f"{fn}: span {i}'s destination is read-only")
    return mv


def _address(mv: memoryview) -> int:
    if not mv.nbytes:
        return 0
    return int(np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv,
                             dtype=np.uint8).ctypes.data)


def copy_spans_py(spans: Sequence[tuple], base: int, size: int, into: bool,
                  stop_at: float) -> list[int | None]:
    """The twin of ``_native.copy_spans`` (see the module docstring)."""
    if type(base) is not int or type(size) is not int:  # noqa: E721 - as PyArg "K"/"n"
        raise TypeError("copy_spans: base and size must be ints")
    if size < 0:
        raise ValueError("copy_spans: negative region size")
    into = bool(into)
    plan = []
    for i, t in enumerate(spans):
        if type(t) is not tuple or len(t) != 4:
            raise TypeError("copy_spans: a span is a tuple (buffer, offset, n, want_hash)")
        buf, off, n, want = t
        if not isinstance(off, int) or not isinstance(n, int):
            raise TypeError("copy_spans: offset and n must be ints")
        if off < 0 or n < 0 or n > size or off > size - n:
            raise ValueError(f"copy_spans: span {i} is outside the mapped region of "
                             f"{size} bytes")
        want = bool(want)
        mv = _buffer(buf, i, into)
        if n > mv.nbytes:
            raise ValueError(f"copy_spans: span {i} moves {n} bytes, its buffer has "
                             f"{mv.nbytes}")
        plan.append((mv, off, n, want))
    out: list[int | None] = []
    since = CHECK_BYTES
    for mv, off, n, want in plan:
        if since >= CHECK_BYTES:
            if time.monotonic() >= stop_at:
                raise TimeoutError("copy_spans: past the deadline")
            since = 0
        local = _address(mv)
        if n:
            if into:
                ctypes.memmove(local, base + off, n)
            else:
                ctypes.memmove(base + off, local, n)
        if want:
            landed = (ctypes.c_char * n).from_address(local) if n else b""
            out.append(xxhash.xxh3_64_intdigest(landed))
        else:
            out.append(None)
        since += n
    return out


def _read_destination(fn: str, buf: Any, i: int, off: int) -> memoryview:
    """Span ``i``'s buffer as flat writable bytes that end before 2**63 - 1 in the file
    from ``off`` on."""
    mv = _buffer(buf, i, True, fn)
    if mv.nbytes > (1 << 63) - 1 - off:
        raise ValueError(f"{fn}: span {i}'s file offset is out of range")
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def _pread_into(fd: int, mv: memoryview, off: int) -> int:
    """Fill ``mv`` from ``fd`` at ``off`` (preadv, retried on EINTR by PEP 475 and after a
    short read): the bytes read, fewer than ``len(mv)`` when the file ended first."""
    done, n = 0, mv.nbytes
    while done < n:
        got = os.preadv(fd, [mv[done:]], off + done)
        if got == 0:
            break
        done += got
    return done


def pread_spans_py(fd: int, spans: Sequence[tuple]) -> tuple[list[int | None], list[int]]:
    """The twin of ``_native.pread_spans`` (see the module docstring)."""
    return _read_spans("pread_spans", fd, spans)


def read_staged_py(fd: int, mapping: Any,
                   spans: Sequence[tuple]) -> tuple[list[int | None], list[int]]:
    """The twin of ``_native.read_staged`` (see the module docstring): ``pread_spans``'s
    reads; the mapping, a speed-up of the C version only, is checked and not read."""
    if mapping is not None:
        try:
            contiguous = memoryview(mapping).c_contiguous
        except TypeError:
            contiguous = False
        if not contiguous:
            raise TypeError("read_staged: mapping must be None or a C-contiguous buffer")
    return _read_spans("read_staged", fd, spans)


def _read_spans(fn: str, fd: int, spans: Sequence[tuple]) -> tuple[list[int | None], list[int]]:
    """The body of ``pread_spans_py``; ``fn`` names the calling function in errors."""
    if type(fd) is not int:  # noqa: E721 - as PyArg "i"
        raise TypeError(f"{fn}: fd must be an int")
    plan = []
    for i, t in enumerate(spans):
        if type(t) is not tuple or len(t) != 3:
            raise TypeError(f"{fn}: a span is a tuple (buffer, file_offset, want_hash)")
        buf, off, want = t
        if not isinstance(off, int):
            raise TypeError(f"{fn}: file_offset must be an int")
        if off < 0 or off >= 1 << 63:
            raise ValueError(f"{fn}: span {i}'s file offset is out of range")
        want = bool(want)
        plan.append((_read_destination(fn, buf, i, off), off, want))
    digests: list[int | None] = []
    short: list[int] = []
    for i, (mv, off, want) in enumerate(plan):
        if _pread_into(fd, mv, off) < mv.nbytes:
            short.append(i)
            digests.append(None)
        else:
            digests.append(xxhash.xxh3_64_intdigest(mv) if want else None)
    return digests, short


def _record_int(v: Any, lo: int, hi: int, what: str, i: int) -> int:
    if not isinstance(v, int):
        raise TypeError(f"pread_records: span {i}'s {what} must be an int")
    if v < lo or v > hi:
        raise ValueError(f"pread_records: span {i}'s {what} is out of range")
    return v


def pread_records_py(spans: Sequence[tuple]) -> tuple[list[int | None], list[tuple[int, int]]]:
    """The twin of ``_native.pread_records`` (see the module docstring)."""
    big = (1 << 63) - 1
    plan = []
    for i, t in enumerate(spans):
        if type(t) is not tuple or len(t) != 5:
            raise TypeError("pread_records: a span is a tuple (fd, buffer, file_offset, "
                            "hash_from, hash_to)")
        fd = _record_int(t[0], -(1 << 31), (1 << 31) - 1, "fd", i)
        off = _record_int(t[2], 0, big, "file offset", i)
        hfrom = _record_int(t[3], 0, big, "hash range", i)
        hto = _record_int(t[4], 0, big, "hash range", i)
        mv = _read_destination("pread_records", t[1], i, off)
        if hfrom > hto or hto > mv.nbytes:
            raise ValueError(f"pread_records: span {i}'s hash range is out of range")
        plan.append((fd, mv, off, hfrom, hto))
    digests: list[int | None] = []
    failed: list[tuple[int, int]] = []
    for i, (fd, mv, off, hfrom, hto) in enumerate(plan):
        try:
            err = -1 if _pread_into(fd, mv, off) == mv.nbytes else 0  # 0: the file ended
        except OSError as exc:
            err = exc.errno or 0
        if err >= 0:
            failed.append((i, err))
            digests.append(None)
        else:
            digests.append(xxhash.xxh3_64_intdigest(mv[hfrom:hto]))
    return digests, failed


def placement_hashes_py(namespace: bytes, keys: Sequence[bytes], seed: int) -> list[int]:
    """The twin of ``_native.placement_hashes`` (see the module docstring)."""
    ns = bytes(memoryview(namespace))  # any bytes-like namespace, as the C "y*"
    head = ns + b"\x00"
    out = []
    for i, k in enumerate(keys):
        if not isinstance(k, bytes):
            raise TypeError(f"placement_hashes: key {i} is {type(k).__name__}, not bytes")
        out.append(xxhash.xxh3_64_intdigest(head + k, seed=seed))
    return out


_RECV_IOV = 512  # buffers per scatter read (protocol._IOV_MAX; RECV_IOV in C)


def landed(bufs: list[memoryview], hs: list[Any], i: int, k: int) -> int:
    """A scatter read put ``k`` bytes into ``bufs`` from view ``i`` on: feed each
    view's new bytes to its hasher (None: not hashed), cut a part-filled view to what
    is still to come, and return the index of the first view not yet full."""
    while i < len(bufs) and k >= len(bufs[i]):
        if hs[i] is not None:
            hs[i].update(bufs[i])  # the rest of view i: all landed now
        k -= len(bufs[i])
        i += 1
    if k:
        if hs[i] is not None:
            hs[i].update(bufs[i][:k])
        bufs[i] = bufs[i][k:]
    return i


def recv_views_py(sock: socket.socket, views: Sequence[Any], want: Sequence[Any] | None,
                  stop_at: float) -> list[int | None]:
    """The twin of ``_native.recv_views`` (see the module docstring)."""
    if not isinstance(sock, socket.socket):
        raise TypeError("recv_views: sock must be a socket")
    if type(stop_at) not in (int, float):  # noqa: E721 - as PyArg "d"
        raise TypeError("recv_views: stop_at must be a number")
    if math.isnan(stop_at):
        raise ValueError("recv_views: stop_at is not a number")
    views = list(views)
    flags = [False] * len(views)
    if want is not None:
        flags = [bool(w) for w in want]
        if len(flags) != len(views):
            raise ValueError(f"recv_views: want has {len(flags)} flags for "
                             f"{len(views)} views")
    bufs = [_buffer(v, i, True, "recv_views").cast("B") for i, v in enumerate(views)]
    hashers = [xxhash.xxh3_64() if f else None for f in flags]
    todo = [(b, h) for b, h in zip(bufs, hashers) if len(b)]
    rest, hs = [b for b, _ in todo], [h for _, h in todo]
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    i = 0
    while i < len(rest):
        if time.monotonic() >= stop_at:
            raise TimeoutError("deadline passed")
        # poll first: a socket with a timeout would otherwise wait on its own clock
        if not poller.poll(max(0, math.ceil((stop_at - time.monotonic()) * 1000))):
            continue
        try:
            k = sock.recvmsg_into(rest[i:i + _RECV_IOV], 0, socket.MSG_DONTWAIT)[0]
        except BlockingIOError:
            continue
        if k == 0:
            raise ConnectionError("peer closed the connection in the middle of a payload")
        i = landed(rest, hs, i, k)
    return [h.intdigest() if h is not None else None for h in hashers]


def exchange_py(sock: socket.socket, request: Any, view: Any, at_least: int,
                stop_at: float) -> int:
    """The twin of ``_native.exchange`` (see the module docstring)."""
    if not isinstance(sock, socket.socket):
        raise TypeError("exchange: sock must be a socket")
    if type(stop_at) not in (int, float):  # noqa: E721 - as PyArg "d"
        raise TypeError("exchange: stop_at must be a number")
    if math.isnan(stop_at):
        raise ValueError("exchange: stop_at is not a number")
    try:
        req = memoryview(request)
    except TypeError:
        raise TypeError("exchange: the request is not a C-contiguous buffer") from None
    if not req.c_contiguous:
        raise TypeError("exchange: the request is not a C-contiguous buffer")
    req = req.cast("B") if req.format != "B" or req.ndim != 1 else req
    dst = _buffer(view, 0, True, "exchange").cast("B")
    at_least = operator.index(at_least)  # TypeError, as PyArg "n"
    if not 1 <= at_least <= len(dst):
        raise ValueError(f"exchange: at_least {at_least} is not within the view's "
                         f"1..{len(dst)} bytes")
    sent = got = 0
    poller, events = select.poll(), select.POLLOUT
    poller.register(sock, events)
    while sent < len(req) or got < at_least:
        sending = sent < len(req)
        if time.monotonic() >= stop_at:
            raise TimeoutError("deadline passed")
        if not sending and events != select.POLLIN:
            events = select.POLLIN
            poller.modify(sock, events)
        # poll first: a socket with a timeout would otherwise wait on its own clock
        if not poller.poll(max(0, math.ceil((stop_at - time.monotonic()) * 1000))):
            continue
        try:
            if sending:
                sent += sock.send(req[sent:], socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                continue
            k = sock.recv_into(dst[got:], len(dst) - got, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} bytes of a reply")
        got += k
    return got


def checksums_py(buffers: Sequence[Any]) -> list[int]:
    """The twin of ``_native.checksums`` (see the module docstring)."""
    views = []
    for i, buf in enumerate(buffers):
        try:
            mv = memoryview(buf)
        except TypeError:
            raise TypeError(f"checksums: buffer {i} is {type(buf).__name__}, not a "
                            "buffer") from None
        if not mv.c_contiguous:
            raise ValueError(f"checksums: buffer {i} is not C-contiguous")
        views.append(mv)
    return [xxhash.xxh3_64_intdigest(mv) for mv in views]


# server/arena.py's chunk header: magic u32 | flags u32 | hdr_len u16 | ns_len u16 |
# key_len u16 | pad u16 | version u64 | data_len u64 | checksum u64 | created_ns u64 |
# hdr_crc u32 | rank u32, then the namespace, the key and (FLAG_PLACED) the placement hash
_HDR = struct.Struct("<IIHHHHQQQQII")
_HDR_FIXED = 64  # the fixed part's room (56 bytes of fields, then 8 unused)
_CHUNK_MAGIC = 0x4F434347
_PLACED, _COMMITTED = 0x2, 0x1


def _arena_view(fn: str, buf: Any) -> memoryview:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"{fn}: {type(buf).__name__} is not a buffer") from None
    if not mv.c_contiguous:
        raise ValueError(f"{fn}: the buffer is not C-contiguous")
    if mv.readonly:
        raise ValueError(f"{fn}: the buffer is read-only")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _ssize(fn: str, v: Any, what: str) -> int:
    if not isinstance(v, int):
        raise TypeError(f"{fn}: {what} must be an int, not {type(v).__name__}")
    if not -(1 << 63) <= v < 1 << 63:
        raise OverflowError(f"{fn}: {what} {v} does not fit a C ssize_t")
    return int(v)


def _u64(fn: str, v: Any, what: str) -> int:
    if not isinstance(v, int):
        raise TypeError(f"{fn}: {what} must be an int, not {type(v).__name__}")
    if not 0 <= v < 1 << 64:
        raise OverflowError(f"{fn}: {what} {v} is not an unsigned 64-bit int")
    return int(v)


def header_write_py(buf: Any, off: Any, ns: Any, key: Any, version: Any, length: Any,
                    created_ns: Any, ph: Any, mark_at: Any) -> int:
    """The twin of ``_native.header_write`` (see the module docstring)."""
    fn = "header_write"
    mv = _arena_view(fn, buf)
    off = _ssize(fn, off, "off")
    if type(ns) is not bytes or type(key) is not bytes:
        raise TypeError(f"{fn}: the namespace and the key must be bytes")
    version = _u64(fn, version, "version")
    length = _u64(fn, length, "length")
    created_ns = _u64(fn, created_ns, "created_ns")
    if ph is not None:
        ph = _u64(fn, ph, "ph")
    mark_at = _ssize(fn, mark_at, "mark_at")
    if len(ns) > 0xFFFF or len(key) > 0xFFFF:
        raise ValueError(f"{fn}: a namespace or key over 65535 bytes")
    hl = (_HDR_FIXED + len(ns) + len(key) + (8 if ph is not None else 0) + 63) & ~63
    if off < 0 or off + hl > len(mv):
        raise ValueError(f"{fn}: a {hl}-byte header at {off} is outside the buffer")
    if not 0 <= mark_at < len(mv):
        raise ValueError(f"{fn}: start mark {mark_at} is outside the buffer")
    _HDR.pack_into(mv, off, _CHUNK_MAGIC, _PLACED if ph is not None else 0, hl, len(ns),
                   len(key), 0, version, length, 0, created_ns, 0, 0)
    p = off + _HDR_FIXED
    mv[p:p + len(ns)] = ns
    p += len(ns)
    mv[p:p + len(key)] = key
    if ph is not None:
        struct.pack_into("<Q", mv, p + len(key), ph)
    mv[mark_at] = 1  # after the header: a start mark names a written header
    return off + hl


def header_commit_py(buf: Any, off: Any, csum: Any) -> None:
    """The twin of ``_native.header_commit`` (see the module docstring)."""
    fn = "header_commit"
    mv = _arena_view(fn, buf)
    off = _ssize(fn, off, "off")
    csum = _u64(fn, csum, "csum")
    if off < 0 or off + _HDR_FIXED > len(mv):
        raise ValueError(f"{fn}: a header at {off} is outside the buffer")
    flags, _, ns_len, key_len = struct.unpack_from("<IHHH", mv, off + 4)
    end = off + _HDR_FIXED + ns_len + key_len + (8 if flags & _PLACED else 0)
    if end > len(mv):
        raise ValueError(f"{fn}: the header at {off} runs past the buffer")
    struct.pack_into("<Q", mv, off + 32, csum)
    crc = zlib.crc32(mv[off + 8:off + 48])
    struct.pack_into("<I", mv, off + 48, zlib.crc32(mv[off + _HDR_FIXED:end], crc))
    struct.pack_into("<I", mv, off + 4, flags | _COMMITTED)  # last


def byte_views_py(objs: Sequence[Any], writable: bool) -> list[memoryview]:
    """The twin of ``_native.byte_views`` (see the module docstring)."""
    out = []
    for buf in objs:
        mv = memoryview(buf)
        if not mv.contiguous:
            raise ValueError("buffer must be C-contiguous")
        if writable and mv.readonly:
            raise ValueError("destination buffer is read-only")
        out.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
    return out


twins = SimpleNamespace(copy_spans=copy_spans_py, placement_hashes=placement_hashes_py,
                        byte_views=byte_views_py, pread_spans=pread_spans_py,
                        read_staged=read_staged_py,
                        pread_records=pread_records_py, checksums=checksums_py,
                        recv_views=recv_views_py, exchange=exchange_py,
                        header_write=header_write_py, header_commit=header_commit_py)


# ---------------------------------------------------------------------- the choice
def _wanted() -> bool:
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    log.warning("%s=%r is not a boolean (use 1 or 0); using the native module if built",
                ENV, raw)
    return True


def _load() -> Any:
    if not _wanted():
        log.info("%s=0: the pure-Python twins run (gcache.native)", ENV)
        return None
    try:
        from gcache import _native  # type: ignore[attr-defined]
    except Exception as exc:  # ImportError, or a broken build (a missing symbol, ...)
        log.warning("gcache._native is not available (%s): the pure-Python twins run, "
                    "slower; reinstall with a C compiler and Python headers "
                    "(pip install -e .) to build it", exc)
        return None
    missing = [n for n in vars(twins) if not callable(getattr(_native, n, None))]
    if missing:  # a stale build of an older tree (the .so outlived a source change)
        log.warning("gcache._native is not available (a stale build without %s): the "
                    "pure-Python twins run, slower; reinstall (pip install -e .) to "
                    "rebuild it", ", ".join(missing))
        return None
    return _native


_mod = _load()
ACTIVE = "python" if _mod is None else "native"
copy_spans = twins.copy_spans if _mod is None else _mod.copy_spans
placement_hashes = twins.placement_hashes if _mod is None else _mod.placement_hashes
byte_views = twins.byte_views if _mod is None else _mod.byte_views
pread_spans = twins.pread_spans if _mod is None else _mod.pread_spans
read_staged = twins.read_staged if _mod is None else _mod.read_staged
pread_records = twins.pread_records if _mod is None else _mod.pread_records
checksums = twins.checksums if _mod is None else _mod.checksums
recv_views = twins.recv_views if _mod is None else _mod.recv_views
exchange = twins.exchange if _mod is None else _mod.exchange
header_write = twins.header_write if _mod is None else _mod.header_write
header_commit = twins.header_commit if _mod is None else _mod.header_commit
