"""A client's configuration, loaded and checked once, at construction.

``client_settings`` merges the ``[client]`` config (file < ``GCACHE_*`` env < explicit
arguments, ``gcache.config``), checks what only makes sense together (transport
and TLS, the namespace against the limits), decides whether nixl is in play and, if
so, starts this process's NIXL agent (~0.4 s: here, not inside the first op's
deadline). Bad settings raise ``ConfigError`` here (setup faults raise; runtime
faults are values). It runs on the thread that constructs the Client and blocks only
while the agent starts.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

from gcache.config import TRANSPORTS, load_config
from gcache.credentials import ClientCredential, parse_client_credential
from gcache.errors import ConfigError
from gcache.protocol import Limits
from gcache.tls import dialer_context
from gcache.sdk.transports.factory import nixl_usable


@dataclass(frozen=True, slots=True)
class ClientSettings:
    config: Any  # the loaded ``client`` config (every key, with its source applied)
    namespace: bytes
    limits: Limits
    transport: str  # auto | tcp | shm | nixl
    token: str | ClientCredential  # what AUTH proves: the credential, else the token
    tls: ssl.SSLContext | None  # the dialer context of every connection (None = plain)
    nixl: bool  # nixl is in play: asked for, or auto with an RDMA device (never TLS)

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_ms / 1000.0

    @property
    def connect_timeout_s(self) -> float:
        return self.config.connect_timeout_ms / 1000.0

    @property
    def device_buffers(self) -> bool:
        """CUDA buffers are accepted: they need one-sided transfers (``nixl``)."""
        return self.transport == "nixl"


def client_settings(namespace: str | bytes, limits: Limits | None,
                    tls: bool | ssl.SSLContext | None, config_file: str | None,
                    options: dict[str, Any]) -> ClientSettings:
    """The settings of a Client (``options``: its explicit config arguments, None =
    unset). Raises ConfigError."""
    cfg = load_config("client", config_file, cli={
        **options, "tls": tls if tls is None or isinstance(tls, bool) else True})
    dialer = tls if isinstance(tls, ssl.SSLContext) else dialer_context(cfg)
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    limits = limits or Limits()
    if len(ns) > limits.max_namespace_bytes:
        raise ConfigError(f"namespace longer than {limits.max_namespace_bytes} bytes")
    token: str | ClientCredential = (parse_client_credential(cfg.credential)
                                     if cfg.credential else cfg.token)
    transport = str(getattr(cfg, "transport", "auto") or "auto")
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, "
                          f"not {transport!r}")
    if dialer is not None and transport == "nixl":
        raise ConfigError("transport='nixl' cannot run under TLS: its bytes move by "
                          "RDMA outside the TLS channel; use transport tcp, shm or auto "
                          "with TLS, or turn TLS off on a trusted fabric")
    nixl = transport == "nixl" or (transport == "auto" and nixl_usable() and dialer is None)
    if nixl:
        from gcache.nixl_lib import NixlUnavailable
        from gcache.sdk.transports.nixl import process_agent

        try:
            process_agent()
        except NixlUnavailable as exc:
            if transport == "nixl":
                raise ConfigError(f"transport='nixl': {exc}") from None
    return ClientSettings(cfg, ns, limits, transport, token, dialer, nixl)
