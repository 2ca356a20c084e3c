"""Wire protocol v1: framing, limits and socket helpers shared by server and SDK.

Design. Every message is one frame:

    prefix (36 bytes, little-endian, fixed struct)
      magic u32 'GCF1' | version u8 | opcode u8 | flags u16 | request_id u64
      status u16 | reserved u16 | header_len u32 | payload_len u64 | header_crc u32
    header  (header_len bytes, msgpack: the op's structured arguments)
    payload (payload_len bytes, raw: values, concatenated in item order)

``header_crc`` is CRC32 over the first 32 prefix bytes followed by the header,
so a corrupt length or opcode is caught before the payload is touched. Every
length is checked against ``Limits`` *before* anything is allocated, and
payloads are received straight into their destination (``recv_into`` an arena
slot or a user buffer) — the payload is never staged in a temporary buffer.

Responses reuse the request's opcode with ``FLAG_RESPONSE`` set and the same
request id (a streamed GET reply is several such frames, ``FLAG_MORE`` on all but
the last). A frame-level failure (bad magic, oversize, auth) is a response
with a non-zero ``status`` and ``{"error": text}``; the sender then closes the
connection, so a malformed stream can never desynchronise.

docs/protocol.md is the normative description; keep the two in step.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import msgpack
import xxhash

from gcache import native
from gcache.errors import ProtocolError
from gcache.status import Status

MAGIC = 0x31464347  # b"GCF1" read as little-endian u32
VERSION = 1
PREFIX = struct.Struct("<IBBHQHHIQI")
PREFIX_SIZE = PREFIX.size  # 36
_CRC_SPAN = PREFIX_SIZE - 4

FLAG_RESPONSE = 0x0001
#: a streamed GET reply (request flag ``"sr": 1``): more reply frames of this request
#: follow, each covering the next items in order; the last one has it clear
FLAG_MORE = 0x0002


class Op:
    """Opcodes. Values are wire-stable."""

    HELLO = 1  # server -> client, right after accept: nonce, name, limits
    AUTH = 2  # client -> server: HMAC(token, nonce); required before data ops
    PING = 3
    PUT = 10
    GET = 11
    EXISTS = 12
    DELETE = 13
    TOUCH = 14
    STATS = 20
    # co-located shared-memory transport (control RPCs; the bytes move through the arena)
    LEASE = 30
    RELEASE = 31
    ALLOC = 32
    COMMIT = 33
    # a co-located writer's put: the server copies the values out of the client's own
    # staging file (clients never write the arena)
    PUT_STAGED = 34

    NAMES = {1: "HELLO", 2: "AUTH", 3: "PING", 10: "PUT", 11: "GET", 12: "EXISTS",
             13: "DELETE", 14: "TOUCH", 20: "STATS", 30: "LEASE", 31: "RELEASE",
             32: "ALLOC", 33: "COMMIT", 34: "PUT_STAGED"}
    SHM_OPS = frozenset({LEASE, RELEASE, ALLOC, COMMIT, PUT_STAGED})
    DATA_OPS = frozenset({PUT, GET, EXISTS, DELETE, TOUCH})


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds checked before allocation. Server and SDK share the defaults."""

    max_key_bytes: int = 512
    max_namespace_bytes: int = 128
    max_value_bytes: int = 256 << 20
    max_batch_items: int = 4096
    max_header_bytes: int = 4 << 20
    max_frame_bytes: int = 512 << 20  # payload bound per frame


_DEFAULT_LIMITS = Limits()
# Before AUTH only AUTH and PING are accepted, with no payload and at most this much header
# (an AUTH header is ~40 bytes): what a stranger can make the server read and decode.
PREAUTH_MAX_HEADER_BYTES = 1024


class FrameHeader(NamedTuple):
    """A frame's parsed prefix (immutable). A NamedTuple, not a frozen dataclass: it is
    made once per frame on both sides, and a frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field) cost about three times as much."""

    opcode: int
    flags: int
    request_id: int
    status: int
    header_len: int
    payload_len: int

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)


def encode_frame(opcode: int, request_id: int, meta: Any, payload_len: int = 0, *,
                 flags: int = 0, status: int = 0) -> bytes:
    """Return prefix + msgpack header. The payload is sent separately."""
    header = msgpack.packb(meta, use_bin_type=True)
    fixed = PREFIX.pack(MAGIC, VERSION, opcode, flags, request_id, status, 0,
                        len(header), payload_len, 0)[:_CRC_SPAN]
    crc = zlib.crc32(header, zlib.crc32(fixed))
    return fixed + crc.to_bytes(4, "little") + header


def decode_prefix(buf: bytes | bytearray | memoryview, limits: Limits) -> FrameHeader:
    """Parse and bound-check a 36-byte prefix. Raises ProtocolError."""
    if len(buf) != PREFIX_SIZE:
        raise ProtocolError(f"truncated frame prefix: {len(buf)} of {PREFIX_SIZE} bytes")
    magic, version, opcode, flags, rid, status, _res, hlen, plen, _crc = PREFIX.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:08x}: peer is not speaking gcache protocol v1")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}; this build speaks {VERSION}")
    if hlen > limits.max_header_bytes:
        raise ProtocolError(f"header length {hlen} exceeds max_header_bytes "
                            f"{limits.max_header_bytes}", Status.TOO_LARGE)
    if plen > limits.max_frame_bytes:
        raise ProtocolError(f"payload length {plen} exceeds max_frame_bytes "
                            f"{limits.max_frame_bytes}", Status.TOO_LARGE)
    return FrameHeader(opcode, flags, rid, status, hlen, plen)


def check_crc(prefix: bytes | bytearray | memoryview, header: bytes | bytearray) -> None:
    expect = int.from_bytes(prefix[_CRC_SPAN:PREFIX_SIZE], "little")
    got = zlib.crc32(header, zlib.crc32(prefix[:_CRC_SPAN]))
    if got != expect:
        raise ProtocolError(f"header CRC mismatch (got 0x{got:08x}, frame says 0x{expect:08x})")


# A header this short holds at most this many msgpack objects (each costs at least one
# byte), so decoding it cannot amplify much; a longer one is decoded with hooks that count
# every container's elements against ``_element_budget`` and stop the decode past it.
_UNCOUNTED_HEADER_BYTES = 64 << 10


def _element_budget(limits: Limits) -> int:
    """Most elements (list items, map keys and values) one header may hold: the largest
    legitimate header is a batch of ``max_batch_items`` items of a few fields each."""
    return 16 * limits.max_batch_items + 4096


class _OverBudget(Exception):
    pass


class _ElementBudget:
    """msgpack list/object hook that counts elements and raises once over ``left``."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    def __call__(self, obj: Any) -> Any:
        self.left -= len(obj) + 1
        if self.left < 0:
            raise _OverBudget("it holds too many elements")
        return obj


def decode_meta(header: bytes | bytearray, limits: Limits | None = None) -> Any:
    """Decode a msgpack header with explicit bounds derived from ``limits``, so that no
    header costs memory or CPU far beyond its own size: each array <= max_batch_items
    (at least 64) entries, each map <= 1024, strings and binaries <= the header, no ext
    types, and (for headers over 64 KiB) at most ``_element_budget`` elements in all.
    A pathological 4 MiB header of nested empty arrays would otherwise build ~4 M
    lists (~280 MiB)."""
    lim = limits if limits is not None else _DEFAULT_LIMITS
    n = len(header)
    kw: dict[str, Any] = {}
    if n > _UNCOUNTED_HEADER_BYTES:
        count = _ElementBudget(_element_budget(lim))
        kw = {"list_hook": count, "object_hook": count}
    try:
        return msgpack.unpackb(header, raw=False, strict_map_key=False, max_str_len=n,
                               max_bin_len=n, max_array_len=max(lim.max_batch_items, 64),
                               max_map_len=1024, max_ext_len=0, **kw)
    except _OverBudget as exc:
        raise ProtocolError(f"frame header too large: {exc}", Status.TOO_LARGE) from None
    except ValueError as exc:
        if "exceeds max_" in str(exc):  # msgpack's own bounds: "N exceeds max_array_len(M)"
            raise ProtocolError(f"frame header too large: {exc}", Status.TOO_LARGE) from None
        raise ProtocolError(f"undecodable frame header: {exc}") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame header: {exc}") from None


# ---------------------------------------------------------------- socket helpers
#
# Every helper takes an optional ``deadline`` (a ``time.monotonic()`` value). With one,
# the socket timeout is recomputed from the time left before *every* blocking syscall
# (``arm``), so a peer that trickles one byte at a time cannot stretch the call past the
# deadline: a socket timeout alone restarts on every byte and is not a deadline. When
# the time is gone they raise ``socket.timeout`` (``TimeoutError``), as a socket timeout
# would. Without one they leave the socket's own timeout alone (the server sets its own).
#
# A non-blocking socket (timeout 0.0: the SDK's plain TCP connections) keeps the same
# rule more cheaply (``_io``): each call is tried at once and, only when it would
# block, ``poll`` waits for the time left before the deadline. CPython's timeout mode
# costs an ioctl (``settimeout``) and a poll before every call; this costs the call
# alone when the bytes are already there.

_IOV_MAX = 512


def arm(sock: socket.socket, deadline: float | None) -> None:
    """Set ``sock``'s timeout to the time left before ``deadline`` (no-op for None).

    Raises ``socket.timeout`` when the deadline has passed."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline passed")
    sock.settimeout(left)


def _wait_ready(sock: socket.socket, deadline: float | None, events: int) -> None:
    """Block until the non-blocking ``sock`` is ready for ``events`` or ``deadline``
    passes (then ``socket.timeout``, as ``arm``)."""
    ms = -1
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        ms = math.ceil(left * 1000)
    p = select.poll()
    p.register(sock, events)
    p.poll(ms)


def _io(sock: socket.socket, deadline: float | None, events: int, call: Any, *args: Any
        ) -> Any:
    """``call(*args)`` (one socket call) by ``deadline``: armed on a socket with a timeout
    (or blocking), tried at once then polled for on a non-blocking one. Without a
    deadline the socket's own mode applies, as ``arm``."""
    if deadline is None:
        return call(*args)
    if sock.gettimeout() != 0.0:
        arm(sock, deadline)
        return call(*args)
    if time.monotonic() >= deadline:  # as arm: nothing starts after the deadline
        raise socket.timeout("deadline passed")
    while True:
        try:
            return call(*args)
        except BlockingIOError:
            _wait_ready(sock, deadline, events)


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None
                    ) -> None:
    """Fill ``view`` completely from ``sock`` by ``deadline``; ConnectionError on EOF."""
    got, n = 0, len(view)
    while got < n:
        k = _io(sock, deadline, select.POLLIN, sock.recv_into, view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k


def recv_into_many(sock: socket.socket, views: Sequence[memoryview],
                   deadline: float | None = None, want: Sequence[bool] | None = None
                   ) -> list[int | None] | None:
    """Fill every view in order with scatter reads: one syscall and one GIL round trip
    fill many buffers, e.g. 16 pages of a batch at once.

    ``want`` (one flag per view, or None): each flagged view's bytes are hashed
    (xxh3_64) right after each read that filled some of them, while they are still in
    the cache (a get's checksum check without a second pass over DRAM); the call then
    returns each view's digest (None where not flagged), else None.

    The whole read ends by ``deadline``. ConnectionError on EOF. With a deadline on a
    plain socket the whole loop is one ``native.recv_views`` call (the C version
    releases the GIL for all of it, hashing included). TLS sockets have no
    ``recvmsg_into``: they fill one view at a time, still straight into it (OpenSSL
    decrypts into the destination), re-armed before every call. Without a deadline the
    socket's own timeout bounds each read (the server's idle timeout).
    """
    tls = isinstance(sock, ssl.SSLSocket)
    if deadline is not None and not tls:
        digests = native.recv_views(sock, views, want, deadline)
        return digests if want is not None else None
    hashers = [xxhash.xxh3_64() if w else None for w in want] if want is not None else None
    if hashers is None:
        bufs = [v for v in views if len(v)]
        hs: list[Any] = [None] * len(bufs)
    else:
        pairs = [(v, h) for v, h in zip(views, hashers) if len(v)]
        bufs, hs = [v for v, _ in pairs], [h for _, h in pairs]
    if tls:
        _recv_into_each(sock, bufs, hs, deadline)
    else:
        _recv_scatter(sock, bufs, hs, deadline)
    if hashers is None:
        return None
    return [h.intdigest() if h is not None else None for h in hashers]


def _recv_scatter(sock: socket.socket, bufs: list[memoryview], hs: list[Any],
                  deadline: float | None) -> None:
    i = 0
    while i < len(bufs):
        k = _io(sock, deadline, select.POLLIN, sock.recvmsg_into, bufs[i:i + _IOV_MAX])[0]
        if k == 0:
            raise ConnectionError("peer closed the connection in the middle of a payload")
        i = native.landed(bufs, hs, i, k)


def _recv_into_each(sock: ssl.SSLSocket, bufs: list[memoryview], hs: list[Any],
                    deadline: float | None) -> None:
    for view, h in zip(bufs, hs):
        got, n = 0, len(view)
        while got < n:
            arm(sock, deadline)
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("peer closed the connection in the middle of a payload")
            if h is not None:
                h.update(view[got:got + k])
            got += k


def discard_views(n: int, scratch: memoryview) -> list[memoryview]:
    """Views of ``scratch`` covering ``n`` bytes, for draining a refused payload."""
    out = []
    while n > 0:
        k = min(n, len(scratch))
        out.append(scratch[:k])
        n -= k
    return out


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), deadline)
    return buf


def discard(sock: socket.socket, n: int, scratch: memoryview,
            deadline: float | None = None) -> None:
    """Read and drop ``n`` bytes through a bounded scratch buffer."""
    while n > 0:
        k = _io(sock, deadline, select.POLLIN, sock.recv_into, scratch, min(n, len(scratch)))
        if k == 0:
            raise ConnectionError("peer closed the connection while draining a payload")
        n -= k


def sendmsg_all(sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview],
                deadline: float | None = None) -> None:
    """Scatter-gather send of every buffer by ``deadline``, handling partial writes
    (a peer that reads slowly cannot hold the sender past it). TLS sockets have no
    ``sendmsg``: they send buffer by buffer (``_send_each``)."""
    # byte views (arena slices: a GET reply's payload) are sliced as they are on a partial
    # write; anything else is viewed as bytes first
    bufs = [b if type(b) is memoryview and b.ndim == 1 and b.format == "B"
            else memoryview(b).cast("B")
            for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):
        return _send_each(sock, bufs, deadline)
    i = 0
    while i < len(bufs):
        chunk = bufs[i:i + _IOV_MAX]
        sent = _io(sock, deadline, select.POLLOUT, sock.sendmsg, chunk)
        while chunk and sent >= len(chunk[0]):
            sent -= len(chunk[0])
            chunk.pop(0)
            i += 1
        if sent:
            bufs[i] = bufs[i][sent:]


_TLS_RECORD = 16 << 10  # largest TLS record payload


def _send_each(sock: ssl.SSLSocket, bufs: list[memoryview], deadline: float | None) -> None:
    """Send every buffer by ``deadline``; neighbours smaller than a TLS record (a frame
    header, small values) are gathered into one record instead of one record and syscall
    each. ``send`` (not ``sendall``) so the deadline is re-armed before every call."""
    small = bytearray()
    for b in bufs:
        if len(small) + len(b) <= _TLS_RECORD:
            small += b
            continue
        if small:
            _send_all(sock, memoryview(small), deadline)
            small = bytearray()
        if len(b) < _TLS_RECORD:
            small += b
        else:
            _send_all(sock, b, deadline)
    if small:
        _send_all(sock, memoryview(small), deadline)


def _send_all(sock: ssl.SSLSocket, view: memoryview, deadline: float | None) -> None:
    sent = 0
    while sent < len(view):
        arm(sock, deadline)
        sent += sock.send(view[sent:sent + (1 << 20)])


_HEADER_STEP = 64 << 10


def recv_header(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """Receive an ``n``-byte header, growing the buffer as bytes arrive, so a prefix
    that merely claims a large header costs no memory until the bytes come."""
    if n <= _HEADER_STEP:
        return recv_exact(sock, n, deadline)
    buf, step = bytearray(), memoryview(bytearray(_HEADER_STEP))
    while len(buf) < n:
        k = _io(sock, deadline, select.POLLIN, sock.recv_into, step,
                min(_HEADER_STEP, n - len(buf)))
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {len(buf)} of {n} "
                                  "header bytes")
        buf += step[:k]
    return buf


def read_prefix(sock: socket.socket, limits: Limits, prefix_buf: bytearray | None = None, *,
                deadline: float | None = None) -> tuple[FrameHeader, bytearray]:
    """Read and bound-check the fixed 36-byte prefix only: nothing of the header is read
    yet, so a caller can refuse the frame (e.g. a data op before AUTH) on its opcode and
    lengths alone. Returns the parsed prefix and its raw bytes (for ``read_header``)."""
    prefix = prefix_buf if prefix_buf is not None else bytearray(PREFIX_SIZE)
    recv_exact_into(sock, memoryview(prefix), deadline)
    return decode_prefix(prefix, limits), prefix


def read_header(sock: socket.socket, fh: FrameHeader, prefix: bytearray, *,
                deadline: float | None = None) -> bytes | bytearray:
    """Read the header that follows ``prefix`` by ``deadline`` and verify the CRC over
    both."""
    header = recv_header(sock, fh.header_len, deadline) if fh.header_len else b""
    check_crc(prefix, header)
    return header


def read_frame(sock: socket.socket, limits: Limits, prefix_buf: bytearray | None = None, *,
               deadline: float | None = None) -> tuple[FrameHeader, Any]:
    """Read prefix + header (not the payload) by ``deadline`` and validate both."""
    fh, prefix = read_prefix(sock, limits, prefix_buf, deadline=deadline)
    return fh, decode_meta(read_header(sock, fh, prefix, deadline=deadline), limits)


def read_reply_into(sock: socket.socket, view: memoryview, limits: Limits,
                    deadline: float, request: bytes | None = None
                    ) -> tuple[FrameHeader, Any, int, int]:
    """The reply to the request just sent on ``sock``, its only one in flight, read
    into ``view`` in as few ``recv`` calls as the bytes arrive: the prefix, the header
    and as much of the payload as fits usually come in one. The first Python read
    waits before it reads (the reply is never there the moment the request left), so
    it costs no ``recv`` that would block.

    ``request`` (a whole encoded frame): send it first, by the same deadline. On a
    plain socket the send and the reads up to the reply's prefix are one
    ``native.exchange`` call (the C version releases the GIL once for the round trip;
    its first non-blocking ``recv`` usually finds nothing, then it polls); on TLS,
    ``sendmsg_all`` then the reads below.

    ``view``'s length bounds every read: a caller with its own destination for the
    payload passes a short view, so little of the payload lands in ``view`` to be
    copied out again. A header longer than ``view`` is assembled from what it holds
    and the rest as it arrives (``recv_header``).

    Returns ``(prefix, header, start, held)``: ``view[start:held]`` are the payload's
    first bytes, ``held - start`` of ``prefix.payload_len``; the rest are still on the
    socket, for the caller to receive straight into its destination. By ``deadline``
    (``socket.timeout`` past it). ConnectionError on EOF; ProtocolError for a bad
    prefix or CRC, or bytes past the end of the frame (a peer that sent more than one
    reply: the stream position is then unknown)."""
    cap = len(view)
    got = 0
    if request is not None and not isinstance(sock, ssl.SSLSocket):
        got = native.exchange(sock, request, view, PREFIX_SIZE, deadline)
    else:
        if request is not None:
            sendmsg_all(sock, [request], deadline)
        _wait_ready(sock, deadline, select.POLLIN)
    need = PREFIX_SIZE  # grows to the header's end once the prefix is known
    fh: FrameHeader | None = None
    while True:
        if fh is None and got >= PREFIX_SIZE:
            fh = decode_prefix(view[:PREFIX_SIZE], limits)
            start = PREFIX_SIZE + fh.header_len
            if got > start + fh.payload_len:
                raise ProtocolError("peer sent bytes past the end of the reply frame")
            if start > cap:  # a long header (an error's message): nothing of the payload
                header = bytearray(view[PREFIX_SIZE:got])
                header += recv_header(sock, start - got, deadline)
                check_crc(view[:PREFIX_SIZE], header)
                return fh, decode_meta(header, limits), 0, 0
            need = min(cap, start + fh.payload_len)
        if fh is not None and got >= need:
            break
        k = _io(sock, deadline, select.POLLIN, sock.recv_into, view[got:],
                (cap if fh is None else need) - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} bytes of a reply")
        got += k
    header = view[PREFIX_SIZE:start]
    check_crc(view[:PREFIX_SIZE], header)
    return fh, decode_meta(header, limits), start, got


# ---------------------------------------------------------------- argument checks

def check_key(key: Any, limits: Limits) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise ProtocolError("key must be non-empty bytes", Status.BAD_REQUEST)
    if len(key) > limits.max_key_bytes:
        raise ProtocolError(f"key of {len(key)} bytes exceeds max_key_bytes "
                            f"{limits.max_key_bytes}", Status.TOO_LARGE)
    return bytes(key)


def check_namespace(ns: Any, limits: Limits) -> bytes:
    if not isinstance(ns, (bytes, bytearray)):
        raise ProtocolError("namespace must be bytes", Status.BAD_REQUEST)
    if len(ns) > limits.max_namespace_bytes:
        raise ProtocolError(f"namespace of {len(ns)} bytes exceeds max_namespace_bytes "
                            f"{limits.max_namespace_bytes}", Status.TOO_LARGE)
    return bytes(ns)


def check_items(meta: Any, limits: Limits) -> list:
    if not isinstance(meta, dict):
        raise ProtocolError("frame header must be a map", Status.BAD_REQUEST)
    items = meta.get("items")
    if not isinstance(items, list):
        raise ProtocolError("frame header lacks an 'items' list", Status.BAD_REQUEST)
    if len(items) > limits.max_batch_items:
        raise ProtocolError(f"batch of {len(items)} items exceeds max_batch_items "
                            f"{limits.max_batch_items}", Status.TOO_LARGE)
    return items


def check_flag(meta: dict, name: str) -> bool:
    """A 0/1 frame flag of the header map (``"ho"``, ``"ia"``): absent is 0. Anything but
    0, 1 (or a boolean) is BAD_REQUEST."""
    v = meta.get(name, 0)
    if v is not True and v is not False and (type(v) is not int or v not in (0, 1)):
        raise ProtocolError(f"{name!r} must be 0 or 1, got {v!r}", Status.BAD_REQUEST)
    return bool(v)


def check_placement(meta: dict, n: int) -> list[int] | None:
    """The frame's ``"ph"`` (one u64 placement hash per item, sent by clients routed by a
    master view), or None when absent. Anything else is BAD_REQUEST. Checked with C-level
    passes (no per-item Python loop): it runs on every put frame."""
    ph = meta.get("ph")
    if ph is None:
        return None
    if type(ph) is not list or len(ph) != n or (n and (
            not set(map(type, ph)) <= _INT or min(ph) < 0 or max(ph) >= 1 << 64)):
        raise ProtocolError("'ph' must hold one u64 placement hash per item",
                            Status.BAD_REQUEST)
    return ph


_INT = frozenset({int})


def chain_parents(meta: dict, items: Sequence[PutItem], limits: Limits
                  ) -> list[bytes] | None:
    """Each parsed item's chain parent from the frame's ``"ch"`` (None when absent:
    nothing is known, and nothing is done per item). ``"ch"`` is the key of the chain page before the frame's first item (``b""``:
    the first item heads a chain) and says the items are consecutive pages of one chain,
    in order: the first key's parent is ``"ch"``, each later key's the key before it
    (the slices of one value share their key's). Anything but bytes of at most
    ``max_key_bytes`` is BAD_REQUEST / TOO_LARGE, before any payload byte is read."""
    ch = meta.get("ch")
    if ch is None:
        return None
    if not isinstance(ch, (bytes, bytearray)):
        raise ProtocolError("'ch' must be the key (bytes) of the chain page before the "
                            "frame's first item, or empty bytes when it heads a chain; "
                            "leave it out when the items are not one chain",
                            Status.BAD_REQUEST)
    if len(ch) > limits.max_key_bytes:
        raise ProtocolError(f"'ch' of {len(ch)} bytes exceeds max_key_bytes "
                            f"{limits.max_key_bytes}", Status.TOO_LARGE)
    parent, out = bytes(ch), []
    prev = None
    for it in items:
        k = it[0]
        if k != prev:
            if prev is not None:
                parent = prev
            prev = k
        out.append(parent)
    return out


class PutItem(NamedTuple):
    """One validated PUT / ALLOC item. ``checksum``: the writer's xxh3_64 of the whole
    value (every slice of a sliced value carries the same one), or None if not sent."""

    key: bytes
    total_len: int
    offset: int
    length: int
    put_id: int
    checksum: int | None


_U64 = 1 << 64


def self_contained(parsed: Sequence[tuple]) -> set[tuple[bytes, int]]:
    """The ``(key, put_id)`` of parsed PUT items whose slices in this one frame tile their
    value exactly (``[0, total_len)``, no gap, no overlap): such a put completes within
    the request, so its reservation cannot outlive it. Whole values are trivially so."""
    if all(it[2] == 0 and it[3] == it[1] > 0 for it in parsed):  # non-empty whole values
        out = {(it[0], it[4]) for it in parsed}
        if len(out) == len(parsed):  # each once (a repeat tiles nothing: the loop below)
            return out
    spans: dict[tuple[bytes, int], list[tuple[int, int, int]]] = {}
    for it in parsed:
        key, tl, off, ln, pid = it[:5]
        spans.setdefault((key, pid), []).append((off, off + ln, tl))
    out = set()
    for k, sp in spans.items():
        sp.sort()
        tl = sp[0][2]
        pos = 0
        for a, b, t in sp:
            if t != tl or a != pos or b <= a:
                break
            pos = b
        else:
            if pos == tl:
                out.add(k)
    return out


def parse_put_items(items: list, limits: Limits, op: str = "PUT",
                    require_checksum: bool = False) -> list[PutItem]:
    """Validate ``[key, total_len, offset, length, put_id, checksum]`` items (PUT and
    ALLOC). ``checksum`` (u64, the writer's xxh3 of the whole value) may be left out of
    a PUT item; ALLOC (``require_checksum``) must carry it."""
    parsed = []
    shape = "[key, total_len, offset, length, put_id, checksum]"
    most, make = limits.max_key_bytes, tuple.__new__
    for it in items:
        if type(it) is list and len(it) == 6:  # the usual item, checked inline
            key, tl, off, ln, pid, csum = it
            if (type(key) is bytes and 0 < len(key) <= most and type(tl) is int
                    and type(off) is int and type(ln) is int and type(pid) is int
                    and type(csum) is int and 0 <= off and 0 <= ln and off + ln <= tl
                    and 0 <= pid and 0 <= csum < _U64):
                parsed.append(make(PutItem, (key, tl, off, ln, pid, csum)))
                continue
        if not (isinstance(it, list) and len(it) in (5, 6)
                and all(isinstance(x, int) for x in it[1:])):
            raise ProtocolError(f"{op} item must be {shape}", Status.BAD_REQUEST)
        if len(it) == 5 and require_checksum:
            raise ProtocolError(f"{op} item must carry the value's checksum: {shape}",
                                Status.BAD_REQUEST)
        key = check_key(it[0], limits)
        tl, off, ln, pid = it[1], it[2], it[3], it[4]
        if tl < 0 or off < 0 or ln < 0 or off + ln > tl or pid < 0:
            raise ProtocolError(f"{op} item has inconsistent lengths (total {tl}, offset "
                                f"{off}, length {ln})", Status.BAD_REQUEST)
        csum = it[5] if len(it) == 6 else None
        if csum is not None and not 0 <= csum < _U64:
            raise ProtocolError(f"{op} item checksum is not a u64", Status.BAD_REQUEST)
        parsed.append(PutItem(key, tl, off, ln, pid, csum))
    return parsed


def auth_mac(token: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the server nonce under the shared token."""
    import hmac
    import hashlib

    return hmac.new(token.encode(), b"gcache-auth-v1:" + nonce, hashlib.sha256).digest()


# LEASE replies in packed form (a LEASE request with ``"pk": 1``): ``{"packed": bytes}``,
# each item's row ``[status, total_len, version, arena_offset, lease_id, checksum]`` as
# six little-endian u64 back to back, instead of one msgpack list per item (which the
# client decoded into a list per key, most of its GC pressure on a batch get).
LEASE_ROW = 6


def pack_lease_rows(rows: Sequence[Sequence[int]]) -> bytes:
    """The packed form of LEASE reply rows (each six non-negative ints below 2**64)."""
    flat = [v for row in rows for v in row]
    return struct.pack(f"<{len(flat)}Q", *flat)


def unpack_lease_rows(blob: Any, n: int) -> tuple[int, ...]:
    """The ``n`` rows of a packed LEASE reply, flat (row j is ``[6*j, 6*j + 6)``);
    ProtocolError unless ``blob`` is bytes of exactly ``n`` rows."""
    if type(blob) is not bytes or len(blob) != 8 * LEASE_ROW * n:
        raise ProtocolError(f"packed LEASE reply is not {n} rows of {LEASE_ROW} u64")
    return struct.unpack(f"<{LEASE_ROW * n}Q", blob)
