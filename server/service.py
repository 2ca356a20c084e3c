"""The gcache-server network service: accept, authenticate, serve frames.

Design. One thread per connection with blocking sockets; the SDK keeps a few
long-lived connections per server, and the GIL is released during every
``recv_into``/``sendmsg``, so payload bytes move between the socket and the
arena without Python touching them. Puts are received straight into the
reserved arena chunk; gets are sent with one scatter-gather ``sendmsg`` from
pinned arena views.

Connection life: the server sends HELLO (nonce, name, limits); the client must
answer AUTH (HMAC of the nonce under the token; empty when no token is set)
before any data op. A malformed frame gets an error reply (when the request id
is known) and the connection is closed; per-item faults (miss, no space, too
large) are statuses inside a normal reply and the stream stays in sync: the
bytes of a refused item are drained through a bounded scratch buffer.

TLS (``tls_cert_file``): the server speaks TLS only. The connection's thread
(never the accept loop) peeks at the first byte: a TLS ClientHello gets the
handshake, bounded by ``_TLS_HANDSHAKE_S``; a plain gcache client (silent for
``_TLS_PLAIN_WAIT_S``, waiting for HELLO) or any other bytes get one plaintext
``AUTH`` error frame saying TLS is required, then the connection closes. TLS
sockets have no ``sendmsg``/``recvmsg_into``: the protocol helpers fall back to
one ``sendall``/``recv_into`` per buffer, still straight from/into the arena.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import ssl
import threading
import time
from typing import Any

from gcache import tls as tlslib
from gcache.errors import ProtocolError
from gcache.network import check_bind
from gcache.protocol import (FLAG_RESPONSE, PREFIX_SIZE, Limits, Op, auth_mac, check_items,
                             check_key, check_namespace, discard_views, encode_frame,
                             parse_put_items, read_frame, recv_into_many,
                             sendmsg_all)
from gcache.status import Status
from gcache.server.metrics import ServerMetrics
from gcache.server.tier import Tier
from gcache.server import shm_ops

log = logging.getLogger("gcache.server")

_SCRATCH = 1 << 20
# Sink for drained bytes, shared by every connection: what lands here is never read, so
# concurrent writes are harmless, and an idle connection costs no 1 MiB buffer of its own.
_DISCARD = memoryview(bytearray(_SCRATCH))
_LINGER_S = 1.0  # how long a failed connection drains the peer's input before closing
_AUTH_TIMEOUT_S = 10.0  # HELLO -> AUTH must complete within this
_TLS_HANDSHAKE_S = 5.0  # accept -> TLS handshake done, one deadline
_TLS_PLAIN_WAIT_S = 1.0  # a peer silent this long after connecting is a plain gcache client
_TLS_LOG_EVERY_S = 10.0  # failed handshakes log at most this often (all are counted)


class Service:
    def __init__(self, tier: Tier, *, listen: str, name: str, token: str, limits: Limits,
                 metrics: ServerMetrics, max_connections: int = 1024,
                 tls: ssl.SSLContext | None = None) -> None:
        self.tier, self.name, self.token, self.limits = tier, name, token, limits
        self.tls = tls  # a server context: every connection must speak TLS
        self._tls_log_at = 0.0
        self.metrics = metrics
        self.max_connections = max_connections
        self.ownership = None  # MembershipAgent when --masters is set: NOT_OWNER checks
        self.nixl_info: dict | None = None  # arena registration, sent in the AUTH reply
        check_bind(listen, token)
        host, port = listen.rsplit(":", 1)
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, int(port)))
        self.sock.listen(512)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = time.time()

    @property
    def connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="gcache-accept",
                                        daemon=True)
        self._thread.start()

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
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread:
            self._thread.join(timeout=2)
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
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    log.warning("connection refused: max_connections reached",
                                extra={"fields": {"peer": str(peer)}})
                    conn.close()
                    continue
                self._conns.add(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name=f"gcache-conn-{peer[1] if len(peer) > 1 else peer}").start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        if self.tls is not None:
            conn = self._start_tls(conn, peer)
            if conn is None:
                return
        handler = _Connection(self, conn, peer)
        try:
            handler.run()
        except (ConnectionError, OSError):
            pass
        except Exception:  # never let one connection take the server down
            log.exception("connection handler failed", extra={"fields": {"peer": str(peer)}})
        finally:
            shm_ops.release_all(handler)  # the connection's shm leases and slots
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass


    def _start_tls(self, conn: socket.socket, peer: Any) -> ssl.SSLSocket | None:
        """On the connection's thread: the TLS handshake, or a plaintext refusal. The
        wrapped socket replaces ``conn`` in ``_conns`` (``stop`` shuts it down); None
        when the connection is over (closed and forgotten here)."""
        deadline = time.monotonic() + _TLS_HANDSHAKE_S
        live: socket.socket = conn
        try:
            first = tlslib.peek_first_byte(conn, _TLS_PLAIN_WAIT_S)
            if first != tlslib.HANDSHAKE_RECORD:
                if first is not None:
                    self._refuse_plain(conn, peer)
                raise ConnectionError("no TLS ClientHello")
            tls = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            with self._lock:  # conn is detached now: stop() must shut the TLS socket down
                self._conns.discard(conn)
                self._conns.add(tls)
            live = tls
            if self._closing.is_set():
                raise ConnectionError("server stopping")
            return tlslib.handshake(tls, deadline)
        except (OSError, ValueError) as exc:
            if not isinstance(exc, ConnectionError):
                self.metrics.protocol_errors.labels("tls").inc()
                now = time.monotonic()
                if now >= self._tls_log_at:
                    self._tls_log_at = now + _TLS_LOG_EVERY_S
                    log.warning("TLS handshake failed: %s (for %.0f s further failures are "
                                "only counted: gcache_protocol_errors_total{reason=\"tls\"})",
                                exc, _TLS_LOG_EVERY_S, extra={"fields": {"peer": str(peer)}})
            if live is not conn:  # let the client read the TLS alert that says why
                tlslib.linger_close(live, _LINGER_S)
            with self._lock:
                self._conns.discard(live)
                self._conns.discard(conn)
            try:
                live.close()
            except OSError:
                pass
            return None

    def _refuse_plain(self, conn: socket.socket, peer: Any) -> None:
        """Tell a peer that does not speak TLS why it is refused, in plaintext."""
        self.metrics.protocol_errors.labels("tls_required").inc()
        try:
            conn.settimeout(1.0)
            conn.sendall(encode_frame(0, 0, {"error": "this server accepts TLS connections "
                                             "only: connect with tls=True (gcache --tls) and "
                                             "the cluster's CA (tls_ca_file)"},
                                      flags=FLAG_RESPONSE, status=Status.AUTH))
            conn.shutdown(socket.SHUT_WR)  # lingering close, as in _Connection.fail
            end = time.monotonic() + _LINGER_S
            while (left := end - time.monotonic()) > 0:
                conn.settimeout(left)
                if not conn.recv_into(_DISCARD):
                    break
        except OSError:
            pass


class _Connection:
    def __init__(self, svc: Service, sock: socket.socket, peer: Any) -> None:
        self.svc, self.sock, self.peer = svc, sock, peer
        self.limits = svc.limits
        self.prefix = bytearray(PREFIX_SIZE)
        self.scratch = _DISCARD
        self.authed = False
        self.nonce = os.urandom(16)

    def reply(self, opcode: int, rid: int, meta: Any, payload: list | None = None,
              status: int = 0) -> None:
        plen = sum(len(p) for p in payload) if payload else 0
        frame = encode_frame(opcode, rid, meta, plen, flags=FLAG_RESPONSE, status=status)
        if payload:
            sendmsg_all(self.sock, [frame, *payload])
        else:
            self.sock.sendall(frame)

    def fail(self, opcode: int, rid: int, status: int, message: str, reason: str) -> None:
        """Frame-level error: tell the peer why, then the caller closes."""
        self.svc.metrics.protocol_errors.labels(reason).inc()
        log.warning("closing connection: %s", message,
                    extra={"fields": {"peer": str(self.peer), "reason": reason}})
        try:
            self.sock.settimeout(1.0)
            self.reply(opcode, rid, {"error": message}, status=status)
            # Lingering close: closing with unread input makes the kernel send RST, which
            # destroys the reply before the peer reads it (or fails a peer still sending
            # its payload). Send FIN, then drain what the peer still sends, bounded in time.
            self.sock.shutdown(socket.SHUT_WR)
            end = time.monotonic() + _LINGER_S
            while (left := end - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if not self.sock.recv_into(_DISCARD):
                    break
        except OSError:
            pass

    def run(self) -> None:
        svc = self.svc
        self.sock.settimeout(_AUTH_TIMEOUT_S)  # a peer that never authenticates is dropped
        self.reply(Op.HELLO, 0, {"v": 1, "name": svc.name, "nonce": self.nonce,
                                 "auth": bool(svc.token),
                                 "limits": {"max_key_bytes": self.limits.max_key_bytes,
                                            "max_value_bytes": self.limits.max_value_bytes,
                                            "max_batch_items": self.limits.max_batch_items,
                                            "max_frame_bytes": self.limits.max_frame_bytes},
                                 **shm_ops.hello_fields(svc.tier)})
        while True:
            try:
                fh, meta = read_frame(self.sock, self.limits, self.prefix)
            except ProtocolError as exc:
                self.fail(0, 0, exc.status, str(exc), "malformed")
                return
            if fh.is_response:
                self.fail(fh.opcode, fh.request_id, Status.BAD_REQUEST,
                          "unexpected response frame from a client", "malformed")
                return
            t0 = time.perf_counter()
            try:
                if not self.handle(fh.opcode, fh.request_id, meta, fh.payload_len):
                    return
            except ProtocolError as exc:
                self.fail(fh.opcode, fh.request_id, exc.status, str(exc), "malformed")
                return
            name = Op.NAMES.get(fh.opcode, "UNKNOWN")
            svc.metrics.frames.labels(name).inc()
            svc.metrics.latency.labels(name).observe(time.perf_counter() - t0)

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
            self.reply(op, rid, {"stats": self.svc_stats()})
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

    def svc_stats(self) -> dict:
        s = dict(self.svc.tier.stats())
        s.update(name=self.svc.name, address=self.svc.address,
                 connections=self.svc.connections, uptime_s=time.time() - self.svc.started,
                 **shm_ops.transport_stats(bool(self.svc.nixl_info)))
        return s

    def misplaced(self, meta: dict, n: int) -> list[bool]:
        """Items this server does not own in a newer epoch than the client's view.

        Clients routed by a master view send ``ep`` (their epoch) and ``ph`` (one placement
        hash per item); clients with a static server list send neither and are not checked.
        """
        agent, ph = self.svc.ownership, meta.get("ph")
        if agent is None or ph is None:
            return [False] * n
        if not (isinstance(ph, list) and len(ph) == n
                and all(isinstance(h, int) and 0 <= h < 1 << 64 for h in ph)):
            raise ProtocolError("'ph' must hold one u64 placement hash per item",
                                Status.BAD_REQUEST)
        ep = meta.get("ep", -1)
        out = agent.not_owned(ep if isinstance(ep, int) else -1, ph)
        return out if out is not None else [False] * n

    # ------------------------------------------------------------------ ops
    def auth(self, rid: int, meta: Any, plen: int) -> bool:
        self.no_payload(plen)
        mac = meta.get("mac", b"") if isinstance(meta, dict) else b""
        token = self.svc.token
        if token and not (isinstance(mac, bytes)
                          and hmac.compare_digest(mac, auth_mac(token, self.nonce))):
            self.fail(Op.AUTH, rid, Status.AUTH,
                      "authentication failed: wrong or missing token; give the client the "
                      "same token as the server", "auth")
            return False
        self.authed = True
        self.sock.settimeout(None)  # authenticated clients may keep idle pooled connections
        info = self.svc.nixl_info
        # the NIXL metadata carries memory keys: only authenticated peers get it
        self.reply(Op.AUTH, rid, {"ok": True, **({"nixl": info} if info else {})})
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
        wrong_owner = self.misplaced(meta, len(parsed))
        statuses: list[Status] = []
        slots = []
        views: list[memoryview] = []
        try:
            for (key, tl, off, ln, pid), wrong in zip(parsed, wrong_owner):
                if wrong:
                    statuses.append(Status.NOT_OWNER)
                    views.extend(discard_views(ln, self.scratch))
                    continue
                slot = (tier.begin_put(ns, key, tl, off, ln, pid) if tl <= lim.max_value_bytes
                        else None)
                if slot is None or slot.status != Status.OK:
                    statuses.append(Status.TOO_LARGE if slot is None else slot.status)
                    views.extend(discard_views(ln, self.scratch))
                    continue
                statuses.append(Status.OK)
                slots.append((len(statuses) - 1, slot))
                views.append(slot.view)
            recv_into_many(self.sock, views)
        except BaseException:
            for _, slot in slots:
                tier.abort_put(slot)
            raise
        for i, slot in slots:
            statuses[i] = tier.finish_put(slot)
        m = self.svc.metrics
        m.bytes.labels("in").inc(plen)
        for st in set(statuses):
            m.items.labels("put", st.name).inc(statuses.count(st))
        self.reply(Op.PUT, rid, {"st": [int(s) for s in statuses]})

    def get(self, rid: int, meta: Any) -> None:
        lim = self.limits
        ns = check_namespace(meta.get("ns", b""), lim)
        items = check_items(meta, lim)
        parsed = []
        for it in items:
            if not (isinstance(it, list) and len(it) == 4 and all(isinstance(x, int) for x in it[1:])):
                raise ProtocolError("GET item must be [key, offset, max_len, expect_version]",
                                    Status.BAD_REQUEST)
            if it[1] < 0 or it[2] < 0 or it[3] < 0:
                raise ProtocolError("GET item has a negative field", Status.BAD_REQUEST)
            parsed.append((check_key(it[0], lim), it[1], it[2], it[3]))
        tier = self.svc.tier
        wrong_owner = self.misplaced(meta, len(parsed))
        out_meta, payload, budget = [], [], lim.max_frame_bytes
        # pin every owned item at once (a disk tier reads them in parallel), then cut the
        # views to the frame budget in item order
        pins = tier.pin_read_many(ns, [(key, off, min(mx, budget), ev) for (key, off, mx, ev),
                                       wrong in zip(parsed, wrong_owner) if not wrong])
        try:
            it = iter(pins)
            for wrong in wrong_owner:
                if wrong:
                    out_meta.append([int(Status.NOT_OWNER), 0, 0, 0])
                    continue
                p = next(it)
                if p.status == Status.OK:
                    if len(p.view) > budget:
                        p.view = p.view[:budget]
                    budget -= len(p.view)
                    payload.append(p.view)
                out_meta.append([int(p.status), p.total_len, p.version,
                                 len(p.view) if p.view is not None else 0])
            self.reply(Op.GET, rid, {"items": out_meta}, payload)
        finally:
            for p in pins:
                tier.unpin(p)
        m = self.svc.metrics
        m.bytes.labels("out").inc(sum(x[3] for x in out_meta))
        hits = sum(1 for x in out_meta if x[0] == Status.OK)
        m.items.labels("get", "OK").inc(hits)
        if len(out_meta) - hits:
            m.items.labels("get", "MISS").inc(len(out_meta) - hits)

    def keyed(self, op: int, rid: int, meta: Any) -> None:
        lim = self.limits
        ns = check_namespace(meta.get("ns", b""), lim)
        keys = [check_key(k, lim) for k in check_items(meta, lim)]
        tier = self.svc.tier
        fn = {Op.EXISTS: tier.exists, Op.DELETE: tier.delete, Op.TOUCH: tier.touch}[op]
        st = [Status.NOT_OWNER if wrong else Status.OK if fn(ns, k) else Status.MISS
              for k, wrong in zip(keys, self.misplaced(meta, len(keys)))]
        self.svc.metrics.items.labels(Op.NAMES[op].lower(), "all").inc(len(st))
        self.reply(op, rid, {"st": [int(s) for s in st]})
