"""The handoff presents the server's own credential to the other servers, so that
credential needs ``write`` on the namespaces it moves: a drained server whose credential
may write only ``team-a/*`` hands off team-a's keys, keeps team-b's (their puts answer
AUTH; counted as waiting, retried), and hands them off too once the credentials file
grants ``"*"`` (SIGHUP, no restart). Nothing is lost or wrong on the way."""

from __future__ import annotations

import os

import pytest

from gcache.discovery import MasterClient
from gcache.sdk import Client
from gcache.testing.cluster import Cluster
from gcache.testing.waiting import wait_for
from handoffops import put_all, read_back

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

SF, SO = "f" * 24, "o" * 24
SIZE, N = 4000, 200


def creds(fleet_namespaces: str) -> str:
    return f"""
[[credential]]
id = "fleet"
secret = "{SF}"
server = true
grants = [{{ namespaces = "{fleet_namespaces}", rights = ["write"] }}]

[[credential]]
id = "ops"
secret = "{SO}"
grants = [{{ namespaces = "*", rights = ["admin"] }}]
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith("GCACHE_"):
            monkeypatch.delenv(var)


def test_handoff_moves_only_what_the_server_credential_may_write(make_cluster, tmp_path):
    path = tmp_path / "credentials.toml"
    path.write_text(creds("team-a/*"))
    cl: Cluster = make_cluster(2, "32MiB", slab="1MiB", masters=3, server_extra=[
        "--credentials-file", str(path), "--credential", f"fleet:{SF}"],
        master_extra=["--credentials-file", str(path)])
    ops = MasterClient(cl.master_addresses, f"ops:{SO}")
    wait_for(lambda: [m["state"] for m in ops.view()["members"]] == ["up", "up"], 30)
    gone = cl.servers[0]
    keys = [f"c-{i}".encode() for i in range(N)]
    clients = {ns: Client(masters=cl.master_addresses, credential=f"ops:{SO}",
                          namespace=ns, timeout_ms=5000) for ns in ("team-a/m", "team-b/m")}
    try:
        for c in clients.values():
            put_all(c, keys, SIZE)
        held = clients["team-a/m"].stats()[gone.address]["objects"]
        assert held > N // 4  # about half of each namespace
        epoch = ops.admin("drain", gone.name)["epoch"]

        def row() -> dict:
            return next(m for m in ops.status()["members"] if m["id"] == gone.name)["stats"]

        def refused() -> dict | None:  # a finished pass that kept only what was refused
            st = row()
            return st if (st.get("handoff_epoch", -1) >= epoch and not st["handoff_active"]
                          and st["handoff_objects_moved"] > 0
                          and st["handoff_objects_left"] == st["handoff_waiting"]
                          == st["objects"] > 0) else None

        # team-a's keys left; team-b's stay, refused (AUTH) and waiting for a retry
        st = wait_for(refused, 30)
        assert st["objects"] < held
        path.write_text(creds("*"))
        for s in cl.servers:
            s.hup()  # the servers re-read the file: the fleet may now write team-b too
        wait_for(lambda: row()["objects"] == 0 and row()["handoff_objects_left"] == 0, 30)
        assert row()["handoff_lost"] == 0
        for c in clients.values():
            got = read_back(c, keys, SIZE)
            assert got.wrong == [] and got.missing == [] and got.ok == N
    finally:
        for c in clients.values():
            c.close()
