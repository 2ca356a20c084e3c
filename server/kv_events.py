"""KV events, the contract: what the tiers report, and the records on the wire.

Every gcache-server can publish what it holds for cache-aware routers (llm-d's precise
prefix scorer, Dynamo's KV router) in vLLM's KV-event format
(``vllm/distributed/kv_events.py``, vLLM 0.33.0), so a subscriber decodes it with
vLLM's own ``msgspec.msgpack.Decoder(type=KVEventBatch)``. Off by default
(``--kv-events-endpoint``). The publisher is ``kv_event_publisher``; the design, the
wire details and how a router consumes them: ``docs/kv-events.md``.

* ``Medium`` names the tier in each event's ``medium``: ``CPU`` (the shared-memory
  tier), ``STORAGE`` (the NVMe tier).
* ``EventQueue``: one per tier. The tier calls ``stored(ns, key)`` when an object
  becomes current in its index (a put, a replace, a promotion into memory, a demotion
  onto disk, a compaction carry) and ``removed(ns, key)`` when it leaves it (eviction,
  demotion or promotion out of it, delete, a newer version elsewhere, a corrupt drop).
  Threads: the tier's own, with **the tier's lock held** (connection threads, the
  evictor, the mover), which serialises the calls of one queue. They never block and
  make no syscall: a ``deque`` append, or, past ``max_events``, a counted drop
  (``dropped``) that the publisher turns into a visible sequence gap. ``drain`` is the
  publisher thread's.
* ``Resident``: one row of a snapshot (what a tier holds now).
* The wire records (``KVEventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``) are field for field vLLM's: msgspec structs, a batch an array
  ``[ts, events]``, each event a map tagged ``type``. ``block_hashes`` hold gcache key
  bytes (vLLM's ``ExternalBlockHash`` is ``bytes | int``); a BlockStored carries one key
  with ``parent_block_hash`` None, ``token_ids`` empty and ``block_size`` 0 (the store
  does not know the engine's chain); a BlockRemoved carries the keys of one medium.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import NamedTuple

import msgspec

from gcache.errors import ConfigError
from gcache.network import is_loopback

__all__ = ["Medium", "EventQueue", "Resident", "BlockStored", "BlockRemoved",
           "AllBlocksCleared", "KVEventBatch", "stored_event", "check_endpoint",
           "check_kv_events"]


class Medium(str, enum.Enum):
    """The ``medium`` of an event: which tier holds the block (vLLM's names)."""

    MEMORY = "CPU"
    DISK = "STORAGE"


# ---------------------------------------------------------------- wire records
# Field for field vLLM 0.33.0's (``tests/server/test_kv_events_decoded_by_vllm.py``
# decodes them with vLLM's classes); its fields with defaults are left out.
class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True,
                       gc=False):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def stored_event(key: bytes, medium: Medium) -> BlockStored:
    return BlockStored([key], None, [], 0, None, medium.value, None)


class Resident(NamedTuple):
    """One object a tier holds now (a snapshot row)."""

    ns: bytes
    key: bytes
    medium: Medium


# ---------------------------------------------------------------- the tiers' side
class EventQueue:
    """One tier's index changes, for the publisher. ``stored`` / ``removed`` are called
    with that tier's lock held, which serialises them; they never block and make no
    syscall. Bounded: past ``max_events`` an event is dropped and counted (``dropped``),
    and the publisher makes the gap visible."""

    __slots__ = ("medium", "_q", "_cap", "dropped")

    def __init__(self, medium: Medium, max_events: int) -> None:
        if max_events < 1:
            raise ConfigError(f"kv_events_queue_events {max_events} must be at least 1")
        self.medium = medium
        self._q: deque[tuple[bool, bytes, bytes]] = deque()
        self._cap = max_events
        self.dropped = 0

    def stored(self, ns: bytes, key: bytes) -> None:
        if len(self._q) < self._cap:
            self._q.append((True, ns, key))
        else:
            self.dropped += 1

    def removed(self, ns: bytes, key: bytes) -> None:
        if len(self._q) < self._cap:
            self._q.append((False, ns, key))
        else:
            self.dropped += 1

    def drain(self, limit: int) -> list[tuple[bool, bytes, bytes]]:
        """Up to ``limit`` events, oldest first (the publisher thread only)."""
        out = []
        q = self._q
        try:
            for _ in range(limit):
                out.append(q.popleft())
        except IndexError:
            pass
        return out




def check_endpoint(endpoint: str, flag: str) -> str:
    """The host of a ZMQ endpoint this server can bind (``tcp://HOST:PORT``; ``ipc://PATH``
    gives ""); ConfigError otherwise."""
    if endpoint.startswith("ipc://") and len(endpoint) > 6:
        return ""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[6:].rpartition(":")
        if sep and host and port.isdigit() and int(port) < 65536:
            return host.strip("[]")
    raise ConfigError(f"{flag} {endpoint!r} is not a ZMQ endpoint to bind; give "
                      "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5557) or ipc:///path")


def check_kv_events(pub: str, replay: str, auth: object) -> None:
    """The KV-event endpoints of a server config (ConfigError with the fix): endpoints
    that parse, the replay one only with the PUB one, and a non-loopback bind only with
    auth on (``auth``), as for ``--listen``: the stream names every key, unauthenticated."""
    if replay and not pub:
        raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint; set both "
                          "or neither")
    for value, flag in ((pub, "--kv-events-endpoint"),
                        (replay, "--kv-events-replay-endpoint")):
        if not value:
            continue
        host = check_endpoint(value, flag)
        if host and not auth and not is_loopback(host):
            raise ConfigError(f"refusing to bind non-loopback address {host} ({flag}) "
                              "without auth: set --credentials-file (or --token) on the "
                              "server, or bind loopback (the KV-event stream names every key)")
