"""HTTP serving on aiohttp, for the masters' API and the servers' metrics endpoint: one
event-loop thread serves every connection (a long-poll is a parked coroutine, not a
thread), and what a slow, silent or hostile peer can hold is bounded in count and in
time.

* ``BoundedAioServer``: an aiohttp low-level server (``aiohttp.web.Server``; https when
  given ``tls``) on a socket bound at construction (``OSError`` when the port is
  taken), served by one daemon thread that runs its event loop (``start``/``stop``).
  At most ``max_connections`` connections, at most ``max_per_ip`` (0: no cap) from one
  peer address: past a cap a connection gets a 503 that names the flag to raise, and is
  closed. With TLS a connection takes its slot before the handshake (which asyncio
  bounds by ``request_deadline_s``), and one past a cap is closed unanswered.
* One deadline per request, not per ``recv``: the request line, headers and body must
  all arrive within ``request_deadline_s`` of the first wait (connection open, or the
  previous answer). Until the handler runs, a timer closes the connection when the
  deadline passes (no answer: nothing was asked); the handler reads a body with
  ``read_body``, under what is left of the same deadline (``BodyTimeout``: answer 408).
  The answer is not under it, so a long-poll keeps its connection.
* aiohttp's parser refuses a malformed request, such as a bad ``Content-Length``
  (400, closed), and caps the request line and header sizes (8190 bytes each).

Threads. Everything above runs on the loop thread. A handler that must block (a Raft
write, rendering a scrape) hands the call to ``run_blocking``: a pool of
``blocking_workers`` threads with at most twice that many jobs running or queued
(``PoolBusy`` past it: answer 503), so a thousand waiting requests hold coroutines and
at most that many threads.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import concurrent.futures
import json
import logging
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gcache.logs import RateLimitedLog

T = TypeVar("T")
LISTEN_BACKLOG = 1024
REFUSAL_LINGER_S = 1.0
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


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


class PoolBusy(Exception):
    """``run_blocking`` refused a call: the pool has its maximum in flight (answer 503)."""


class BodyTimeout(Exception):
    """The request body did not arrive within the request deadline: answer 408."""


class _Caps:
    """Connection counts, total and per peer address (the loop thread only)."""

    def __init__(self, max_connections: int, max_per_ip: int, name: str,
                 flags: tuple[str, str] | None, log: logging.Logger) -> None:
        self.max_connections, self.max_per_ip = max_connections, max_per_ip
        self.total = 0
        self.lingering = 0  # refused connections waiting for their peer to hang up
        self.per_ip: dict[str, int] = {}
        self.name = name
        self.log = RateLimitedLog(log, 10.0)
        self.busy, self.busy_ip = busy_answers(name, max_connections, max_per_ip, flags)

    def take(self, ip: str) -> bytes:
        """Admit a connection from ``ip`` (b'') or the 503 that refuses it."""
        if self.total >= self.max_connections:
            self.log.warning("conn_cap", "%s at its connection cap (%d): refused %s",
                             self.name, self.max_connections, ip)
            return self.busy
        n = self.per_ip.get(ip, 0)
        if self.max_per_ip and n >= self.max_per_ip:
            self.log.warning("ip_cap", "%s at its per-address connection cap (%d): refused %s",
                             self.name, self.max_per_ip, ip)
            return self.busy_ip
        self.total += 1
        self.per_ip[ip] = n + 1
        return b""

    def refuse(self, transport: asyncio.Transport, answer: bytes) -> asyncio.TimerHandle | None:
        """Send ``answer`` and close. The close waits (at most ``REFUSAL_LINGER_S``, for
        at most ``max_connections`` refusals at once) for the peer to finish sending its
        request and hang up: closing with its bytes unread would reset the connection,
        and the reset can destroy the 503 before the peer reads it. Returns the timer
        of a lingering refusal (``lingered`` counts it down)."""
        transport.write(answer)
        if self.lingering >= self.max_connections or not transport.can_write_eof():
            transport.close()
            return None
        transport.write_eof()
        self.lingering += 1
        return asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.abort)

    def lingered(self, timer: asyncio.TimerHandle) -> None:
        timer.cancel()
        self.lingering -= 1

    def drop(self, ip: str) -> None:
        self.total -= 1
        n = self.per_ip.pop(ip) - 1
        if n:
            self.per_ip[ip] = n


class _TLSProtocol(asyncio.sslproto.SSLProtocol):
    """asyncio's TLS layer, with the caps taken before the handshake (a connection past
    one is closed unanswered: it cannot read plain text), and the alert of a failed
    handshake sent: asyncio aborts the connection first and drops it, and a client
    refused for its certificate (mTLS) must read why (CERTIFICATE_REQUIRED,
    UNKNOWN_CA), not a bare close."""

    def __init__(self, http: _BoundedProtocol, tls: ssl.SSLContext, deadline_s: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, http, tls, None, server_side=True,
                         ssl_handshake_timeout=deadline_s, ssl_shutdown_timeout=deadline_s)
        self.caps, self.ip, self.admitted = http.caps, "", False
        http.counted = True  # here, before the handshake

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.ip = str(peer[0]) if peer else ""
        if self.caps.take(self.ip):
            transport.close()
            return
        self.admitted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.admitted:
            return
        self.admitted = False
        self.caps.drop(self.ip)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            super().data_received(data)

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        if handshake_exc is not None:
            try:
                self._process_outgoing()  # the alert, still in the TLS object's buffer
            except Exception:  # noqa: BLE001 - the abort below is the answer anyway
                pass
        super()._on_handshake_complete(handshake_exc)


class _BoundedProtocol(RequestHandler):
    """aiohttp's connection protocol, plus the caps and the request deadline."""

    def __init__(self, manager: web.Server, caps: _Caps, deadline_s: float,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(manager, loop=loop, keepalive_timeout=deadline_s)
        self.caps, self.deadline_s, self.ev_loop = caps, deadline_s, loop
        self.ip = ""
        self.counted = False  # True: the TLS layer under it holds its slot
        self.admitted = False
        self.refused: asyncio.TimerHandle | None = None
        self.in_request = False
        self.received = 0
        self.deadline = 0.0  # loop time by which the current request must be in
        self.timer: asyncio.TimerHandle | None = None
        self.conn: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.ip = str(peer[0]) if peer else ""
        refusal = b"" if self.counted else self.caps.take(self.ip)
        if refusal:
            self.refused = self.caps.refuse(transport, refusal)  # type: ignore[arg-type]
            return
        self.admitted = True
        self.conn = transport  # type: ignore[assignment]
        super().connection_made(transport)
        self.arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.admitted:
            if self.refused is not None:
                self.caps.lingered(self.refused)
                self.refused = None
            return
        self.admitted = False
        if not self.counted:
            self.caps.drop(self.ip)
        self.disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            if not self.in_request:
                self.received += len(data)
            super().data_received(data)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (or a handler that raised):
        a JSON error, logged rate limited (a peer triggers it at will), and closed."""
        if request.writer.output_size > 0:  # an answer is half sent: nothing to add
            raise ConnectionError("answer already started; cannot send an error answer")
        why = (message or str(exc) or "").strip().splitlines()[0] if status < 500 else \
            "internal error"
        self.caps.log.warning("bad_request", "%s: %s: %d %s", self.caps.name, self.ip,
                              status, why)
        body = json.dumps({"error": f"bad request: {why}: send one well-formed HTTP/1.1 "
                                    "request"} if status < 500 else {"error": why}).encode()
        resp = web.Response(status=status, body=body,
                            headers={"Content-Type": "application/json"})
        resp.force_close()
        return resp

    def arm(self) -> None:
        """The next request must be in within the deadline from now."""
        self.disarm()
        self.in_request = False
        self.received = 0  # bytes of the next request: 0 is an idle keep-alive
        self.deadline = self.ev_loop.time() + self.deadline_s
        self.timer = self.ev_loop.call_at(self.deadline, self._expired)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def begin(self) -> None:
        """The request line and headers are in: the handler runs (it bounds the body)."""
        self.disarm()
        self.in_request = True

    def _expired(self) -> None:
        self.timer = None
        if self.in_request or self.conn is None:
            return
        if self.received:  # not just an idle keep-alive connection closing
            self.caps.log.warning("request", "%s: %s: request not received within %.1fs",
                                  self.caps.name, self.ip, self.deadline_s)
        if self.conn.get_write_buffer_size():
            self.conn.abort()  # a peer that does not read its answers holds nothing
        else:
            self.conn.close()  # headers never finished: nothing to answer


async def read_body(request: web.BaseRequest) -> bytes:
    """``request``'s body, under what is left of its deadline (``BodyTimeout``)."""
    proto = request.protocol
    assert isinstance(proto, _BoundedProtocol)
    left = proto.deadline - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(request.read(), max(left, 0.0))
    except asyncio.TimeoutError:
        raise BodyTimeout from None


class BoundedAioServer:
    """See the module docstring. ``handler`` runs on the loop thread for every request."""

    def __init__(self, address: tuple[str, int], handler: Handler, *, max_connections: int,
                 max_per_ip: int = 0, tls: ssl.SSLContext | None = None,
                 request_deadline_s: float = 5.0,
                 blocking_workers: int = 16, name: str = "gcache-master",
                 flags: tuple[str, str] | None = ("--max-connections",
                                                  "--max-connections-per-ip"),
                 log: logging.Logger | None = None,
                 on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """``name``: who answers (the 503s and logs say it); ``flags``: the options that
        raise the two caps, named in the 503s (None: fixed caps); ``log``: where refusals
        are logged (rate limited: one line per kind per 10 s); ``on_stop``: awaited on the
        loop when it stops (close clients made on it). ``OSError`` when ``address``
        cannot be bound."""
        self.tls, self.name = tls, name
        self.request_deadline_s = request_deadline_s
        self.sock = socket.create_server(address, backlog=LISTEN_BACKLOG,
                                         family=socket.AF_INET6 if ":" in address[0]
                                         else socket.AF_INET)
        self.server_address = self.sock.getsockname()[:2]
        self.loop = asyncio.new_event_loop()
        self.pool = concurrent.futures.ThreadPoolExecutor(
            blocking_workers, thread_name_prefix=f"{name}-blocking")
        caps = _Caps(max_connections, max_per_ip, name, flags,
                     log or logging.getLogger("gcache.http"))
        self._handler = handler
        self._on_stop = on_stop
        self.workers = blocking_workers
        self.in_flight = 0  # run_blocking jobs running or queued (the loop thread only)
        # handler_cancellation: a watcher that hangs up stops costing its coroutine at once
        self.web = web.Server(self._serve, handler_cancellation=True, loop=self.loop)

        def protocol() -> asyncio.Protocol:
            http = _BoundedProtocol(self.web, caps, request_deadline_s, self.loop)
            if tls is None:
                return http
            return _TLSProtocol(http, tls, request_deadline_s, self.loop)

        self._protocol = protocol
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        proto = request.protocol
        assert isinstance(proto, _BoundedProtocol)
        proto.begin()
        try:
            return await self._handler(request)
        finally:
            proto.arm()  # the next request on this connection: a new deadline

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pool (for calls that block, such as Raft writes). At most
        ``2 * blocking_workers`` calls run or wait at once: past that ``PoolBusy``, so a
        stalled dependency answers 503 at once instead of queueing without a bound."""
        if self.in_flight >= 2 * self.workers:
            raise PoolBusy(f"{self.name} has {self.in_flight} blocking requests in flight "
                           "(its maximum)")
        self.in_flight += 1
        job = self.pool.submit(fn, *args)
        # counted until the job ends, not until its request does: a peer that hangs up
        # cancels a queued job, while a running one still holds its thread
        job.add_done_callback(self._job_ended)
        return await asyncio.wrap_future(job, loop=self.loop)

    def _job_ended(self, job: concurrent.futures.Future) -> None:
        """(the job's thread) Count it down on the loop."""
        try:
            self.loop.call_soon_threadsafe(self._count_down)
        except RuntimeError:  # the loop is closed: stopped
            pass

    def _count_down(self) -> None:
        self.in_flight -= 1

    def start(self, thread_name: str = "gcache-master-http") -> None:
        self._server = self.loop.run_until_complete(self.loop.create_server(
            self._protocol, sock=self.sock, backlog=LISTEN_BACKLOG))
        self._thread = threading.Thread(target=self.loop.run_forever, name=thread_name,
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close every connection (any thread but the loop's)."""
        if self._thread is None:
            self.sock.close()
            self.loop.close()
            self.pool.shutdown(wait=False, cancel_futures=True)
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            self.web.pre_shutdown()
            await self.web.shutdown(1.0)
            if self._on_stop is not None:
                await self._on_stop()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        self._thread = None
        self.pool.shutdown(wait=False, cancel_futures=True)
