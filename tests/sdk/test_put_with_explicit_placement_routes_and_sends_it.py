"""``put_batch_from_async(..., placement=hashes)`` (the servers' handoff): each key goes to
its hash's owner and carries that hash (``ph``, which the owner's NOT_OWNER check agrees
with), so readers of the key's group find it; bad ``placement=`` raises ValueError. (That
the owner stores the hash is pinned by the drain tests in tests/server.)"""

from __future__ import annotations

import pytest

from gcache.sdk import Client, Status
from gcache.sdk.routing import placement_hashes
from gcache.testing.oracle import check_value, value_for
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.timeout(90)]

TOKEN = "tok"
SERVERS = [f"127.0.0.1:{p}" for p in (1, 2, 3)]  # never dialed: owners() does no IO


@pytest.mark.unit
def test_owners_by_placement_match_the_group_rule_and_bad_input_raises() -> None:
    keys = [f"k{i}".encode() for i in range(30)]
    groups = [f"g{i % 4}" for i in range(30)]
    ph = placement_hashes(b"ns", keys, groups)
    with Client(SERVERS, namespace="ns") as c:
        assert c.owners(keys, placement=ph) == c.owners(keys, group=groups)
        assert c.owners(keys, placement=ph) != c.owners(keys)  # not the keys' own owners
        for bad in (ph[:-1], ph[:-1] + [-1], ph[:-1] + [1 << 64], ph[:-1] + ["x"]):
            with pytest.raises(ValueError, match="one u64 placement hash per key"):
                c.put_batch(keys, [b"v"] * len(keys), placement=bad)
        with pytest.raises(ValueError, match="not both"):
            c.put_batch(keys, [b"v"] * len(keys), placement=ph, group=groups)


@pytest.mark.integration
def test_a_put_by_placement_is_a_hit_for_its_groups_readers(make_cluster) -> None:
    cl = make_cluster(3, "32MiB", masters=3, token=TOKEN)
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        wait_for(lambda: len(c.view.ring) == 3, 30)
        keys = [f"p-{i}".encode() for i in range(60)]
        groups = [f"session-{i % 5}" for i in range(60)]
        ph = placement_hashes(c.namespace, keys, groups)
        st = c.put_batch(keys, [value_for(k, 3000) for k in keys], placement=ph)
        assert st == [Status.OK] * len(keys)
        vals = c.get_batch(keys, group=groups)  # routed (and NOT_OWNER-checked) by group
        assert all(v is not None and check_value(k, v) for k, v in zip(keys, vals))
