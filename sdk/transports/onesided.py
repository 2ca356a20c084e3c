"""One-sided data paths: the server says *where* the bytes are, the client moves them.

``OneSidedTransport`` is a ``TcpTransport`` (it reuses the handshake and the plain
ops) that serves GET and PUT through the control ops of docs/protocol.md
("Shared-memory ops"), and leaves the byte movement to a ``DataPath``:

* GET: ``LEASE`` (one per distinct key in the frame; the server pins each object and
  answers its arena offset) -> ``move_in`` copies each slice into its destination ->
  ``RELEASE``. The LEASE asks for a streamed reply: a server with disk reads to do
  sends the ready rows first, then the disk reads' rows as they land, and each
  frame's objects are copied as it arrives. A RELEASE that answers non-OK means the
  lease expired mid-copy: that item is a miss. Keys the server cannot lease (``BUSY``:
  past the connection's scratch room or lease bound) are read with a plain GET on the
  same connection, which asks for a streamed reply (docs/protocol.md), so their first
  items travel while the later disk reads go on.
* PUT: ``ALLOC`` (same items as a PUT: sliced puts work unchanged) -> ``move_out``
  copies into the slots -> ``COMMIT``; the server checksums and publishes exactly as
  for a TCP put.
* EXISTS / DELETE / TOUCH, everything when ``kind`` is tcp, and frames smaller than
  ``min_bytes`` (``one_sided_min_bytes``): the plain TCP ops. One round trip that
  carries the bytes beats two control round trips plus a copy for small frames.

A GET whose copies all ended within half the lease bound of a moment before the grant
cannot have read an expired lease, so its RELEASE is sent without waiting; the reply
is read before the connection's next request (``_drain``). Otherwise RELEASE waits,
and a non-OK answer turns that item into a miss.

Data paths (the ``DataPath`` contract below): the shared-memory mapping (shm.py
``ShmPath``: memmove out of the arena, puts through a staging file) and NIXL (nixl.py
``NixlPath``: one-sided RDMA READ/WRITE, or CMA between processes of one host). A
transport holds its candidate paths in order and, after AUTH, attaches the first one
that accepts the connection; with none, the connection runs the plain TCP ops, or
is refused (``no_path``). ``ShmTransport`` tries shm; ``NixlTransport`` tries nixl
(shm first under ``auto``).

Deadlines follow the Transport contract: no copy starts past the deadline (or past
half the server's lease bound), every send and receive of the control RPCs (RELEASE
replies included) re-arms its socket timeout from the time left before each syscall,
and a timeout closes the connection, which makes the server drop its leases and slots.
"""

from __future__ import annotations

import abc
import logging
import time
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Sequence

from gcache.errors import GCacheError, ProtocolError
from gcache.protocol import (FLAG_MORE, LEASE_ROW, Op, encode_frame, read_frame,
                             sendmsg_all, unpack_lease_rows)
from gcache.status import Status, status_of
from gcache.config import TransportKind
from gcache.sdk.transports.base import (AuthError, ItemResult, TransportTimeout, Work,
                                        frame_chain, next_request_id)
from gcache.sdk.transports.tcp import TcpTransport, check_answers, put_fields

if TYPE_CHECKING:
    import ssl

    from gcache.credentials import ClientCredential
    from gcache.protocol import Limits

log = logging.getLogger("gcache.sdk.onesided")

# process-wide counters (tests and benchmarks read them): items moved one-sided, items
# that fell back to a TCP GET, connections per chosen data path
STATS = {"shm_get_items": 0, "shm_put_items": 0, "tcp_fallback_items": 0,
         "shm_connections": 0, "tcp_connections": 0,
         "nixl_get_items": 0, "nixl_put_items": 0, "nixl_connections": 0,
         "nixl_staged_bytes": 0, "small_frame_tcp_items": 0, "shm_staged_frames": 0,
         "landed_hashes": 0}  # get slices hashed as they landed (``ItemResult.landed``)


class _FrameStatus(GCacheError):
    """The server refused a control frame (then closes): a status for every item."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


# One slice to move: (local, remote, n, want_hash) = a memoryview or DeviceView of at
# least ``n`` bytes <-> ``n`` bytes at arena offset ``remote``; ``want_hash``: a get
# slice holding a whole object whose reader checks checksums (``Work.verify``), hashed
# as it lands by paths that can (``DataPath.move_in``). Plain tuples: a frame holds
# thousands.
Copy = tuple  # (local, remote, n, want_hash)

_INT6 = (int, int, int, int, int, int)
RELEASE_GRACE_S = 0.01  # how long a no-wait RELEASE may block past the deadline
_key_of, _version_of = attrgetter("key"), attrgetter("version")


def _lease_rows(rmeta: dict, n: int) -> tuple[int, ...] | list[int]:
    """A LEASE reply's ``n`` rows, flat (row j at ``[6*j, 6*j + 6)``): the packed form
    (``"packed"``, asked for with ``"pk": 1``), or a server's list of lists; anything
    else is a ProtocolError (the caller closes the connection)."""
    if "packed" in rmeta:
        return unpack_lease_rows(rmeta["packed"], n)
    leases = rmeta.get("items")
    if not isinstance(leases, list) or len(leases) != n:
        raise ProtocolError("LEASE reply items do not match the request")
    for ls in leases:
        if type(ls) is not list or tuple(map(type, ls)) != _INT6:
            raise ProtocolError("malformed LEASE reply item")
    return [v for ls in leases for v in ls]


class DataPath(abc.ABC):
    """How one connection's bytes move once the server said where they are.

    Every method runs on the dispatch thread that owns the transport, which passes
    itself as ``conn`` (for its control RPCs: ``call``, ``plain``, ``copy_window``).

    * ``attach(conn)``: after AUTH, from ``conn.auth_reply``: '' when this path serves
      the connection (``kind``, ``lease_s`` and ``span`` then hold for it), else why
      not. No network IO (it maps a file or adds a NIXL remote).
    * ``move_in`` / ``move_out``: copy ``(local, remote, n, want_hash)`` slices out of /
      into the arena; no copy starts past ``deadline`` or half the lease bound
      (``conn.copy_window``), and a transfer in flight is abandoned at ``deadline``.
      ``move_in`` returns, per copy, the xxh3_64 of the bytes that landed where it
      hashed them (``want_hash``; the shm path does, while they are in the cache), else
      None; or None for the whole frame (a path that never hashes: nixl).
    * ``put(conn, work)``: one PUT frame; by default ALLOC -> ``move_out`` -> COMMIT
      (``conn.put_alloc``; an if-absent put goes as a plain PUT). Blocks until
      ``work.deadline`` at the latest.
    * ``close()``: the connection closed: drop per-connection state. Never blocks.
    * ``release()``: the transport is gone: drop what outlives connections (mappings,
      registrations). Never blocks.
    """

    kind: TransportKind
    lease_s = 10.0  # the server's lease bound
    span = (0, 0)  # [lo, hi) of arena offsets the server may hand out

    @abc.abstractmethod
    def attach(self, conn: OneSidedTransport) -> str: ...

    @abc.abstractmethod
    def move_in(self, conn: OneSidedTransport, copies: list[Copy], t0: float,
                deadline: float) -> list[int | None] | None: ...

    def move_out(self, conn: OneSidedTransport, copies: list[Copy], t0: float,
                 deadline: float) -> None:
        raise TypeError(f"the {self.kind.value} path does not write the arena")

    def put(self, conn: OneSidedTransport, work: Work) -> list[ItemResult]:
        return conn.put_alloc(work)

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def release(self) -> None: ...


class OneSidedTransport(TcpTransport):
    kind: TransportKind | None = None  # the attached path's, or tcp, once connected
    min_bytes = 256 << 10  # smaller frames go as plain GET/PUT (``one_sided_min_bytes``)

    def __init__(self, address: str, token: str | ClientCredential, limits: Limits,
                 connect_timeout: float, tls: ssl.SSLContext | None = None, *,
                 paths: Sequence[DataPath] = ()) -> None:
        super().__init__(address, token, limits, connect_timeout, tls)
        self.paths = tuple(paths)  # tried in order after each handshake
        self.path: DataPath | None = None  # the one serving this connection

    # ------------------------------------------------------------------ connection
    def connect(self, deadline: float) -> None:
        TcpTransport.connect(self, deadline)
        why = ""
        for path in self.paths:
            why = path.attach(self)
            if not why:
                self.path, self.kind = path, path.kind
                return
        self.path = None
        self.no_path(why)
        self.kind = TransportKind.TCP
        STATS["tcp_connections"] += 1

    def no_path(self, why: str) -> None:
        """No data path took this connection (``why``: the last one's reason): raise to
        refuse it, or return to run the plain TCP ops on it."""

    def __del__(self) -> None:
        try:
            for path in self.paths:
                path.release()
        except Exception:
            pass

    # ------------------------------------------------------------------ movers
    def move_in(self, copies: list[Copy], t0: float, deadline: float
                ) -> list[int | None] | None:
        """Copy every ``(local, remote, n, want_hash)`` from the arena into ``local``;
        the landed bytes' hashes where the path computed them (``DataPath.move_in``)."""
        return self.path.move_in(self, copies, t0, deadline)

    def move_out(self, copies: list[Copy], t0: float, deadline: float) -> None:
        """Copy every ``local`` (a read-only view) into the arena."""
        self.path.move_out(self, copies, t0, deadline)

    # ------------------------------------------------------------------ requests
    unread = 0  # RELEASE frames sent without waiting for their replies

    def close(self) -> None:
        super().close()
        self.unread = 0
        for path in self.paths:
            path.close()

    def _small(self, work: Work) -> bool:
        """A frame this small costs less as one plain round trip (the bytes ride along)
        than as two control round trips plus a copy: single-key gets and puts. A byte
        get (no destination) counts its ``max_len``: a first read the caller kept under
        ``min_bytes`` (``sdk/point.py``) is small; one of ``slice_bytes`` is not."""
        get = work.op == Op.GET  # a get's max_len and destination, a put's length and source
        total = 0
        for it in work.items:
            total += it.max_len if get else it.length
            buf = it.dest if get else it.src
            if total >= self.min_bytes or not (isinstance(buf, memoryview)
                                               or get and buf is None):
                return False  # large, or device memory
        STATS["small_frame_tcp_items"] += len(work.items)
        return True

    def _drain(self, deadline: float) -> None:
        """Read the replies of RELEASEs sent without waiting (in order, before any other)."""
        while self.unread:
            fh, _ = read_frame(self.sock, self.limits, self.prefix, deadline=deadline)
            if fh.opcode != Op.RELEASE:
                raise ProtocolError(f"expected a RELEASE reply, got op {fh.opcode}")
            self.unread -= 1

    def _execute(self, work: Work) -> list[ItemResult]:
        # TcpTransport.execute wraps this: timeouts and protocol errors close the channel
        if self.unread:
            self._drain(work.deadline)
        if self.kind in (None, TransportKind.TCP) or work.op not in (Op.GET, Op.PUT) \
                or self._small(work):
            return super()._execute(work)
        try:
            return self._get(work) if work.op == Op.GET else self.path.put(self, work)
        except _FrameStatus as exc:  # as TcpTransport: a frame-level refusal is per-item
            self.close()
            if exc.status == Status.AUTH:
                raise AuthError(str(exc)) from None
            return [ItemResult(exc.status) for _ in work.items]

    def plain(self, work: Work, stream: bool = False) -> list[ItemResult]:
        """``work`` as the plain TCP op on this connection (``stream``: a GET asks for a
        streamed reply)."""
        return TcpTransport._execute(self, work, stream)

    def call(self, op: int, meta: dict, deadline: float) -> Any:
        """One control round trip (LEASE, RELEASE, ALLOC, COMMIT, PUT_STAGED): the reply
        header; ``_FrameStatus`` when the server refused the frame (it then closes)."""
        rid = self._ask(op, meta, deadline)
        rmeta, more = self._answer(op, rid, deadline)
        if more:
            raise ProtocolError(f"{Op.NAMES.get(op, op)} reply is streamed, not asked to be")
        return rmeta

    def _ask(self, op: int, meta: dict, deadline: float) -> int:
        """Send one control request; its request id."""
        if self.unread:
            self._drain(deadline)
        rid = next_request_id()
        sendmsg_all(self.sock, [encode_frame(op, rid, meta)], deadline)
        return rid

    def _answer(self, op: int, rid: int, deadline: float) -> tuple[dict, bool]:
        """The next reply frame to request ``rid``: its header map, and whether more
        frames follow (``FLAG_MORE``: a streamed reply); ``_FrameStatus`` when the
        server refused the frame (it then closes)."""
        fh, rmeta = read_frame(self.sock, self.limits, self.prefix, deadline=deadline)
        check_answers(fh, rid, op)
        if fh.status:
            err = rmeta.get("error", "") if isinstance(rmeta, dict) else ""
            raise _FrameStatus(status_of(fh.status), f"{self.address} refused "
                               f"{Op.NAMES.get(op, op)}: {err}")
        if fh.payload_len:
            raise ProtocolError(f"{Op.NAMES.get(op, op)} reply carries a payload")
        if not isinstance(rmeta, dict):
            raise ProtocolError("reply header is not a map")
        return rmeta, bool(fh.flags & FLAG_MORE)

    def _refused(self, work: Work, rmeta: dict) -> list[ItemResult]:
        """The server refuses one-sided ops to this peer (not on its host, no NIXL): use
        the plain ops on this connection from now on, starting with this frame."""
        log.info("%s refused one-sided ops (%s); using TCP on this connection",
                 self.address, rmeta.get("error", ""))
        self.kind = TransportKind.TCP
        return self.plain(work)

    def _check_span(self, off: int, n: int) -> None:
        lo, hi = self.path.span
        if not (isinstance(off, int) and isinstance(n, int) and n >= 0 and lo <= off
                and off + n <= hi):
            raise ProtocolError(f"server gave arena span [{off}, {off + n}) outside the "
                                f"arena data [{lo}, {hi})")

    def copy_window(self, t0: float, deadline: float) -> None:
        """No copy may start past the deadline or past half the lease bound."""
        now = time.monotonic()
        if now >= deadline or now - t0 > self.path.lease_s / 2:
            raise TransportTimeout()

    def _get(self, work: Work) -> list[ItemResult]:
        items = work.items
        keys = list(map(_key_of, items))
        which: list[int] | None = None  # item -> its row in the LEASE (None: the same)
        if any(map(_version_of, items)) or len(dict.fromkeys(keys)) != len(keys):
            first: dict[tuple[bytes, int], int] = {}
            which = [first.setdefault((it.key, it.version), len(first)) for it in items]
            uniq = list(first)
        else:  # distinct keys, no expected version: one row each, in item order
            uniq = [(k, 0) for k in keys]  # tuples of atomics: the GC untracks them
        extra = dict(work.extra or {})
        if which is not None and "ph" in extra and isinstance(extra["ph"], list) \
                and len(extra["ph"]) == len(items):
            ph = [0] * len(uniq)
            for i, j in enumerate(which):
                ph[j] = extra["ph"][i]
            extra["ph"] = ph
        t0 = time.monotonic()
        # "sr": the server may stream the reply (its disk reads' rows as each lands), so
        # the copies of the first ones overlap the later reads (docs/protocol.md)
        rid = self._ask(Op.LEASE, {"ns": work.ns, "items": uniq, "pk": 1, "sr": 1, **extra},
                        work.deadline)
        rmeta, more = self._answer(Op.LEASE, rid, work.deadline)
        if rmeta.get("one_sided") is False and not more:
            return self._refused(work, rmeta)
        out: list[ItemResult | None] = [None] * len(items)
        fallback: list[int] = []
        held: list[tuple[int, int]] = []  # (item, lease id) of every copied lease
        lids: list[int] = []  # every lease the reply granted, each once
        try:  # any failure before RELEASE closes the connection: the server drops the leases
            if not more and "ix" not in rmeta:  # one frame: every row in request order
                self._take(work, which, range(len(uniq)), _lease_rows(rmeta, len(uniq)),
                           t0, out, fallback, held, lids)
            else:  # streamed: each frame names the rows it carries
                seen = bytearray(len(uniq))
                left = len(uniq)
                while True:
                    ix = rmeta.get("ix")
                    if type(ix) is not list or not ix:
                        raise ProtocolError("streamed LEASE reply frame without \"ix\" rows")
                    for r in ix:
                        if type(r) is not int or not 0 <= r < len(uniq) or seen[r]:
                            raise ProtocolError(f"streamed LEASE reply names row {r!r}: not "
                                                "one of the request's, or again")
                        seen[r] = 1
                    left -= len(ix)
                    self._take(work, which, ix, unpack_lease_rows(rmeta.get("packed"),
                                                                  len(ix)),
                               t0, out, fallback, held, lids)
                    if not more:
                        break
                    rmeta, more = self._answer(Op.LEASE, rid, work.deadline)
                if left:
                    raise ProtocolError(f"streamed LEASE reply ended with {left} of "
                                        f"{len(uniq)} rows missing")
        except BaseException:
            self.close()
            raise
        if lids and time.monotonic() - t0 < self.path.lease_s / 2:
            # Every copy ended within half the lease bound of a moment before the grant, so
            # no lease can have expired mid-copy: release without waiting for the answer
            # (read before the next request on this connection). A few dozen bytes on an
            # idle request/response stream never block unless the server stopped reading:
            # that costs at most RELEASE_GRACE_S past the deadline, then the connection.
            sendmsg_all(self.sock, [encode_frame(Op.RELEASE, next_request_id(),
                                                 {"leases": lids})],
                        max(work.deadline, time.monotonic() + RELEASE_GRACE_S))
            self.unread += 1
        elif lids:
            # Waited for, within the deadline: past it the op is a miss anyway, and the
            # timeout closes the connection, which drops the leases on the server.
            rel = self.call(Op.RELEASE, {"leases": lids}, work.deadline)
            st = rel.get("st")
            if not isinstance(st, list) or len(st) != len(lids):
                raise ProtocolError("RELEASE reply does not match the request")
            lost = {lid for lid, s in zip(lids, st) if s != Status.OK}
            if lost:  # expired mid-copy: the bytes may be torn
                for i, lid in held:
                    if lid in lost:
                        res = out[i]
                        out[i] = ItemResult(Status.TIMEOUT, res.total_len, res.version, 0)
        STATS[f"{self.kind.value}_get_items"] += len(items) - len(fallback)
        if fallback:
            self._drain(work.deadline)
            STATS["tcp_fallback_items"] += len(fallback)
            # the keys the server could not lease are (mostly) on its disk tier only: a
            # streamed reply sends each verified prefix while the later reads go on
            fallback.sort()
            for i, r in zip(fallback, self.plain(self.subset(work, fallback), stream=True)):
                out[i] = r
        return out  # type: ignore[return-value]

    def _take(self, work: Work, which: list[int] | None, ix: Sequence[int],
              rows: Sequence[int], t0: float, out: list[ItemResult | None],
              fallback: list[int], held: list[tuple[int, int]], lids: list[int]) -> None:
        """Act on LEASE rows ``rows`` (flat, row j at ``[6*j, 6*j + 6)``) for request
        rows ``ix``: each OK row's lease joins ``lids`` and is copied into its items'
        destinations (one ``move_in``), a BUSY row's items join ``fallback``, and any
        other status is those items' result."""
        items = work.items
        lo, hi = self.path.span
        OK, BUSY = Status.OK, Status.BUSY
        for b in range(0, len(rows), LEASE_ROW):
            if rows[b] == OK:
                lids.append(rows[b + 4])
                off, total = rows[b + 3], rows[b + 1]
                if not lo <= off <= off + total <= hi:
                    self._check_span(off, total)  # raises
        if which is None:
            pairs: Any = zip(ix, range(0, len(rows), LEASE_ROW))
        else:
            at = {r: LEASE_ROW * j for j, r in enumerate(ix)}
            pairs = [(i, at[r]) for i, r in enumerate(which) if r in at]
        verify = work.verify
        copies: list[Copy] = []
        hashed: list[ItemResult] = []  # results whose copy is hashed as it lands
        for i, b in pairs:
            st = rows[b]
            if st != OK:
                if st == BUSY:
                    fallback.append(i)
                else:
                    out[i] = ItemResult(status_of(st), rows[b + 1], rows[b + 2], 0)
                continue
            it = items[i]
            total, off = rows[b + 1], rows[b + 3]
            held.append((i, rows[b + 4]))
            start = it.offset
            if start > total:
                start = total
            n = total - start
            if n > it.max_len:
                n = it.max_len
            res = out[i] = ItemResult(OK, total, rows[b + 2], n, None, rows[b + 5])
            dst = it.dest
            if dst is None:  # a byte get: the bytes land in a new buffer
                res.data = bytearray(n)
                dst = memoryview(res.data)
            elif n > len(dst):
                raise ProtocolError(f"{n} bytes for a {len(dst)}-byte destination")
            want = verify and n == total  # the whole object (so start == 0)
            if want:
                hashed.append(res)
            if n or want:
                copies.append((dst, off + start, n, want))
        if copies:
            landed = self.move_in(copies, t0, work.deadline)
            if hashed and landed is not None:
                for res, h in zip(hashed, (h for h in landed if h is not None)):
                    res.landed = h
                STATS["landed_hashes"] += len(hashed)

    def put_alloc(self, work: Work) -> list[ItemResult]:
        """A PUT frame as ALLOC -> ``move_out`` -> COMMIT (the nixl path's). An if-absent
        put (``"ia"``) goes as a plain PUT: COMMIT has no frame to carry the flag."""
        if work.extra and work.extra.get("ia"):
            return self.plain(work)
        items = work.items
        t0 = time.monotonic()
        rmeta = self.call(Op.ALLOC, {"ns": work.ns, "items": put_fields(items),
                                     **(work.extra or {})}, work.deadline)
        if rmeta.get("one_sided") is False:
            return self._refused(work, rmeta)
        slots = rmeta.get("items")
        if not isinstance(slots, list) or len(slots) != len(items):
            raise ProtocolError("ALLOC reply items do not match the request")
        out = [ItemResult(Status.OK) for _ in items]
        ok, fallback = [], []
        for i, (it, s) in enumerate(zip(items, slots)):
            if not (isinstance(s, list) and len(s) == 3 and all(isinstance(x, int) for x in s)):
                raise ProtocolError("malformed ALLOC reply item")
            if s[0] == Status.BUSY:  # past this connection's reservation bound: plain PUT
                fallback.append(i)
                continue
            if s[0] != Status.OK:
                out[i] = ItemResult(status_of(s[0]))
                continue
            self._check_span(s[1], it.length)
            if len(it.src) != it.length:
                raise ValueError(f"put slice has {len(it.src)} bytes, item says {it.length}")
            ok.append(i)
        if ok:
            self.move_out([(items[i].src, slots[i][1], items[i].length, False) for i in ok
                           if items[i].length], t0, work.deadline)
            rmeta = self.call(Op.COMMIT, {"slots": [slots[i][2] for i in ok], "abort": []},
                               work.deadline)
            st = rmeta.get("st")
            if not isinstance(st, list) or len(st) != len(ok):
                raise ProtocolError("COMMIT reply does not match the request")
            for i, s in zip(ok, st):
                out[i] = ItemResult(status_of(s))
        STATS[f"{self.kind.value}_put_items"] += len(ok)
        if fallback:
            STATS["tcp_fallback_items"] += len(fallback)
            for i, r in zip(fallback, self.plain(self.subset(work, fallback))):
                out[i] = r
        return out

    @staticmethod
    def subset(work: Work, idx: list[int]) -> Work:
        """The items ``idx`` of ``work`` as a frame of their own (placement hashes and
        chain parent too)."""
        extra = dict(work.extra or {})
        if "ph" in extra and isinstance(extra["ph"], list) \
                and len(extra["ph"]) == len(work.items):
            extra["ph"] = [extra["ph"][i] for i in idx]
        items = [work.items[i] for i in idx]
        if extra.get("ch") is not None:
            known = {it.index + 1: it.key for it in work.items}  # the key before each
            known[work.items[0].index] = extra["ch"]
            ch = frame_chain(items, known.get)
            if ch is None:
                del extra["ch"]
            else:
                extra["ch"] = ch
        return Work(work.op, work.ns, items, work.deadline, None, extra or None)
