"""``placement_hashes`` is the rule the client routes by: benches that import it (the
blast-radius bench) place keys exactly where ``Client`` sends them, for every form of
``group=``."""

from __future__ import annotations

import pytest

from gcache.hashing import placement_hash
from gcache.sdk import Client
from gcache.sdk.routing import placement_hashes
from gcache.view import View

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SERVERS = [f"127.0.0.1:{p}" for p in (1, 2, 3, 4, 5)]  # never dialed: owners() does no IO


@pytest.mark.parametrize("group", [None, "session-7", b"session-7",
                                   ["a", None, b"b", "a"] * 10])
def test_owners_follow_placement_hashes(group) -> None:
    keys = [f"k{i}".encode() for i in range(40)]
    ring = View.static(SERVERS).ring
    want = [m.address for m in ring.owners(placement_hashes(b"ns", keys, group))]
    with Client(SERVERS, namespace="ns") as c:
        assert c.owners(keys, group=group) == want


def test_a_group_ignores_the_key_and_a_none_entry_does_not() -> None:
    keys = [b"x", b"y"]
    assert placement_hashes(b"ns", keys, "g") == [placement_hash(b"ns", b"", b"g")] * 2
    assert placement_hashes(b"ns", keys, ["g", None]) == [
        placement_hash(b"ns", b"", b"g"), placement_hash(b"ns", b"y")]
    with pytest.raises(ValueError, match="one entry per key"):
        placement_hashes(b"ns", keys, ["g"])
