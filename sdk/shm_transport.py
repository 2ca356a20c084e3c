"""The co-located shared-memory transport: copy straight between the arena and user buffers.

Design. ``ShmTransport`` is a ``TcpTransport`` (it reuses the handshake and the plain
ops) that, after HELLO, checks whether it runs on the server's host: the server
announces its arena (path, size, st_dev/st_ino, uid, boot id) and the client must be
able to ``stat`` that path and see the same file, owned by its own uid. It then maps
the file (MAP_SHARED, read-write; one mapping per arena per process, shared by every
connection) and moves bytes with ``memmove`` (ctypes drops the GIL, so the dispatch
threads copy in parallel):

* GET: ``LEASE`` (one per distinct key in the frame; the server pins each object and
  answers its arena offset) -> copy each slice into its destination -> ``RELEASE``.
  A RELEASE that answers non-OK means the lease expired mid-copy: that item is a miss.
  Keys the server cannot lease (``BUSY``: on disk only, or too many leases) are read
  with a plain GET on the same connection.
* PUT: ``ALLOC`` (same items as a PUT: sliced puts work unchanged) -> copy into the
  slots -> ``COMMIT``; the server checksums and publishes exactly as for a TCP put.
* EXISTS / DELETE / TOUCH: the plain TCP ops.

Modes (``Client(transport=...)``): ``auto`` uses shm when co-located and TCP otherwise;
``shm`` requires co-location (a remote server is unreachable for this client); ``tcp``
never maps. Deadlines follow the Transport contract: no copy starts past the deadline
(or past half the server's lease bound), the control RPCs run under socket timeouts,
and a timeout closes the connection, which makes the server drop its leases and slots.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from typing import Any

import numpy as np

from gcache.errors import ProtocolError
from gcache.protocol import Limits, Op, encode_frame, read_frame
from gcache.status import Status, status_of
from gcache.sdk.transport import (AuthFailed, ItemResult, TcpTransport, Transport,
                                  TransportTimeout, Work, _rids)

MODES = ("auto", "tcp", "shm")

# process-wide counters (tests and benchmarks read them): items moved through the
# mapping, items that fell back to a TCP GET, connections per chosen data path
STATS = {"shm_get_items": 0, "shm_put_items": 0, "tcp_fallback_items": 0,
         "shm_connections": 0, "tcp_connections": 0}


class _FrameStatus(Exception):
    """The server refused a control frame (then closes): a status for every item."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


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
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _copy(dst_addr: int, src_addr: int, n: int) -> None:
    if n:
        ctypes.memmove(dst_addr, src_addr, n)  # a foreign call: the GIL is released


class ShmTransport(TcpTransport):
    def __init__(self, address: str, token: str, limits: Limits, connect_timeout: float,
                 mode: str = "auto") -> None:
        super().__init__(address, token, limits, connect_timeout)
        if mode not in ("auto", "shm"):
            raise ValueError(f"ShmTransport mode must be auto or shm, not {mode!r}")
        self.mode = mode
        self.map: _Mapping | None = None
        self.kind = ""  # "shm" or "tcp" once connected
        self.lease_s = 10.0
        self.data_off = 0

    # ------------------------------------------------------------------ connection
    def connect(self, deadline: float) -> None:
        super().connect(deadline)
        info = self.hello.get("shm") if isinstance(self.hello, dict) else None
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
            if self.mode == "shm":
                super().close()
                raise ConnectionError(f"{self.address} is not co-located (cannot map its "
                                      "arena); use transport='tcp' or 'auto'")
            self.kind = "tcp"
            STATS["tcp_connections"] += 1
            return
        self.kind = "shm"
        STATS["shm_connections"] += 1
        self.lease_s = max(0.05, int(info.get("lease_ms", 10000)) / 1000.0)
        self.data_off = int(info.get("data_off", 0))

    def release_mapping(self) -> None:
        if self.map is not None:
            _release(self.map)
            self.map = None

    def __del__(self) -> None:
        try:
            self.release_mapping()
        except Exception:
            pass

    # ------------------------------------------------------------------ requests
    def execute(self, work: Work) -> list[ItemResult]:
        if self.sock is None:
            self.connect(work.deadline)
        if self.kind != "shm" or work.op not in (Op.GET, Op.PUT):
            return super().execute(work)
        try:
            return self._get(work) if work.op == Op.GET else self._put(work)
        except TimeoutError:  # socket.timeout
            self.close()
            raise TransportTimeout() from None
        except _FrameStatus as exc:  # as TcpTransport: a frame-level refusal is per-item
            self.close()
            if exc.status == Status.AUTH:
                raise AuthFailed(str(exc)) from None
            return [ItemResult(exc.status) for _ in work.items]
        except ProtocolError as exc:
            self.close()
            raise ConnectionError(f"protocol error from {self.address}: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _call(self, op: int, meta: dict, deadline: float) -> Any:
        rid = next(_rids)
        self._settimeout(deadline)
        self.sock.sendall(encode_frame(op, rid, meta))
        self._settimeout(deadline)
        fh, rmeta = read_frame(self.sock, self.limits, self.prefix)
        if fh.request_id != rid or fh.opcode != op:
            raise ProtocolError(f"reply for request {fh.request_id}/op {fh.opcode}, "
                                f"expected {rid}/op {op}")
        if fh.status:
            err = rmeta.get("error", "") if isinstance(rmeta, dict) else ""
            raise _FrameStatus(status_of(fh.status), f"{self.address} refused "
                               f"{Op.NAMES.get(op, op)}: {err}")
        if fh.payload_len:
            raise ProtocolError(f"{Op.NAMES.get(op, op)} reply carries a payload")
        if not isinstance(rmeta, dict):
            raise ProtocolError("reply header is not a map")
        return rmeta

    def _check_span(self, off: int, n: int) -> None:
        if not (isinstance(off, int) and self.data_off <= off and off + n <= self.map.size):
            raise ProtocolError(f"server gave arena span [{off}, {off + n}) outside the "
                                f"arena data [{self.data_off}, {self.map.size})")

    def _copy_window(self, t0: float, deadline: float) -> None:
        """No copy may start past the deadline or past half the lease bound."""
        now = time.monotonic()
        if now >= deadline or now - t0 > self.lease_s / 2:
            raise TransportTimeout()

    def _get(self, work: Work) -> list[ItemResult]:
        items = work.items
        first: dict[tuple[bytes, int], int] = {}
        which = []
        for it in items:
            which.append(first.setdefault((it[0], it[3]), len(first)))
        uniq = list(first)
        extra = dict(work.extra or {})
        if "ph" in extra and isinstance(extra["ph"], list) and len(extra["ph"]) == len(items):
            ph = [0] * len(uniq)
            for i, j in enumerate(which):
                ph[j] = extra["ph"][i]
            extra["ph"] = ph
        t0 = time.monotonic()
        rmeta = self._call(Op.LEASE, {"ns": work.ns, "items": [[k, ev] for k, ev in uniq],
                                      **extra}, work.deadline)
        leases = rmeta.get("items")
        if not isinstance(leases, list) or len(leases) != len(uniq):
            raise ProtocolError("LEASE reply items do not match the request")
        out: list[ItemResult | None] = [None] * len(items)
        fallback = []
        held: list[int] = []
        try:  # any failure before RELEASE closes the connection: the server drops the leases
            for ls in leases:
                if not (isinstance(ls, list) and len(ls) == 5
                        and all(isinstance(x, int) for x in ls)):
                    raise ProtocolError("malformed LEASE reply item")
                if ls[0] == Status.OK:
                    held.append(ls[4])
                    self._check_span(ls[3], ls[1])
            base = self.map.base
            for i, it in enumerate(items):
                st, total, ver, off, _lid = leases[which[i]]
                if st == Status.BUSY:
                    fallback.append(i)
                    continue
                if st != Status.OK:
                    out[i] = ItemResult(status_of(st), total, ver, 0)
                    continue
                start = min(it[1], total)
                n = min(total - start, it[2])
                self._copy_window(t0, work.deadline)
                if it[4] is None:
                    data = bytearray(n)
                    if n:
                        _copy(_addr(memoryview(data)), base + off + start, n)
                    out[i] = ItemResult(Status.OK, total, ver, n, data)
                else:
                    dst = it[4]
                    if n > len(dst):
                        raise ProtocolError(f"{n} bytes for a {len(dst)}-byte destination")
                    if n:
                        _copy(_addr(dst[:n]), base + off + start, n)
                    out[i] = ItemResult(Status.OK, total, ver, n)
        except BaseException:
            self.close()
            raise
        if held:
            # released even past the deadline (bounded): a lease must not outlive its use
            rel = self._call(Op.RELEASE, {"leases": held},
                             max(work.deadline, time.monotonic() + 0.2))
            st = rel.get("st")
            if not isinstance(st, list) or len(st) != len(held):
                raise ProtocolError("RELEASE reply does not match the request")
            lost = {lid for lid, s in zip(held, st) if s != Status.OK}
            if lost:  # expired mid-copy: the bytes may be torn
                for i in range(len(items)):
                    r = leases[which[i]]
                    if r[0] == Status.OK and r[4] in lost and out[i] is not None:
                        out[i] = ItemResult(Status.TIMEOUT, r[1], r[2], 0)
        STATS["shm_get_items"] += len(items) - len(fallback)
        if fallback:
            STATS["tcp_fallback_items"] += len(fallback)
            sub_extra = dict(work.extra or {})
            if "ph" in sub_extra and isinstance(sub_extra["ph"], list) \
                    and len(sub_extra["ph"]) == len(items):
                sub_extra["ph"] = [sub_extra["ph"][i] for i in fallback]
            sub = Work(Op.GET, work.ns, [items[i] for i in fallback], work.deadline, None,
                       sub_extra or None)
            for i, r in zip(fallback, TcpTransport._execute(self, sub)):
                out[i] = r
        return out  # type: ignore[return-value]

    def _put(self, work: Work) -> list[ItemResult]:
        items = work.items
        t0 = time.monotonic()
        rmeta = self._call(Op.ALLOC, {"ns": work.ns, "items": [[it[0], it[1], it[2], it[3],
                                                                it[4]] for it in items],
                                      **(work.extra or {})}, work.deadline)
        slots = rmeta.get("items")
        if not isinstance(slots, list) or len(slots) != len(items):
            raise ProtocolError("ALLOC reply items do not match the request")
        out = [ItemResult(Status.OK) for _ in items]
        ok = []
        for i, (it, s) in enumerate(zip(items, slots)):
            if not (isinstance(s, list) and len(s) == 3 and all(isinstance(x, int) for x in s)):
                raise ProtocolError("malformed ALLOC reply item")
            if s[0] != Status.OK:
                out[i] = ItemResult(status_of(s[0]))
                continue
            self._check_span(s[1], it[3])
            ok.append(i)
        base = self.map.base
        for i in ok:
            it, (_, off, _sid) = items[i], slots[i]
            n = it[3]
            self._copy_window(t0, work.deadline)
            if n:
                src = it[5]
                if len(src) != n:
                    raise ValueError(f"put slice has {len(src)} bytes, item says {n}")
                _copy(base + off, _addr(src), n)
        if ok:
            rmeta = self._call(Op.COMMIT, {"slots": [slots[i][2] for i in ok], "abort": []},
                               work.deadline)
            st = rmeta.get("st")
            if not isinstance(st, list) or len(st) != len(ok):
                raise ProtocolError("COMMIT reply does not match the request")
            for i, s in zip(ok, st):
                out[i] = ItemResult(status_of(s))
        STATS["shm_put_items"] += len(ok)
        return out


def make_transport(mode: str, address: str, token: str, limits: Limits,
                   connect_timeout: float) -> Transport:
    """The transport for one dispatch thread: ``tcp`` -> TcpTransport, else ShmTransport
    (``auto`` falls back to TCP by itself when the server is not co-located)."""
    if mode == "tcp":
        return TcpTransport(address, token, limits, connect_timeout)
    if mode not in MODES:
        raise ValueError(f"transport must be one of {', '.join(MODES)}, not {mode!r}")
    return ShmTransport(address, token, limits, connect_timeout, mode)
