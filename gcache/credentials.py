"""Scoped credentials: who may read, write or administer which namespaces.

Design. Servers and masters read one credentials file (``--credentials-file``,
``GCACHE_CREDENTIALS_FILE``), TOML, one ``[[credential]]`` table per client,
server fleet or operator::

    [[credential]]
    id = "team-a"                      # letters, digits, . _ - @ (no ':')
    secret = "…at least 16 characters…"  # e.g. `openssl rand -hex 24`
    grants = [
      { namespaces = "team-a/*", rights = ["read", "write"] },
      { namespaces = "shared/*", rights = ["read"] },
    ]

    [[credential]]
    id = "fleet"                       # what gcache-server presents to the masters
    secret = "…"
    server = true

Rights, per grant, over the namespaces its glob (``fnmatch``, case-sensitive;
``*`` also matches ``/``) selects:

* ``read``: GET, EXISTS, TOUCH (a GET refreshes recency just the same) and the
  shm/nixl LEASE;
* ``write``: PUT, DELETE and the shm/nixl ALLOC/COMMIT;
* ``admin``: read and write, and (a later step) the namespace's quota. Granted on
  ``namespaces = "*"`` it makes a *cluster admin*: server-wide STATS and the
  masters' ``/admin`` and ``/status``.

``server = true`` lets the credential register servers and heartbeat with the
masters (nothing else on its own). A credential may hold both.

The legacy shared ``--token`` keeps working next to (or without) the file: it is a
full-rights credential (every right on ``*``, and ``server``) named ``<token>``.
With neither a file nor a token, auth is off (loopback only) and every peer has
full rights.

Clients authenticate with ``AUTH {"id": id, "mac": HMAC(secret, nonce)}`` (a bare
``{"mac": …}`` is the legacy token) and the master API with
``Authorization: Bearer id:secret`` (or ``Bearer <token>``).

``CredentialStore`` holds the current table; ``reload()`` (SIGHUP) swaps in a new
one only if the file parses, so a bad edit keeps the old credentials and says why.
Connections re-resolve their credential on every frame, so a narrowed grant
applies to their next frame, and a removed credential (or a changed secret)
ends them.

Only the stdlib is imported (the core is the bottom layer).
"""

from __future__ import annotations

import difflib
import enum
import fnmatch
import hmac
import logging
import os
import re
import threading
import tomllib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gcache.errors import ConfigError
from gcache.protocol import auth_mac

log = logging.getLogger("gcache.credentials")

TOKEN_ID = "<token>"  # the legacy --token, in logs and metrics (no file id can look like it)
OPEN_ID = "<open>"  # auth off: every peer (loopback only)
MIN_SECRET_CHARS = 16
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_CACHE_MAX = 4096  # memoised (right, namespace) answers per credential


class Right(str, enum.Enum):
    """What a grant allows on its namespaces (wire- and file-stable spellings)."""

    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


_IMPLIED = {Right.READ: frozenset({Right.READ, Right.ADMIN}),
            Right.WRITE: frozenset({Right.WRITE, Right.ADMIN}),
            Right.ADMIN: frozenset({Right.ADMIN})}  # right needed -> rights that satisfy it


@dataclass(frozen=True, slots=True)
class Grant:
    pattern: str  # fnmatch glob over the namespace, case-sensitive
    rights: frozenset[Right]


@dataclass(frozen=True, eq=False)
class Credential:
    """One credential: its id, secret and grants. Immutable; a reload builds new ones."""

    id: str
    secret: str = field(repr=False)
    grants: tuple[Grant, ...] = ()
    server: bool = False
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def allows(self, right: Right, ns: bytes) -> bool:
        """True when some grant gives ``right`` (or one implying it) over namespace ``ns``."""
        k = (right, ns)
        hit = self._memo.get(k)
        if hit is None:
            name = ns.decode("utf-8", "surrogateescape")
            ok = _IMPLIED[right]
            hit = any(g.rights & ok and fnmatch.fnmatchcase(name, g.pattern)
                      for g in self.grants)
            if len(self._memo) >= _CACHE_MAX:
                self._memo.clear()
            self._memo[k] = hit
        return hit

    @property
    def cluster_admin(self) -> bool:
        """Admin over every namespace (a grant ``namespaces = "*"`` with ``admin``)."""
        return any(g.pattern == "*" and Right.ADMIN in g.rights for g in self.grants)


def full_rights(cred_id: str, secret: str) -> Credential:
    """Every right on every namespace, and the server role (the legacy token; auth off)."""
    return Credential(cred_id, secret, (Grant("*", frozenset(Right)),), server=True)


# ---------------------------------------------------------------- the file


def _err(path: str, where: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"credentials file {path}: {where}: {problem}; {fix}")


def _unknown(path: str, where: str, key: str, allowed: tuple[str, ...]) -> ConfigError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
    return _err(path, where, f"unknown key {key!r}", f"{hint} (remove or rename it)")


_CRED_KEYS = ("id", "secret", "grants", "server")
_GRANT_KEYS = ("namespaces", "rights")


def parse_credentials(data: Any, path: str = "<credentials>") -> dict[str, Credential]:
    """Validate a parsed credentials document; ConfigError names the entry and the fix."""
    if not isinstance(data, dict):
        raise _err(path, "top level", "not a table", "write [[credential]] tables")
    for key in data:
        if key != "credential":
            raise _unknown(path, "top level", key, ("credential",))
    entries = data.get("credential")
    if not isinstance(entries, list) or not entries:
        raise _err(path, "top level", "no [[credential]] table",
                   "add at least one [[credential]] with id, secret and grants")
    out: dict[str, Credential] = {}
    for i, ent in enumerate(entries, 1):
        where = f"credential #{i}"
        if not isinstance(ent, dict):
            raise _err(path, where, "not a table", "write it as a [[credential]] table")
        cid = ent.get("id")
        if isinstance(cid, str):
            where = f"credential #{i} (id {cid!r})"
        for key in ent:
            if key not in _CRED_KEYS:
                raise _unknown(path, where, key, _CRED_KEYS)
        if not isinstance(cid, str) or not _ID_RE.fullmatch(cid):
            raise _err(path, where, f"id {cid!r} is missing or malformed",
                       "use 1-64 letters, digits, '.', '_', '-' or '@', starting with a "
                       "letter or digit (no ':')")
        if cid in out:
            raise _err(path, where, "the id is used twice", "give every credential its own id")
        secret = ent.get("secret")
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
            raise _err(path, where, f"secret is missing or shorter than {MIN_SECRET_CHARS} "
                       "characters", "generate one, e.g. `openssl rand -hex 24`")
        server = ent.get("server", False)
        if not isinstance(server, bool):
            raise _err(path, where, f"server = {server!r} is not a boolean",
                       "write server = true or leave it out")
        raw_grants = ent.get("grants", [])
        if not isinstance(raw_grants, list):
            raise _err(path, where, "grants is not a list",
                       'write grants = [{ namespaces = "team-a/*", rights = ["read"] }]')
        grants = []
        for j, g in enumerate(raw_grants, 1):
            gwhere = f"{where}, grant #{j}"
            if not isinstance(g, dict):
                raise _err(path, gwhere, "not a table",
                           'write { namespaces = "team-a/*", rights = ["read"] }')
            for key in g:
                if key not in _GRANT_KEYS:
                    raise _unknown(path, gwhere, key, _GRANT_KEYS)
            pattern = g.get("namespaces")
            if not isinstance(pattern, str) or not pattern or len(pattern) > 256:
                raise _err(path, gwhere, f"namespaces {pattern!r} is missing or not a glob",
                           'give one glob string such as "team-a/*" (or "*" for all)')
            rights = g.get("rights")
            names = [r.value for r in Right]
            if (not isinstance(rights, list) or not rights
                    or not all(isinstance(r, str) and r in names for r in rights)):
                raise _err(path, gwhere, f"rights {rights!r} are not a non-empty list of "
                           f"{', '.join(names)}", 'write e.g. rights = ["read", "write"]')
            if len(set(rights)) != len(rights):
                raise _err(path, gwhere, f"rights {rights!r} repeat a right",
                           "list each right once")
            grants.append(Grant(pattern, frozenset(Right(r) for r in rights)))
        if not grants and not server:
            raise _err(path, where, "grants nothing",
                       "add grants (or server = true), or remove the credential")
        twin = next((c.id for c in out.values() if hmac.compare_digest(c.secret, secret)), None)
        if twin is not None:  # the MAC proves the secret: shared secrets blur who is who
            raise _err(path, where, f"its secret is also the secret of {twin!r}",
                       "give every credential its own secret")
        out[cid] = Credential(cid, secret, tuple(grants), server)
    return out


def load_credentials(path: str | os.PathLike[str]) -> dict[str, Credential]:
    """Read and validate a credentials file (ConfigError saying what to fix)."""
    label = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read credentials file {label}: {exc.strerror}; "
                          "fix the path or the permissions") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"credentials file {label} is not valid TOML ({exc}); fix it"
                          ) from None
    return parse_credentials(data, label)


# ---------------------------------------------------------------- verifying peers


class CredentialTable:
    """One immutable generation of credentials: the file's entries plus the token."""

    def __init__(self, creds: dict[str, Credential], token: str = "") -> None:
        self.creds = dict(creds)
        self.token = token
        self.token_cred = full_rights(TOKEN_ID, token) if token else None
        self.required = bool(token or creds)
        self.open_cred = None if self.required else full_rights(OPEN_ID, "")

    def verify_mac(self, cred_id: Any, mac: Any, nonce: bytes) -> Credential | None:
        """The credential an AUTH frame proves, or None. ``cred_id`` None = legacy token."""
        if not self.required:
            return self.open_cred
        if not isinstance(mac, bytes):
            return None
        if cred_id is None:
            cred = self.token_cred
        else:
            cred = self.creds.get(cred_id) if isinstance(cred_id, str) else None
        # compare even for an unknown id, so its answer takes as long as a wrong secret's
        expect = auth_mac(cred.secret if cred else "\0unknown", nonce)
        return cred if hmac.compare_digest(mac, expect) and cred is not None else None

    def verify_bearer(self, header: str) -> Credential | None:
        """The credential an ``Authorization`` header proves (``Bearer id:secret`` or
        ``Bearer <token>``), or None."""
        if not self.required:
            return self.open_cred
        if not header.startswith("Bearer "):
            return None
        value = header[len("Bearer "):]
        if self.token and hmac.compare_digest(value.encode(), self.token.encode()):
            return self.token_cred
        cid, sep, secret = value.partition(":")
        cred = self.creds.get(cid) if sep else None
        ok = hmac.compare_digest(secret.encode(), (cred.secret if cred else "\0").encode())
        return cred if ok and cred is not None else None

    def current(self, cred: Credential) -> Credential | None:
        """``cred`` as this generation knows it (new grants apply at once), or None when
        it was removed or its secret changed (the peer must authenticate again)."""
        if cred.id == TOKEN_ID:
            return self.token_cred if self.token and self.token == cred.secret else None
        if cred.id == OPEN_ID:
            return self.open_cred
        now = self.creds.get(cred.id)
        return now if now is not None and hmac.compare_digest(now.secret, cred.secret) else None


class CredentialStore:
    """The live credentials of one daemon: a file (optional) plus the legacy token.

    ``table`` is swapped atomically; readers never lock. ``reload()`` is called on SIGHUP.
    """

    def __init__(self, path: str = "", token: str = "") -> None:
        self.path, self.token = path, token
        self.table = CredentialTable(load_credentials(path) if path else {}, token)
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return self.table.required

    def reload(self) -> bool:
        """Re-read the file; on any error keep the current credentials and log why."""
        if not self.path:
            log.info("SIGHUP: no credentials file configured; nothing to reload")
            return False
        with self._lock:
            try:
                creds = load_credentials(self.path)
            except ConfigError as exc:
                log.error("credentials reload failed, keeping the previous %d credentials: %s",
                          len(self.table.creds), exc)
                return False
            self.table = CredentialTable(creds, self.token)
        log.info("credentials reloaded from %s: %d credentials (%s)", self.path, len(creds),
                 ", ".join(sorted(creds)))
        return True


# ---------------------------------------------------------------- the client side


class ClientCredential(NamedTuple):
    """What a client presents: a credential id and its secret (``"id:secret"``)."""

    id: str
    secret: str

    def __repr__(self) -> str:
        return f"ClientCredential(id={self.id!r}, secret='***')"

    @property
    def bearer(self) -> str:
        return f"{self.id}:{self.secret}"


def parse_client_credential(text: str) -> ClientCredential:
    """``"id:secret"`` -> ClientCredential; ConfigError (secret never shown) if malformed."""
    if not isinstance(text, str):
        raise ConfigError("credential must be a string 'id:secret'")
    cid, sep, secret = text.partition(":")
    if not sep or not _ID_RE.fullmatch(cid) or not secret:
        raise ConfigError("credential must be 'id:secret' with the id of a [[credential]] in "
                          "the servers' credentials file; check GCACHE_CREDENTIAL / credential=")
    return ClientCredential(cid, secret)


def auth_fields(auth: str | ClientCredential, nonce: bytes) -> dict:
    """The AUTH frame's header: ``{"id", "mac"}`` for a credential, ``{"mac"}`` for the
    legacy token (empty mac when there is none)."""
    if isinstance(auth, ClientCredential):
        return {"id": auth.id, "mac": auth_mac(auth.secret, nonce)}
    return {"mac": auth_mac(auth, nonce) if auth else b""}


def bearer_of(auth: str | ClientCredential) -> str:
    """What goes after ``Bearer`` on the master API."""
    return auth.bearer if isinstance(auth, ClientCredential) else auth
