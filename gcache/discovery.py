"""Client of the gcache-master discovery API (HTTP + JSON), used by servers and SDKs.

Design. Any master answers; followers forward writes to the leader, so a
client just tries the masters in turn, starting with the last one that
answered. Every call has a short timeout and failures are values
(``MasterUnavailable``), because the IO path must keep working on the last
view when every master is down. ``watch`` long-polls ``/view?since=E`` and
returns as soon as the epoch moves past ``E`` (or after ``wait_ms``).

The token travels as ``Authorization: Bearer <token>``. Give ``tls`` (a dialer
context from ``gcache.tls``) when the masters serve https (``gcache-master
--tls-cert-file``): every call then verifies the master's certificate, and its
name against the address dialed, before the token is sent.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from gcache.ring import Member
from gcache.tls import explain
from gcache.view import View


class MasterUnavailable(Exception):
    """No master answered (or every answer was an error)."""


class MasterClient:
    def __init__(self, masters: Sequence[str] | str, token: str = "", timeout_s: float = 2.0,
                 tls: ssl.SSLContext | None = None) -> None:
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
                timeout_s: float | None = None, retry_s: float = 2.0) -> dict:
        """Try every master; while none can answer (e.g. mid-election: HTTP 503),
        retry for up to ``retry_s``. Client errors raise MasterError at once."""
        deadline = time.monotonic() + retry_s
        while True:
            try:
                return self._request_once(method, path, body, timeout_s)
            except MasterUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _request_once(self, method: str, path: str, body: dict | None,
                      timeout_s: float | None) -> dict:
        last = ""
        n = len(self.masters)
        for i in range(n):
            idx = (self._good + i) % n
            addr = self.masters[idx]
            try:
                out = http_json(addr, method, path, body, self.token,
                                timeout_s or self.timeout_s, tls=self.tls)
            except urllib.error.HTTPError as exc:
                detail = _error_text(exc)
                if exc.code in (401, 400, 404, 409):
                    raise MasterError(exc.code, detail) from None
                last = f"{addr}: HTTP {exc.code} {detail}"
                continue
            except (OSError, ValueError) as exc:
                # urllib wraps TLS failures of the connect, not those of the reply
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                last = (explain(reason, addr)[1] if isinstance(reason, ssl.SSLError)
                        else f"{addr}: {exc}")
                continue
            self._good = idx
            return out
        raise MasterUnavailable(f"no master answered {method} {path}: {last}")

    # ------------------------------------------------------------------ API
    def view(self, since: int = -1, wait_ms: int = 0) -> dict:
        timeout = self.timeout_s + wait_ms / 1000.0
        return self.request("GET", f"/view?since={since}&wait_ms={wait_ms}", timeout_s=timeout)

    def register(self, member_id: str, address: str, capacity_bytes: int, boot_id: str) -> dict:
        return self.request("POST", "/register", {"id": member_id, "address": address,
                                                   "capacity_bytes": capacity_bytes,
                                                   "boot_id": boot_id})

    def heartbeat(self, member_id: str, incarnation: int, boot_id: str, stats: dict) -> dict:
        return self.request("POST", "/heartbeat", {"id": member_id, "incarnation": incarnation,
                                                    "boot_id": boot_id, "stats": stats})

    def admin(self, op: str, member_id: str) -> dict:
        return self.request("POST", "/admin", {"op": op, "id": member_id})

    def status(self) -> dict:
        return self.request("GET", "/status")


class MasterError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code = code


def http_json(addr: str, method: str, path: str, body: dict | None, token: str,
              timeout_s: float, headers: dict[str, str] | None = None,
              tls: ssl.SSLContext | None = None) -> dict:
    """One JSON call to a master: https with ``tls`` (a dialer context), else http."""
    data = json.dumps(body).encode() if body is not None else None
    scheme = "https" if tls is not None else "http"
    req = urllib.request.Request(f"{scheme}://{addr}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout_s, context=tls) as resp:
        return json.loads(resp.read() or b"{}")


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read() or b"{}").get("error", exc.reason)
    except Exception:
        return str(exc.reason)


def view_from_wire(doc: dict) -> View:
    """A routing View from a master view document: UP members only, weighted by
    capacity relative to the largest member (equal capacities -> equal weights)."""
    ups = [m for m in doc.get("members", []) if m.get("state") == "up"]
    top = max((int(m.get("capacity_bytes") or 0) for m in ups), default=0)
    members = tuple(
        Member(id=m["id"], address=m["address"],
               weight=max(0.05, int(m.get("capacity_bytes") or 0) / top) if top else 1.0)
        for m in sorted(ups, key=lambda m: m["id"]))
    return View(int(doc.get("epoch", 0)), members)


def parse_view_doc(doc: Any) -> dict:
    if not isinstance(doc, dict) or "epoch" not in doc:
        raise ValueError("master returned a malformed view")
    return doc
