"""Server side of the co-located shared-memory transport (LEASE/RELEASE/ALLOC/COMMIT).

Design. A client on the same host (same uid) maps the arena file itself and copies
bytes between the mapping and its own buffers; the server only hands out and takes
back *where* the bytes are, through four small control ops on the ordinary framed
connection (docs/protocol.md, "Shared-memory ops"):

* ``LEASE`` pins memory-resident objects (``MemoryTier.pin_read_many``: one lock
  hold per frame, no views cut) and answers each
  object's absolute arena offset. Eviction, replace and delete of a pinned object only
  mark it doomed, so its bytes stay put until ``RELEASE``. An object only the disk
  tier holds is read whole into an arena scratch chunk charged to the connection's
  ``Holder`` (``_lease_disk``: ``TieredStore.read_disk_into``), verified, and leased
  the same way; ``RELEASE``, expiry or close frees the chunk. With no room for it it
  answers ``BUSY`` and the client reads it with a plain GET. ``MISS`` means absent
  from every tier. A LEASE with ``"sr": 1`` and disk reads to do is answered as a
  stream: the rows ready at once, then each verified prefix of the reads as it lands.
* ``ALLOC`` reserves an uncommitted chunk (``Tier.begin_put``, the same reservation a
  TCP put uses, sliced puts included) and answers the slice's arena offset; the object
  is not visible until ``COMMIT`` runs ``finish_put`` (checksum, commit flag, publish).

Leases and slots belong to the connection: the ids are per-connection counters looked
up only in that connection's tables, so a forged or stale id answers ``BAD_REQUEST``
and can never touch another connection's state. On close every lease is released and
every slot aborted. A reaper also expires leases older than ``lease_ms``
(``GCACHE_SHM_LEASE_MS``, default 10 s, read when the server builds its ``ShmRegistry``),
so a stuck reader cannot pin memory forever; a RELEASE of an expired lease answers
``TIMEOUT`` and the client drops what it copied (it may be torn).

State. Nothing here is module-level: one server's connection states, its ``lease_ms``
and its reaper thread belong to a ``ShmRegistry`` (built and started by
``server/app.py``'s ``Server``, handed to the ``Service``), so two servers in one
process share none of it. Threads: ``handle``, ``ShmRegistry.state`` / ``holder`` /
``release_all`` run on the connection's own thread and only take that connection's lock
(and, once per connection, the registry's); ``ShmRegistry.stats`` runs on any thread
(STATS, scrapes, heartbeats) and does not block; ``start`` / ``stop`` run on the owner's
thread, and ``stop`` joins the reaper within ``lease_ms / 4`` (at most 1 s).

Reservations. Only a one-sided peer may LEASE or ALLOC (``one_sided_refusal``: same
host, or the server runs NIXL). Every chunk an ALLOC reserves is charged to the
connection's ``Holder`` (memory_tier): past ``max_held_bytes`` for the connection
(default a quarter of the arena) or ``max_reserved_bytes`` over all (half of it) the
item answers ``BUSY`` (the SDK then sends that value with a plain PUT), so no client
can reserve the arena away. Put slots expire after ``lease_ms`` like leases (COMMIT
then answers ``TIMEOUT``). Slots used to live as long as the connection because a
stuck writer may still be copying into its chunk, and reusing that chunk at once
would let those late bytes land in another object. Writer checksums (verified on
COMMIT, and by readers) would catch such a scribble before it is ever served, but it
would still destroy an innocent object; so an expired slot's chunk is *quarantined*
instead: never published, never reused, still charged to its connection (whose bound
therefore still holds), and freed when that connection closes.

Staged puts (``PUT_STAGED``). Co-located clients never write the arena: they map it
read-only and put through a staging file of their own (``gcache.staging``). The frame
is a PUT whose payload is not on the socket but at the start of that file's data:
the server reserves each chunk exactly as for a PUT, copies the bytes in from the
file it opened itself (``O_RDONLY|O_NOFOLLOW``) with ``native.read_staged``: a memcpy
from a read-only mapping of the file (a ``preadv`` from tmpfs costs 2.7-2.9x as much,
looking up each page), under a fault guard, so a client truncating its file causes a
short read, never a SIGBUS that ends the server (the twin, ``GCACHE_NATIVE=0``, and a
file the server could not map, preadv instead), then ``finish_put`` verifies the
writer's checksum over the bytes *in the arena* (a client rewriting its file mid-copy
gets ``CORRUPT``, never a published value that was not checksummed) and publishes.
Each item is finished right after its copy, while its bytes are in the cache (a frame
that fails midway keeps the items finished before it: each was verified). One round
trip per frame, where ALLOC + COMMIT took two. The file is validated once per
connection (``Stage.open``): a bare name of this arena's staging pattern in the
arena's directory, a regular file with one link, no permission bits for others, size
within [header, header + max_frame_bytes], and the 16-byte key the frame names at its
start. A refused staging file answers every item ``BAD_REQUEST`` with ``"staged":
false`` and the reason (a normal reply: the connection and the server go on; the SDK
puts over TCP).

ALLOC is for writers the server trusts with its arena: NIXL peers (one-sided RDMA
writes need a reserved chunk to land in; the server runs ``--nixl``), or same-host
writers when the server runs ``--shm-trusted-writers`` (old SDKs that map the arena
read-write). Otherwise ALLOC is refused like a non-one-sided peer's (``"one_sided":
false``).

Scope: LEASE needs ``read`` on the frame's namespace, ALLOC and PUT_STAGED ``write``
(as GET and PUT), checked before the staging file is opened; COMMIT re-checks
``write`` on each slot's namespace, so a reload that narrows the credential between
ALLOC and COMMIT publishes nothing. Refused items answer ``AUTH``. Together with the
read-only mapping this confines what a co-located client can *change* to its
credential's namespaces (docs/architecture.md, "Tenancy"); it can still *read* the
whole arena file if it may open it.

Ownership (``NOT_OWNER``) is checked exactly as for GET/PUT when the client sends its
view epoch and placement hashes (``ep``/``ph``), and skipped otherwise.
"""

from __future__ import annotations

import functools
import hmac
import itertools
import logging
import mmap
import socket
import os
import stat
import threading
import time
import weakref
from typing import Any, Callable

from gcache import native, staging
from gcache.credentials import Right
from gcache.errors import ProtocolError
from gcache.logs import RateLimitedLog
from gcache.network import boot_id
from gcache.protocol import (Op, chain_parents, check_flag, check_items, check_key,
                             check_namespace,
                             check_placement, pack_lease_rows, parse_put_items,
                             self_contained)
from gcache.server.tier import Pinned, PutRequest, abort_slots
from gcache.status import Status

log = logging.getLogger("gcache.server.shm")
#: what a client can make happen at will (cutting its staging file) logs at most once
#: per 10 s; ``gcache_protocol_errors_total{reason="staging_shrunk"}`` counts every value
stage_log = RateLimitedLog(log, 10.0)

LEASE_MS_ENV = "GCACHE_SHM_LEASE_MS"
DEFAULT_LEASE_MS = 10000
_OK = int(Status.OK)
#: a streamed LEASE reply sends at least this many bytes of disk reads a frame while
#: reads are left to claim: each frame costs a header, a send and a client wake-up
_LEASE_STREAM_MIN_BYTES = 1 << 20
#: PUT_STAGED reads this many bytes of a frame per read_staged call (GIL released once)
STAGED_GROUP_BYTES = 1 << 20


def lease_ms_from_env() -> int:
    """``GCACHE_SHM_LEASE_MS`` as read now (default 10000; empty means the default)."""
    return int(os.environ.get(LEASE_MS_ENV, "") or DEFAULT_LEASE_MS)


def memory_tier(tier: Any) -> Any:
    """The MemoryTier behind ``tier`` (itself, or a TieredStore's ``memory``), or None."""
    from gcache.server.memory_tier import MemoryTier

    if isinstance(tier, MemoryTier):
        return tier
    mem = getattr(tier, "memory", None)
    return mem if isinstance(mem, MemoryTier) else None


def identity_fields(tier: Any, lease_ms: int) -> dict:
    """``{"shm": identity}`` for the AUTH reply: what a co-located client needs to find and
    trust the arena (it stats ``path`` and must see the same dev/ino and its own uid).
    Never in HELLO: the arena path, its owner uid and the boot id are for authenticated
    peers only."""
    mem = memory_tier(tier)
    if mem is None:
        return {}
    arena = mem.arena
    try:
        st = os.fstat(arena.fd)
    except OSError:
        return {}
    return {"shm": {"path": arena.path, "size": arena.size, "dev": st.st_dev,
                    "ino": st.st_ino, "uid": st.st_uid, "gid": st.st_gid,
                    "data_off": arena.data_off, "lease_ms": lease_ms, "boot_id": boot_id(),
                    "staged": True}}  # takes PUT_STAGED (older servers do not say so)


class StageRefused(Exception):
    """A staging file that may not be read (the message says why and what to do)."""


class Stage:
    """A client's staging file, opened read-only by the server and validated once, and
    mapped read-only when the native copy (which guards against the client shrinking
    the file under it) runs."""

    MAX_PER_CONNECTION = 4  # a well-behaved client uses one

    def __init__(self, fd: int, key: bytes, size: int) -> None:
        self.fd, self.key, self.size = fd, key, size
        self.map: mmap.mmap | None = None
        if native.ACTIVE == "native":  # the twin preads: a mapping would go unused
            try:
                self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            except (OSError, ValueError) as exc:  # then every span is read with preadv
                log.info("cannot map a staging file (%s): its puts are read with preadv",
                         exc)

    @classmethod
    def open(cls, arena_path: str, name: Any, key: Any, max_frame_bytes: int) -> "Stage":
        if not isinstance(name, str) or not staging.is_name_for(name, arena_path):
            raise StageRefused(f"staging file name {name!r} is not a bare file name of the "
                               f"form {staging.name_prefix(arena_path)}<32 hex> in the arena's "
                               "directory")
        if not isinstance(key, bytes) or len(key) != staging.KEY_BYTES:
            raise StageRefused(f"staging key must be {staging.KEY_BYTES} bytes")
        path = os.path.join(os.path.dirname(arena_path), name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise StageRefused(f"cannot open staging file {name}: {exc.strerror} (a symlink "
                               "is refused; the server must be able to read the file)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StageRefused(f"staging file {name} is not a regular file")
            if st.st_nlink != 1:
                raise StageRefused(f"staging file {name} has {st.st_nlink} links, not 1")
            if st.st_mode & 0o007:
                raise StageRefused(f"staging file {name} grants access to others (mode "
                                   f"{stat.S_IMODE(st.st_mode):o}): use 0600, or 0640 with "
                                   "the arena's group")
            hi = staging.HEADER_BYTES + max_frame_bytes
            if not staging.HEADER_BYTES <= st.st_size <= hi:
                raise StageRefused(f"staging file {name} has {st.st_size} bytes, not within "
                                   f"[{staging.HEADER_BYTES}, {hi}]")
            head = os.pread(fd, len(staging.MAGIC) + staging.KEY_BYTES, 0)
            if not hmac.compare_digest(head, staging.header(key)):
                raise StageRefused(f"staging file {name} does not hold the frame's key")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, key, st.st_size)

    def close(self) -> None:  # on the connection's thread, so no copy is using the map
        if self.map is not None:
            self.map.close()
            self.map = None
        try:
            os.close(self.fd)
        except OSError:
            pass


class ShmState:
    """One connection's leases, slots and reservations (``holder``); each lease and slot
    expires ``lease_ms`` after it was handed out."""

    def __init__(self, max_held: int, tier: Any = None,
                 lease_ms: int = DEFAULT_LEASE_MS) -> None:
        from gcache.server.memory_tier import Holder

        self.tier = tier
        self.lease_ms = lease_ms
        self.lease_s = lease_ms / 1000.0
        self.holder = Holder()
        self.lock = threading.Lock()
        self.leases: dict[int, tuple[Any, Any, float]] = {}  # id -> (tier, Pinned, expiry)
        self.slots: dict[int, tuple[Any, Any, float]] = {}  # id -> (tier, PutSlot, expiry)
        self.expired: set[int] = set()  # lease ids reaped before RELEASE (bounded)
        self.ids = itertools.count(1)
        self.max_held = max_held
        self.closed = False
        self.refusal: str | None = None  # why LEASE/ALLOC are refused ('' = allowed)
        self.alloc_refusal: str | None = None  # why ALLOC is refused ('' = allowed)
        self.stages: dict[str, Stage] = {}  # staging files this connection named

    def stage(self, arena_path: str, name: Any, key: Any, max_frame_bytes: int) -> Stage:
        """The staging file ``name`` (opened and validated on first use); StageRefused."""
        with self.lock:
            s = self.stages.get(name) if isinstance(name, str) else None
        if s is not None:
            if not (isinstance(key, bytes) and hmac.compare_digest(key, s.key)):
                raise StageRefused(f"staging file {name} does not hold the frame's key")
            return s
        s = Stage.open(arena_path, name, key, max_frame_bytes)
        with self.lock:
            if self.closed:
                s.close()
                raise StageRefused("connection closed")
            while len(self.stages) >= Stage.MAX_PER_CONNECTION:
                self.stages.pop(next(iter(self.stages))).close()
            self.stages[name] = s
        return s

    def hold(self, table: dict, entry: tuple) -> int:
        """File ``entry`` (a lease or a slot) under a fresh id; 0 once the connection closed
        (the caller then releases what it pinned)."""
        with self.lock:
            if self.closed:
                return 0
            i = next(self.ids)
            table[i] = entry
            return i

    def hold_many(self, table: dict, entries: list[tuple]) -> list[int]:
        """``hold`` of every entry of one frame with one lock hold: their ids, or [] once
        the connection closed (the caller then releases what it pinned)."""
        with self.lock:
            if self.closed:
                return []
            ids = list(itertools.islice(self.ids, len(entries)))
            table.update(zip(ids, entries))
            return ids

    def expire(self, now: float) -> None:
        with self.lock:
            old_l = [i for i, (_, _, exp) in self.leases.items() if exp < now]
            # expired slots: the writer may still be copying, so their chunks are
            # quarantined (kept, charged to this connection) until it closes
            old_s = [i for i, (_, _, exp) in self.slots.items() if exp < now]
            gone_l = [self.leases.pop(i) for i in old_l]
            gone_s = [self.slots.pop(i) for i in old_s]
            if len(self.expired) > 65536:
                self.expired.clear()
            self.expired.update(old_l)
            self.expired.update(old_s)
        _unpin_all(gone_l)
        for tier, slot, _ in gone_s:
            tier.abort_put(slot, self.holder)
        if old_l or old_s:
            log.warning("expired %d shm leases and %d slots held past %d ms", len(old_l),
                        len(old_s), self.lease_ms)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            leases, slots = list(self.leases.values()), list(self.slots.values())
            self.leases.clear()
            self.slots.clear()
            stages = list(self.stages.values())
            self.stages.clear()
        for s in stages:
            s.close()
        _unpin_all(leases)
        for tier, slot, _ in slots:
            tier.abort_put(slot)
        if self.tier is not None:  # incomplete sliced puts it took part in, quarantine
            self.tier.release_holder(self.holder)


class ShmRegistry:
    """One server's shm state: every connection's ``ShmState`` (for STATS and the
    reaper), the lease expiry ``lease_ms`` and the reaper thread that enforces it.

    ``lease_ms`` defaults to ``GCACHE_SHM_LEASE_MS`` read at construction. ``start`` /
    ``stop`` (owner's thread; idempotent) run and join the reaper; the other methods run
    on connection threads (see the module docstring)."""

    def __init__(self, lease_ms: int | None = None) -> None:
        self.lease_ms = lease_ms_from_env() if lease_ms is None else lease_ms
        self._states: "weakref.WeakSet[ShmState]" = weakref.WeakSet()
        self._lock = threading.Lock()  # guards _states (added to by connection threads)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def start(self) -> None:
        """Start the reaper (once)."""
        with self._lock:
            if self._reaper is not None or self._stop.is_set():
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="gcache-shm-reaper",
                                            daemon=True)
            self._reaper.start()

    def stop(self) -> None:
        """Stop the reaper and wait for it (one tick at most); idempotent."""
        self._stop.set()
        with self._lock:
            reaper = self._reaper
        if reaper is not None:
            reaper.join(timeout=2.0)

    def _reap_loop(self) -> None:
        while not self._stop.wait(min(1.0, self.lease_ms / 4000.0)):
            now = time.monotonic()
            for st in self._snapshot():
                try:
                    st.expire(now)
                except Exception:  # never let the reaper die
                    log.exception("shm lease reaper failed")

    def _snapshot(self) -> list[ShmState]:
        with self._lock:
            return list(self._states)

    def state(self, conn: Any) -> ShmState:
        """``conn``'s ShmState, made on its first shm op (or sliced put)."""
        st = conn.shm_state
        if st is None:
            st = conn.shm_state = ShmState(4 * conn.limits.max_batch_items, conn.svc.tier,
                                           self.lease_ms)
            with self._lock:
                self._states.add(st)
        return st

    def holder(self, conn: Any) -> Any:
        """The connection's reservation ``Holder`` (for sliced TCP puts as well)."""
        return self.state(conn).holder

    @staticmethod
    def release_all(conn: Any) -> None:
        """Connection closed: release its leases, abort its slots, fail the incomplete
        sliced puts it took part in."""
        st = conn.shm_state
        if st is not None:
            st.close()

    def stats(self, nixl_on: bool) -> dict:
        """Leases and put slots held right now over every connection, and whether the arena
        is registered with NIXL (for STATS, /healthz and the metrics)."""
        leases = slots = 0
        for st in self._snapshot():
            with st.lock:
                leases += len(st.leases)
                slots += len(st.slots)
        return {"shm_leases": leases, "shm_slots": slots, "nixl": 1 if nixl_on else 0}


def _ids(meta: Any, field: str, limit: int) -> list[int]:
    ids = meta.get(field, []) if isinstance(meta, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ProtocolError(f"'{field}' must be a list of integer ids", Status.BAD_REQUEST)
    if len(ids) > limit:
        raise ProtocolError(f"{len(ids)} ids exceed max_batch_items {limit}", Status.TOO_LARGE)
    return ids


@functools.lru_cache(maxsize=1024)
def is_local_address(host: str) -> bool:
    """Whether ``host`` (an IP literal) is an address of this host's network namespace:
    only those can be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def one_sided_refusal(conn: Any) -> str:
    """'' if the peer of ``conn`` can be a one-sided reader/writer, else why not.

    A one-sided peer either maps the arena (same host: its address is one of ours) or
    reaches it through NIXL (the server registered it). Anyone else could only ALLOC and
    COMMIT without writing, or LEASE without reading: no use, only a way to hold memory.
    """
    if conn.svc.nixl_info:
        return ""
    peer = conn.peer
    host = peer[0] if isinstance(peer, tuple) and peer else None
    if not isinstance(host, str) or is_local_address(host.split("%")[0]):
        return ""
    return (f"peer {host} is neither on this host nor a NIXL client (the server runs "
            "without --nixl): one-sided ops are refused, use GET and PUT")


def alloc_refusal(conn: Any) -> str:
    """'' if ``conn``'s peer may ALLOC (reserve a chunk it then writes itself), else why not.

    Writing the arena directly is for peers the server trusts with it: NIXL peers (the
    server registered the arena for remote writes) and, with ``--shm-trusted-writers``,
    same-host peers. Co-located clients put with PUT_STAGED and never need it."""
    svc = conn.svc
    if svc.nixl_info:
        return ""
    if getattr(svc, "shm_trusted_writers", False):
        return one_sided_refusal(conn)
    return ("ALLOC is refused: the server runs without --nixl and without "
            "--shm-trusted-writers, so no client writes its arena; co-located clients put "
            "with PUT_STAGED, others with PUT")


def handle(conn: Any, op: int, rid: int, meta: Any, plen: int) -> None:
    """Serve one shm control op on ``conn`` (a service ``_Connection``, authenticated)."""
    conn.no_payload(plen)
    if not isinstance(meta, dict):
        raise ProtocolError("frame header must be a map", Status.BAD_REQUEST)
    tier = conn.svc.tier
    mem = memory_tier(tier)
    st = conn.svc.shm.state(conn)
    if op in (Op.LEASE, Op.ALLOC, Op.PUT_STAGED):
        if st.refusal is None:
            st.refusal = one_sided_refusal(conn)
        if op == Op.ALLOC and st.alloc_refusal is None:
            st.alloc_refusal = alloc_refusal(conn)
        why = st.refusal or (st.alloc_refusal if op == Op.ALLOC else "")
        if why:
            items = check_items(meta, conn.limits)
            if op != Op.LEASE:  # a malformed frame is a frame error, refused peer or not
                parse_put_items(items, conn.limits, Op.NAMES[op], require_checksum=True)
            n = len(items)
            if op == Op.PUT_STAGED:
                conn.reply(op, rid, {"st": [int(Status.AUTH)] * n, "staged": False,
                                     "error": why})
                return
            width = 6 if op == Op.LEASE else 3
            conn.reply(op, rid, {"items": [[int(Status.AUTH)] + [0] * (width - 1)] * n,
                                 "one_sided": False, "error": why})
            return
    if op == Op.LEASE:
        _lease(conn, st, tier, mem, rid, meta)
    elif op == Op.RELEASE:
        conn.reply(op, rid, {"st": _release(conn, st, meta)})
    elif op == Op.ALLOC:
        conn.reply(op, rid, {"items": _alloc(conn, st, tier, mem, meta)})
    elif op == Op.PUT_STAGED:
        conn.reply(op, rid, _put_staged(conn, st, tier, mem, meta))
    else:
        conn.reply(op, rid, {"st": _commit(conn, st, meta)})


def _lease(conn: Any, st: ShmState, tier: Any, mem: Any, rid: int, meta: dict) -> None:
    """Pin the frame's memory-resident objects, lease the disk-only ones, and answer
    where each one is. The frame's pins, lease ids and lease-bound check each take their
    lock once per frame (``MemoryTier.pin_read_many`` with no views cut: the server never
    reads the bytes). With ``"sr": 1`` and disk reads to do, the reply is streamed
    (docs/protocol.md): the rows ready at once first, then each verified prefix of the
    disk reads as it lands, so the client copies while later reads go on."""
    lim = conn.limits
    ns = check_namespace(meta.get("ns", b""), lim)
    items = check_items(meta, lim)
    stream, packed = check_flag(meta, "sr"), check_flag(meta, "pk")
    parsed = []
    most = lim.max_key_bytes
    for it in items:
        if type(it) is list and len(it) == 2:  # the usual item, checked inline
            k, ev = it
            if type(k) is bytes and 0 < len(k) <= most and type(ev) is int and ev >= 0:
                parsed.append((k, 0, 0, ev))
                continue
        if not (isinstance(it, list) and len(it) == 2 and isinstance(it[1], int)
                and it[1] >= 0):
            raise ProtocolError("LEASE item must be [key, expect_version]", Status.BAD_REQUEST)
        parsed.append((check_key(it[0], lim), 0, 0, it[1]))
    if not conn.may(Right.READ, ns, Op.LEASE):
        _reply_rows(conn, rid, [[int(Status.AUTH), 0, 0, 0, 0, 0]] * len(parsed), packed)
        return
    refused = conn.read_refusals(ns, meta, len(parsed))
    busy = [int(Status.BUSY), 0, 0, 0, 0, 0]
    out: list = [busy] * len(parsed)  # BUSY unless answered below
    want = []  # indices to pin, in order
    for i, no in enumerate(refused):
        if no is not None:
            out[i] = [int(no), 0, 0, 0, 0, 0]
        elif mem is not None:
            want.append(i)
    expiry = time.monotonic() + st.lease_s
    OK, MISS = Status.OK, Status.MISS
    hits = nbytes = missed = 0
    # memory misses the disk tier may hold: read (or found absent) below, with no
    # lookup of their own first (the disk read looks each key up)
    on_disk = []
    into = getattr(tier, "read_disk_into", None) if mem is not tier else None
    while want:
        # at most max_held leases per connection: the items past the bound answer BUSY
        # (the client reads them with a GET), as do misses after it, unpinned
        with st.lock:
            room = st.max_held - len(st.leases)
        if room <= 0:
            break
        batch, want = want[:room], want[room:]
        pins = mem.pin_read_many(ns, [parsed[i] for i in batch], False)
        got = [(i, p) for i, p in zip(batch, pins) if p.status == OK]
        for i, p in zip(batch, pins):
            if p.status != OK:
                s = p.status
                if s == MISS and into is not None:
                    on_disk.append(i)
                    s = Status.BUSY  # until read below (or past the lease bound: a GET)
                elif s == MISS and mem is not tier and tier.exists(ns, parsed[i][0]):
                    s = Status.BUSY  # on disk only: read with a GET
                else:
                    missed += 1
                out[i] = (int(s), p.total_len, p.version, 0, 0, 0)
        if not got:
            continue
        ids = st.hold_many(st.leases, [(mem, p, expiry) for _, p in got])
        if not ids:  # the connection closed meanwhile
            mem.unpin_many([p for _, p in got])
            for i, _ in got:
                out[i] = [int(Status.CLOSED), 0, 0, 0, 0, 0]
            missed += len(got)
            continue
        for (i, p), lid in zip(got, ids):
            o = p.token
            out[i] = (int(OK), o.length, o.version, o.data_off, lid, p.checksum)
            nbytes += o.length
        hits += len(got)
    if on_disk:
        with st.lock:
            on_disk = on_disk[:max(0, st.max_held - len(st.leases))]  # the rest stay BUSY
    if on_disk and stream:
        def send(ix: list[int], more: bool) -> None:  # one frame of a streamed reply
            conn.reply(Op.LEASE, rid, {"packed": pack_lease_rows([out[i] for i in ix]),
                                       "ix": ix}, more=more)

        reading = set(on_disk)
        first = [i for i in range(len(parsed)) if i not in reading]
        if first:  # the rows ready now
            send(first, True)
        counts = _lease_disk(st, tier, into, ns, parsed, on_disk, out, expiry, send)
    else:
        counts = (_lease_disk(st, tier, into, ns, parsed, on_disk, out, expiry)
                  if on_disk else (0, 0, 0))
        _reply_rows(conn, rid, out, packed)
    hits += counts[0]
    nbytes += counts[1]
    missed += counts[2]
    # counted as gets (the items served); BUSY items are counted by the GET that follows
    m = conn.svc.metrics
    if hits:
        m.items.labels("get", "OK").inc(hits)
        m.bytes.labels("out").inc(nbytes)
    missed += len(refused) - refused.count(None) - refused.count(Status.BUSY)  # C-level
    if missed:
        m.items.labels("get", "MISS").inc(missed)
    m.namespace_reads(ns, hits, missed, nbytes)
    m.handoff_reads(meta, hits, missed)


def _reply_rows(conn: Any, rid: int, rows: list, packed: bool) -> None:
    """A LEASE reply of one frame: every row, in request order."""
    if packed:  # the client reads the packed form (docs/protocol.md)
        conn.reply(Op.LEASE, rid, {"packed": pack_lease_rows(rows)})
    else:
        conn.reply(Op.LEASE, rid, {"items": [list(r) for r in rows]})


def _lease_disk(st: ShmState, tier: Any, into: Any, ns: bytes, parsed: list,
                want: list[int], out: list, expiry: float,
                send: Callable[[list[int], bool], None] | None = None
                ) -> tuple[int, int, int]:
    """Lease keys only the disk tier may hold: each whole record is read (in parallel,
    as a GET frame's) into an arena scratch chunk charged to the connection
    (``TieredStore.read_disk_into``), verified, and leased like a memory object, so the
    reader copies it from the arena with no socket copy and no second round trip.
    RELEASE, expiry or close frees the chunk (``unpin``). A key in no tier is MISS; with
    no free chunk, or for a record not read whole, the item stays BUSY (the client reads
    it with a GET). Answers in ``out``; ``send(indices, more)``: each verified prefix
    is sent as it is leased (a streamed reply, the last with ``more`` False), else the
    caller replies. (items leased, bytes leased, misses)."""
    counts = [0, 0, 0]
    n = len(want)

    def settle(start: int, pins: list[Pinned]) -> None:  # owns ``pins``: lease or unpin
        ix = want[start:start + len(pins)]
        got = []
        for i, p in zip(ix, pins):
            if p.status == Status.OK:
                got.append((i, p))
            else:
                out[i] = (int(p.status), p.total_len, p.version, 0, 0, 0)
                counts[2] += p.status == Status.MISS
        ids = st.hold_many(st.leases, [(tier, p, expiry) for _, p in got]) if got else []
        if got and not ids:  # the connection closed meanwhile
            tier.unpin_many([p for _, p in got])
            for i, _ in got:
                out[i] = [int(Status.CLOSED), 0, 0, 0, 0, 0]
        for (i, p), lid in zip(got, ids):  # none when the connection closed
            chunk, at = p.token.scratch
            out[i] = (int(Status.OK), p.total_len, p.version, chunk.off + at, lid, p.checksum)
            counts[0] += 1
            counts[1] += p.total_len
        if send is not None:
            send(ix, start + len(pins) < n)

    items = [(parsed[i][0], 0, 1 << 62, parsed[i][3]) for i in want]
    if send is None:
        settle(0, into(ns, items, st.holder))
    else:
        into(ns, items, st.holder, settle, _LEASE_STREAM_MIN_BYTES)
    return counts[0], counts[1], counts[2]


def _release(conn: Any, st: ShmState, meta: dict) -> list[int]:
    ids = _ids(meta, "leases", conn.limits.max_batch_items)
    leases = st.leases
    with st.lock:
        popped = [leases.pop(i, None) for i in ids]
        whole = None not in popped  # every lease still held: the usual answer
        out, gone = [], []
        for i, held in zip([] if whole else ids, popped):
            if held is not None:
                gone.append(held)
                out.append(int(Status.OK))
            elif i in st.expired:
                st.expired.discard(i)
                out.append(int(Status.TIMEOUT))  # reaped: what the client copied may be torn
            else:
                out.append(int(Status.BAD_REQUEST))  # unknown or forged id
    if whole:
        _unpin_all(popped)
        return [_OK] * len(ids)
    _unpin_all(gone)
    return out


def _unpin_all(held: list[tuple[Any, Any, float]]) -> None:
    """Unpin ``(tier, Pinned, expiry)`` leases: one ``unpin_many`` per tier (one lock
    hold for a frame's leases)."""
    if not held:
        return
    first = held[0][0]
    if all(h[0] is first for h in held):  # the usual case: one tier
        first.unpin_many([h[1] for h in held])
        return
    by_tier: dict[int, tuple[Any, list]] = {}
    for tier, pin, _ in held:
        by_tier.setdefault(id(tier), (tier, []))[1].append(pin)
    for tier, pins in by_tier.values():
        tier.unpin_many(pins)


def _alloc(conn: Any, st: ShmState, tier: Any, mem: Any, meta: dict) -> list:
    lim = conn.limits
    ns = check_namespace(meta.get("ns", b""), lim)
    items = check_items(meta, lim)
    # PUT's item shape, no payload. The checksum is required: the server never sees a
    # one-sided writer's bytes arrive, so it is the only proof they were written.
    parsed = parse_put_items(items, lim, "ALLOC", require_checksum=True)
    if check_flag(meta, "ia"):  # COMMIT publishes with no frame to carry it
        raise ProtocolError("'ia' (put if absent) is not supported on ALLOC: use PUT or "
                            "PUT_STAGED", Status.BAD_REQUEST)
    if not conn.may(Right.WRITE, ns, Op.ALLOC):
        return [[int(Status.AUTH), 0, 0]] * len(parsed)
    ph = check_placement(meta, len(parsed))  # kept with each object
    wrong_owner = conn.not_owned(meta, ph, len(parsed))
    ph = ph or [None] * len(parsed)
    parents = chain_parents(meta, parsed, lim) or itertools.repeat(None)
    out = []
    now = time.monotonic()
    for (key, tl, off, ln, pid, csum), wrong, h, up in zip(parsed, wrong_owner, ph, parents):
        if wrong:
            out.append([int(Status.NOT_OWNER), 0, 0])
            continue
        if mem is None:
            out.append([int(Status.BUSY), 0, 0])
            continue
        with st.lock:
            full = len(st.slots) >= st.max_held
        if full:
            out.append([int(Status.BUSY), 0, 0])
            continue
        slot = (tier.begin_put(ns, key, tl, off, ln, pid, csum=csum, holder=st.holder, ph=h,
                               parent=up)
                if tl <= lim.max_value_bytes else None)
        if slot is None or slot.status != Status.OK:
            out.append([int(Status.TOO_LARGE if slot is None else slot.status), 0, 0])
            continue
        obj = getattr(slot.token, "obj", None)
        if obj is None:  # a tier whose slots are not arena chunks
            tier.abort_put(slot)
            out.append([int(Status.BUSY), 0, 0])
            continue
        sid = st.hold(st.slots, (tier, slot, now + st.lease_s))
        if not sid:
            tier.abort_put(slot)
            out.append([int(Status.CLOSED), 0, 0])
            continue
        out.append([int(Status.OK), obj.data_off + off, sid])
    return out


def _slot_namespace(slot: Any) -> bytes | None:
    """The namespace a put slot was reserved under (MemoryTier files ``(ns, key, put_id)``
    as ``extra["key"]``); None when the tier does not say (the COMMIT is then refused)."""
    k = slot.extra.get("key")
    return k[0] if isinstance(k, tuple) and k and isinstance(k[0], bytes) else None


def _commit(conn: Any, st: ShmState, meta: dict) -> list[int]:
    lim = conn.limits.max_batch_items
    commit, abort = _ids(meta, "slots", lim), _ids(meta, "abort", lim)
    with st.lock:
        taken = [st.slots.pop(i, None) for i in commit]
        dropped = [st.slots.pop(i, None) for i in abort]
    for held in dropped:
        if held is not None:
            held[0].abort_put(held[1])
    out = []
    nbytes = 0
    per_ns: dict[bytes, int] = {}
    for i, held in zip(commit, taken):
        if held is None:  # expired (reaped), or an unknown or forged id
            with st.lock:
                expired = i in st.expired
                st.expired.discard(i)
            out.append(int(Status.TIMEOUT if expired else Status.BAD_REQUEST))
            continue
        tier, slot, _ = held
        ns = _slot_namespace(slot)
        if ns is None or not conn.may(Right.WRITE, ns, Op.COMMIT):
            tier.abort_put(slot)
            out.append(int(Status.AUTH))
            continue
        ln = slot.extra.get("len", 0)
        nbytes += ln
        s = tier.finish_put(slot)
        if s == Status.OK:
            per_ns[ns] = per_ns.get(ns, 0) + ln
        out.append(int(s))
    m = conn.svc.metrics
    m.bytes.labels("in").inc(nbytes)
    for ns, n in per_ns.items():
        m.namespace_writes(ns, n)
    ok = sum(1 for s in out if s == Status.OK)
    if ok:
        m.items.labels("put", "OK").inc(ok)
    return out


def _put_staged(conn: Any, st: ShmState, tier: Any, mem: Any, meta: dict) -> dict:
    """A PUT whose payload is the data of the client's staging file: reserve, copy in
    (``read_staged`` straight into the arena chunks), verify the writer's checksum,
    publish."""
    lim = conn.limits
    ns = check_namespace(meta.get("ns", b""), lim)
    # the checksum is required: it is what proves the bytes are the writer's value
    parsed = parse_put_items(check_items(meta, lim), lim, "PUT_STAGED",
                             require_checksum=True)
    parents = chain_parents(meta, parsed, lim) or itertools.repeat(None)
    if_absent = check_flag(meta, "ia")
    total = sum(p.length for p in parsed)
    if total > lim.max_frame_bytes:
        raise ProtocolError(f"PUT_STAGED items describe {total} bytes, over max_frame_bytes "
                            f"{lim.max_frame_bytes}", Status.TOO_LARGE)
    if not conn.may(Right.WRITE, ns, Op.PUT_STAGED):  # before the file is even opened
        return {"st": [int(Status.AUTH)] * len(parsed)}
    if mem is None:
        return {"st": [int(Status.BAD_REQUEST)] * len(parsed), "staged": False,
                "error": "this server has no memory arena: use PUT"}
    try:
        stage = st.stage(mem.arena.path, meta.get("stage"), meta.get("skey"),
                         lim.max_frame_bytes)
        if staging.HEADER_BYTES + total > stage.size:
            raise StageRefused(f"staging file {meta.get('stage')} has {stage.size} bytes, "
                               f"too small for this frame's {total}")
    except StageRefused as exc:
        conn.svc.metrics.protocol_errors.labels("staging").inc()
        return {"st": [int(Status.BAD_REQUEST)] * len(parsed), "staged": False,
                "error": f"{exc}; the client puts over TCP instead"}
    ph = check_placement(meta, len(parsed))  # kept with each object
    wrong_owner = conn.not_owned(meta, ph, len(parsed))
    ph = ph or [None] * len(parsed)
    tombs = conn.svc.tombstones
    guard = tombs.guard(ns) if if_absent and tombs is not None else None
    statuses: list[Status | None] = [None] * len(parsed)
    # items are reserved in groups of about STAGED_GROUP_BYTES, each group read in one
    # read_staged call (the GIL released once, each whole value hashed as it lands),
    # then verified and published in frame order. A GIL release per 64 KiB read handed
    # the GIL to another connection thread every few us (futex wake-ups were a third of
    # the server's CPU); a group, not the whole frame, so the last slices of a large
    # value are still in the cache when its checksum reads them.
    group: list[tuple[int, int, bool]] = []  # (index, file offset, whole) of each item
    reqs: list[PutRequest] = []  # and their requests
    group_bytes = 0
    pos = staging.HEADER_BYTES
    nbytes = shrunk = 0
    whole = self_contained(parsed)
    new = tuple.__new__  # PutRequest(...) without the NamedTuple's Python-level __new__
    for i, ((key, tl, off, ln, pid, csum), wrong, h, up) in enumerate(
            zip(parsed, wrong_owner, ph, parents)):
        at, pos = pos, pos + ln
        if wrong or (guard is not None and guard.skip(key)):
            statuses[i] = Status.NOT_OWNER if wrong else Status.OK  # skipped: OK
            continue
        if tl > lim.max_value_bytes:
            statuses[i] = Status.TOO_LARGE
            continue
        # a put whose slices all travel in this frame completes within it: only one that
        # waits for slices of other frames is a reservation that outlives it
        holder = None if (key, pid) in whole else st.holder
        reqs.append(new(PutRequest, (key, tl, off, ln, pid, csum, holder, h, up)))
        group.append((i, at, off == 0 and ln == tl))
        group_bytes += ln
        if group_bytes >= STAGED_GROUP_BYTES:
            nb, cut = _reserve_read_finish(tier, ns, stage, group, reqs, parsed, statuses,
                                           if_absent, guard)
            nbytes, shrunk, group, reqs, group_bytes = nbytes + nb, shrunk + cut, [], [], 0
    nb, cut = _reserve_read_finish(tier, ns, stage, group, reqs, parsed, statuses, if_absent,
                                   guard)
    nbytes, shrunk = nbytes + nb, shrunk + cut
    m = conn.svc.metrics
    if shrunk:  # the client cut its file under the copy: those values were refused
        m.protocol_errors.labels("staging_shrunk").inc(shrunk)
        stage_log.warning("staging_shrunk", "a client's staging file ended before %d "
                          "value(s) of a PUT_STAGED frame were copied: refused (BAD_REQUEST); "
                          "the client shrank the file under the copy", shrunk,
                          fields={"peer": str(conn.peer), "stage": meta.get("stage")})
    m.bytes.labels("in").inc(total)
    m.namespace_writes(ns, nbytes)
    for s in set(statuses):
        m.items.labels("put", s.name).inc(statuses.count(s))  # type: ignore[union-attr]
    return {"st": [int(s) for s in statuses]}  # type: ignore[arg-type]


def _reserve_read_finish(tier: Any, ns: bytes, stage: Stage,
                         group: list[tuple[int, int, bool]],
                         reqs: list[PutRequest], parsed: list, statuses: list,
                         if_absent: bool, guard: Any) -> tuple[int, int]:
    """Reserve a group of PUT_STAGED items (``group``: each one's index, file offset and
    whether it is a whole value; ``reqs``: its request) in one tier call, fill them from
    the staging file in one ``read_staged`` call, then finish them in one; (the bytes
    published, the values the file ended before). Sets each item's status."""
    if not reqs:
        return 0, 0
    reads: list[tuple[int, Any]] = []  # (index, slot) of each reserved item
    spans = []  # and its read_staged span: a whole value is hashed as it lands
    for (i, at, whole), slot in zip(group, tier.begin_puts(ns, reqs)):
        if slot.status == Status.OK:
            reads.append((i, slot))
            spans.append((slot.view, at, whole))
        else:
            statuses[i] = slot.status
    if not reads:
        return 0, 0
    try:
        digests, short = native.read_staged(stage.fd, stage.map, spans)
    except BaseException:
        abort_slots(tier, [slot for _, slot in reads])
        raise
    cut = set(short)
    for j in short:  # the client shrank its file
        i, slot = reads[j]
        statuses[i] = Status.BAD_REQUEST
        tier.abort_put(slot)
    kept = [(r, d) for j, (r, d) in enumerate(zip(reads, digests)) if j not in cut]
    done = tier.finish_puts([slot for (_, slot), _ in kept], if_absent=if_absent,
                            digests=[d for _, d in kept])
    nbytes = 0
    for ((i, _), _), s in zip(kept, done):
        statuses[i] = s
        if s == Status.OK:
            nbytes += parsed[i].length
            if guard is not None:
                guard.settle(tier, parsed[i].key)
    return nbytes, len(short)
