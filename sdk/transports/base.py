"""The Transport contract: one channel to one server, driven by one dispatch thread.

A ``Transport`` carries request frames (``Work``) to one server and returns one
``ItemResult`` per item. Implementations: ``TcpTransport`` (tcp.py: the framed
protocol over a socket), ``ShmTransport`` and ``NixlTransport`` (shm.py, nixl.py: the
one-sided data paths of onesided.py over the same socket); ``factory.make_transport``
picks one per ``Client(transport=...)``.

Threads and blocking. A transport is owned by exactly one dispatch thread
(``dispatcher.Lane``), which makes it, calls every method on it, and closes it; or it
is a lane's one-hop transport, checked out by one synchronous caller at a time
(``Lane.run_here``: the pool's pop and append order those uses). It is never used by
two threads at once, so it takes no locks. The probe and ``Client.stats`` make their own
short-lived ``TcpTransport`` on the reaper or a stats thread.

* ``kind``: the data path of the current connection (``TransportKind``: tcp, shm,
  nixl), ``None`` until the first connection is up. One-sided transports learn it in
  the handshake (``auto`` falls back to tcp per connection). Never blocks.
* ``connect(deadline)``: dial, greet (HELLO), authenticate (AUTH), and for one-sided
  transports attach the data path. Blocks until done or ``deadline`` (a
  ``time.monotonic`` value) — never longer: every blocking call re-arms its socket
  timeout from the time left before each syscall (``gcache.protocol.arm``), because a
  socket timeout alone restarts on every byte and is not a deadline. ``execute``
  connects on its own when there is no connection; callers call ``connect`` only to
  probe a server or to inspect the handshake. A plain TCP connection is non-blocking
  after the handshake (``TcpTransport``): all its IO must go through the
  ``gcache.protocol`` socket helpers, which poll for the time left.
* ``execute(work)``: send one request frame and read its reply; blocks until
  ``work.deadline`` at the latest. Returns one ``ItemResult`` per item, or raises:

  - ``TransportTimeout`` when the deadline passes mid-request; the channel is then
    closed, because the stream position is unknown (a late reply can never land in a
    buffer already reported as a miss);
  - ``AuthError`` when the server refuses the credential (or token) at AUTH;
  - ``ConnectionError`` / ``OSError`` when the server is unreachable or died.

  A request outside the credential's namespace grants is not an exception: the server
  answers ``Status.AUTH`` per item and the channel stays open.
* ``close()``: drop the connection (idempotent, never blocks); the next ``execute``
  reconnects.

Framing (``Framing.frames``): how the items of one batch for one server are cut into
request frames depends on the data path the server's connections ended up on (a
lane's ``kind``): TCP frames aim at ``frame_target_bytes`` spread over the
connections; shm frames split a batch evenly over the connections (at least
``ONE_SIDED_FRAME_BYTES`` each: no bytes travel in them and each costs two control
RPCs); nixl sends one frame, i.e. one NIXL transfer, per batch and server (UCX
pipelines its descriptors itself, and concurrent transfers of one agent contend).
Pure computation, on whichever thread sends.

Work items (``Work.items``), by op: ``PutItem`` (PUT), ``GetItem`` (GET), ``KeyItem``
(EXISTS, DELETE, TOUCH). NamedTuples: they cost what a tuple costs, and a frame holds
thousands. Each carries ``index``, the key's position in the caller's batch, which the
transports pass through and never send.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

from gcache.config import TransportKind
from gcache.errors import AuthError, TransportTimeout  # noqa: F401  (part of the contract)
from gcache.protocol import Op
from gcache.status import Status

#: Request ids of every connection of this process (unique per connection is enough).
next_request_id = itertools.count(1).__next__


#: ``PutItem.checksum`` of an unsliced value whose checksum is computed when it is sent
DIGEST_LATER = -1


class PutItem(NamedTuple):
    """One slice of a value to store."""

    key: bytes
    total_len: int  # the whole value's length
    offset: int  # of this slice in the value
    length: int  # of this slice
    put_id: int  # ties the slices of one sliced put together (0: not sliced)
    src: Any  # the slice's bytes: a memoryview or DeviceView of ``length`` bytes
    # xxh3_64 of the whole value, the same on every slice; or DIGEST_LATER for an
    # unsliced value: the transport computes it as it sends (``tcp.put_fields``; the shm
    # staging copy hashes the value in the same pass as it copies it)
    checksum: int | None
    index: int = 0  # the key's position in the caller's batch (not sent)


def frame_chain(part: Sequence[PutItem], before: Callable[[int], bytes | None]
                ) -> bytes | None:
    """The ``"ch"`` of a put frame holding ``part`` (slices of consecutive keys of one
    chain, by ``index``): ``before(i)``, the key of the page before key ``i``, for its
    first key. None when ``part``'s keys are not consecutive or ``before`` does not know
    (then no ``"ch"`` is sent)."""
    prev = part[0].index
    for it in part:
        if it.index - prev not in (0, 1):
            return None
        prev = it.index
    return before(part[0].index)


class GetItem(NamedTuple):
    """One slice of an object to read."""

    key: bytes
    offset: int
    max_len: int
    version: int  # the object version every slice must come from (0: any)
    dest: Any  # a memoryview / DeviceView to land in, or None: new bytes (a byte get)
    index: int = 0  # the key's position in the caller's batch (not sent)


class KeyItem(NamedTuple):
    """One key of an EXISTS, DELETE or TOUCH."""

    key: bytes
    index: int = 0  # the key's position in the caller's batch (not sent)


@dataclass(slots=True)
class ItemResult:
    status: Status
    total_len: int = 0
    version: int = 0
    nbytes: int = 0
    data: bytes | bytearray | None = None  # a byte get's bytes (bytes when copied once)
    checksum: int = 0  # a get's: the server's xxh3_64 of the whole object
    # a get's xxh3_64 of the bytes that landed, when the transport hashed them as they
    # landed (``Work.verify``, a slice that is the whole object); None: not hashed
    landed: int | None = None


@dataclass(slots=True, eq=False)
class Work:
    """One request frame for one server (items: see the module docstring)."""

    op: int
    ns: bytes
    items: list  # PutItem | GetItem | KeyItem, by op
    deadline: float
    on_done: Any  # callable(work, list[ItemResult]) -> None, called exactly once
    extra: dict | None = None  # merged into the request header (view epoch, placement hashes)
    retried: bool = False  # a NOT_OWNER re-send: never re-routed again
    address: str = ""  # the server it is for (the sender's bookkeeping; transports ignore it)
    state: int = 0  # 0 queued, 1 running, 2 done (moved under the dispatcher's state lock)
    # a get whose caller checks checksums: a transport that can hash a slice holding a
    # whole object while its bytes are still in the cache says so in ``landed``
    verify: bool = False


class Transport(abc.ABC):
    """One channel to one server (see the module docstring for threads and blocking)."""

    #: the data path of the current connection; None until the first connection is up
    kind: TransportKind | None = None

    @abc.abstractmethod
    def connect(self, deadline: float) -> None:
        """Dial and authenticate by ``deadline``."""

    @abc.abstractmethod
    def execute(self, work: Work) -> list[ItemResult]:
        """One request frame; one result per item, by ``work.deadline``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drop the connection (idempotent)."""


ONE_SIDED_FRAME_BYTES = 4 << 20  # smallest frame target on shm lanes
KEY_ITEM_BYTES = 64  # what an EXISTS / DELETE / TOUCH item counts for when packing


@dataclass(frozen=True, slots=True)
class Framing:
    """How one batch's items for one server are cut into request frames."""

    slice_bytes: int
    frame_target_bytes: int
    conns: int  # dispatch threads (connections) per server
    max_items: int  # items per frame (``Limits.max_batch_items``)

    @staticmethod
    def item_bytes(op: int, items: list) -> list[int]:
        """What each item counts for when packing: a get slice's ``max_len``, a put
        slice's ``length``, ``KEY_ITEM_BYTES`` for a key op."""
        if op == Op.GET:
            return [it.max_len for it in items]
        if op == Op.PUT:
            return [it.length for it in items]
        return [KEY_ITEM_BYTES] * len(items)

    def frames(self, kind: TransportKind | None, op: int, items: list) -> list[list]:
        """``items`` (one server's, in order) as frames for a lane of ``kind``."""
        sizes = self.item_bytes(op, items)
        total = sum(sizes)
        per_conn = -(-total // self.conns)
        if kind == TransportKind.SHM:
            # one-sided: no bytes travel in the frame and each frame costs two control
            # RPCs, so split the batch evenly over the lane's threads (no frame cap)
            target = max(ONE_SIDED_FRAME_BYTES, per_conn)
        elif kind == TransportKind.NIXL:
            # one NIXL transfer per batch: UCX pipelines its descriptors itself, and
            # concurrent transfers of one agent contend (measured: 1 frame 4.1 GB/s,
            # 4 frames 2.6 GB/s at 1 MiB over CMA)
            target = max(total, self.slice_bytes)
        else:
            target = max(self.slice_bytes, min(self.frame_target_bytes, per_conn))
        out: list[list] = []
        cur: list = []
        size, most = 0, self.max_items
        for it, n in zip(items, sizes):
            if cur and (size + n > target or len(cur) >= most):
                out.append(cur)
                cur, size = [], 0
            cur.append(it)
            size += n
        if cur:
            out.append(cur)
        return out
