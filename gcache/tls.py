"""TLS for every gcache listener and dialer: contexts, bounded handshakes, error meaning.

Design. One place builds ``ssl.SSLContext`` objects from the config table's
``tls_*`` options and runs handshakes, so the data port, the master API and the
metrics endpoint (servers), and the SDK, the servers' heartbeats and the
``gcache`` CLI (clients) follow the same rules:

* A listener speaks TLS when it has a certificate (``tls_cert_file``, with
  ``tls_key_file`` unless the key sits in the same PEM). With ``tls_ca_file``
  it asks for client certificates and verifies those it gets against that CA;
  with ``tls_require_client_cert`` a client without one is refused (mTLS).
* A dialer speaks TLS when asked (``tls``, or any ``tls_*`` file set). It
  verifies the peer's certificate against ``tls_ca_file`` (or the system
  store) *and its name against the address dialed*: certificates must carry
  the host names or IP addresses that servers advertise and masters listen on.
  Its own certificate (``tls_cert_file``) is presented when the peer asks.
* Handshakes run on the connection's own thread (never on an accept loop),
  with the socket in timeout mode: CPython bounds the whole ``do_handshake``
  by one deadline, not per ``recv``. (The HTTP listeners, aiohttp, handshake on
  their event loop under the request deadline: ``gcache.bounded_aiohttp``.)

TLS protects the bytes on the wire and, with mTLS, who may open a connection.
It replaces no token: the HMAC handshake (data port) and the bearer token
(master API) still run inside the TLS channel.

Only the stdlib is imported; the core stays the bottom layer.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from typing import Any

from gcache.errors import ConfigError
from gcache.network import linger

log = logging.getLogger("gcache.tls")

HANDSHAKE_RECORD = 0x16  # first byte of every TLS ClientHello record
_MIN_VERSION = ssl.TLSVersion.TLSv1_2
# alert reasons a dialer reads when the listener refused *its* certificate (mTLS)
_REFUSED_OUR_CERT = ("CERTIFICATE_REQUIRED", "UNKNOWN_CA", "BAD_CERTIFICATE",
                     "CERTIFICATE_UNKNOWN", "UNSUPPORTED_CERTIFICATE", "CERTIFICATE_EXPIRED",
                     "CERTIFICATE_REVOKED", "ACCESS_DENIED")
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
            "UNKNOWN_PROTOCOL", "HTTP_REQUEST")


def _load_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str, what: str) -> None:
    try:
        ctx.load_cert_chain(cert_file, key_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS {what} certificate {cert_file!r} / key "
                          f"{key_file or '(in the same file)'!r}: {exc}; point tls_cert_file "
                          "and tls_key_file at a PEM certificate chain and its key") from None


def _load_ca(ctx: ssl.SSLContext, ca_file: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the TLS CA bundle {ca_file!r}: {exc}; point "
                          "tls_ca_file at a PEM file of CA certificates") from None


def server_context(cert_file: str, key_file: str = "", ca_file: str = "",
                   require_client_cert: bool = False) -> ssl.SSLContext:
    """A listener's context. ``ca_file`` verifies client certificates (asked for, and
    required with ``require_client_cert``: mTLS). Raises ConfigError on bad files."""
    if not cert_file:
        raise ConfigError("TLS needs a certificate: set tls_cert_file (and tls_key_file)")
    if require_client_cert and not ca_file:
        raise ConfigError("tls_require_client_cert needs tls_ca_file, the CA that signs "
                          "client certificates")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _MIN_VERSION
    _load_chain(ctx, cert_file, key_file, "server")
    if ca_file:
        _load_ca(ctx, ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def client_context(ca_file: str = "", cert_file: str = "", key_file: str = ""
                   ) -> ssl.SSLContext:
    """A dialer's context: verifies the peer (``ca_file``, else the system store) and its
    name; presents ``cert_file`` when the peer asks (mTLS). Raises ConfigError."""
    if key_file and not cert_file:
        raise ConfigError("tls_key_file is set without tls_cert_file; set both")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = _MIN_VERSION
    if ca_file:
        _load_ca(ctx, ca_file)
    if cert_file:
        _load_chain(ctx, cert_file, key_file, "client")
    return ctx


def listener_context(cfg: Any) -> ssl.SSLContext | None:
    """The listener context of a server config, or None when it has no certificate."""
    if not cfg.tls_cert_file:
        if cfg.tls_key_file or cfg.tls_require_client_cert:
            raise ConfigError("tls_key_file / tls_require_client_cert are set but "
                              "tls_cert_file is not; set tls_cert_file to turn TLS on")
        return None
    return server_context(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_ca_file,
                          cfg.tls_require_client_cert)


def dialer_context(cfg: Any) -> ssl.SSLContext | None:
    """The dialer context of a client config (TLS when ``tls`` or any tls_* file is set),
    or of a server config (TLS when it has a certificate: it then talks https to the
    masters, presenting its own certificate). None means plain TCP / http."""
    if cfg.scope == "server":
        on = bool(cfg.tls_cert_file)
    else:
        on = cfg.tls or bool(cfg.tls_cert_file or cfg.tls_ca_file)
    if not on:
        return None
    return client_context(cfg.tls_ca_file, cfg.tls_cert_file, cfg.tls_key_file)


# ---------------------------------------------------------------- handshakes

def peek_first_byte(sock: socket.socket, wait_s: float) -> int | None:
    """The first byte the peer sent, without consuming it; -1 when the peer stayed
    silent for ``wait_s`` (a plain gcache client waits for the server's HELLO),
    None when it closed."""
    sock.settimeout(wait_s)
    try:
        first = sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        return -1
    return first[0] if first else None


def accept(ctx: ssl.SSLContext, sock: socket.socket, deadline: float) -> ssl.SSLSocket:
    """Server side: wrap ``sock`` and finish the handshake by ``deadline`` (monotonic).

    ``sock`` is detached by the wrap: use only the returned socket afterwards. A failure
    raises OSError / ssl.SSLError / TimeoutError after a lingering close, so the peer
    can read the alert that says why."""
    tls = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    try:
        return handshake(tls, deadline)
    except BaseException:
        linger_close(tls)
        raise


def connect(ctx: ssl.SSLContext, sock: socket.socket, host: str, deadline: float
            ) -> ssl.SSLSocket:
    """Client side: wrap ``sock`` for ``host`` (the name its certificate must carry) and
    finish the handshake by ``deadline``. Raises TimeoutError or ssl.SSLError."""
    tls = ctx.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    try:
        return handshake(tls, deadline)
    except BaseException:
        tls.close()
        raise


def handshake(tls: ssl.SSLSocket, deadline: float) -> ssl.SSLSocket:
    """Run ``do_handshake`` bounded by ``deadline``: in timeout mode CPython computes one
    deadline for the whole handshake, so a peer trickling bytes cannot stretch it.
    The caller closes ``tls`` on failure."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no time left for the TLS handshake")
    tls.settimeout(left)
    tls.do_handshake()
    return tls


def linger_close(sock: socket.socket, linger_s: float = 1.0) -> None:
    """Close after a failed server handshake without destroying the alert (a TLS 1.3
    client may already have sent its request): ``network.linger``, then close."""
    try:
        linger(sock, linger_s)
    finally:
        sock.close()


def explain(exc: ssl.SSLError, peer: str) -> tuple[bool, str]:
    """What a dialer's TLS failure means: ``(is_auth, message for the operator)``.

    ``is_auth`` is True when a certificate was refused on either side (the peer's is
    not trusted, or the peer refused ours), which the SDK reports as ``AUTH``."""
    reason = str(getattr(exc, "reason", "") or "")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True, (f"the TLS certificate of {peer} is not trusted "
                      f"({exc.verify_message}); give this client the CA that signed it "
                      "(tls_ca_file), and make the certificate name this address")
    if "ALERT" in reason and any(r in reason for r in _REFUSED_OUR_CERT):
        return True, (f"{peer} refused this client's TLS certificate ({reason}): it "
                      "requires one signed by its tls_ca_file (mTLS); set tls_cert_file "
                      "and tls_key_file")
    if any(r in reason for r in _NOT_TLS):
        return False, (f"{peer} does not speak TLS ({reason}); turn TLS on there, or off "
                       "here")
    return False, f"TLS with {peer} failed: {exc}"
