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

Serving. aiohttp on one event-loop thread (``gcache.bounded_aiohttp``): a ``/view``
long-poll is a coroutine parked on the epoch (``_watch_epoch``, one thread, turns the Raft
node's epoch changes into a wake-up of every parked poll), so a thousand watchers cost
coroutines, not threads. A follower forwards to the leader from the loop too (an aiohttp
client). Routes that block (Raft writes, ``/status``, ``/metrics``) run on a pool of
``_BLOCKING_WORKERS`` threads with at most twice that many jobs running or queued: past
that a 503 (``gcache.bounded_aiohttp.PoolBusy``), never an unbounded queue.

Limits (everything before auth is bounded, in time and in count):

* one deadline per request, not per ``recv``: the request line, headers and
  body must all arrive within ``request_deadline_ms`` of the first wait
  (connection open, or the previous answer), else the connection is closed
  (408 when the headers were read). The answer is not under it, so the
  ``/view`` long-poll keeps working; a TLS handshake has the same deadline;
* at most ``max_connections`` connections are served at once, and at most
  ``max_connections_per_ip`` from one peer address (so one host cannot take
  every slot; generous, since the SDK clients and server of a host share its
  address); beyond either a connection gets a 503 and is closed. The listen
  backlog is ``gcache.bounded_aiohttp.LISTEN_BACKLOG``;
* ``Content-Length`` must be a plain decimal at most ``_MAX_BODY`` (aiohttp's
  parser answers a malformed one 400 itself); chunked bodies are refused; any
  error answer closes the connection (an unread body must not be parsed as the
  next request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import threading

import aiohttp
from aiohttp import web

from gcache.bounded_aiohttp import BodyTimeout, BoundedAioServer, PoolBusy, read_body
from gcache.clock import SYSTEM, Clock
from gcache.credentials import Credential, CredentialStore
from gcache.logs import RateLimitedLog
from gcache.master.cluster_page import PAGE_HEADERS, ClusterPage
from gcache.master.detector import FailureDetector
from gcache.master.joiner import DEFAULT_JOIN_RAMP_S, DEFAULT_JOIN_TIMEOUT_S, JoinDriver
from gcache.master.metrics import MasterMetrics
from gcache.master.raft_node import RaftNode
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
_BLOCKING_WORKERS = 16  # pool threads for Raft writes, /status and /metrics
_LEADER_ONLY = ("/register", "/heartbeat", "/admin", "/self", "/status")
# a leader-only route that finds this master no longer leads (it lost an election
# between the check in dispatch and the route): the client retries, maybe elsewhere
_NOT_LEADER = (503, {"error": "this master stopped being the Raft leader during the "
                              "request; retry shortly"})


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
        self._client: aiohttp.ClientSession | None = None  # forwards to the leader
        self._epoch_event = asyncio.Event()  # set (and replaced) when the epoch moves
        # the last /view answer and its (epoch, leader): the loop thread only
        self._view_json: tuple[tuple[int, str | None], bytes] = ((-1, None), b"")
        host, port = listen.rsplit(":", 1)
        self.http = BoundedAioServer((host.strip("[]"), int(port)), self.dispatch,
                                     max_connections=max_connections,
                                     max_per_ip=max_connections_per_ip, tls=tls,
                                     request_deadline_s=self.request_deadline,
                                     blocking_workers=_BLOCKING_WORKERS, log=log,
                                     on_stop=self._close_client)
        self.address = f"{host}:{self.http.server_address[1]}"

    def start(self) -> None:
        self.http.start("gcache-master-http")
        threading.Thread(target=self._watch_epoch, name="gcache-master-epoch",
                         daemon=True).start()
        threading.Thread(target=self.detector.run, args=(self._stop,),
                         name="gcache-master-monitor", daemon=True).start()
        threading.Thread(target=self.joiner.run, args=(self._stop,),
                         name="gcache-master-join", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.http.stop()
        if self.down_events is not None:
            self.down_events.close()

    def _removed(self, mid: str, res: dict) -> None:
        """A ``remove`` of ``mid`` committed: its blocks are unreachable (KV events)."""
        if self.down_events is not None and res.get("changed", True):
            self.down_events.member_gone(mid)

    # ------------------------------------------------------------------ long-poll
    def _watch_epoch(self) -> None:
        """One thread turns the Raft node's epoch changes into a wake-up of every
        ``/view`` long-poll coroutine on the API's event loop."""
        last = self.node.membership.epoch
        while not self._stop.is_set():
            self.node.wait_epoch(last, 0.5)
            epoch = self.node.membership.epoch
            if epoch > last:
                last = epoch
                try:
                    self.http.loop.call_soon_threadsafe(self._epoch_moved)
                except RuntimeError:  # the loop is closed: stopping
                    return

    def _epoch_moved(self) -> None:
        event, self._epoch_event = self._epoch_event, asyncio.Event()
        event.set()

    async def _wait_epoch(self, since: int, timeout: float) -> None:
        """Until the applied epoch moves past ``since`` or ``timeout`` passes (a parked
        coroutine, no thread)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.node.membership.epoch <= since:
            left = end - loop.time()
            if left <= 0:
                return
            event = self._epoch_event  # taken after the check, with no await between
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                return

    # ------------------------------------------------------------------ plumbing
    async def dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request, on the API's event loop; blocking routes run on its pool."""
        try:
            method, path = request.method, request.path
            auth = request.headers.get("Authorization", "")
            cred = self.credentials.table.verify_bearer(auth)
            if method == "GET" and path in _PROBES and (cred is None or path == "/readyz"):
                code, doc = self.probe(path)  # Kubernetes probes carry no credential
                return self._send(code, doc)
            if method == "GET" and path == "/metrics":  # counts only: no credential
                return self._send_raw(200, await self.http.run_blocking(self.metrics.render),
                                      "text/plain; version=0.0.4; charset=utf-8")
            page = self.page.get(path) if method == "GET" else None
            if page is not None:  # static files, no cluster data: no credential
                return self._send_raw(200, page.body, page.content_type, PAGE_HEADERS)
            if cred is None:
                return self._send(401, {"error": "wrong or missing credential: send "
                                                 "'Authorization: Bearer id:secret' (a "
                                                 "credential of the masters' credentials "
                                                 "file) or the masters' token"})
            denied = _denied(cred, path)
            if denied:
                return self._send(403, {"error": denied})
            body: dict = {}
            if request.headers.get("Transfer-Encoding"):
                return self._send(400, {"error": "chunked bodies are not accepted: send "
                                                 "Content-Length"})
            raw_length = (request.headers.get("Content-Length") or "0").strip()
            if not _CONTENT_LENGTH.fullmatch(raw_length):
                return self._send(400, {"error": f"bad Content-Length {raw_length[:32]!r}: "
                                                 "must be a decimal byte count"})
            n = int(raw_length)
            if n > _MAX_BODY:
                return self._send(400, {"error": f"body of {n} bytes is too large "
                                                 f"(limit {_MAX_BODY})"})
            try:
                raw_body = await read_body(request) if n else b""
            except BodyTimeout:
                peer_log.warning("request", "master API: %s: body not received within %.1fs",
                                 request.remote, self.request_deadline)
                return self._send(408, {"error": "the request body did not arrive within "
                                                 f"{self.request_deadline:.1f}s"})
            if method == "POST":
                body = json.loads(raw_body or b"{}")
                if not isinstance(body, dict):
                    return self._send(400, {"error": "body must be a JSON object"})
            query = dict(request.query)
            if (method, path) == ("GET", "/view"):
                return self._send_raw(200, await self.view(query), "application/json")
            route = {("GET", "/status"): self.status,
                     ("POST", "/register"): self.register, ("POST", "/heartbeat"): self.heartbeat,
                     ("POST", "/admin"): self.admin, ("POST", "/self"): self.self_op,
                     ("GET", "/healthz"): self.health}
            fn = route.get((method, path))
            if fn is None:
                return self._send(404, {"error": f"no route {method} {path}"})
            if path in _LEADER_ONLY and not self.node.is_leader:
                forwarded = request.headers.get(_FORWARDED) is not None
                return self._send(*await self._forward(method, request.raw_path, body, auth,
                                                       forwarded))
            return self._send(*await self.http.run_blocking(fn, query, body, method,
                                                            request.raw_path))
        except PoolBusy as exc:
            return self._send(503, {"error": f"{exc}; retry shortly"})
        except (ValueError, KeyError, TypeError) as exc:
            return self._send(400, {"error": f"bad request: {exc}"})
        except Exception as exc:  # the API must never take the master down
            log.exception("master API error")
            return self._send(500, {"error": str(exc)})

    @classmethod
    def _send(cls, code: int, doc: dict) -> web.Response:
        """Answer; an error answer also closes the connection (its body may be unread)."""
        return cls._send_raw(code, json.dumps(doc).encode(), "application/json")

    @staticmethod
    def _send_raw(code: int, data: bytes, ctype: str,
                  headers: tuple[tuple[str, str], ...] = ()) -> web.Response:
        resp = web.Response(status=code, body=data,
                            headers={"Content-Type": ctype, **dict(headers)})
        if code >= 400:
            resp.force_close()
        return resp

    def leader_api(self) -> str | None:
        lead = self.node.leader
        return self.raft_to_api.get(lead) if lead else None

    async def _forward(self, method: str, path: str, body: dict, auth: str,
                       forwarded: bool) -> tuple[int, dict]:
        """Relay a leader-only request to the leader (on the event loop: a paused leader
        holds a coroutine for ``_FORWARD_TIMEOUT_S``, no thread); 503 when there is none.

        One hop only: during an election two nodes may each name the other as leader,
        so a request that was already forwarded is refused instead of bounced back.
        """
        api = self.leader_api()
        if api is None or forwarded:
            return 503, {"error": "no Raft leader right now (election in progress or no "
                                  "quorum); retry shortly"}
        if self._client is None:  # made on the loop, closed by the server's stop
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                timeout=aiohttp.ClientTimeout(total=_FORWARD_TIMEOUT_S))
        scheme = "https" if self.peer_tls is not None else "http"
        try:
            # the caller's own credential: the leader checks the same rights
            async with self._client.request(
                    method, f"{scheme}://{api}{path}",
                    json=body if method == "POST" else None,
                    headers={_FORWARDED: "1", "Authorization": auth},
                    ssl=self.peer_tls if self.peer_tls is not None else True) as resp:
                raw, code, reason = await resp.read(), resp.status, resp.reason
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return 503, {"error": f"leader {api} unreachable: {exc or type(exc).__name__}"}
        try:
            doc = json.loads(raw or b"{}")
        except ValueError:
            doc = {"error": str(reason)}
        return (200 if 200 <= code < 300 else code), doc

    async def _close_client(self) -> None:
        if self._client is not None:
            await self._client.close()

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

    async def view(self, q: dict) -> bytes:
        """The view document, as JSON. Built once per (epoch, leader): when the epoch
        moves every parked watcher wakes at once, and each gets the same bytes."""
        since = int(q.get("since", -1))
        wait_ms = min(int(q.get("wait_ms", 0)), _MAX_WAIT_MS)
        if wait_ms > 0 and self.node.membership.epoch <= since:
            await self._wait_epoch(since, wait_ms / 1000.0)
        key = (self.node.membership.epoch, self.leader_api())
        if self._view_json[0] != key:
            doc = self.node.membership.view()
            doc["leader"] = key[1]
            # keyed by the epoch the document holds (the Raft thread may have moved on)
            self._view_json = ((doc["epoch"], key[1]), json.dumps(doc).encode())
        return self._view_json[1]

    def register(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        if not self.node.is_leader:
            return _NOT_LEADER
        op = {"op": "register", "id": str(body["id"]), "address": str(body["address"]),
              "capacity_bytes": int(body["capacity_bytes"]), "boot_id": str(body["boot_id"])}
        if self.joiner.initial_ramp is not None:  # a newcomer joins JOINING, ramping
            op["ramp"] = self.joiner.initial_ramp
        res = self.node.submit(op)
        self.detector.seen(op["id"])
        return 200, {**res, "view": self.node.membership.view()}

    def heartbeat(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        if not self.node.is_leader:
            return _NOT_LEADER
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
            return _NOT_LEADER
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
            return _NOT_LEADER
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
            return _NOT_LEADER
        doc = self.node.membership.view()
        self.detector.annotate(doc["members"])
        doc["leader"] = self.address
        doc["masters"] = sorted(self.raft_to_api.values())
        return 200, doc
