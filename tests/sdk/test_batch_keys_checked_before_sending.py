"""Every batch call checks its keys before anything is sent, bytes keys included.

``Client._keys`` takes C-level passes when every key already is ``bytes`` of a valid
length; an empty key, one over ``max_key_bytes``, or a non-bytes key among bytes ones
must still be refused (empty, too long) or converted (str) exactly as ``_key`` does
per key. No server is needed: the refusal comes before any IO.
"""

from __future__ import annotations

import pytest

from gcache.sdk import Client
from gcache.testing.cluster import free_port

pytestmark = [pytest.mark.unit]


@pytest.mark.timeout(30)
def test_batch_keys_checked_before_sending():
    with Client([f"127.0.0.1:{free_port()}"], timeout_ms=200, connect_timeout_ms=100) as c:
        most = c.limits.max_key_bytes
        assert c._keys([b"a", "b", bytearray(b"c")]) == [b"a", b"b", b"c"]
        assert c._keys([b"a" * most, b"x"]) == [b"a" * most, b"x"]
        for bad in ([b"ok", b""], [b"ok", b"k" * (most + 1)], ["", b"ok"]):
            with pytest.raises(ValueError):
                c._keys(bad)
            with pytest.raises(ValueError):
                c.get_batch_into(bad, [bytearray(1)] * len(bad))
            with pytest.raises(ValueError):
                c.exists_batch(bad)
        assert c._keys([]) == []
