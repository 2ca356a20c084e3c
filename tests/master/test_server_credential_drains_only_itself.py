"""``POST /self``: a server credential (``server = true``, no admin) drains or removes only
the member it runs as, proven by that member's boot id; against 3 real masters and two
real servers registered with the same fleet credential.

* member A's boot id on member B: 403 naming the fix, at the leader and at a follower
  alike; B stays up;
* ``remove`` before the drain: 409 (a server deregisters only after its drain);
* a data credential: 403; the fleet credential on ``/admin``: still 403;
* with its own boot id: drain (B draining), then remove (B gone).
"""

from __future__ import annotations

import os

import pytest

from gcache.discovery import MasterClient, MasterError
from gcache.testing.cluster import Cluster
from gcache.testing.waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SA, SF, SO = "a" * 24, "f" * 24, "o" * 24
CREDS = f"""
[[credential]]
id = "team-a"
secret = "{SA}"
grants = [{{ namespaces = "team-a/*", rights = ["read", "write"] }}]

[[credential]]
id = "fleet"
secret = "{SF}"
server = true

[[credential]]
id = "ops"
secret = "{SO}"
grants = [{{ namespaces = "*", rights = ["admin"] }}]
"""


def wait_for(pred, timeout: float):
    return _wait_for(pred, timeout, retry_on=(Exception,))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith("GCACHE_"):
            monkeypatch.delenv(var)


@pytest.fixture
def fleet_cluster(tmp_path):
    path = tmp_path / "credentials.toml"
    path.write_text(CREDS)
    cl = Cluster(2, "16MiB", slab="1MiB", masters=3, log_dir=str(tmp_path),
                 server_extra=["--credentials-file", str(path), "--credential", f"fleet:{SF}"],
                 master_extra=["--credentials-file", str(path)])
    cl.start()
    try:
        for addr in cl.master_addresses:
            ops = MasterClient([addr], f"ops:{SO}")
            wait_for(lambda o=ops: [m["state"] for m in o.view()["members"]] == ["up", "up"],
                     20)
        yield cl
    finally:
        cl.close()


def test_server_credential_drains_only_its_own_member(fleet_cluster):
    ops = MasterClient(fleet_cluster.master_addresses, f"ops:{SO}")
    view = ops.view()
    lead = view["leader"]
    a, b = view["members"]
    follower = next(m for m in fleet_cluster.master_addresses if m != lead)
    for addr in (lead, follower):
        fleet = MasterClient([addr], f"fleet:{SF}")
        with pytest.raises(MasterError) as err:  # A's boot on B: another member
            fleet.self_op("drain", b["id"], a["boot_id"])
        assert err.value.code == 403, err.value
        assert "only the member it runs as" in err.value.message
        with pytest.raises(MasterError) as err:
            fleet.self_op("remove", b["id"], b["boot_id"])  # not drained yet
        assert err.value.code == 409 and "only after its drain" in err.value.message
        with pytest.raises(MasterError) as err:
            fleet.admin("drain", b["id"])
        assert err.value.code == 403
        with pytest.raises(MasterError) as err:
            MasterClient([addr], f"team-a:{SA}").self_op("drain", b["id"], b["boot_id"])
        assert err.value.code == 403
        with pytest.raises(MasterError) as err:
            fleet.self_op("leave", b["id"], b["boot_id"])
        assert err.value.code == 400
    assert [m["state"] for m in ops.view()["members"]] == ["up", "up"]
    # with its own boot id, through a follower too
    fleet = MasterClient([follower], f"fleet:{SF}")
    assert fleet.self_op("drain", b["id"], b["boot_id"])["member"]["state"] == "draining"
    wait_for(lambda: {m["id"]: m["state"] for m in ops.view()["members"]}
             == {a["id"]: "up", b["id"]: "draining"}, 10)
    # stopped first: its heartbeats would register it again after the remove
    next(s for s in fleet_cluster.servers if s.name == b["id"]).terminate()
    assert fleet.self_op("remove", b["id"], b["boot_id"])["member"] is None
    wait_for(lambda: [m["id"] for m in ops.view()["members"]] == [a["id"]], 10)
