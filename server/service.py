"""The gcache-server network service: accept, authenticate, serve frames.

Design. One thread per connection with blocking sockets; the SDK keeps a few
long-lived connections per server, and the GIL is released during every
``recv_into``/``sendmsg``, so payload bytes move between the socket and the
arena without Python touching them. Puts are received straight into the
reserved arena chunk; gets are sent with one scatter-gather ``sendmsg`` from
pinned arena views.

Connection life (docs/protocol.md): admission at accept (connection and
pre-auth budgets, ``Service._admit``); the server sends HELLO (nonce, name,
limits, nothing about the arena); the client must answer AUTH (``{"id", "mac"}``:
HMAC of the nonce under its credential's secret, or ``{"mac"}`` under the legacy
token; empty when auth is off) within the handshake deadline, and before AUTH
only AUTH and PING frames with a small header are read at all (judged on the
36-byte prefix). Every frame then re-resolves the connection's credential in the
current ``CredentialStore`` generation (a SIGHUP reload applies to the next
frame; a removed credential ends the connection) and each op handler checks its
one namespace once: a frame outside the credential's grants answers ``AUTH`` for
every item in a normal reply (payload drained, connection kept) and is counted
in ``gcache_auth_refused_total``. A malformed frame gets an error reply (when the request id
is known) and the connection is closed; per-item faults (miss, no space, too
large) are statuses inside a normal reply and the stream stays in sync: the
bytes of a refused item are drained through a bounded scratch buffer.

Reads: every byte of a connection is read through its ``FrameReader``
(gcache/frame_reader.py). After AUTH it reads ahead, so a request's prefix and header
usually come in one ``recv``; bytes past the frame's header feed the PUT payload's
first views or the next frame (a client may pipeline frames in one write).

TLS (``tls_cert_file``): the server speaks TLS only. The connection's thread
(never the accept loop) peeks at the first byte: a TLS ClientHello gets the
handshake, bounded by the connection's handshake deadline (``handshake_timeout_ms``
from accept, TLS and AUTH together); a plain gcache client (silent for
``_TLS_PLAIN_WAIT_S``, waiting for HELLO) or any other bytes get one plaintext
``AUTH`` error frame saying TLS is required, then the connection closes. TLS
sockets have no ``sendmsg``/``recvmsg_into``: the protocol helpers fall back to
one ``send``/``recv_into`` per buffer (re-armed from the deadline before each),
still straight from/into the arena.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import ssl
import threading
import time
from itertools import repeat
from typing import Any, Callable, NamedTuple

from gcache import tls as tlslib
from gcache.credentials import Credential, CredentialStore, Right
from gcache.errors import ProtocolError
from gcache.logs import RateLimitedLog
from gcache.network import check_bind, linger
from gcache.sched import background_thread
from gcache.protocol import (FLAG_MORE, FLAG_RESPONSE, PREAUTH_MAX_HEADER_BYTES,
                             FrameHeader, Limits, Op, check_flag, check_items, check_key,
                             chain_parents, check_namespace, check_placement, discard_views,
                             encode_frame, parse_put_items,
                             decode_meta, self_contained, sendmsg_all)
from gcache.frame_reader import FrameReader
from gcache.status import Status
from gcache.server.metrics import ServerMetrics
from gcache.server.tier import Pinned, PutRequest, PutSlot, Tier, abort_slots
from gcache.server import shm_ops

log = logging.getLogger("gcache.server")
# lines a stranger can trigger at will (refusals, failed handshakes): one per reason per 10 s
peer_log = RateLimitedLog(log, 10.0)

_SCRATCH = 1 << 20
# Sink for drained bytes, shared by every connection: what lands here is never read, so
# concurrent writes are harmless, and an idle connection costs no 1 MiB buffer of its own.
_DISCARD = memoryview(bytearray(_SCRATCH))
_LINGER_S = 1.0  # how long a failed connection drains the peer's input before closing
_READ_BACKSTOP_S = 1.0  # a payload read's own stop, past the watchdog's deadline (tick <= 0.1 s)
_PREAUTH_OPS = frozenset({Op.AUTH, Op.PING})  # all a stranger may send
_TLS_PLAIN_WAIT_S = 1.0  # a peer silent this long after connecting is a plain gcache client


class Listener(NamedTuple):
    """A bound, listening data socket and the ``host:port`` it answers on (the port the
    kernel chose when ``listen`` asked for port 0)."""

    sock: socket.socket
    address: str


def listen_on(listen: str, auth_required: str | bool) -> Listener:
    """Bind and listen on ``listen`` (``host:port``). A non-loopback address without auth
    raises ValueError (``check_bind``); a bind that fails raises OSError."""
    check_bind(listen, auth_required)
    host, port = listen.rsplit(":", 1)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return Listener(sock, f"{host}:{sock.getsockname()[1]}")


class Service:
    """The listening socket, its connections and their deadlines.

    Admission (``_admit``, accept thread, before any thread is spent on the connection):
    a connection is refused at once past ``max_connections``, or when its address already
    holds ``max_preauth_per_ip`` unauthenticated connections; when ``max_preauth_connections``
    strangers are waiting, the oldest of them is shut down to make room (it has had the
    longest to authenticate, while a real client finishes its handshake in one round trip).
    So unauthenticated peers hold at most ``max_preauth_connections`` slots, fewer than
    ``max_connections``, and never for longer than ``handshake_timeout_ms``.

    Deadlines (``_watch``, one thread): every connection carries ``deadline`` (monotonic
    seconds): accept + handshake timeout until AUTH succeeds, then infinity, except while a
    reply is being sent (send start + ``send_timeout_ms``). The watchdog shuts down the
    socket of any connection past its deadline, which fails the blocked ``recv``/``send``
    in its thread, whose cleanup then releases the connection's pins, leases and slots.
    A per-call socket timeout would restart on every byte; this deadline does not.

    Built from a ``Listener`` (``listen_on``, which the owner binds first so it knows the
    address before anything else is built), the ownership check (``ownership``: the
    ``MembershipAgent`` when masters are configured, else None), the arena's NIXL
    registration (``nixl_info``, sent in the AUTH reply), with masters the freshness rule
    (``freshness``: which reads of mutable namespaces answer MISS, ``read_refusals``), and
    the recent deletes (``tombstones``) that if-absent puts skip; ``extra_stats`` adds the
    owner's numbers (the handoff's) to STATS. ``start`` / ``stop`` run on the owner's
    thread; ``stop`` is bounded (about 5 s) and closes the listening socket.
    """

    def __init__(self, tier: Tier, *, listener: Listener, name: str, token: str,
                 limits: Limits,
                 metrics: ServerMetrics, max_connections: int = 1024,
                 credentials: CredentialStore | None = None,
                 max_preauth_connections: int = 256, max_preauth_per_ip: int = 128,
                 handshake_timeout_ms: int = 5000, send_timeout_ms: int = 10000,
                 request_timeout_ms: int = 10000, tls: ssl.SSLContext | None = None,
                 quotas: Any = None, shm_trusted_writers: bool = False,
                 shm: shm_ops.ShmRegistry, ownership: Any = None,
                 nixl_info: dict | None = None,
                 extra_stats: Callable[[], dict] | None = None, freshness: Any = None,
                 tombstones: Any = None) -> None:
        self.tier, self.name, self.token, self.limits = tier, name, token, limits
        self.shm = shm  # the connections' shm leases and slots (its owner runs the reaper)
        self.quotas = quotas  # gcache.quotas.QuotaStore: per-namespace rows in STATS
        self.credentials = credentials or CredentialStore(token=token)
        self.tls = tls  # a server context: every connection must speak TLS
        self.metrics = metrics
        self.max_connections = max_connections
        # at most half the slots ever go to strangers: authenticated clients keep the rest
        self.max_preauth = min(max_preauth_connections, max(1, max_connections // 2))
        self.max_preauth_per_ip = max_preauth_per_ip
        self.handshake_s, self.send_s = handshake_timeout_ms / 1000.0, send_timeout_ms / 1000.0
        self.request_s = request_timeout_ms / 1000.0
        self.ownership = ownership  # MembershipAgent when --masters is set: NOT_OWNER checks
        self.nixl_info = nixl_info  # arena registration, sent in the AUTH reply
        # the owner's numbers STATS also carries (the handoff's, the self-drain's); any
        # connection thread, must not block
        self.extra_stats = extra_stats
        # freshness.Freshness (with masters): mutable namespaces' reads (read_refusals)
        self.freshness = freshness
        # tombstones.Tombstones: recent deletes, which if-absent puts do not bring back
        self.tombstones = tombstones
        # same-host peers may ALLOC (write the arena themselves); see shm_ops.alloc_refusal
        self.shm_trusted_writers = shm_trusted_writers
        self.sock, self.address = listener
        # under _lock: every open connection, the unauthenticated ones (oldest first) and
        # their count per peer address. A socket is shut down by another thread only while
        # it is in _conns, and closed only after leaving it (no fd-reuse race).
        self._conns: dict[socket.socket, _Connection] = {}
        self._preauth: dict[_Connection, None] = {}
        self._preauth_ip: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self.started = time.time()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def guard_stats(self) -> dict[str, int]:
        """The freshness rule's and the tombstones' numbers (``stale_dropped``,
        ``put_if_absent_tombstoned``, ``tombstones``): STATS, heartbeats, /metrics."""
        s: dict[str, int] = {}
        for part in (self.freshness, self.tombstones):
            if part is not None:
                s.update(part.stats())
        return s

    def start(self) -> None:
        for target, name in ((self._accept_loop, "gcache-accept"),
                             (self._watch, "gcache-deadlines")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._closing.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            for c in self._conns:
                _shutdown(c)
        for t in self._threads:
            t.join(timeout=2)
        deadline = time.monotonic() + 3
        while self._conns and time.monotonic() < deadline:
            time.sleep(0.01)

    # ------------------------------------------------------------------ accept
    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.01)
                continue
            handler = self._admit(conn, peer)
            if handler is not None:
                threading.Thread(target=self._serve, args=(handler,), daemon=True,
                                 name=f"gcache-conn-{peer[1] if len(peer) > 1 else peer}"
                                 ).start()

    def _admit(self, conn: socket.socket, peer: Any) -> _Connection | None:
        """Register a fresh connection as unauthenticated, or close it at once (None)."""
        ip = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        evicted = None
        with self._lock:
            if len(self._conns) >= self.max_connections:
                refused = "max_connections"
            elif self._preauth_ip.get(ip, 0) >= self.max_preauth_per_ip:
                refused = "preauth_per_ip"
            else:
                refused = ""
                if len(self._preauth) >= self.max_preauth:
                    evicted = next(iter(self._preauth))
                    self.do_drop_preauth(evicted)
                    _shutdown(evicted.sock)
                handler = _Connection(self, conn, peer, ip,
                                      time.monotonic() + self.handshake_s)
                self._conns[conn] = handler
                self._preauth[handler] = None
                self._preauth_ip[ip] = self._preauth_ip.get(ip, 0) + 1
            self.metrics.preauth.set(len(self._preauth))
        if evicted is not None:
            self._refused("preauth_total", evicted.peer)
        if refused:
            conn.close()
            self._refused(refused, peer)
            return None
        return handler

    def _refused(self, reason: str, peer: Any) -> None:
        self.metrics.refused.labels(reason).inc()
        peer_log.warning(f"refused:{reason}", "connection refused: %s", _REFUSALS[reason],
                         fields={"peer": str(peer), "reason": reason})

    def do_drop_preauth(self, handler: _Connection) -> None:
        """Forget ``handler`` as unauthenticated (caller holds ``_lock``); idempotent."""
        if handler in self._preauth:
            del self._preauth[handler]
            n = self._preauth_ip[handler.ip] - 1
            if n:
                self._preauth_ip[handler.ip] = n
            else:
                del self._preauth_ip[handler.ip]

    def authenticated(self, handler: _Connection) -> None:
        with self._lock:
            self.do_drop_preauth(handler)
            handler.deadline = math.inf
            self.metrics.preauth.set(len(self._preauth))

    def _watch(self) -> None:
        tick = max(0.01, min(0.1, self.handshake_s / 10, self.send_s / 10,
                             self.request_s / 10))
        while not self._closing.wait(tick):
            now = time.monotonic()
            expired = []
            with self._lock:
                for c, h in self._conns.items():
                    if h.deadline < now:
                        h.deadline = math.inf  # once
                        _shutdown(c)
                        expired.append(h)
            for h in expired:
                phase = h.phase if h.authed else "handshake"
                self.metrics.deadline_closed.labels(phase).inc()
                peer_log.warning(f"deadline:{phase}", "closing connection: %s deadline passed",
                                 phase, fields={"peer": str(h.peer), "reason": phase})

    def _serve(self, handler: _Connection) -> None:
        try:
            handler.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None and not self._start_tls(handler):
                return
            handler.run()
        except (ConnectionError, OSError):
            pass
        except Exception:  # never let one connection take the server down
            log.exception("connection handler failed",
                          extra={"fields": {"peer": str(handler.peer)}})
        finally:
            self.shm.release_all(handler)  # the connection's shm leases and slots
            with self._lock:
                self._conns.pop(handler.sock, None)
                self.do_drop_preauth(handler)
                self.metrics.preauth.set(len(self._preauth))
            try:
                handler.sock.close()
            except OSError:
                pass


    def _start_tls(self, handler: _Connection) -> bool:
        """On the connection's thread: the TLS handshake, by the connection's handshake
        deadline (which the watchdog enforces too), or a plaintext refusal to a peer that
        does not speak TLS. The wrapped socket replaces the plain one in ``_conns`` and in
        ``handler``; False when the connection is over (the caller's cleanup closes it)."""
        conn, peer = handler.sock, handler.peer
        try:
            first = tlslib.peek_first_byte(conn, _TLS_PLAIN_WAIT_S)
            if first != tlslib.HANDSHAKE_RECORD:
                if first is not None:
                    self._refuse_plain(conn)
                return False
            tls = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            with self._lock:  # conn is detached now: the watchdog and stop() shut down tls
                self._conns.pop(conn, None)
                self._conns[tls] = handler
                handler.sock = tls
            if self._closing.is_set():
                return False
            tlslib.handshake(tls, handler.deadline)
            return True
        except (OSError, ValueError) as exc:
            if not isinstance(exc, ConnectionError):
                self.metrics.protocol_errors.labels("tls").inc()
                peer_log.warning("tls", "TLS handshake failed: %s", exc,
                                 fields={"peer": str(peer), "reason": "tls"})
            if handler.sock is not conn:  # let the client read the TLS alert that says why
                tlslib.linger_close(handler.sock, _LINGER_S)
            return False

    def _refuse_plain(self, conn: socket.socket) -> None:
        """Tell a peer that does not speak TLS why it is refused, in plaintext."""
        self.metrics.protocol_errors.labels("tls_required").inc()
        try:
            conn.settimeout(1.0)
            conn.sendall(encode_frame(0, 0, {"error": "this server accepts TLS connections "
                                             "only: connect with tls=True (gcache --tls) and "
                                             "the cluster's CA (tls_ca_file)"},
                                      flags=FLAG_RESPONSE, status=Status.AUTH))
        except OSError:
            return
        linger(conn, _LINGER_S)


_OK = int(Status.OK)


def _get_items(items: list, lim: Limits) -> list:
    """Validate GET items ``[key, offset, max_len, expect_version]`` in place (``max_len``
    capped at ``max_frame_bytes``); returns the same lists, so nothing is allocated per
    item. The common shape (bytes key, non-negative ints) passes one type check per
    field; anything else goes through the full checks."""
    max_key, max_frame = lim.max_key_bytes, lim.max_frame_bytes
    for it in items:
        if not (type(it) is list and len(it) == 4 and type(it[0]) is bytes
                and 0 < len(it[0]) <= max_key and type(it[1]) is int and type(it[2]) is int
                and type(it[3]) is int and it[1] >= 0 and 0 <= it[2] <= max_frame
                and it[3] >= 0):
            _check_get_item(it, lim)
    return items


def _check_get_item(it: Any, lim: Limits) -> None:
    """The full check of one GET item (raises ProtocolError); a bytearray key becomes
    bytes, ``max_len`` is capped at ``max_frame_bytes``."""
    if not (isinstance(it, list) and len(it) == 4 and all(isinstance(x, int) for x in it[1:])):
        raise ProtocolError("GET item must be [key, offset, max_len, expect_version]",
                            Status.BAD_REQUEST)
    if it[1] < 0 or it[2] < 0 or it[3] < 0:
        raise ProtocolError("GET item has a negative field", Status.BAD_REQUEST)
    it[0] = check_key(it[0], lim)
    it[2] = min(it[2], lim.max_frame_bytes)


_REFUSALS = {
    "max_connections": "max_connections reached",
    "preauth_per_ip": "this address already holds max_preauth_per_ip unauthenticated "
                      "connections",
    "preauth_total": "max_preauth_connections unauthenticated connections were waiting; "
                     "closed the oldest to admit a new one",
}


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _GetReply:
    """One GET's reply, built in item order from its pins (``served``: the items not
    refused) and its refusals: one frame, or with ``"sr": 1`` one frame per verified
    prefix (``send_ready``, ``FLAG_MORE``) and a last one (``send_rest``). A frame's
    item rows and its payload views cover the same items, so every frame stands alone;
    the views are cut to what is left of ``max_frame_bytes`` over the whole reply."""

    __slots__ = ("conn", "rid", "refused", "budget", "hits", "rows", "payload", "pos",
                 "npins")

    def __init__(self, conn: _Connection, rid: int, refused: list[Status | None] | None,
                 budget: int) -> None:
        self.conn, self.rid, self.refused, self.budget = conn, rid, refused, budget
        self.hits = 0
        self.rows: list[list[int]] = []
        self.payload: list[memoryview] = []
        self.pos = 0  # next request item (refusals included)
        self.npins = 0  # pins already folded into rows

    def _fold(self, pins: list[Pinned], end: int) -> None:
        """Rows (and views) for the request items up to pin ``end``, and the refusals
        after it when it is the last pin."""
        rows, payload, refused = self.rows, self.payload, self.refused
        budget = self.budget
        for p in pins[self.npins:end]:
            if refused is not None:
                while refused[self.pos] is not None:
                    rows.append([int(refused[self.pos]), 0, 0, 0, 0])
                    self.pos += 1
                self.pos += 1
            v = p.view
            if v is None:
                rows.append([int(p.status), p.total_len, p.version, 0, p.checksum])
                continue
            if len(v) > budget:
                v = p.view = v[:budget]
            budget -= len(v)
            payload.append(v)
            rows.append([_OK, p.total_len, p.version, len(v), p.checksum])
        self.budget, self.npins = budget, end
        if refused is not None and end == len(pins):
            rows.extend([int(no), 0, 0, 0, 0] for no in refused[self.pos:] if no is not None)
            self.pos = len(refused)

    def _send(self, more: bool) -> None:
        self.hits += len(self.payload)
        self.conn.reply(Op.GET, self.rid, {"items": self.rows}, self.payload, more=more)
        self.rows, self.payload = [], []

    def send_ready(self, end: int, pins: list[Pinned]) -> None:
        """``pin_read_stream``'s ``ready``: send the items up to pin ``end`` unless that is
        every pin (``send_rest`` sends the last frame)."""
        if end < len(pins):
            self._fold(pins, end)
            self._send(more=True)

    def send_rest(self, pins: list[Pinned]) -> None:
        """The reply's only (or last) frame: whatever was not sent yet."""
        self._fold(pins, len(pins))
        self._send(more=False)


class _Connection:
    def __init__(self, svc: Service, sock: socket.socket, peer: Any, ip: str,
                 deadline: float) -> None:
        self.svc, self.sock, self.peer, self.ip = svc, sock, peer, ip
        self.deadline = deadline  # enforced by Service._watch; see Service
        self.phase = "handshake"  # what the deadline bounds: handshake, request or send
        self.limits = svc.limits
        self.reader: FrameReader | None = None  # made in run(), on the final (TLS) socket
        self.scratch = _DISCARD
        self.authed = False
        self.cred: Credential | None = None  # set by AUTH, re-resolved every frame
        self.nonce = os.urandom(16)
        self.shm_state: shm_ops.ShmState | None = None  # made by svc.shm on first use

    def reply(self, opcode: int, rid: int, meta: Any, payload: list | None = None,
              status: int = 0, more: bool = False) -> None:
        """Send one reply within the send deadline (``send_timeout_ms``; before AUTH, the
        handshake deadline if that comes first): past it the watchdog shuts the socket
        down, and this raises OSError. ``more``: a streamed GET reply's frame that is not
        its last (``FLAG_MORE``)."""
        plen = sum(len(p) for p in payload) if payload else 0
        frame = encode_frame(opcode, rid, meta, plen,
                             flags=FLAG_RESPONSE | FLAG_MORE if more else FLAG_RESPONSE,
                             status=status)
        outer, outer_phase = self.deadline, self.phase
        self.deadline = min(outer, time.monotonic() + self.svc.send_s)
        self.phase = "send"
        try:
            if payload:
                sendmsg_all(self.sock, [frame, *payload])
            else:
                self.sock.sendall(frame)
        finally:
            if self.deadline != math.inf:  # not already fired by the watchdog
                self.deadline, self.phase = outer, outer_phase

    def fail(self, opcode: int, rid: int, status: int, message: str, reason: str) -> None:
        """Frame-level error: tell the peer why, then the caller closes."""
        self.svc.metrics.protocol_errors.labels(reason).inc()
        peer_log.warning(reason, "closing connection: %s", message,
                         fields={"peer": str(self.peer), "reason": reason})
        try:
            self.sock.settimeout(1.0)
            self.reply(opcode, rid, {"error": message}, status=status)
        except OSError:
            return
        linger(self.sock, _LINGER_S)  # so the reply is read, not destroyed by an RST

    def run(self) -> None:
        svc = self.svc
        m = svc.metrics
        # a per-call cap as well; the handshake deadline itself is Service._watch's
        self.sock.settimeout(svc.handshake_s)
        # no read-ahead before AUTH: a stranger's prefix is judged before its header is read
        self.reader = FrameReader(self.sock, self.limits, read_ahead=False)
        self.reply(Op.HELLO, 0, {"v": 1, "name": svc.name, "nonce": self.nonce,
                                 "auth": svc.credentials.required,
                                 "limits": {"max_key_bytes": self.limits.max_key_bytes,
                                            "max_value_bytes": self.limits.max_value_bytes,
                                            "max_batch_items": self.limits.max_batch_items,
                                            "max_frame_bytes": self.limits.max_frame_bytes}})
        rec = m.frame_stats.recorder()  # this thread's frame counts, summed by a scrape
        try:
            while (request := self.next_request()) is not None:
                fh, meta = request
                t0 = time.perf_counter()
                try:
                    if not self.handle(fh.opcode, fh.request_id, meta, fh.payload_len):
                        return
                except ProtocolError as exc:
                    self.fail(fh.opcode, fh.request_id, exc.status, str(exc), "malformed")
                    return
                if self.authed:  # idle until the next request: a pooled connection is fine
                    self.deadline, self.phase = math.inf, "idle"
                rec.record(Op.NAMES.get(fh.opcode, "UNKNOWN"), time.perf_counter() - t0)
        finally:
            m.frame_stats.retire(rec)

    def next_request(self) -> tuple[FrameHeader, Any] | None:
        """Read the next request's prefix and header; None after a frame-level error
        (replied to; the caller closes). Before AUTH the prefix is judged before any
        header byte is read; the header is decoded only once its CRC checked out."""
        try:
            fh, prefix = self.reader.read_prefix()
            if not self.authed and not self.preauth_frame_ok(fh):
                return None
            if self.authed:  # the rest of this request (header, payload) has a deadline
                self.deadline = time.monotonic() + self.svc.request_s
                self.phase = "request"
            header = self.reader.read_header(fh, prefix)
        except ProtocolError as exc:  # the prefix is not vouched for: request id 0
            self.fail(0, 0, exc.status, str(exc), "malformed")
            return None
        try:
            meta = decode_meta(header, self.limits)
        except ProtocolError as exc:  # the CRC vouched for the request id
            self.fail(fh.opcode, fh.request_id, exc.status, str(exc), "malformed")
            return None
        if fh.is_response:
            self.fail(fh.opcode, fh.request_id, Status.BAD_REQUEST,
                      "unexpected response frame from a client", "malformed")
            return None
        return fh, meta

    def preauth_frame_ok(self, fh: FrameHeader) -> bool:
        """Judge a stranger's frame on its fixed prefix alone, before one header byte is
        read: only AUTH and PING, as requests, with no payload and a small header. Anything
        else gets an error reply (the prefix's request id, not yet covered by a checked
        CRC) and False: the caller closes."""
        if fh.opcode not in _PREAUTH_OPS:
            status, msg, reason = (Status.AUTH, "authenticate (AUTH frame) before any other "
                                   "op", "unauthenticated")
        elif fh.is_response:
            status, msg, reason = (Status.BAD_REQUEST, "unexpected response frame from a "
                                   "client", "malformed")
        elif fh.payload_len:
            status, msg, reason = (Status.BAD_REQUEST, f"{Op.NAMES[fh.opcode]} carries no "
                                   f"payload, frame says {fh.payload_len} bytes", "malformed")
        elif fh.header_len > PREAUTH_MAX_HEADER_BYTES:
            status, msg, reason = (Status.TOO_LARGE, f"header length {fh.header_len} "
                                   f"exceeds {PREAUTH_MAX_HEADER_BYTES} bytes before AUTH",
                                   "malformed")
        else:
            return True
        self.fail(fh.opcode, fh.request_id, status, msg, reason)
        return False

    def handle(self, op: int, rid: int, meta: Any, plen: int) -> bool:
        if op == Op.AUTH:
            return self.auth(rid, meta, plen)
        if op == Op.PING:
            self.no_payload(plen)
            self.reply(op, rid, {"name": self.svc.name})
            return True
        if not self.authed:
            self.fail(op, rid, Status.AUTH, "authenticate (AUTH frame) before any other op",
                      "unauthenticated")
            return False
        cred = self.svc.credentials.table.current(self.cred)
        if cred is None:
            self.fail(op, rid, Status.AUTH, f"credential {self.cred.id!r} was removed or its "
                      "secret changed since this connection authenticated; authenticate "
                      "again with a current credential", "revoked")
            return False
        self.cred = cred  # this frame runs under the current grants
        if op in Op.DATA_OPS and not isinstance(meta, dict):
            raise ProtocolError("frame header must be a map", Status.BAD_REQUEST)
        if op == Op.PUT:
            self.put(rid, meta, plen)
        elif op == Op.GET:
            self.no_payload(plen)
            self.get(rid, meta)
        elif op in (Op.EXISTS, Op.DELETE, Op.TOUCH):
            self.no_payload(plen)
            self.keyed(op, rid, meta)
        elif op == Op.STATS:
            self.no_payload(plen)
            if self.cred.cluster_admin:
                self.reply(op, rid, {"stats": self.svc_stats()})
            else:  # server-wide numbers: cluster admins only; the connection stays usable
                self.svc.metrics.auth_refused.labels(self.cred.id, "STATS").inc()
                self.reply(op, rid, {"error": f"credential {self.cred.id!r} may not read "
                                     "server-wide STATS: it needs admin on namespaces "
                                     "\"*\""}, status=Status.AUTH)
        elif op in Op.SHM_OPS:
            shm_ops.handle(self, op, rid, meta, plen)
        else:
            self.fail(op, rid, Status.BAD_REQUEST, f"unknown opcode {op}", "malformed")
            return False
        return True

    def no_payload(self, plen: int) -> None:
        if plen:
            raise ProtocolError(f"this op carries no payload, frame says {plen} bytes",
                                Status.BAD_REQUEST)

    def may(self, right: Right, ns: bytes, op: int) -> bool:
        """The frame's one scope check: does the credential hold ``right`` on ``ns``?
        A refusal is counted by credential id and op."""
        if self.cred.allows(right, ns):
            return True
        self.svc.metrics.auth_refused.labels(self.cred.id, Op.NAMES.get(op, str(op))).inc()
        return False

    def svc_stats(self) -> dict:
        s = dict(self.svc.tier.stats())
        s.update(name=self.svc.name, address=self.svc.address,
                 connections=self.svc.connections, uptime_s=time.time() - self.svc.started,
                 **self.svc.shm.stats(bool(self.svc.nixl_info)), **self.svc.guard_stats())
        if self.svc.extra_stats is not None:
            s.update(self.svc.extra_stats())
        s["namespaces"] = self.svc.tier.namespace_stats(self.svc.quotas,
                                                        self.svc.metrics.namespace.limit)
        return s

    def misplaced(self, meta: dict, n: int, handoff: bool = False) -> list[bool]:
        """Items this server does not own in a newer epoch than the client's view.

        Clients routed by a master view send ``ep`` (their epoch) and ``ph`` (one placement
        hash per item); clients with a static server list send neither and are not checked.
        ``handoff`` (GET, EXISTS, LEASE, DELETE): a frame with ``"ho": 1`` (the SDK asking a
        key's previous owner) is not checked either: it is served from what this server
        holds (a delete deletes it here, so a later re-ask cannot bring it back).
        """
        if handoff and check_flag(meta, "ho"):
            return [False] * n
        return self.not_owned(meta, check_placement(meta, n), n)

    def not_owned(self, meta: dict, ph: list[int] | None, n: int) -> list[bool]:
        """``misplaced`` given the frame's checked ``ph`` (``check_placement``): put
        paths check it once, and also store it with each object."""
        agent = self.svc.ownership
        if agent is None or ph is None:
            return [False] * n
        ep = meta.get("ep", -1)
        out = agent.not_owned(ep if isinstance(ep, int) else -1, ph)
        return out if out is not None else [False] * n

    def read_refusals(self, ns: bytes, meta: dict, n: int) -> list[Status | None]:
        """Per item of a read frame (GET, EXISTS, LEASE): NOT_OWNER (``misplaced``),
        MISS (a mutable namespace's item this server may not answer: the freshness rule,
        ``server/freshness.py``), or None: serve it. Content namespaces pay one lookup."""
        wrong = self.misplaced(meta, n, handoff=True)
        fresh = self.svc.freshness
        if fresh is None or not fresh.is_mutable(ns):
            return [Status.NOT_OWNER if w else None for w in wrong]
        ep = meta.get("ep")
        ok = fresh.readable(ep if isinstance(ep, int) else None, check_placement(meta, n), n)
        return [Status.NOT_OWNER if w else None if r else Status.MISS
                for w, r in zip(wrong, ok)]

    # ------------------------------------------------------------------ ops
    def auth(self, rid: int, meta: Any, plen: int) -> bool:
        self.no_payload(plen)
        meta = meta if isinstance(meta, dict) else {}
        cred = self.svc.credentials.table.verify_mac(meta.get("id"), meta.get("mac", b""),
                                                     self.nonce)
        if cred is None:
            self.fail(Op.AUTH, rid, Status.AUTH,
                      "authentication failed: unknown credential id, wrong secret, or wrong "
                      "or missing token; give the client a credential ('id:secret') from the "
                      "server's credentials file, or the server's token", "auth")
            return False
        if check_flag(meta, "bg"):  # a bulk mover (the handoff): keep off foreground CPU
            background_thread()
        self.cred = cred
        self.authed = True
        self.svc.authenticated(self)
        self.sock.settimeout(None)  # authenticated clients may keep idle pooled connections
        self.reader.read_ahead = True  # prefix and header in one recv from now on
        info = self.svc.nixl_info
        # only authenticated peers learn where the arena is (shm: path, uid, boot id) and
        # how to reach it (nixl: metadata carrying memory keys)
        self.reply(Op.AUTH, rid, {"ok": True, **shm_ops.identity_fields(self.svc.tier, self.svc.shm.lease_ms),
                                  **({"nixl": info} if info else {})})
        return True

    def put(self, rid: int, meta: Any, plen: int) -> None:
        lim = self.limits
        ns = check_namespace(meta.get("ns", b""), lim)
        items = check_items(meta, lim)
        # validate everything before reading a single payload byte
        parsed = parse_put_items(items, lim)
        total = sum(p[3] for p in parsed)
        if total != plen:
            raise ProtocolError(f"PUT items describe {total} payload bytes but the frame "
                                f"carries {plen}", Status.BAD_REQUEST)
        # reserve every destination first, then receive the whole payload with scatter
        # reads straight into the arena (refused items drain into a shared scratch)
        tier = self.svc.tier
        if_absent = check_flag(meta, "ia")
        allowed = self.may(Right.WRITE, ns, Op.PUT)
        # each object keeps the placement hash it was routed by (the handoff moves it there)
        ph = check_placement(meta, len(parsed))
        wrong_owner = self.not_owned(meta, ph, len(parsed))
        ph = ph or [None] * len(parsed)
        parents = chain_parents(meta, parsed, lim) or repeat(None)
        guard = self.svc.tombstones.guard(ns) if if_absent and self.svc.tombstones else None
        statuses: list[Status] = []
        slots: list[tuple[int, PutSlot]] = []  # (item, its reserved slot), in frame order
        try:
            whole = self_contained(parsed)
            reqs: list[PutRequest] = []
            asked: list[int] = []  # the item of each request
            for i, ((key, tl, off, ln, pid, csum), wrong, h, up) in enumerate(
                    zip(parsed, wrong_owner, ph, parents)):
                if not allowed or wrong or (guard is not None and guard.skip(key)):
                    # a tombstoned if-absent item is skipped: OK, as any if-absent skip
                    statuses.append(Status.AUTH if not allowed else Status.NOT_OWNER
                                    if wrong else Status.OK)
                    continue
                if tl > lim.max_value_bytes:
                    statuses.append(Status.TOO_LARGE)
                    continue
                statuses.append(Status.OK)
                # as in PUT_STAGED: only a slice of a put waiting for other frames' slices
                # holds a reservation past this request, answered for by this connection
                # (bounded, released when it closes)
                holder = None if (key, pid) in whole else self.svc.shm.holder(self)
                reqs.append(PutRequest(key, tl, off, ln, pid, csum, holder, h, up))
                asked.append(i)
            # reserve every destination first (one tier call for the frame), then receive
            # the whole payload with scatter reads straight into the arena (refused items
            # drain into a shared scratch)
            for i, slot in zip(asked, tier.begin_puts(ns, reqs)):
                if slot.status == Status.OK:
                    slots.append((i, slot))
                else:
                    statuses[i] = slot.status
            views: list[memoryview] = []
            want: list[bool] = []  # hash a view as it lands: a value this frame carries whole
            at: list[int] = []  # each slot's view
            reserved = dict(slots)
            for i, p in enumerate(parsed):
                slot = reserved.get(i)
                if slot is not None:
                    at.append(len(views))
                    views.append(slot.view)
                    want.append(p.length == p.total_len)
                else:
                    drain = discard_views(p.length, self.scratch)
                    views.extend(drain)
                    want.extend([False] * len(drain))
            # one native call receives the payload with the GIL released (other
            # connections' threads run Python meanwhile), hashing each whole value while
            # its bytes are cached; finish_puts does not hash them again. The watchdog
            # shuts the socket at the request's deadline; the read's own stop, a little
            # later, is a backstop. Not on TLS: its reads would arm the socket's timeout
            # with that stop, and the timeout would outlive the request (the next idle
            # wait for a request would then end with it).
            stop = (self.deadline + _READ_BACKSTOP_S
                    if self.deadline != math.inf and not isinstance(self.sock, ssl.SSLSocket)
                    else None)
            got = self.reader.recv_into_many(views, stop, want)
            digests = [got[j] for j in at] if got is not None else [None] * len(at)
        except BaseException:
            abort_slots(tier, [slot for _, slot in slots])
            raise
        done = tier.finish_puts([slot for _, slot in slots], if_absent=if_absent,
                                digests=digests)
        for (i, _), st in zip(slots, done):
            statuses[i] = st
            if guard is not None and st == Status.OK:
                guard.settle(tier, parsed[i][0])
        m = self.svc.metrics
        m.add(m.bytes, "in")(plen)
        if allowed:
            m.namespace_writes(ns, sum(p[3] for p, st in zip(parsed, statuses)
                                       if st == Status.OK))
        for st in set(statuses):
            m.add(m.items, "put", st.name)(statuses.count(st))
        self.reply(Op.PUT, rid, {"st": [int(s) for s in statuses]})

    def get(self, rid: int, meta: Any) -> None:
        lim = self.limits
        ns = check_namespace(meta.get("ns", b""), lim)
        items = _get_items(check_items(meta, lim), lim)
        tier = self.svc.tier
        if not self.may(Right.READ, ns, Op.GET):
            self.reply(Op.GET, rid,
                       {"items": [[int(Status.AUTH), 0, 0, 0, 0]] * len(items)})
            return
        refused = self.read_refusals(ns, meta, len(items))
        stream = check_flag(meta, "sr")
        if refused.count(None) != len(refused):  # some item refused (C-level count)
            served = [it for it, no in zip(items, refused) if no is None]
        else:
            served, refused = items, None
        out = _GetReply(self, rid, refused, lim.max_frame_bytes)
        # pin every owned item at once (one tier lock hold; a disk tier reads them in
        # parallel), then cut the views to the frame budget in item order; a streamed
        # reply sends each verified prefix of items as soon as it is pinned
        if stream:
            pins = tier.pin_read_stream(ns, served, out.send_ready)
        else:
            pins = tier.pin_read_many(ns, served)
        try:
            out.send_rest(pins)
        finally:
            tier.unpin_many(pins)
        m = self.svc.metrics
        nbytes = lim.max_frame_bytes - out.budget
        m.add(m.bytes, "out")(nbytes)
        hits, misses = out.hits, len(items) - out.hits
        m.add(m.items, "get", "OK")(hits)
        if misses:
            m.add(m.items, "get", "MISS")(misses)
        m.namespace_reads(ns, hits, misses, nbytes)
        m.handoff_reads(meta, hits, misses)

    def keyed(self, op: int, rid: int, meta: Any) -> None:
        lim = self.limits
        ns = check_namespace(meta.get("ns", b""), lim)
        keys = [check_key(k, lim) for k in check_items(meta, lim)]
        tier = self.svc.tier
        fn = {Op.EXISTS: tier.exists, Op.DELETE: tier.delete, Op.TOUCH: tier.touch}[op]
        # TOUCH only refreshes recency, as every GET hit does: read is enough
        if not self.may(Right.WRITE if op == Op.DELETE else Right.READ, ns, op):
            self.reply(op, rid, {"st": [int(Status.AUTH)] * len(keys)})
            return
        if op == Op.EXISTS:
            refused = self.read_refusals(ns, meta, len(keys))
        else:
            refused = [Status.NOT_OWNER if w else None
                       for w in self.misplaced(meta, len(keys), op == Op.DELETE)]
        tombs = self.svc.tombstones if op == Op.DELETE else None
        st = []
        for k, no in zip(keys, refused):
            if no is None and tombs is not None:
                tombs.deleted(ns, k)  # before the delete: see tombstones.IfAbsentGuard
            st.append(no if no is not None else Status.OK if fn(ns, k) else Status.MISS)
        m = self.svc.metrics
        m.add(m.items, Op.NAMES[op].lower(), "all")(len(st))
        if op == Op.EXISTS:
            found = st.count(Status.OK)
            self.svc.metrics.handoff_reads(meta, found, len(st) - found)
        self.reply(op, rid, {"st": [int(s) for s in st]})
