"""Client of the gcache-master discovery API (HTTP + JSON), used by servers and SDKs.

Design. Any master answers; followers forward writes to the leader, so a
client just tries the masters in turn, starting with the last one that
answered. Every call has a short timeout and failures are values
(``MasterUnavailable``), because the IO path must keep working on the last
view when every master is down. ``watch`` long-polls ``/view?since=E`` and
returns as soon as the epoch moves past ``E`` (or after ``wait_ms``).

Timeouts are deadlines: one HTTP exchange (connect, TLS handshake, request,
status line, headers, body) ends by ``timeout_s`` after it starts however slowly
a master trickles its answer, because the socket timeout is recomputed from the
time left before every syscall. A call made on behalf of a data op
(``deadline=``, e.g. the view refresh after ``NOT_OWNER``) ends by that op's
deadline too.

The credential travels as ``Authorization: Bearer id:secret`` (or the legacy
``Bearer <token>``). Give ``tls`` (a dialer context from ``gcache.tls``) when
the masters serve https (``gcache-master --tls-cert-file``): every call then
verifies the master's certificate, and its name against the address dialed,
before the credential is sent; otherwise run the masters on a trusted network.
A 401 (unknown credential) or 403 (no right for the route) raises
``MasterError`` at once: another master would answer the same.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import ssl
import time
import urllib.error
from typing import Any, Sequence

from gcache.backoff import Backoff
from gcache.errors import MasterError, MasterUnavailable
from gcache.protocol import arm
from gcache.tls import connect as tls_connect, explain
from gcache.view import View, view_from_wire  # noqa: F401  (re-exported for callers)


class MasterClient:
    def __init__(self, masters: Sequence[str] | str, token: str = "", timeout_s: float = 2.0,
                 tls: ssl.SSLContext | None = None) -> None:
        """``token``: what follows ``Bearer``: a credential ``id:secret`` or the token.
        ``tls``: a dialer context when the masters serve https."""
        if isinstance(masters, str):
            masters = [m for m in masters.split(",") if m.strip()]
        self.masters = [m.strip() for m in masters]
        if not self.masters:
            raise ValueError("no master addresses given")
        self.token = token
        self.timeout_s = timeout_s
        self.tls = tls
        self._good = 0

    def request(self, method: str, path: str, body: dict | None = None,
                timeout_s: float | None = None, retry_s: float = 2.0,
                deadline: float | None = None) -> dict:
        """Try every master; while none can answer (e.g. mid-election: HTTP 503),
        retry for up to ``retry_s``. Client errors raise MasterError at once.

        ``deadline`` (``time.monotonic()``): nothing runs past it, retries included;
        MasterUnavailable when it passes."""
        retry_end = time.monotonic() + retry_s
        if deadline is not None:
            retry_end = min(retry_end, deadline)
        backoff = Backoff(0.05, 0.5)  # jittered: clients that lost the masters spread out
        while True:
            try:
                return self._request_once(method, path, body, timeout_s, deadline)
            except MasterUnavailable:
                pause = backoff.next()
                if time.monotonic() + pause >= retry_end:
                    raise
                time.sleep(pause)

    def _request_once(self, method: str, path: str, body: dict | None,
                      timeout_s: float | None, deadline: float | None = None) -> dict:
        tried: list[str] = []  # why each master failed, in the order asked
        n = len(self.masters)
        for i in range(n):
            idx = (self._good + i) % n
            addr = self.masters[idx]
            t = timeout_s or self.timeout_s
            if deadline is not None:
                t = min(t, deadline - time.monotonic())
                if t <= 0:
                    tried.append("the caller's deadline passed before the next master")
                    break
            try:
                out = http_json(addr, method, path, body, self.token, t, tls=self.tls)
            except urllib.error.HTTPError as exc:
                detail = _error_text(exc)
                if exc.code in (400, 401, 403, 404, 409):
                    raise MasterError(exc.code, detail) from None
                tried.append(f"{addr}: HTTP {exc.code} {detail}")
                continue
            except (OSError, ValueError) as exc:
                tried.append(explain(exc, addr)[1] if isinstance(exc, ssl.SSLError)
                             else f"{addr}: {exc}")
                continue
            self._good = idx
            return out
        asked = sum(1 for t in tried if not t.startswith("the caller's deadline"))
        raise MasterUnavailable(f"no master answered {method} {path} (asked {asked} of {n}): "
                                + "; ".join(tried))

    # ------------------------------------------------------------------ API
    def view(self, since: int = -1, wait_ms: int = 0, deadline: float | None = None) -> dict:
        timeout = self.timeout_s + wait_ms / 1000.0
        return self.request("GET", f"/view?since={since}&wait_ms={wait_ms}", timeout_s=timeout,
                            deadline=deadline)

    def register(self, member_id: str, address: str, capacity_bytes: int, boot_id: str) -> dict:
        return self.request("POST", "/register", {"id": member_id, "address": address,
                                                   "capacity_bytes": capacity_bytes,
                                                   "boot_id": boot_id})

    def heartbeat(self, member_id: str, incarnation: int, boot_id: str, stats: dict) -> dict:
        return self.request("POST", "/heartbeat", {"id": member_id, "incarnation": incarnation,
                                                    "boot_id": boot_id, "stats": stats})

    def admin(self, op: str, member_id: str) -> dict:
        return self.request("POST", "/admin", {"op": op, "id": member_id})

    def self_op(self, op: str, member_id: str, boot_id: str,
                deadline: float | None = None) -> dict:
        """A server's ``drain``, ``remove`` or ``down`` of itself: the member registered
        with ``boot_id`` (a server credential may act only on its own member)."""
        return self.request("POST", "/self", {"op": op, "id": member_id, "boot_id": boot_id},
                            deadline=deadline)

    def status(self, deadline: float | None = None) -> dict:
        return self.request("GET", "/status", deadline=deadline)


class _DeadlineIO:
    """What http.client needs of a socket (``sendall``, ``makefile``, ``close``), with
    every send and receive ending by one deadline. It wraps a plain or a TLS socket
    alike: http.client reads through ``makefile``, which calls ``recv_into`` once per
    buffer fill, and each call is re-armed from the time left."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline
        # like a socket's: http.client closes the connection as soon as it has the
        # headers of a "Connection: close" answer, and the body is read after that
        self.readers, self.closed = 0, False

    def recv_into(self, buf: Any, n: int = 0) -> int:
        arm(self.sock, self.deadline)
        return self.sock.recv_into(buf, n)

    def sendall(self, data: Any) -> None:
        view, sent = memoryview(data).cast("B"), 0
        while sent < len(view):
            arm(self.sock, self.deadline)
            sent += self.sock.send(view[sent:])

    def makefile(self, mode: str = "rb", *args: Any, **kw: Any) -> io.BufferedReader:
        self.readers += 1
        return io.BufferedReader(socket.SocketIO(self, "rb"))  # type: ignore[arg-type]

    def _decref_socketios(self) -> None:  # SocketIO.close calls it
        self.readers -= 1
        if self.closed and self.readers <= 0:
            self.sock.close()

    def close(self) -> None:
        """Closes the socket once no reader made by ``makefile`` is open."""
        self.closed = True
        if self.readers <= 0:
            self.sock.close()


class _DeadlineHTTPConnection(http.client.HTTPConnection):
    def __init__(self, addr: str, deadline: float, tls: ssl.SSLContext | None = None
                 ) -> None:
        super().__init__(addr, timeout=max(0.001, deadline - time.monotonic()))
        self.deadline, self.tls = deadline, tls

    def connect(self) -> None:
        super().connect()  # create_connection under the time left
        sock = self.sock
        if self.tls is not None:  # the handshake, under the same deadline
            sock = tls_connect(self.tls, sock, self.host, self.deadline)
        self.sock = _DeadlineIO(sock, self.deadline)


def http_json(addr: str, method: str, path: str, body: dict | None, token: str,
              timeout_s: float, headers: dict[str, str] | None = None,
              tls: ssl.SSLContext | None = None) -> dict:
    """One JSON request/response, ended by ``timeout_s`` from now whatever the peer does;
    https with ``tls`` (a dialer context), else http.

    Raises ``urllib.error.HTTPError`` for a non-2xx answer, ``OSError`` (a
    ``TimeoutError`` past the deadline, an ``ssl.SSLError`` for a refused certificate)
    when the master is unreachable or too slow."""
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"Content-Type": "application/json", "Connection": "close", **(headers or {})}
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    conn = _DeadlineHTTPConnection(addr, time.monotonic() + timeout_s, tls)
    try:
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
    except http.client.HTTPException as exc:
        raise ConnectionError(f"bad HTTP answer from {addr}: {exc!r}") from None
    finally:
        conn.close()
    if not 200 <= resp.status < 300:
        scheme = "https" if tls is not None else "http"
        raise urllib.error.HTTPError(f"{scheme}://{addr}{path}", resp.status, resp.reason,
                                     resp.headers, io.BytesIO(raw))
    return json.loads(raw or b"{}")


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read() or b"{}").get("error", exc.reason)
    except Exception:
        return str(exc.reason)


