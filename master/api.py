"""gcache-master HTTP API: discovery, registration, heartbeats, admin, status.

Design. Reads (``/view``) are answered by any master from its applied state
and long-poll on the epoch. Writes (``/register``, ``/admin``) and the soft
state (``/heartbeat``, ``/status``) belong to the leader; a follower forwards
the request to the leader's API (Raft port - 1) and relays the answer, so a
client may talk to any master.

Heartbeats are soft state on the leader, never Raft writes: the failure detector
(``master/detector.py``, on the injected clock) records them and marks a member
silent for ``heartbeat_timeout_ms`` ``down``; its monitor thread runs here. A
heartbeat from a member that is ``down`` with the same boot re-registers it (a
healed partition); one from a stale incarnation is told to re-register (409).

Joins: ``/register`` asks for a ramped join (``join_ramp_s`` > 0: the op carries the
join driver's initial ramp; ``Membership`` decides whether the id joins JOINING), and
the join driver (``master/joiner.py``, on the same clock) ramps the newcomer and ends
its join; its thread runs here too.

Auth. Every route needs a credential (``Authorization: Bearer id:secret``) or the
legacy token (``Bearer <token>``), unless the master runs with neither: 401
otherwise. ``/register``, ``/heartbeat`` and ``/self`` need a credential with
``server = true``; ``/admin`` and ``/status`` need a cluster admin (``admin`` on
namespaces ``"*"``): 403 otherwise.

``/self`` is a server acting on its own membership (``op`` ``drain``: the server
drains itself, on SIGTERM with ``--drain-on-stop`` or when it finds itself unhealthy;
``remove``: a drained server deregisters; ``down``: a server stopping without a drain
marks itself down at once, so clients route around it now rather than after the
heartbeat timeout, and a restart under its name comes back warm). The body names the member and the
``boot_id`` the member registered with: a different boot is another process, 403, so a
server credential drains or removes only the member it runs as. (This guards against a
server acting on the wrong id by mistake, not against a hostile holder of a server
credential: boot ids are in ``/view``, and such a holder may ``/register`` any id.)
``remove`` is refused (409) unless the member is draining, or drained. ``/view`` takes
any valid credential (every client routes by the view), and so does ``/healthz`` for its
full document (leader, epoch). Without a credential, ``/healthz`` (liveness:
``{"status": "ok"}``) and ``/readyz`` (200 once a Raft leader is known, else 503 and
why) answer anyone, revealing no member, address or epoch: they are what Kubernetes
probes. A follower forwards the caller's own Authorization header, so the leader decides
with the same credential. ``GET /ui`` (and its ``/ui/app.js``, ``/ui/style.css``) is the
live cluster page (``master/cluster_page.py``): static files from a fixed table, served
to anyone because they hold no cluster data; the page itself polls ``/status`` with the
credential its user gives it.

Limits (everything before auth is bounded, in time and in count):

* one deadline per request, not per ``recv``: the request line, headers and
  body must all arrive within ``request_deadline_ms`` of the first wait
  (``DeadlineReader`` recomputes the time left before every read), else the
  connection is closed (408 when the headers were read). The answer is not
  under it, so the ``/view`` long-poll keeps working;
* at most ``max_connections`` connections are served at once, one thread
  each, and at most ``max_connections_per_ip`` from one peer address (so one
  host cannot take every thread; generous, since the SDK clients and server of
  a host share its address); beyond either a connection gets a 503 and is
  closed, never queued on a thread. The listen backlog is ``gcache.http_bounds.LISTEN_BACKLOG``;
* ``Content-Length`` must be a plain decimal at most ``_MAX_BODY``; chunked
  bodies are refused; any error answer closes the connection (an unread body
  must not be parsed as the next request).
"""

from __future__ import annotations

import json
import logging
import re
import ssl
import threading
import urllib.error
import urllib.parse
from typing import Any

from gcache.clock import SYSTEM, Clock
from gcache.credentials import Credential, CredentialStore
from gcache.discovery import http_json
from gcache.logs import RateLimitedLog
from gcache.master.cluster_page import PAGE_HEADERS, ClusterPage
from gcache.master.detector import FailureDetector
from gcache.master.joiner import DEFAULT_JOIN_RAMP_S, DEFAULT_JOIN_TIMEOUT_S, JoinDriver
from gcache.master.metrics import MasterMetrics
from gcache.master.raft_node import RaftNode
from gcache.http_bounds import BoundedHTTPServer, DeadlineRequestHandler
from gcache.view import MemberState

log = logging.getLogger("gcache.master")
# lines a peer can trigger at will (refusals, cut-off requests): one per kind per 10 s
peer_log = RateLimitedLog(log, 10.0)

_PROBES = ("/healthz", "/readyz")  # answered without a credential
_MAX_BODY = 1 << 20
_MAX_WAIT_MS = 30_000
_FORWARDED = "X-Gcache-Forwarded"
_FORWARD_TIMEOUT_S = 1.0  # a paused leader must not hold a heartbeat for long
_CONTENT_LENGTH = re.compile(r"[0-9]{1,10}")
DEFAULT_REQUEST_DEADLINE_MS = 5000
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_CONNECTIONS_PER_IP = 256  # 0: no per-address cap


def _denied(cred: Credential, path: str) -> str:
    """Why ``cred`` may not call ``path`` ('' when it may). Unknown paths answer 404 later."""
    if path in ("/register", "/heartbeat", "/self") and not cred.server:
        return (f"credential {cred.id!r} may not register, heartbeat or drain servers: give "
                "gcache-server a credential with server = true")
    if path in ("/admin", "/status") and not cred.cluster_admin:
        return (f"credential {cred.id!r} may not call {path}: it needs admin on "
                'namespaces "*" (a cluster admin)')
    return ""


class MasterService:
    def __init__(self, node: RaftNode, *, listen: str, token: str, heartbeat_timeout_ms: int,
                 raft_to_api: dict[str, str], credentials: CredentialStore | None = None,
                 tls: ssl.SSLContext | None = None, peer_tls: ssl.SSLContext | None = None,
                 request_deadline_ms: int = DEFAULT_REQUEST_DEADLINE_MS,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_connections_per_ip: int = DEFAULT_MAX_CONNECTIONS_PER_IP,
                 join_ramp_s: float = DEFAULT_JOIN_RAMP_S,
                 join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
                 clock: Clock = SYSTEM, kv_events_endpoint: str = "") -> None:
        """``kv_events_endpoint``: where the leader publishes that a member is gone
        (``down_events``; empty: not published). ``zmq.ZMQError`` if it cannot bind."""
        self.node, self.token = node, token
        self.down_events = None
        if kv_events_endpoint:
            from gcache.master.down_events import DownPublisher  # zmq: only when asked

            self.down_events = DownPublisher(kv_events_endpoint)
        self.credentials = credentials or CredentialStore(token=token)
        # tls: serve https; peer_tls: the dialer context for forwarding to the leader
        self.peer_tls = peer_tls
        self.detector = FailureDetector(
            node, heartbeat_timeout_ms / 1000.0, clock,
            on_down=self.down_events.member_gone if self.down_events is not None else None)
        self.metrics = MasterMetrics(node)  # GET /metrics (master/metrics.py)
        self.page = ClusterPage()  # GET /ui: the live cluster page (master/cluster_page.py)
        self.joiner = JoinDriver(node, self.detector, join_ramp_s, join_timeout_s, clock)
        self.request_deadline = request_deadline_ms / 1000.0
        self.raft_to_api = raft_to_api
        self._stop = threading.Event()
        self._local = threading.local()
        host, port = listen.rsplit(":", 1)
        svc = self

        class Handler(DeadlineRequestHandler):
            protocol_version = "HTTP/1.1"
            request_deadline_s = svc.request_deadline

            def do_GET(self) -> None:  # noqa: N802
                svc.dispatch(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                svc.dispatch(self, "POST")

            def log_message(self, *args: Any) -> None:
                pass

            def log_error(self, fmt: str, *args: Any) -> None:
                if self.reader.received:  # not just an idle keep-alive connection closing
                    peer_log.warning("request", "master API: %s: %s", self.client_address[0],
                                     fmt % args)

        self.http = BoundedHTTPServer((host.strip("[]"), int(port)), Handler, max_connections,
                                      max_per_ip=max_connections_per_ip, tls=tls,
                                      handshake_s=self.request_deadline, log=log)
        self.address = f"{host}:{self.http.server_address[1]}"

    def start(self) -> None:
        threading.Thread(target=self.http.serve_forever, name="gcache-master-http",
                         daemon=True).start()
        threading.Thread(target=self.detector.run, args=(self._stop,),
                         name="gcache-master-monitor", daemon=True).start()
        threading.Thread(target=self.joiner.run, args=(self._stop,),
                         name="gcache-master-join", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.http.shutdown()
        self.http.server_close()
        if self.down_events is not None:
            self.down_events.close()

    def _removed(self, mid: str, res: dict) -> None:
        """A ``remove`` of ``mid`` committed: its blocks are unreachable (KV events)."""
        if self.down_events is not None and res.get("changed", True):
            self.down_events.member_gone(mid)

    # ------------------------------------------------------------------ plumbing
    def dispatch(self, h: Any, method: str) -> None:
        try:
            auth = h.headers.get("Authorization", "")
            cred = self.credentials.table.verify_bearer(auth)
            probe = urllib.parse.urlparse(h.path).path
            if method == "GET" and probe in _PROBES and (cred is None or probe == "/readyz"):
                code, doc = self.probe(probe)  # Kubernetes probes carry no credential
                return self._send(h, code, doc)
            if method == "GET" and probe == "/metrics":  # counts only: no credential
                return self._send_raw(h, 200, self.metrics.render(),
                                      "text/plain; version=0.0.4; charset=utf-8")
            page = self.page.get(probe) if method == "GET" else None
            if page is not None:  # static files, no cluster data: no credential
                return self._send_raw(h, 200, page.body, page.content_type, PAGE_HEADERS)
            if cred is None:
                return self._send(h, 401, {"error": "wrong or missing credential: send "
                                                    "'Authorization: Bearer id:secret' (a "
                                                    "credential of the masters' credentials "
                                                    "file) or the masters' token"})
            url = urllib.parse.urlparse(h.path)
            denied = _denied(cred, url.path)
            if denied:
                return self._send(h, 403, {"error": denied})
            self._local.auth = auth
            body: dict = {}
            if h.headers.get("Transfer-Encoding"):
                return self._send(h, 400, {"error": "chunked bodies are not accepted: send "
                                                    "Content-Length"})
            raw_length = (h.headers.get("Content-Length") or "0").strip()
            if not _CONTENT_LENGTH.fullmatch(raw_length):
                return self._send(h, 400, {"error": f"bad Content-Length {raw_length[:32]!r}: "
                                                    "must be a decimal byte count"})
            n = int(raw_length)
            if n > _MAX_BODY:
                return self._send(h, 400, {"error": f"body of {n} bytes is too large "
                                                    f"(limit {_MAX_BODY})"})
            try:
                raw_body = h.rfile.read(n) if n else b""
            except TimeoutError:
                h.reader.disarm()
                peer_log.warning("request", "master API: %s: body not received within %.1fs",
                                 h.client_address[0], self.request_deadline)
                return self._send(h, 408, {"error": "the request body did not arrive within "
                                                    f"{self.request_deadline:.1f}s"})
            if len(raw_body) < n:
                h.close_connection = True  # the peer closed mid-body: nobody to answer
                return
            h.reader.disarm()
            if method == "POST":
                body = json.loads(raw_body or b"{}")
                if not isinstance(body, dict):
                    return self._send(h, 400, {"error": "body must be a JSON object"})
            route = {("GET", "/view"): self.view, ("GET", "/status"): self.status,
                     ("POST", "/register"): self.register, ("POST", "/heartbeat"): self.heartbeat,
                     ("POST", "/admin"): self.admin, ("POST", "/self"): self.self_op,
                     ("GET", "/healthz"): self.health}
            fn = route.get((method, url.path))
            if fn is None:
                return self._send(h, 404, {"error": f"no route {method} {url.path}"})
            query = dict(urllib.parse.parse_qsl(url.query))
            self._local.forwarded = h.headers.get(_FORWARDED) is not None
            code, out = fn(query, body, method, h.path)
            self._send(h, code, out)
        except ConnectionError:  # the peer left before its answer (a long-poll given up)
            h.close_connection = True
        except (ValueError, KeyError, TypeError) as exc:
            self._send(h, 400, {"error": f"bad request: {exc}"})
        except Exception as exc:  # the API must never take the master down
            log.exception("master API error")
            self._send(h, 500, {"error": str(exc)})

    @classmethod
    def _send(cls, h: Any, code: int, doc: dict) -> None:
        """Answer; an error answer also closes the connection (its body may be unread)."""
        cls._send_raw(h, code, json.dumps(doc).encode(), "application/json")

    @staticmethod
    def _send_raw(h: Any, code: int, data: bytes, ctype: str,
                  headers: tuple[tuple[str, str], ...] = ()) -> None:
        h.reader.disarm()  # the send gets its own timeout, whatever was left of the deadline
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        for name, value in headers:
            h.send_header(name, value)
        h.send_header("Content-Length", str(len(data)))
        if code >= 400:
            h.send_header("Connection", "close")  # send_header sets close_connection too
        h.end_headers()
        h.wfile.write(data)

    def leader_api(self) -> str | None:
        lead = self.node.leader
        return self.raft_to_api.get(lead) if lead else None

    def _forward(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        """Relay a leader-only request to the leader; 503 when there is none.

        One hop only: during an election two nodes may each name the other as leader,
        so a request that was already forwarded is refused instead of bounced back.
        """
        api = self.leader_api()
        if api is None or self.node.is_leader or getattr(self._local, "forwarded", False):
            return 503, {"error": "no Raft leader right now (election in progress or no "
                                  "quorum); retry shortly"}
        try:
            # the caller's own credential: the leader checks the same rights
            return 200, http_json(api, method, path, body if method == "POST" else None,
                                  "", _FORWARD_TIMEOUT_S,
                                  {_FORWARDED: "1", "Authorization": self._local.auth},
                                  tls=self.peer_tls)
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read() or b"{}")
            except ValueError:
                return exc.code, {"error": str(exc.reason)}
        except OSError as exc:
            return 503, {"error": f"leader {api} unreachable: {exc}"}

    # ------------------------------------------------------------------ routes
    def probe(self, path: str) -> tuple[int, dict]:
        """The credential-free probes, which say nothing an outsider could use (no
        member, address or epoch): ``/healthz`` 200 while the process serves its API;
        ``/readyz`` 200 while this master knows a Raft leader and reaches a quorum (it
        can answer or forward writes), else 503 with why."""
        if path == "/healthz":
            return 200, {"status": "ok"}
        ready, why = self.node.readiness()
        return (200 if ready else 503), {"ready": ready, "reason": why}

    def health(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        return 200, {"status": "ok", "leader": self.leader_api(), "is_leader":
                     self.node.is_leader, "epoch": self.node.membership.epoch}

    def view(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        since = int(q.get("since", -1))
        wait_ms = min(int(q.get("wait_ms", 0)), _MAX_WAIT_MS)
        if wait_ms > 0 and self.node.membership.epoch <= since:
            self.node.wait_epoch(since, wait_ms / 1000.0)
        doc = self.node.membership.view()
        doc["leader"] = self.leader_api()
        return 200, doc

    def register(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        if not self.node.is_leader:
            return self._forward(method, path, body)
        op = {"op": "register", "id": str(body["id"]), "address": str(body["address"]),
              "capacity_bytes": int(body["capacity_bytes"]), "boot_id": str(body["boot_id"])}
        if self.joiner.initial_ramp is not None:  # a newcomer joins JOINING, ramping
            op["ramp"] = self.joiner.initial_ramp
        res = self.node.submit(op)
        self.detector.seen(op["id"])
        return 200, {**res, "view": self.node.membership.view()}

    def heartbeat(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        if not self.node.is_leader:
            return self._forward(method, path, body)
        mid, inc, boot = str(body["id"]), int(body["incarnation"]), str(body.get("boot_id", ""))
        rec = self.node.membership.get(mid)
        if rec is None or rec.incarnation != inc or (boot and rec.boot_id != boot):
            return 409, {"error": "unknown member or stale incarnation: re-register"}
        self.detector.seen(mid, dict(body.get("stats") or {}))
        if rec.state is MemberState.DOWN:  # a healed partition: same boot, back up
            self.node.submit({"op": "register", "id": mid, "address": rec.address,
                              "capacity_bytes": rec.capacity_bytes, "boot_id": rec.boot_id})
        return 200, {"epoch": self.node.membership.epoch}

    def admin(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        if not self.node.is_leader:
            return self._forward(method, path, body)
        op = str(body["op"])
        if op not in ("drain", "undrain", "remove"):
            return 400, {"error": f"unknown admin op {op!r}: use drain, undrain (add) or remove"}
        if self.node.membership.get(str(body["id"])) is None:
            return 404, {"error": f"no member {body['id']!r}"}
        res = self.node.submit({"op": op, "id": str(body["id"])})
        if op == "undrain":
            self.detector.seen(str(body["id"]))
        elif op == "remove":
            self._removed(str(body["id"]), res)
        return 200, res

    def self_op(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        """A server drains or removes itself: the member ``id`` registered with
        ``boot_id`` (see Auth in the module docstring)."""
        if not self.node.is_leader:
            return self._forward(method, path, body)
        op, mid, boot = str(body["op"]), str(body["id"]), str(body["boot_id"])
        if op not in ("drain", "remove", "down"):
            return 400, {"error": f"unknown self op {op!r}: use drain, remove or down"}
        rec = self.node.membership.get(mid)
        if rec is None:
            return 404, {"error": f"no member {mid!r}"}
        if rec.boot_id != boot:
            return 403, {"error": f"member {mid!r} is another process (its boot id differs): "
                                  "a server credential may drain or remove only the member "
                                  "it runs as; use gcache admin with a cluster admin "
                                  "credential"}
        if op == "remove" and not (rec.drained or rec.state is MemberState.DRAINING):
            return 409, {"error": f"member {mid!r} is {rec.state.value}, not draining: a "
                                  "server removes itself only after its drain"}
        log.info("member %r asks to %s itself", mid, op)
        if op == "down":  # a planned stop: down now, not a heartbeat timeout later
            res = self.node.submit({"op": "mark_down", "id": mid,
                                    "incarnation": rec.incarnation})
            if self.down_events is not None and res.get("changed", True):
                self.down_events.member_gone(mid)  # its blocks are unreachable now
            return 200, res
        res = self.node.submit({"op": op, "id": mid})
        if op == "remove":
            self._removed(mid, res)
        return 200, res

    def status(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        if not self.node.is_leader:
            return self._forward(method, path, body)
        doc = self.node.membership.view()
        self.detector.annotate(doc["members"])
        doc["leader"] = self.address
        doc["masters"] = sorted(self.raft_to_api.values())
        return 200, doc
