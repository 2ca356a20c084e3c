"""The Transport contract and the TCP transport.

A ``Transport`` is one channel to one server, owned by exactly one dispatch
thread, which calls ``execute`` for one ``Work`` (one request frame) at a
time and may block in it until ``deadline`` (a ``time.monotonic`` value) —
never longer. ``execute`` returns one ``ItemResult`` per item or raises:

* ``TransportTimeout`` when the deadline passes mid-request; the channel is
  then closed, because the stream position is unknown;
* ``AuthFailed`` when the server refuses the token;
* ``ConnectionError``/``OSError`` when the server is unreachable or died.

The shm and nixl fast paths (later issues) implement the same contract, so the
dispatcher and the Client do not change.

TCP specifics: put payloads are sent with one scatter-gather ``sendmsg``
straight from the caller's buffers; get payloads are received with
``recv_into`` straight into the caller's destination views.

TLS (``tls``, a dialer context): the handshake runs inside ``connect`` before
HELLO, within the connect deadline, and the server's certificate must name the
host dialed. A refused certificate on either side raises ``AuthFailed`` (the
items' status is ``AUTH``); over TLS, payloads move one buffer per syscall
(``sendall``/``recv_into``), still without staging copies on this side.
"""

from __future__ import annotations

import abc
import itertools
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any

from gcache import tls as tlslib
from gcache.errors import ProtocolError
from gcache.protocol import (PREFIX_SIZE, Limits, Op, auth_mac, encode_frame, read_frame,
                             recv_into_many, sendmsg_all)
from gcache.status import Status, status_of


class TransportTimeout(Exception):
    pass


class AuthFailed(Exception):
    pass


@dataclass(slots=True)
class ItemResult:
    status: Status
    total_len: int = 0
    version: int = 0
    nbytes: int = 0
    data: bytearray | None = None


@dataclass(slots=True, eq=False)
class Work:
    """One request frame for one server.

    items, by op:
      PUT:    (key, total_len, offset, length, put_id, src_view)
      GET:    (key, offset, max_len, expect_version, dest_view | None)
      others: key
    """

    op: int
    ns: bytes
    items: list
    deadline: float
    on_done: Any  # callable(list[ItemResult]) -> None, called exactly once
    extra: dict | None = None  # merged into the request header (view epoch, placement hashes)
    retried: bool = False
    state: int = 0  # 0 queued, 1 running, 2 done


_rids = itertools.count(1)


class Transport(abc.ABC):
    @abc.abstractmethod
    def execute(self, work: Work) -> list[ItemResult]: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class TcpTransport(Transport):
    def __init__(self, address: str, token: str, limits: Limits, connect_timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
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

    # ------------------------------------------------------------------ connection
    def _settimeout(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeout()
        self.sock.settimeout(left)

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
        try:
            hs_deadline = min(deadline, time.monotonic() + self.connect_timeout * 4)
            if self.tls is not None:
                self.sock = sock = tlslib.connect(self.tls, sock, self.host, hs_deadline)
            self._settimeout(hs_deadline)
            fh, hello = read_frame(sock, self.limits, self.prefix)
            if fh.status:  # refused before HELLO, e.g. a TLS-only server to a plain client
                err = hello.get("error", "") if isinstance(hello, dict) else ""
                exc_type = AuthFailed if fh.status == Status.AUTH else ConnectionError
                raise exc_type(f"{self.address} refused the connection: {err}")
            if fh.opcode != Op.HELLO or not isinstance(hello, dict):
                raise ConnectionError(f"{self.address} did not greet with HELLO")
            self.server_name = str(hello.get("name", ""))
            self.hello = hello
            mac = auth_mac(self.token, hello["nonce"]) if self.token else b""
            sock.sendall(encode_frame(Op.AUTH, next(_rids), {"mac": mac}))
            fh, meta = read_frame(sock, self.limits, self.prefix)
            if fh.status == Status.AUTH:
                raise AuthFailed(meta.get("error", "auth failed") if isinstance(meta, dict)
                                 else "auth failed")
            if fh.status != 0:
                raise ConnectionError(f"{self.address} refused the handshake: {meta}")
            self.auth_reply = meta if isinstance(meta, dict) else {}
        except socket.timeout:
            self.close()
            raise TransportTimeout() from None
        except ssl.SSLError as exc:
            self.close()
            is_auth, why = tlslib.explain(exc, self.address)
            raise (AuthFailed if is_auth else ConnectionError)(why) from None
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

    def _execute(self, work: Work) -> list[ItemResult]:
        op, rid, sock = work.op, next(_rids), self.sock
        if op == Op.PUT:
            meta = {"ns": work.ns, "items": [[it[0], it[1], it[2], it[3], it[4]]
                                             for it in work.items], **(work.extra or {})}
            plen = sum(it[3] for it in work.items)
            self._settimeout(work.deadline)
            sendmsg_all(sock, [encode_frame(op, rid, meta, plen),
                               *(it[5] for it in work.items)])
        elif op == Op.GET:
            meta = {"ns": work.ns, "items": [[it[0], it[1], it[2], it[3]] for it in work.items],
                    **(work.extra or {})}
            self._settimeout(work.deadline)
            sock.sendall(encode_frame(op, rid, meta))
        else:
            self._settimeout(work.deadline)
            sock.sendall(encode_frame(op, rid, {"ns": work.ns, "items": work.items,
                                                **(work.extra or {})}))
        self._settimeout(work.deadline)
        fh, rmeta = read_frame(sock, self.limits, self.prefix)
        if fh.request_id != rid or fh.opcode != op:
            raise ProtocolError(f"reply for request {fh.request_id}/op {fh.opcode}, "
                                f"expected {rid}/op {op}")
        if fh.status:
            err = rmeta.get("error", "") if isinstance(rmeta, dict) else ""
            st = status_of(fh.status)
            if st == Status.AUTH:
                raise AuthFailed(err)
            self.close()  # the server closes after a frame-level error
            return [ItemResult(st) for _ in work.items]
        if op == Op.GET:
            return self._read_get(work, rmeta, fh.payload_len)
        st = rmeta.get("st") if isinstance(rmeta, dict) else None
        if not isinstance(st, list) or len(st) != len(work.items):
            raise ProtocolError("reply status list does not match the request")
        return [ItemResult(status_of(s)) for s in st]

    def _read_get(self, work: Work, rmeta: Any, plen: int) -> list[ItemResult]:
        items = rmeta.get("items") if isinstance(rmeta, dict) else None
        if not isinstance(items, list) or len(items) != len(work.items):
            raise ProtocolError("GET reply items do not match the request")
        if sum(x[3] for x in items) != plen:
            raise ProtocolError("GET reply lengths do not add up to its payload")
        out = []
        views = []
        for it, (st, total, ver, n) in zip(work.items, items):
            res = ItemResult(status_of(st), total, ver, n)
            if n:
                if n > it[2]:
                    raise ProtocolError(f"server sent {n} bytes for a {it[2]}-byte request")
                if it[4] is None:
                    res.data = bytearray(n)
                    views.append(memoryview(res.data))
                else:
                    views.append(it[4][:n])
            out.append(res)
        # one scatter read fills many destinations; the deadline is re-armed per syscall
        recv_into_many(self.sock, views, lambda: self._settimeout(work.deadline))
        return out


def _call_stats(self: TcpTransport, deadline: float) -> dict:
    """STATS round trip on a connected transport (admin path, not dispatched)."""
    self._settimeout(deadline)
    rid = next(_rids)
    self.sock.sendall(encode_frame(Op.STATS, rid, {}))
    fh, meta = read_frame(self.sock, self.limits, self.prefix)
    if fh.status or not isinstance(meta, dict):
        raise ConnectionError(f"STATS failed on {self.address}: {meta}")
    return meta.get("stats", {})


TcpTransport.call_stats = _call_stats
