"""HTTP serving with bounds, for the masters' API and the servers' metrics endpoint:
what a slow, silent or hostile peer can hold is bounded in count and in time.

* ``BoundedHTTPServer``: an (https when given ``tls``) threading HTTP server with at most
  ``max_connections`` connection threads and at most ``max_per_ip`` of them (0: no cap)
  for one peer address. Past a cap a connection is answered 503 from the accept loop
  (non-blocking; plain HTTP only: a TLS peer is just closed) and closed, never queued on
  a thread. A TLS handshake runs on the connection's thread, within ``handshake_s``.
* ``DeadlineRequestHandler``: a request handler whose request (line, headers, body)
  must arrive within ``request_deadline_s`` of its first byte's wait, through a
  ``DeadlineReader``; ``reader.disarm()`` once the request is in.
* ``DeadlineReader``: a socket's reads under one deadline: the time left is recomputed
  before every ``recv``, so a peer trickling a byte at a time is cut off when the
  deadline passes (a per-``recv`` timeout would let it go on forever).

Threads: the accept loop runs ``process_request`` (never blocks: refusals are
non-blocking sends); each admitted connection runs on its own daemon thread.
"""

from __future__ import annotations

import http.server
import io
import json
import logging
import socket
import ssl
import threading
import time
from typing import Any

from gcache.logs import RateLimitedLog
from gcache.protocol import arm
from gcache.tls import HTTPServer

LISTEN_BACKLOG = 1024
SEND_TIMEOUT_S = 10.0  # answers are small: one send fills no socket buffer


def busy_answers(name: str, max_connections: int, max_per_ip: int,
                 flags: tuple[str, str] | None) -> tuple[bytes, bytes]:
    """The whole 503 answers past the connection cap and past the per-address cap:
    ``name`` is who answers, ``flags`` the options that raise the caps (None: fixed)."""
    raise_all, raise_ip = ((f"; retry, or raise {flags[0]}", f"; retry, or raise {flags[1]}")
                           if flags else ("; retry", "; retry"))
    return (_503(f"{name} is serving its maximum of {max_connections} connections"
                 f"{raise_all}"),
            _503(f"{name} is serving its maximum of {max_per_ip} connections from your "
                 f"address{raise_ip}"))


def _503(error: str) -> bytes:
    body = json.dumps({"error": error}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


class DeadlineReader(io.RawIOBase):
    """A socket's reads under one deadline: the time left is recomputed before every
    ``recv``, so a peer trickling a byte at a time is cut off when the deadline passes."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline: float | None = None
        self.received = 0  # bytes since arm(): 0 means an idle keep-alive, not a slow peer

    def arm(self, deadline: float) -> None:
        self.deadline, self.received = deadline, 0

    def disarm(self) -> None:
        """The request is in: the answer (maybe a long-poll) is not under the deadline."""
        self.deadline = None
        self._sock.settimeout(SEND_TIMEOUT_S)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        arm(self._sock, self.deadline)  # TimeoutError once the deadline has passed
        n = self._sock.recv_into(b)
        self.received += n
        return n


class BoundedHTTPServer(HTTPServer):
    """An (https when given ``tls``) HTTP server with at most ``max_connections`` connection
    threads, at most ``max_per_ip`` of them (0: no cap) for one peer address: past a cap a
    connection is answered 503 from the accept loop (non-blocking; plain HTTP only: a TLS
    peer is just closed) and closed. A TLS handshake runs on the connection's thread,
    within ``handshake_s``."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int, *,
                 max_per_ip: int = 0, tls: ssl.SSLContext | None = None,
                 handshake_s: float = 10.0, name: str = "gcache-master",
                 flags: tuple[str, str] | None = ("--max-connections",
                                                  "--max-connections-per-ip"),
                 log: logging.Logger | None = None) -> None:
        """``name``: who answers (the 503s and logs say it); ``flags``: the options that
        raise the two caps, named in the 503s (None: fixed caps); ``log``: where refusals
        are logged (rate limited: one line per kind per 10 s)."""
        self.max_connections = max_connections
        self.max_per_ip = max_per_ip
        self.handshake_s = handshake_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._per_ip: dict[str, int] = {}
        self._per_ip_lock = threading.Lock()
        self.name = name
        self._log = RateLimitedLog(log or logging.getLogger("gcache.http"), 10.0)
        self._busy, self._busy_ip = busy_answers(name, max_connections, max_per_ip, flags)
        super().__init__(address, handler, tls=tls)

    def _refuse(self, request: Any, answer: bytes) -> None:
        if self.tls is None:
            try:
                request.setblocking(False)
                request.send(answer)
            except OSError:
                pass
        self.shutdown_request(request)

    def _take_ip(self, ip: str) -> bool:
        if not self.max_per_ip:
            return True
        with self._per_ip_lock:
            n = self._per_ip.get(ip, 0)
            if n >= self.max_per_ip:
                return False
            self._per_ip[ip] = n + 1
            return True

    def _drop_ip(self, ip: str) -> None:
        if not self.max_per_ip:
            return
        with self._per_ip_lock:
            n = self._per_ip.pop(ip) - 1
            if n:
                self._per_ip[ip] = n

    def process_request(self, request: Any, client_address: Any) -> None:
        ip = client_address[0]
        if not self._slots.acquire(blocking=False):
            self._log.warning("conn_cap", "%s at its connection cap (%d): refused %s",
                              self.name, self.max_connections, ip)
            self._refuse(request, self._busy)
            return
        if not self._take_ip(ip):
            self._slots.release()
            self._log.warning("ip_cap", "%s at its per-address connection cap (%d): "
                              "refused %s", self.name, self.max_per_ip, ip)
            self._refuse(request, self._busy_ip)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._drop_ip(ip)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._drop_ip(client_address[0])
            self._slots.release()


class DeadlineRequestHandler(http.server.BaseHTTPRequestHandler):
    """``BaseHTTPRequestHandler`` reading each request under one deadline of
    ``request_deadline_s`` (a subclass sets it); a request that has not arrived whole by
    then ends the connection (``TimeoutError``, which the base class handles)."""

    request_deadline_s = 5.0
    reader: DeadlineReader

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by one that reads under the request deadline
        self.reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self) -> None:
        self.reader.arm(time.monotonic() + self.request_deadline_s)
        super().handle_one_request()
