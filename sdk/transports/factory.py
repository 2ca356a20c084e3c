"""Which transport a dispatch thread gets, from ``Client(transport=...)``.

``make_transport`` is called on the dispatch thread that will own the transport (it
never blocks: nothing connects until the first ``execute``). ``nixl_usable`` is
decided once per process (the first call may load NIXL; later calls are free).
"""

from __future__ import annotations

import functools
import logging
import ssl

from gcache.config import TRANSPORTS
from gcache.credentials import ClientCredential
from gcache.protocol import Limits
from gcache.sdk.transports.base import Transport
from gcache.sdk.transports.onesided import OneSidedTransport
from gcache.sdk.transports.shm import ShmTransport
from gcache.sdk.transports.tcp import TcpTransport


def make_transport(mode: str, address: str, token: str | ClientCredential, limits: Limits,
                   connect_timeout: float, nixl_bounce_bytes: int = 8 << 20,
                   one_sided_min_bytes: int = 256 << 10,
                   tls: ssl.SSLContext | None = None, background: bool = False,
                   stream_gets: bool = False) -> Transport:
    """The transport for one dispatch thread.

    ``tcp`` -> TcpTransport; ``shm`` -> ShmTransport; ``nixl`` -> NixlTransport;
    ``auto`` -> shm when co-located, else nixl when this host has an RDMA device and
    the server offers NIXL, else TCP (decided per connection). With ``tls`` every
    connection is TLS; nixl is refused (its bytes bypass the TLS channel), shm works
    unchanged (its control RPCs ride the TLS socket, its bytes stay on this host).
    ``background``: the transport asks the server to serve its connection at background
    CPU priority (``gcache.sched``); the dispatch thread that owns it lowers itself
    (``Lane``), never a caller's thread that borrows one (the one-hop path).
    ``stream_gets``: its GETs ask for streamed replies (``"sr": 1``)."""
    t = _transport(mode, address, token, limits, connect_timeout, nixl_bounce_bytes,
                   one_sided_min_bytes, tls)
    if background:
        t.background = True
    if stream_gets:
        t.stream_gets = True
    return t


def _transport(mode: str, address: str, token: str | ClientCredential, limits: Limits,
               connect_timeout: float, nixl_bounce_bytes: int, one_sided_min_bytes: int,
               tls: ssl.SSLContext | None) -> Transport:
    if mode == "tcp":
        return TcpTransport(address, token, limits, connect_timeout, tls)
    if mode not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {mode!r}")
    if tls is not None and mode == "nixl":
        raise ValueError("transport nixl cannot run under TLS: its bytes move by RDMA "
                         "outside the TLS channel; use tcp, shm or auto")
    if tls is not None:
        t: OneSidedTransport = ShmTransport(address, token, limits, connect_timeout, mode, tls)
    elif mode == "nixl" or (mode == "auto" and nixl_usable()):
        from gcache.sdk.transports.nixl import NixlTransport

        t = NixlTransport(address, token, limits, connect_timeout, mode, nixl_bounce_bytes)
    else:
        t = ShmTransport(address, token, limits, connect_timeout, mode)
    t.min_bytes = one_sided_min_bytes
    return t


@functools.cache
def nixl_usable() -> bool:
    """Whether ``auto`` considers nixl here (decided once per process, logged once)."""
    from gcache.nixl_lib import available, rdma_devices

    why = "no RDMA device on this host" if not rdma_devices() else available()
    if why:
        logging.getLogger("gcache.sdk").info(
            "transport auto: nixl not used (%s); shm when co-located, else TCP", why)
    return not why
