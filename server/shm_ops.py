"""Server side of the co-located shared-memory transport (LEASE/RELEASE/ALLOC/COMMIT).

Design. A client on the same host (same uid) maps the arena file itself and copies
bytes between the mapping and its own buffers; the server only hands out and takes
back *where* the bytes are, through four small control ops on the ordinary framed
connection (docs/protocol.md, "Shared-memory ops"):

* ``LEASE`` pins memory-resident objects (``MemoryTier.pin_read``) and answers each
  object's absolute arena offset. Eviction, replace and delete of a pinned object only
  mark it doomed, so its bytes stay put until ``RELEASE``. Only objects already in the
  memory tier are leased; anything else (on disk only) answers ``BUSY`` and the client
  reads it with a plain GET. ``MISS`` means absent from every tier.
* ``ALLOC`` reserves an uncommitted chunk (``Tier.begin_put``, the same reservation a
  TCP put uses, sliced puts included) and answers the slice's arena offset; the object
  is not visible until ``COMMIT`` runs ``finish_put`` (checksum, commit flag, publish).

Leases and slots belong to the connection: the ids are per-connection counters looked
up only in that connection's tables, so a forged or stale id answers ``BAD_REQUEST``
and can never touch another connection's state. On close every lease is released and
every slot aborted. A reaper also expires leases older than ``lease_ms``
(``GCACHE_SHM_LEASE_MS``, default 10 s), so a stuck reader cannot pin memory
forever; a RELEASE of an expired lease answers ``TIMEOUT`` and the client drops
what it copied (it may be torn).

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

Scope: LEASE needs ``read`` on the frame's namespace, ALLOC ``write`` (as GET and
PUT); COMMIT re-checks ``write`` on each slot's namespace, so a reload that narrows
the credential between ALLOC and COMMIT publishes nothing. Refused items answer
``AUTH``. This bounds what the *server* hands out; a same-uid client still maps
the whole arena file read-write itself (docs/architecture.md, "Tenancy").

Ownership (``NOT_OWNER``) is checked exactly as for GET/PUT when the client sends its
view epoch and placement hashes (``ep``/``ph``), and skipped otherwise.
"""

from __future__ import annotations

import functools
import itertools
import logging
import socket
import os
import threading
import time
import weakref
from typing import Any

from gcache.credentials import Right
from gcache.errors import ProtocolError
from gcache.network import boot_id
from gcache.protocol import Op, check_items, check_key, check_namespace, parse_put_items
from gcache.status import Status

log = logging.getLogger("gcache.server.shm")

LEASE_MS = int(os.environ.get("GCACHE_SHM_LEASE_MS", "10000") or 10000)


def memory_tier(tier: Any) -> Any:
    """The MemoryTier behind ``tier`` (itself, or a TieredStore's ``memory``), or None."""
    from gcache.server.memory_tier import MemoryTier

    if isinstance(tier, MemoryTier):
        return tier
    mem = getattr(tier, "memory", None)
    return mem if isinstance(mem, MemoryTier) else None


def identity_fields(tier: Any) -> dict:
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
                    "ino": st.st_ino, "uid": st.st_uid, "data_off": arena.data_off,
                    "lease_ms": LEASE_MS, "boot_id": boot_id()}}


class ShmState:
    """One connection's leases, slots and reservations (``holder``)."""

    def __init__(self, max_held: int, tier: Any = None) -> None:
        from gcache.server.memory_tier import Holder

        self.tier = tier
        self.holder = Holder()
        self.lock = threading.Lock()
        self.leases: dict[int, tuple[Any, Any, float]] = {}  # id -> (tier, Pinned, expiry)
        self.slots: dict[int, tuple[Any, Any, float]] = {}  # id -> (tier, PutSlot, expiry)
        self.expired: set[int] = set()  # lease ids reaped before RELEASE (bounded)
        self.ids = itertools.count(1)
        self.max_held = max_held
        self.closed = False
        self.refusal: str | None = None  # why LEASE/ALLOC are refused ('' = allowed)

    def hold(self, table: dict, entry: tuple) -> int:
        """File ``entry`` (a lease or a slot) under a fresh id; 0 once the connection closed
        (the caller then releases what it pinned)."""
        with self.lock:
            if self.closed:
                return 0
            i = next(self.ids)
            table[i] = entry
            return i

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
        for tier, pin, _ in gone_l:
            tier.unpin(pin)
        for tier, slot, _ in gone_s:
            tier.abort_put(slot, self.holder)
        if old_l or old_s:
            log.warning("expired %d shm leases and %d slots held past %d ms", len(old_l),
                        len(old_s), LEASE_MS)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            leases, slots = list(self.leases.values()), list(self.slots.values())
            self.leases.clear()
            self.slots.clear()
        for tier, pin, _ in leases:
            tier.unpin(pin)
        for tier, slot, _ in slots:
            tier.abort_put(slot)
        if self.tier is not None:  # incomplete sliced puts it took part in, quarantine
            self.tier.release_holder(self.holder)


_states: "weakref.WeakSet[ShmState]" = weakref.WeakSet()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None


def _reap_loop() -> None:
    while True:
        time.sleep(min(1.0, LEASE_MS / 4000.0))
        now = time.monotonic()
        for st in list(_states):
            try:
                st.expire(now)
            except Exception:  # never let the reaper die
                log.exception("shm lease reaper failed")


def _state(conn: Any) -> ShmState:
    global _reaper
    st = getattr(conn, "shm_state", None)
    if st is None:
        st = conn.shm_state = ShmState(4 * conn.limits.max_batch_items, conn.svc.tier)
        _states.add(st)
        with _reaper_lock:
            if _reaper is None:
                _reaper = threading.Thread(target=_reap_loop, name="gcache-shm-reaper",
                                           daemon=True)
                _reaper.start()
    return st


def transport_stats(nixl_on: bool) -> dict:
    """Leases and put slots held right now over every connection, and whether the arena
    is registered with NIXL (for STATS, /healthz and the metrics)."""
    leases = slots = 0
    for st in list(_states):
        with st.lock:
            leases += len(st.leases)
            slots += len(st.slots)
    return {"shm_leases": leases, "shm_slots": slots, "nixl": 1 if nixl_on else 0}


def holder(conn: Any) -> Any:
    """The connection's reservation ``Holder`` (for sliced TCP puts as well)."""
    return _state(conn).holder


def release_all(conn: Any) -> None:
    """Connection closed: release its leases, abort its slots, fail the incomplete
    sliced puts it took part in."""
    st = getattr(conn, "shm_state", None)
    if st is not None:
        st.close()


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


def handle(conn: Any, op: int, rid: int, meta: Any, plen: int) -> None:
    """Serve one shm control op on ``conn`` (a service ``_Connection``, authenticated)."""
    conn.no_payload(plen)
    if not isinstance(meta, dict):
        raise ProtocolError("frame header must be a map", Status.BAD_REQUEST)
    tier = conn.svc.tier
    mem = memory_tier(tier)
    st = _state(conn)
    if op in (Op.LEASE, Op.ALLOC):
        if st.refusal is None:
            st.refusal = one_sided_refusal(conn)
        if st.refusal:
            n = len(check_items(meta, conn.limits))
            width = 6 if op == Op.LEASE else 3
            conn.reply(op, rid, {"items": [[int(Status.AUTH)] + [0] * (width - 1)] * n,
                                 "one_sided": False, "error": st.refusal})
            return
    if op == Op.LEASE:
        conn.reply(op, rid, {"items": _lease(conn, st, tier, mem, meta)})
    elif op == Op.RELEASE:
        conn.reply(op, rid, {"st": _release(conn, st, meta)})
    elif op == Op.ALLOC:
        conn.reply(op, rid, {"items": _alloc(conn, st, tier, mem, meta)})
    else:
        conn.reply(op, rid, {"st": _commit(conn, st, meta)})


def _lease(conn: Any, st: ShmState, tier: Any, mem: Any, meta: dict) -> list:
    lim = conn.limits
    ns = check_namespace(meta.get("ns", b""), lim)
    items = check_items(meta, lim)
    parsed = []
    for it in items:
        if not (isinstance(it, list) and len(it) == 2 and isinstance(it[1], int)
                and it[1] >= 0):
            raise ProtocolError("LEASE item must be [key, expect_version]", Status.BAD_REQUEST)
        parsed.append((check_key(it[0], lim), it[1]))
    if not conn.may(Right.READ, ns, Op.LEASE):
        return [[int(Status.AUTH), 0, 0, 0, 0, 0]] * len(parsed)
    wrong_owner = conn.misplaced(meta, len(parsed))
    out = []
    now = time.monotonic()
    hits = 0
    for (key, ev), wrong in zip(parsed, wrong_owner):
        if wrong:
            out.append([int(Status.NOT_OWNER), 0, 0, 0, 0, 0])
            continue
        if mem is None:
            out.append([int(Status.BUSY), 0, 0, 0, 0, 0])
            continue
        with st.lock:
            full = len(st.leases) >= st.max_held
        if full:
            out.append([int(Status.BUSY), 0, 0, 0, 0, 0])
            continue
        p = mem.pin_read(ns, key, 0, 0, ev)
        if p.status != Status.OK:
            s = p.status
            if s == Status.MISS and mem is not tier and tier.exists(ns, key):
                s = Status.BUSY  # on disk only: read it with a GET (which promotes)
            out.append([int(s), p.total_len, p.version, 0, 0, 0])
            continue
        o = p.token
        if p.view is not None:
            p.view.release()
            p.view = None
        lid = st.hold(st.leases, (mem, p, now + LEASE_MS / 1000.0))
        if not lid:
            mem.unpin(p)
            out.append([int(Status.CLOSED), 0, 0, 0, 0, 0])
            continue
        hits += 1
        out.append([int(Status.OK), o.length, o.version, o.data_off, lid, p.checksum])
    # counted as gets (the items served); BUSY items are counted by the GET that follows
    m = conn.svc.metrics
    nbytes = sum(x[1] for x in out if x[0] == Status.OK)
    if hits:
        m.items.labels("get", "OK").inc(hits)
        m.bytes.labels("out").inc(nbytes)
    missed = sum(1 for x in out if x[0] not in (Status.OK, Status.BUSY))
    if missed:
        m.items.labels("get", "MISS").inc(missed)
    m.namespace_reads(ns, hits, missed, nbytes)
    return out


def _release(conn: Any, st: ShmState, meta: dict) -> list[int]:
    ids = _ids(meta, "leases", conn.limits.max_batch_items)
    out, gone = [], []
    with st.lock:
        for i in ids:
            held = st.leases.pop(i, None)
            if held is not None:
                gone.append(held)
                out.append(int(Status.OK))
            elif i in st.expired:
                st.expired.discard(i)
                out.append(int(Status.TIMEOUT))  # reaped: what the client copied may be torn
            else:
                out.append(int(Status.BAD_REQUEST))  # unknown or forged id
    for tier, pin, _ in gone:
        tier.unpin(pin)
    return out


def _alloc(conn: Any, st: ShmState, tier: Any, mem: Any, meta: dict) -> list:
    lim = conn.limits
    ns = check_namespace(meta.get("ns", b""), lim)
    items = check_items(meta, lim)
    # PUT's item shape, no payload. The checksum is required: the server never sees a
    # one-sided writer's bytes arrive, so it is the only proof they were written.
    parsed = parse_put_items(items, lim, "ALLOC", require_checksum=True)
    if not conn.may(Right.WRITE, ns, Op.ALLOC):
        return [[int(Status.AUTH), 0, 0]] * len(parsed)
    wrong_owner = conn.misplaced(meta, len(parsed))
    out = []
    now = time.monotonic()
    for (key, tl, off, ln, pid, csum), wrong in zip(parsed, wrong_owner):
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
        slot = (tier.begin_put(ns, key, tl, off, ln, pid, csum=csum, holder=st.holder)
                if tl <= lim.max_value_bytes else None)
        if slot is None or slot.status != Status.OK:
            out.append([int(Status.TOO_LARGE if slot is None else slot.status), 0, 0])
            continue
        obj = getattr(slot.token, "obj", None)
        if obj is None:  # a tier whose slots are not arena chunks
            tier.abort_put(slot)
            out.append([int(Status.BUSY), 0, 0])
            continue
        sid = st.hold(st.slots, (tier, slot, now + LEASE_MS / 1000.0))
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
