"""The co-located shared-memory transport: reads copy straight out of the arena, puts
go through a staging file of the client's own.

Design. ``ShmPath`` is the shm ``DataPath`` of a one-sided transport
(``ShmTransport``; ``NixlTransport`` under ``auto`` tries it first). After AUTH it
checks whether it runs on the server's host: the server's AUTH
reply announces its arena (path, size, st_dev/st_ino, uid, gid, boot id) and the client
must be able to open that path read-only and see the same file, owned by the
announced uid (its own uid, or, when the server runs ``--shm-group``, the server's:
the arena is then mode 0640 and members of that group may read it). It maps the
file **read-only** (MAP_SHARED, PROT_READ; one mapping per arena per process, shared
by every connection) and reads a whole frame with one ``gcache.native.copy_spans``
call (the GIL released for all of it, so the dispatch threads copy in parallel; a
slice that holds a whole object is hashed as it lands when the reader checks
checksums, so the check reads the cache, not DRAM): LEASE -> copy -> RELEASE.

Clients never write the arena. A put writes the values, back to back, into the
connection's staging file (``gcache.staging``: created in the arena's directory,
mode 0600, or 0640 with the arena's group under another uid; mapped read-write by
this client only, read-only by the server) and sends one ``PUT_STAGED`` naming it and
its key; the server copies the bytes into fresh chunks, verifies each value's checksum
and publishes (one round trip, where ALLOC + COMMIT took two). The file's name is
unlinked once the server has opened it (after the first reply), so a crashed client
leaves nothing behind. A frame larger than the staging file goes as several PUT_STAGED; a value
larger than it, or a connection whose staging the server refused, goes as a plain
PUT.

The control ops (LEASE/RELEASE, ALLOC/COMMIT for NIXL) and the deadline rules live in
``OneSidedTransport`` (onesided.py); this module maps, stages and copies.

Modes (``Client(transport=...)``): ``auto`` uses shm when co-located and TCP otherwise;
``shm`` requires co-location (a remote server is unreachable for this client); ``tcp``
never maps.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import ssl
import threading

import numpy as np

from gcache import staging
from gcache.network import boot_id
from gcache.config import TransportKind
from gcache.credentials import ClientCredential
from gcache.protocol import Limits, Op
from gcache.status import status_of
from gcache.errors import ProtocolError
from gcache.native import copy_spans
from gcache.sdk.transports.base import DIGEST_LATER, ItemResult, TransportTimeout, Work
from gcache.sdk.transports.onesided import STATS, Copy, DataPath, OneSidedTransport
from gcache.sdk.transports.tcp import put_fields

log = logging.getLogger("gcache.sdk.shm")

STAGE_BYTES = 64 << 20  # data capacity of one connection's staging file (tmpfs: sparse)


class _Mapping:
    """One arena file mapped read-only into this process, shared by all its connections."""

    def __init__(self, fd: int, size: int, key: tuple, gid: int) -> None:
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        self.size, self.key, self.gid, self.refs = size, key, gid, 0
        anchor = np.frombuffer(self.mm, dtype=np.uint8)  # a read-only buffer's address
        self.base = int(anchor.ctypes.data)
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
    if info.get("boot_id") and info.get("boot_id") != boot_id():
        return None
    key = (dev, ino, size)
    with _maps_lock:
        m = _maps.get(key)
        if m is None:
            try:
                # read-only: this process never writes the arena (puts are staged)
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # not on this host, or neither its uid nor the arena's group
                return None
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino, st.st_size) != key or st.st_uid != uid:
                    return None
                m = _Mapping(fd, size, key, st.st_gid)
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


class _Staging:
    """This connection's staging file: created in the arena's directory, mapped
    read-write by this process only, read by the server (``gcache.staging``)."""

    def __init__(self, arena_path: str, arena_uid: int, arena_gid: int, capacity: int) -> None:
        self.name = staging.new_name(arena_path)
        self.path = os.path.join(os.path.dirname(arena_path), self.name)
        self.key = os.urandom(staging.KEY_BYTES)
        self.capacity = capacity
        self.named = True  # the file still has its name (unlinked after the first reply)
        flags = (os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | getattr(os, "O_CLOEXEC", 0))
        fd = os.open(self.path, flags, 0o600)
        try:
            if os.getuid() != arena_uid:  # the server reads it through the arena's group
                os.fchown(fd, -1, arena_gid)
                os.fchmod(fd, 0o640)
            os.ftruncate(fd, staging.HEADER_BYTES + capacity)
            os.pwrite(fd, staging.header(self.key), 0)
            self.mm = mmap.mmap(fd, staging.HEADER_BYTES + capacity, mmap.MAP_SHARED,
                                mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(anchor) + staging.HEADER_BYTES
        self._anchor = anchor

    def unlink(self) -> None:
        if self.named:
            self.named = False
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def close(self) -> None:
        self.unlink()
        self._anchor = None
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass


class ShmPath(DataPath):
    """The shm data path of one transport: the arena mapping (shared by every connection
    of this process) and this connection's staging file."""

    kind = TransportKind.SHM

    def __init__(self) -> None:
        self.map: _Mapping | None = None
        self.stage: _Staging | None = None  # this connection's staging file (lazily)
        self.stage_refused = ""  # why puts on this connection go as plain PUTs

    # ------------------------------------------------------------------ connection
    def attach(self, conn: OneSidedTransport) -> str:
        """Map the server's arena if it is on this host."""
        auth = conn.auth_reply
        info = auth.get("shm") if isinstance(auth, dict) else None
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
            return "not co-located (cannot map its arena)"
        STATS["shm_connections"] += 1
        self.lease_s = max(0.05, int(info.get("lease_ms", 10000)) / 1000.0)
        self.span = (int(info.get("data_off", 0)), m.size)
        return ""

    def close(self) -> None:  # the server forgets its staging fd with the connection
        if self.stage is not None:
            self.stage.close()
            self.stage = None
        self.stage_refused = ""

    def release(self) -> None:
        if self.map is not None:
            _release(self.map)
            self.map = None
        if self.stage is not None:
            self.stage.close()

    # ------------------------------------------------------------------ movers
    def move_in(self, conn: OneSidedTransport, copies: list[Copy], t0: float,
                deadline: float) -> list[int | None]:
        """One ``copy_spans`` call (the GIL released for the whole frame; the clock read
        every few MiB, not per slice), hashing each ``want_hash`` copy as it lands."""
        m = self.map
        try:
            return copy_spans(copies, m.base, m.size, True,
                              min(deadline, t0 + self.lease_s / 2))
        except TimeoutError:  # past the deadline or half the lease bound
            raise TransportTimeout() from None

    def move_out(self, conn: OneSidedTransport, copies: list[Copy], t0: float,
                 deadline: float) -> None:
        raise TypeError("the arena is mapped read-only: shm puts go through the staging file")

    # ------------------------------------------------------------------ staged puts
    def put(self, conn: OneSidedTransport, work: Work) -> list[ItemResult]:
        items = work.items
        out: list[ItemResult | None] = [None] * len(items)
        tcp: list[int] = []
        stage = None if self.stage_refused else self._staging(conn)
        cap = stage.capacity if stage is not None else 0
        runs: list[list[int]] = []
        used = cap
        for i, it in enumerate(items):
            n = it.length
            if len(it.src) != n:
                raise ValueError(f"put slice has {len(it.src)} bytes, item says {n}")
            if stage is None or n > cap or it.checksum is None:
                tcp.append(i)
            elif used + n > cap:
                runs.append([i])
                used = n
            else:
                runs[-1].append(i)
                used += n
        for run in runs:
            if self.stage_refused:
                tcp.extend(run)
                continue
            for i, r in zip(run, self._put_run(conn, work, run)):
                out[i] = r
        if tcp:
            STATS["tcp_fallback_items"] += len(tcp)
            for i, r in zip(tcp, conn.plain(conn.subset(work, tcp))):
                out[i] = r
        return out  # type: ignore[return-value]

    def _staging(self, conn: OneSidedTransport) -> _Staging | None:
        if self.stage is None:
            shm = conn.auth_reply.get("shm", {})
            if not shm.get("staged"):
                # an older server: it would close the connection on an unknown opcode
                self.stage_refused = "the server does not take staged puts (PUT_STAGED)"
                log.info("%s: puts go over TCP on this connection (%s)", conn.address,
                         self.stage_refused)
                return None
            try:
                self.stage = _Staging(str(shm["path"]), int(shm["uid"]), self.map.gid,
                                      min(STAGE_BYTES, conn.limits.max_frame_bytes))
            except (OSError, KeyError, TypeError, ValueError) as exc:
                self.stage_refused = f"cannot create a staging file: {exc}"
                log.info("%s: puts go over TCP on this connection (%s)", conn.address,
                         self.stage_refused)
                return None
        return self.stage

    def _put_run(self, conn: OneSidedTransport, work: Work, run: list[int]
                 ) -> list[ItemResult]:
        """One PUT_STAGED: copy the run's values into the staging file, ask the server."""
        stage, items = self.stage, work.items
        spans, pos = [], 0
        for i in run:
            it = items[i]
            n = it.length
            # an unsliced value's checksum: hashed in the same pass as its copy, from the
            # caller's buffer while it is in the cache (no second pass over DRAM)
            spans.append((it.src, pos, n, it.checksum == DIGEST_LATER))
            pos += n
        try:  # one call, the GIL released; the clock read every few MiB
            sums = copy_spans(spans, stage.base, stage.capacity, False, work.deadline)
        except TimeoutError:
            raise TransportTimeout() from None
        sub = conn.subset(work, run)
        meta = {"ns": work.ns, "stage": stage.name, "skey": stage.key,
                "items": put_fields(sub.items, sums),
                **(sub.extra or {})}
        try:
            rmeta = conn.call(Op.PUT_STAGED, meta, work.deadline)
        finally:
            stage.unlink()  # the server holds it open (or refused it) by now
        st = rmeta.get("st")
        if not isinstance(st, list) or len(st) != len(run) \
                or not all(isinstance(x, int) for x in st):
            raise ProtocolError("PUT_STAGED reply does not match the request")
        if rmeta.get("staged") is False:
            self.stage_refused = str(rmeta.get("error", "refused"))
            log.warning("%s refused this connection's staging file (%s); puts go over TCP "
                        "on it", conn.address, self.stage_refused)
            return conn.plain(sub)
        STATS["shm_put_items"] += len(run)
        STATS["shm_staged_frames"] += 1
        return [ItemResult(status_of(x)) for x in st]


class ShmTransport(OneSidedTransport):
    """One connection that maps the co-located server's arena (``shm``), else runs the
    plain TCP ops (``auto``) or refuses the server (``shm``)."""

    def __init__(self, address: str, token: str | ClientCredential, limits: Limits,
                 connect_timeout: float, mode: str = "auto",
                 tls: ssl.SSLContext | None = None) -> None:
        if mode not in ("auto", "shm", "nixl"):
            raise ValueError(f"ShmTransport mode must be auto, shm or nixl, not {mode!r}")
        self.mode = mode
        self.shm = ShmPath()
        super().__init__(address, token, limits, connect_timeout, tls, paths=(self.shm,))

    def no_path(self, why: str) -> None:
        if self.mode == "shm":
            self.close()
            raise ConnectionError(f"{self.address} is not co-located (cannot map its "
                                  "arena); use transport='tcp' or 'auto'")
