"""The TCP transport: the framed protocol over one socket (docs/protocol.md).

It implements the ``Transport`` contract of base.py (threads, blocking, errors).
Put payloads are sent with one scatter-gather ``sendmsg`` straight from the caller's
buffers; get payloads are received with ``recv_into`` straight into the caller's
destination views.

TLS (``tls``, a dialer context): the handshake runs inside ``connect`` before
HELLO, within the connect deadline, and the server's certificate must name the
host dialed. A refused certificate on either side raises ``AuthError`` (the
items' status is ``AUTH``); over TLS, payloads move one buffer per syscall
(``sendall``/``recv_into``), still without staging copies on this side.

``call_stats`` is the admin STATS round trip (``Client.stats``), not dispatched.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Any

import xxhash

from gcache import tls as tlslib
from gcache.native import checksums
from gcache.credentials import ClientCredential, auth_fields
from gcache.errors import AuthError, ProtocolError, TransportTimeout
from gcache.protocol import (FLAG_MORE, PREFIX_SIZE, FrameHeader, Limits, Op, encode_frame,
                             read_frame, read_reply_into, recv_into_many, sendmsg_all)
from gcache.config import TransportKind
from gcache.status import Status, status_of
from gcache.sdk.buffers import digest
from gcache.sdk.transports.base import (DIGEST_LATER, ItemResult, PutItem, Transport, Work,
                                        next_request_id)


_INT5 = (int, int, int, int, int)
_HOST_DEST = (type(None), memoryview)  # a byte get, or host memory (not a device view)

ONE_ITEM_BUFFER_BYTES = (128 << 10) + (4 << 10)
"""A connection's reply buffer for one-item frames (made on first use): the prefix,
the header and a byte get's value of up to 128 KiB arrive in it with one ``recv``. A
longer value lands in new bytes after the part that came with the header."""
SHORT_READ_BYTES = 512
"""How much a one-item reply with no value to copy out (a get into a destination, a
key op) reads into the buffer at first: a prefix and a one-item header fit."""


def put_fields(items: list[PutItem], sums: list[int | None] | None = None) -> list[list]:
    """A PUT's (or ALLOC's, PUT_STAGED's) wire items: everything but the bytes. A
    ``DIGEST_LATER`` checksum is computed here (xxh3_64 of the item's bytes: the whole
    value), or taken from ``sums`` (one per item; None: compute) when the caller hashed
    the bytes as it copied them. Host buffers are hashed in one ``native.checksums``
    call (the GIL released: the other dispatch threads run meanwhile)."""
    late = list(sums) if sums is not None else [None] * len(items)
    host = [j for j, it in enumerate(items) if it.checksum == DIGEST_LATER
            and late[j] is None and isinstance(it.src, (memoryview, bytes, bytearray))]
    if host:
        for j, c in zip(host, checksums([items[j].src for j in host])):
            late[j] = c
    out = []
    for it, s in zip(items, late):
        c = it.checksum
        if c == DIGEST_LATER:
            c = s if s is not None else digest(it.src)  # a device buffer: copied first
        out.append([it.key, it.total_len, it.offset, it.length, it.put_id, c])
    return out


def get_rows(rmeta: Any, items: list, plen: int, more: bool = False) -> list[list[int]]:
    """A GET reply frame's item rows ``[status, total_len, version, nbytes, checksum]``,
    checked against the request's ``items`` (all of them, or with ``more``, a streamed
    reply's frame that is not the last, a non-empty proper prefix of them) and the
    frame's payload length ``plen``. ProtocolError for anything else."""
    rows = rmeta.get("items") if isinstance(rmeta, dict) else None
    if not isinstance(rows, list) or (
            not 0 < len(rows) < len(items) if more else len(rows) != len(items)):
        raise ProtocolError("GET reply items do not match the request")
    if not all(type(x) is list and len(x) == 5 and tuple(map(type, x)) == _INT5
               for x in rows):
        raise ProtocolError("malformed GET reply item")
    if sum(x[3] for x in rows) != plen:
        raise ProtocolError("GET reply lengths do not add up to its payload")
    for it, x in zip(items, rows):
        n = x[3]
        if n < 0:
            raise ProtocolError("GET reply item has a negative length")
        if n > it.max_len:
            raise ProtocolError(f"server sent {n} bytes for a {it.max_len}-byte request")
    return rows


def check_answers(fh: FrameHeader, rid: int, op: int) -> None:
    """A reply frame must answer request ``rid`` of ``op``: ProtocolError otherwise."""
    if fh.request_id != rid or fh.opcode != op:
        raise ProtocolError(f"reply for request {fh.request_id}/op {fh.opcode}, "
                            f"expected {rid}/op {op}")


def key_results(rmeta: Any, n: int) -> list[ItemResult]:
    """An EXISTS, DELETE or TOUCH reply's per-item results, one for each of ``n``
    items: ProtocolError for a status list that does not match the request."""
    st = rmeta.get("st") if isinstance(rmeta, dict) else None
    if not isinstance(st, list) or len(st) != n:
        raise ProtocolError("reply status list does not match the request")
    return [ItemResult(status_of(s)) for s in st]


class TcpTransport(Transport):
    kind: TransportKind | None = TransportKind.TCP
    background = False  # AUTH asks the server to serve this connection at background priority
    stream_gets = False  # GETs ask for a streamed reply ("sr": 1, docs/protocol.md)

    def __init__(self, address: str, token: str | ClientCredential, limits: Limits,
                 connect_timeout: float, tls: ssl.SSLContext | None = None) -> None:
        """``token``: the client's ``ClientCredential``, or the legacy token ('' = none);
        ``tls``: a dialer context to speak TLS to the server."""
        self.address = address
        self.tls = tls
        host, port = address.rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)
        self.token = token
        self.limits = limits
        self.connect_timeout = connect_timeout
        self.sock: socket.socket | None = None
        self.prefix = bytearray(PREFIX_SIZE)
        self.server_name = ""
        self.hello: dict = {}
        self.auth_reply: dict = {}  # what the server grants after AUTH (e.g. its NIXL agent)
        self._buf: memoryview | None = None  # one-item replies land here (``_one``)

    # ------------------------------------------------------------------ connection
    def connect(self, deadline: float) -> None:
        left = min(self.connect_timeout, deadline - time.monotonic())
        if left <= 0:
            raise TransportTimeout()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=left)
        except socket.timeout:
            raise ConnectionError(f"connect to {self.address} timed out") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        # one deadline for the whole handshake, re-armed before every syscall
        hs_deadline = min(deadline, time.monotonic() + self.connect_timeout * 4)
        try:
            if self.tls is not None:
                self.sock = sock = tlslib.connect(self.tls, sock, self.host, hs_deadline)
            fh, hello = read_frame(sock, self.limits, self.prefix, deadline=hs_deadline)
            if fh.status:  # refused before HELLO, e.g. a TLS-only server to a plain client
                err = hello.get("error", "") if isinstance(hello, dict) else ""
                exc_type = AuthError if fh.status == Status.AUTH else ConnectionError
                raise exc_type(f"{self.address} refused the connection: {err}")
            if fh.opcode != Op.HELLO or not isinstance(hello, dict):
                raise ConnectionError(f"{self.address} did not greet with HELLO")
            self.server_name = str(hello.get("name", ""))
            self.hello = hello
            sendmsg_all(sock, [encode_frame(Op.AUTH, next_request_id(),
                                            {**auth_fields(self.token, hello["nonce"]),
                                             **({"bg": 1} if self.background else {})})],
                        hs_deadline)
            fh, meta = read_frame(sock, self.limits, self.prefix, deadline=hs_deadline)
            if fh.status == Status.AUTH:
                raise AuthError(meta.get("error", "auth failed") if isinstance(meta, dict)
                                 else "auth failed")
            if fh.status != 0:
                raise ConnectionError(f"{self.address} refused the handshake: {meta}")
            self.auth_reply = meta if isinstance(meta, dict) else {}
            if self.tls is None:
                # non-blocking from here on: every call is tried at once and only polled
                # for when it would block, still by the deadline (gcache.protocol._io)
                sock.settimeout(0.0)
        except socket.timeout:
            self.close()
            raise TransportTimeout() from None
        except ssl.SSLError as exc:
            self.close()
            is_auth, why = tlslib.explain(exc, self.address)
            raise (AuthError if is_auth else ConnectionError)(why) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def call_stats(self, deadline: float) -> dict:
        """STATS round trip on a connected transport (admin path, not dispatched), ended by
        ``deadline`` (``socket.timeout`` past it)."""
        sendmsg_all(self.sock, [encode_frame(Op.STATS, next_request_id(), {})], deadline)
        fh, meta = read_frame(self.sock, self.limits, self.prefix, deadline=deadline)
        if fh.status or not isinstance(meta, dict):
            raise ConnectionError(f"STATS failed on {self.address}: {meta}")
        return meta.get("stats", {})

    # ------------------------------------------------------------------ requests
    def execute(self, work: Work) -> list[ItemResult]:
        if self.sock is None:
            self.connect(work.deadline)
        try:
            return self._execute(work)
        except socket.timeout:
            self.close()
            raise TransportTimeout() from None
        except ProtocolError as exc:
            self.close()
            raise ConnectionError(f"protocol error from {self.address}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _execute(self, work: Work, stream: bool = False) -> list[ItemResult]:
        """``work`` as one request and its reply; ``stream``: a GET asks for a streamed
        reply even when ``stream_gets`` is off."""
        op = work.op
        if len(work.items) == 1 and op != Op.PUT and self.tls is None \
                and (op != Op.GET or type(work.items[0].dest) in _HOST_DEST):
            return self._one(work)
        rid, sock, deadline = next_request_id(), self.sock, work.deadline
        if op == Op.PUT:
            meta = {"ns": work.ns, "items": put_fields(work.items), **(work.extra or {})}
            plen = sum(it.length for it in work.items)
            sendmsg_all(sock, [encode_frame(op, rid, meta, plen),
                               *(it.src for it in work.items)], deadline)
        elif op == Op.GET:
            meta = {"ns": work.ns, "items": [[it.key, it.offset, it.max_len, it.version]
                                             for it in work.items], **(work.extra or {})}
            if self.stream_gets or stream:
                # the server may stream the reply (a frame per verified prefix of items),
                # so a disk-served frame's first items travel while its later ones are read
                meta["sr"] = 1
            sendmsg_all(sock, [encode_frame(op, rid, meta)], deadline)
        else:
            sendmsg_all(sock, [encode_frame(op, rid, {"ns": work.ns,
                                                      "items": [it.key for it in work.items],
                                                      **(work.extra or {})})], deadline)
        fh, rmeta = self._reply(rid, op, deadline)
        if fh.status:
            return self._frame_failed(work, fh.status, rmeta)
        if op == Op.GET:
            return self._read_get(work, fh, rmeta, rid)
        return key_results(rmeta, len(work.items))

    def _one(self, work: Work) -> list[ItemResult]:
        """A frame of one item (a GET, never streamed: one item is one frame anyway, or
        an EXISTS, DELETE or TOUCH; plain TCP only): the request sent and the reply
        read with ``read_reply_into`` into this connection's reply buffer, usually in
        one ``native.exchange`` call (a send, then a ``recv`` after one ``poll``, the
        GIL released once) instead of four calls. A GET's bytes are copied
        out of the buffer once, into new bytes (a byte get's ``data``) or the item's
        destination; bytes the buffer did not hold land there straight from the socket.
        Same checks, results and errors as the many-item path (``_read_get_frame``)."""
        op, it, sock, deadline = work.op, work.items[0], self.sock, work.deadline
        rid = next_request_id()
        extra = work.extra
        if op == Op.GET:
            meta = {"ns": work.ns, "items": [[it.key, it.offset, it.max_len, it.version]]}
        else:
            meta = {"ns": work.ns, "items": [it.key]}
        if extra:
            meta.update(extra)
        view = self._buf
        if view is None:
            view = self._buf = memoryview(bytearray(ONE_ITEM_BUFFER_BYTES))
        # the request sent and the reply's start read in one call (native.exchange); a
        # byte get's value is copied out of the buffer once (it must be copied into
        # new bytes anyway); anything else reads ahead only a header's worth, so a
        # value with a destination lands there straight from the socket
        fh, rmeta, start, held = read_reply_into(
            sock, view if op == Op.GET and it.dest is None else view[:SHORT_READ_BYTES],
            self.limits, deadline, encode_frame(op, rid, meta))
        check_answers(fh, rid, op)
        if fh.status:
            return self._frame_failed(work, fh.status, rmeta)
        if fh.flags & FLAG_MORE:
            raise ProtocolError("streamed reply to a request that did not ask for one")
        if op != Op.GET:
            results = key_results(rmeta, 1)
            if fh.payload_len:
                raise ProtocolError(f"{Op.NAMES[op]} reply carries a payload")
            return results
        st, total, ver, n, csum = get_rows(rmeta, work.items, fh.payload_len)[0]
        res = ItemResult(status_of(st), total, ver, n, None, csum)
        if not n:
            return [res]
        end = start + n
        if it.dest is None:
            if held >= end:  # all of it arrived in the buffer: one copy out
                data: Any = bytes(view[start:end])
            else:
                data = bytearray(n)
                dst = memoryview(data)
                dst[:held - start] = view[start:held]
                recv_into_many(sock, [dst[held - start:]], deadline)
            res.data = data
        else:
            data = dst = it.dest[:n]
            dst[:held - start] = view[start:held]
            if held < end:
                recv_into_many(sock, [dst[held - start:]], deadline)
        if work.verify and n == total and it.offset == 0:
            res.landed = xxhash.xxh3_64_intdigest(data)  # the whole object, still cached
        return [res]

    def _reply(self, rid: int, op: int, deadline: float) -> tuple[FrameHeader, Any]:
        """The next reply frame, which must answer request ``rid`` of ``op``."""
        fh, rmeta = read_frame(self.sock, self.limits, self.prefix, deadline=deadline)
        check_answers(fh, rid, op)
        return fh, rmeta

    def _frame_failed(self, work: Work, status: int, rmeta: Any) -> list[ItemResult]:
        """A frame-level error reply: every item gets its status (AUTH raises)."""
        err = rmeta.get("error", "") if isinstance(rmeta, dict) else ""
        st = status_of(status)
        if st == Status.AUTH:
            raise AuthError(err)
        self.close()  # the server closes after a frame-level error
        return [ItemResult(st) for _ in work.items]

    def _read_get(self, work: Work, fh: FrameHeader, rmeta: Any, rid: int
                  ) -> list[ItemResult]:
        """A GET reply: one frame, or a streamed one (``FLAG_MORE`` on every frame but the
        last, each covering at least one of the next items, in order), all by the work's
        deadline. A frame-level error after some frames closes the connection: every
        item is then that status (nothing was reported yet)."""
        out: list[ItemResult] = []
        n = len(work.items)
        while True:
            rest = work.items[len(out):] if out else work.items  # no copy for one frame
            part = self._read_get_frame(rest, rmeta, fh.payload_len, work.deadline,
                                        more=bool(fh.flags & FLAG_MORE), verify=work.verify)
            out += part
            if not fh.flags & FLAG_MORE:
                break
            fh, rmeta = self._reply(rid, Op.GET, work.deadline)
            if fh.status:
                return self._frame_failed(work, fh.status, rmeta)
        if len(out) != n:
            raise ProtocolError("GET reply items do not match the request")
        return out

    def _read_get_frame(self, items: list, rmeta: Any, plen: int, deadline: float,
                        more: bool, verify: bool = False) -> list[ItemResult]:
        """One GET reply frame's rows and payload, for the first of ``items`` (all of
        them unless ``more``: a streamed reply's frame that is not the last). With
        ``verify``, an item that is a whole object is hashed as its bytes land
        (``ItemResult.landed``), so the batch's check needs no second pass over them."""
        rows = get_rows(rmeta, items, plen, more)
        out = []
        views = []
        want: list[bool] | None = [] if verify else None
        landing: list[ItemResult] = []  # the result each view fills
        for it, (st, total, ver, n, csum) in zip(items, rows):
            res = ItemResult(status_of(st), total, ver, n, None, csum)
            if n:
                if it.dest is None:
                    res.data = bytearray(n)
                    views.append(memoryview(res.data))
                else:
                    views.append(it.dest[:n])
                landing.append(res)
                if want is not None:
                    # the whole object (offset 0, as a whole-object slice always is)
                    want.append(n == total and it.offset == 0)
            out.append(res)
        # one scatter read fills many destinations, all by the deadline, hashing the
        # whole objects as they land
        digests = recv_into_many(self.sock, views, deadline, want)
        if digests is not None:
            for res, d in zip(landing, digests):
                if d is not None:
                    res.landed = d
        return out
