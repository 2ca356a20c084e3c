"""gcache-master HTTP API: discovery, registration, heartbeats, admin, status.

Design. Reads (``/view``) are answered by any master from its applied state
and long-poll on the epoch. Writes (``/register``, ``/admin``) and the soft
state (``/heartbeat``, ``/status``) belong to the leader; a follower forwards
the request to the leader's API (Raft port - 1) and relays the answer, so a
client may talk to any master.

Heartbeats are soft state on the leader, never Raft writes: ``last_seen`` per
member in memory. The leader's monitor turns a member whose heartbeats stop
for ``heartbeat_timeout_ms`` into ``down`` (one replicated ``mark_down``, which
moves the epoch). A new leader starts every member's clock afresh, so a
failover never marks healthy servers down. A heartbeat from a member that is
``down`` with the same boot re-registers it (a healed partition); one from a
stale incarnation is told to re-register (409).

Auth. Every route needs a credential (``Authorization: Bearer id:secret``) or the
legacy token (``Bearer <token>``), unless the master runs with neither: 401
otherwise. ``/register`` and ``/heartbeat`` need a credential with
``server = true``; ``/admin`` and ``/status`` need a cluster admin (``admin`` on
namespaces ``"*"``): 403 otherwise. ``/view`` and ``/healthz`` take any valid
credential (every client routes by the view). A follower forwards the caller's
own Authorization header, so the leader decides with the same credential.
"""

from __future__ import annotations

import http.server
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.parse
from typing import Any

from gcache.credentials import Credential, CredentialStore
from gcache.discovery import http_json
from gcache.tls import HTTPServer
from gcache.master.raft_node import RaftNode

log = logging.getLogger("gcache.master")

_MAX_BODY = 1 << 20
_MAX_WAIT_MS = 30_000
_FORWARDED = "X-Gcache-Forwarded"
_FORWARD_TIMEOUT_S = 1.0  # a paused leader must not hold a heartbeat for long


def _denied(cred: Credential, path: str) -> str:
    """Why ``cred`` may not call ``path`` ('' when it may). Unknown paths answer 404 later."""
    if path in ("/register", "/heartbeat") and not cred.server:
        return (f"credential {cred.id!r} may not register or heartbeat servers: give "
                "gcache-server a credential with server = true")
    if path in ("/admin", "/status") and not cred.cluster_admin:
        return (f"credential {cred.id!r} may not call {path}: it needs admin on "
                'namespaces "*" (a cluster admin)')
    return ""


class MasterService:
    def __init__(self, node: RaftNode, *, listen: str, token: str, heartbeat_timeout_ms: int,
                 raft_to_api: dict[str, str], credentials: CredentialStore | None = None,
                 tls: ssl.SSLContext | None = None, peer_tls: ssl.SSLContext | None = None
                 ) -> None:
        self.node, self.token = node, token
        self.credentials = credentials or CredentialStore(token=token)
        # tls: serve https; peer_tls: the dialer context for forwarding to the leader
        self.peer_tls = peer_tls
        self.heartbeat_timeout = heartbeat_timeout_ms / 1000.0
        self.raft_to_api = raft_to_api
        self.last_seen: dict[str, float] = {}
        self.stats: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._was_leader = False
        self._stop = threading.Event()
        self._local = threading.local()
        host, port = listen.rsplit(":", 1)
        svc = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                svc.dispatch(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                svc.dispatch(self, "POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.http = HTTPServer((host.strip("[]"), int(port)), Handler, tls=tls)
        self.address = f"{host}:{self.http.server_address[1]}"

    def start(self) -> None:
        threading.Thread(target=self.http.serve_forever, name="gcache-master-http",
                         daemon=True).start()
        threading.Thread(target=self._monitor, name="gcache-master-monitor",
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.http.shutdown()
        self.http.server_close()

    # ------------------------------------------------------------------ plumbing
    def dispatch(self, h: http.server.BaseHTTPRequestHandler, method: str) -> None:
        try:
            auth = h.headers.get("Authorization", "")
            cred = self.credentials.table.verify_bearer(auth)
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
            if method == "POST":
                n = int(h.headers.get("Content-Length") or 0)
                if n > _MAX_BODY:
                    return self._send(h, 400, {"error": f"body of {n} bytes is too large"})
                body = json.loads(h.rfile.read(n) or b"{}")
                if not isinstance(body, dict):
                    return self._send(h, 400, {"error": "body must be a JSON object"})
            route = {("GET", "/view"): self.view, ("GET", "/status"): self.status,
                     ("POST", "/register"): self.register, ("POST", "/heartbeat"): self.heartbeat,
                     ("POST", "/admin"): self.admin, ("GET", "/healthz"): self.health}
            fn = route.get((method, url.path))
            if fn is None:
                return self._send(h, 404, {"error": f"no route {method} {url.path}"})
            query = dict(urllib.parse.parse_qsl(url.query))
            self._local.forwarded = h.headers.get(_FORWARDED) is not None
            code, out = fn(query, body, method, h.path)
            self._send(h, code, out)
        except (ValueError, KeyError, TypeError) as exc:
            self._send(h, 400, {"error": f"bad request: {exc}"})
        except Exception as exc:  # the API must never take the master down
            log.exception("master API error")
            self._send(h, 500, {"error": str(exc)})

    @staticmethod
    def _send(h: http.server.BaseHTTPRequestHandler, code: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
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
        res = self.node.submit(op)
        with self._lock:
            self.last_seen[op["id"]] = time.monotonic()
        return 200, {**res, "view": self.node.membership.view()}

    def heartbeat(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        if not self.node.is_leader:
            return self._forward(method, path, body)
        mid, inc, boot = str(body["id"]), int(body["incarnation"]), str(body.get("boot_id", ""))
        rec = self.node.membership.get(mid)
        if rec is None or rec.incarnation != inc or (boot and rec.boot_id != boot):
            return 409, {"error": "unknown member or stale incarnation: re-register"}
        with self._lock:
            self.last_seen[mid] = time.monotonic()
            self.stats[mid] = dict(body.get("stats") or {})
        if rec.state.value == "down":  # a healed partition: same boot, back up
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
            with self._lock:
                self.last_seen[str(body["id"])] = time.monotonic()
        return 200, res

    def status(self, q: dict, body: dict, method: str, path: str) -> tuple[int, dict]:
        if not self.node.is_leader:
            return self._forward(method, path, body)
        doc = self.node.membership.view()
        now = time.monotonic()
        with self._lock:
            for m in doc["members"]:
                seen = self.last_seen.get(m["id"])
                m["last_heartbeat_s"] = None if seen is None else round(now - seen, 2)
                m["stats"] = self.stats.get(m["id"], {})
        doc["leader"] = self.address
        doc["masters"] = sorted(self.raft_to_api.values())
        return 200, doc

    # ------------------------------------------------------------------ monitor
    def _monitor(self) -> None:
        while not self._stop.wait(0.1):
            leader = self.node.is_leader
            now = time.monotonic()
            if leader and not self._was_leader:
                with self._lock:  # fresh clocks for everyone: soft state died with the old leader
                    self.last_seen = {mid: now for mid in self.node.membership.members()}
                log.info("became leader: epoch %d", self.node.membership.epoch)
            self._was_leader = leader
            if not leader:
                continue
            for mid, rec in self.node.membership.members().items():
                if rec.state.value not in ("up", "draining", "joining"):
                    continue
                with self._lock:
                    seen = self.last_seen.setdefault(mid, now)
                if now - seen > self.heartbeat_timeout:
                    log.warning("member %s missed heartbeats for %.1fs: marking down", mid,
                                now - seen)
                    try:
                        self.node.submit({"op": "mark_down", "id": mid,
                                          "incarnation": rec.incarnation})
                    except (TimeoutError, RuntimeError) as exc:
                        log.warning("mark_down %s not committed: %s", mid, exc)
