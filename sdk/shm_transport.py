"""The co-located shared-memory transport: copy straight between the arena and user buffers.

Design. ``ShmTransport`` is a ``TcpTransport`` (it reuses the handshake and the plain
ops) that, after AUTH, checks whether it runs on the server's host: the server's AUTH
reply announces its arena (path, size, st_dev/st_ino, uid, boot id) and the client must be
able to ``stat`` that path and see the same file, owned by its own uid. It then maps
the file (MAP_SHARED, read-write; one mapping per arena per process, shared by every
connection) and moves bytes with ``memmove`` (ctypes drops the GIL, so the dispatch
threads copy in parallel):

The control ops (LEASE/RELEASE, ALLOC/COMMIT) and the deadline rules live in
``OneSidedTransport`` (gcache.sdk.onesided); this module only maps and copies.

Modes (``Client(transport=...)``): ``auto`` uses shm when co-located and TCP otherwise;
``shm`` requires co-location (a remote server is unreachable for this client); ``tcp``
never maps.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import ssl
import threading

import numpy as np

from gcache.network import boot_id
from gcache.credentials import ClientCredential
from gcache.protocol import Limits
from gcache.sdk.onesided import STATS, Copy, OneSidedTransport, _FrameStatus  # noqa: F401
from gcache.sdk.transport import TcpTransport, Transport

MODES = ("auto", "tcp", "shm", "nixl")
CHECK_BYTES = 2 << 20  # deadline / lease-bound check at least this often while copying


class _Mapping:
    """One arena file mapped into this process, shared by all its connections."""

    def __init__(self, fd: int, size: int, key: tuple) -> None:
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size, self.key, self.refs = size, key, 0
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(anchor)
        self._anchor = anchor

    def close(self) -> None:
        self._anchor = None
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # an export still alive: the mapping goes with the process


_maps: dict[tuple, _Mapping] = {}
_maps_lock = threading.Lock()


def _acquire(info: dict) -> _Mapping | None:
    """Map the announced arena if this process can see the very same file; else None."""
    try:
        path, size = str(info["path"]), int(info["size"])
        dev, ino, uid = int(info["dev"]), int(info["ino"]), int(info["uid"])
    except (KeyError, TypeError, ValueError):
        return None
    if uid != os.getuid():
        return None
    if info.get("boot_id") and info.get("boot_id") != boot_id():
        return None
    key = (dev, ino, size)
    with _maps_lock:
        m = _maps.get(key)
        if m is None:
            try:
                fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                return None
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino, st.st_size) != key or st.st_uid != uid:
                    return None
                m = _Mapping(fd, size, key)
            except (OSError, ValueError):
                return None
            finally:
                os.close(fd)
            _maps[key] = m
        m.refs += 1
        return m


def _release(m: _Mapping) -> None:
    with _maps_lock:
        m.refs -= 1
        if m.refs <= 0 and _maps.get(m.key) is m:
            del _maps[m.key]
            m.close()


def _addr(view: memoryview) -> int:
    try:  # writable buffers: ~0.2 us, the export ends with the temporary
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only (bytes) or empty
        return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _copy(dst_addr: int, src_addr: int, n: int) -> None:
    if n:
        ctypes.memmove(dst_addr, src_addr, n)  # a foreign call: the GIL is released


class ShmTransport(OneSidedTransport):
    def __init__(self, address: str, token: str | ClientCredential, limits: Limits,
                 connect_timeout: float, mode: str = "auto",
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__(address, token, limits, connect_timeout, tls)
        if mode not in ("auto", "shm", "nixl"):
            raise ValueError(f"ShmTransport mode must be auto, shm or nixl, not {mode!r}")
        self.mode = mode
        self.map: _Mapping | None = None

    # ------------------------------------------------------------------ connection
    def connect(self, deadline: float) -> None:
        TcpTransport.connect(self, deadline)
        if self.try_map():
            return
        if self.mode == "shm":
            super().close()
            raise ConnectionError(f"{self.address} is not co-located (cannot map its "
                                  "arena); use transport='tcp' or 'auto'")
        self.kind = "tcp"
        STATS["tcp_connections"] += 1

    def try_map(self) -> bool:
        """After the handshake: map the server's arena if it is on this host (kind shm)."""
        info = self.auth_reply.get("shm") if isinstance(self.auth_reply, dict) else None
        m = self.map
        if m is not None and isinstance(info, dict):
            try:
                same = (int(info["dev"]), int(info["ino"]), int(info["size"])) == m.key
            except (KeyError, TypeError, ValueError):
                same = False
            if not same:  # the server recreated its arena: map the new file
                _release(m)
                self.map = m = None
        if m is None and isinstance(info, dict):
            self.map = m = _acquire(info)
        if m is None:
            return False
        self.kind = "shm"
        STATS["shm_connections"] += 1
        self.lease_s = max(0.05, int(info.get("lease_ms", 10000)) / 1000.0)
        self.span = (int(info.get("data_off", 0)), m.size)
        return True

    def release_mapping(self) -> None:
        if self.map is not None:
            _release(self.map)
            self.map = None

    def __del__(self) -> None:
        try:
            self.release_mapping()
        except Exception:
            pass

    # ------------------------------------------------------------------ movers
    def move_in(self, copies: list[Copy], t0: float, deadline: float) -> None:
        base, since = self.map.base, CHECK_BYTES
        for local, remote, n in copies:
            if since >= CHECK_BYTES:  # the clock is read every few MiB, not per slice
                self.copy_window(t0, deadline)
                since = 0
            _copy(_addr(local), base + remote, n)
            since += n

    def move_out(self, copies: list[Copy], t0: float, deadline: float) -> None:
        base, since = self.map.base, CHECK_BYTES
        for local, remote, n in copies:
            if since >= CHECK_BYTES:
                self.copy_window(t0, deadline)
                since = 0
            _copy(base + remote, _addr(local), n)
            since += n


def make_transport(mode: str, address: str, token: str | ClientCredential, limits: Limits,
                   connect_timeout: float, nixl_bounce_bytes: int = 8 << 20,
                   one_sided_min_bytes: int = 256 << 10,
                   tls: ssl.SSLContext | None = None) -> Transport:
    """The transport for one dispatch thread.

    ``tcp`` -> TcpTransport; ``shm`` -> ShmTransport; ``nixl`` -> NixlTransport;
    ``auto`` -> shm when co-located, else nixl when this host has an RDMA device and
    the server offers NIXL, else TCP (decided per connection). With ``tls`` every
    connection is TLS; nixl is refused (its bytes bypass the TLS channel), shm works
    unchanged (its control RPCs ride the TLS socket, its bytes stay on this host)."""
    if mode == "tcp":
        return TcpTransport(address, token, limits, connect_timeout, tls)
    if mode not in MODES:
        raise ValueError(f"transport must be one of {', '.join(MODES)}, not {mode!r}")
    if tls is not None and mode == "nixl":
        raise ValueError("transport nixl cannot run under TLS: its bytes move by RDMA "
                         "outside the TLS channel; use tcp, shm or auto")
    if tls is not None:
        t: OneSidedTransport = ShmTransport(address, token, limits, connect_timeout, mode, tls)
    elif mode == "nixl" or (mode == "auto" and nixl_usable()):
        from gcache.sdk.nixl_transport import NixlTransport

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
