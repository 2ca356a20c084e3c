"""KV events on the wire: vLLM's KV-event records, the topic rule and the endpoint
checks, shared by the servers (``gcache.server.kv_events``: what the tiers report;
``gcache.server.kv_event_publisher``) and the masters (``gcache.master.down_events``:
a lost server). Design, wire and how routers consume them: ``docs/kv-events.md``.

The records are field for field vLLM 0.33.0's (``vllm/distributed/kv_events.py``), so
a subscriber decodes them with vLLM's own ``msgspec.msgpack.Decoder(type=KVEventBatch)``:
a batch is an array ``[ts, events]``, each event a map tagged ``type``; the fields vLLM
gives defaults are left out. ``block_hashes`` hold gcache key bytes (vLLM's
``ExternalBlockHash`` is ``bytes | int``); a BlockStored carries one key with
``parent_block_hash`` None, ``token_ids`` empty and ``block_size`` 0 (the store does not
know the engine's chain); a BlockRemoved carries the keys of one medium.

Topics: ``kv@<server>@<namespace>``; ``kv@<server>@*`` (``ALL_NAMESPACES``) concerns
every namespace of that server (``topic``).
"""

from __future__ import annotations

import enum

import msgspec

from gcache.errors import ConfigError
from gcache.network import is_loopback

__all__ = ["Medium", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch",
           "stored_event", "stored_raw", "topic", "ALL_NAMESPACES", "check_endpoint", "check_kv_events"]

ALL_NAMESPACES = b"*"


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


def stored_event(key: bytes, medium: Medium, parent: bytes | None = None) -> BlockStored:
    """One key's BlockStored; ``parent``: the key before it in its chain, if known."""
    return BlockStored([key], parent, [], 0, None, medium.value, None)


_ENCODE = msgspec.msgpack.Encoder().encode
_SENTINEL = b"\x00gcache-key\x01"


def _template(medium: str) -> tuple[bytes, bytes]:
    """The msgpack bytes of a one-key BlockStored of ``medium`` before and after the
    key's ``bin`` value, cut from msgspec's own encoding (so there is one encoder)."""
    raw = _ENCODE(BlockStored([_SENTINEL], None, [], 0, None, medium, None))
    i = raw.index(_SENTINEL)
    if raw[i - 2:i] != b"\xc4" + bytes((len(_SENTINEL),)):
        raise RuntimeError("msgspec encoded a BlockStored key unexpectedly")
    return raw[:i - 2], raw[i + len(_SENTINEL):]


_TEMPLATES = {m: _template(m.value) for m in Medium}


def stored_raw(key: bytes, medium: Medium) -> msgspec.Raw:
    """``stored_event(key, medium)`` already encoded (the same bytes; a list of these
    encodes inside a ``KVEventBatch``): the publisher's per-key cost, half of building
    and encoding the struct."""
    pre, post = _TEMPLATES[medium]
    n = len(key)
    if n < 256:
        head = b"\xc4" + bytes((n,))
    elif n < 65536:
        head = b"\xc5" + n.to_bytes(2, "big")
    else:
        head = b"\xc6" + n.to_bytes(4, "big")
    return msgspec.Raw(b"".join((pre, head, key, post)))


def topic(server: bytes, ns: bytes) -> bytes:
    """The topic of ``server``'s events about namespace ``ns`` (``ALL_NAMESPACES``: all)."""
    return b"kv@" + server + b"@" + ns


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
