"""LEASE/ALLOC are for one-sided peers only: same host (the peer's address is one of
ours) or NIXL (the server registered its arena). Before the fix a TCP client on another
host could ALLOC, and hold or publish chunks it never wrote. Checked here on the rule
itself; test_remote_peer_cannot_alloc_or_lease.py checks it with a real second host (a
network namespace)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gcache.server.shm_ops import is_local_address, one_sided_refusal

pytestmark = [pytest.mark.unit]


def _conn(peer, nixl=None):
    return SimpleNamespace(peer=peer, svc=SimpleNamespace(nixl_info=nixl))


def test_local_addresses_are_recognised():
    assert is_local_address("127.0.0.1") and is_local_address("::1")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never ours


def test_remote_peer_without_nixl_is_refused():
    assert one_sided_refusal(_conn(("127.0.0.1", 5000))) == ""
    why = one_sided_refusal(_conn(("192.0.2.1", 5000)))
    assert "192.0.2.1" in why and "GET and PUT" in why
    assert one_sided_refusal(_conn(("192.0.2.1", 5000), nixl={"agent": "a"})) == ""
