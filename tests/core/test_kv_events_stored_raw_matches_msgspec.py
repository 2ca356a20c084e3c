"""The publisher's pre-framed BlockStored (``stored_raw``) is byte for byte what msgspec
encodes for the struct (``stored_event``), for every key-length class and medium, so the
fast path can never publish something vLLM's decoder reads differently."""

from __future__ import annotations

import msgspec
import pytest

from gcache.kv_events import KVEventBatch, Medium, stored_event, stored_raw

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.mark.parametrize("medium", list(Medium))
@pytest.mark.parametrize("length", [1, 255, 256, 512, 65535, 65536])
def test_stored_raw_encodes_exactly_like_the_struct(medium, length):
    key = bytes(range(256)) * (length // 256) + bytes(length % 256)
    enc = msgspec.msgpack.encode
    fast = enc(KVEventBatch(1.5, [stored_raw(key, medium), stored_raw(b"k", medium)]))
    slow = enc(KVEventBatch(1.5, [stored_event(key, medium), stored_event(b"k", medium)]))
    assert fast == slow
    back = msgspec.msgpack.decode(fast, type=KVEventBatch)
    assert back.events[0].block_hashes == [key] and back.events[0].medium == medium.value
