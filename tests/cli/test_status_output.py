"""`gcache status` for people and scripts: a table that fits 80 columns with ids and
addresses whole and each member's recent hit ratio, ops/s and p99; `-o json` and
`-o tsv`; `--watch`; and an error naming every master tried."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gcache.cli import main as gcache_main
from gcache.sdk import Client, Status
from gcache.testing.cluster import free_port
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration]

TOKEN = "status-output-token"


def _status(cl, *args: str) -> str:
    r = CliRunner().invoke(gcache_main, ["status", "--masters", ",".join(cl.master_addresses),
                                         "--token", TOKEN, *args], terminal_width=80)
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.timeout(120)
def test_status_table_json_tsv_and_watch(make_cluster) -> None:
    cl = make_cluster(2, "32MiB", slab="1MiB", masters=1, token=TOKEN)
    with Client(masters=cl.master_addresses, token=TOKEN) as c:
        wait_for(lambda: len(c.view.members) == 2, 30)
        keys = [f"k{i}".encode() for i in range(200)]
        assert c.put_batch(keys, [b"v" * 1000] * 200) == [Status.OK] * 200

        def served() -> list[dict]:
            # reads again before each look: a server's recent window can end between
            # two frames of one batch (e.g. a previous-owner re-ask of the misses while
            # the ring's handoff window is open) and hold only its misses; the next
            # window of these reads holds both
            assert c.get_batch(keys[:150] + [b"absent"] * 50).count(None) == 50
            rows = list(csv.DictReader(io.StringIO(_status(cl, "-o", "tsv")),
                                       delimiter="\t"))
            ok = all(r["ops_per_s"] and r["hit_ratio"] for r in rows) and \
                0 < min(float(r["hit_ratio"]) for r in rows) < 1  # 50 of 200 reads missed
            return rows if ok else []

        rows = wait_for(served, 30)  # the next heartbeats carry the recent figures
    assert sorted(r["id"] for r in rows) == sorted(s.name for s in cl.servers)
    assert {r["address"] for r in rows} == set(cl.addresses)
    assert all(r["state"] == "up" and float(r["p99_ms"]) > 0 for r in rows)

    table = _status(cl)
    assert max(len(line) for line in table.splitlines()) <= 80, table
    for s in cl.servers:  # ids and addresses whole, not "up2…" / "127…"
        assert s.name in table and s.address in table, table
    assert "%" in table and "ms" in table or "µs" in table

    doc = json.loads(_status(cl, "-o", "json"))
    assert doc["epoch"] >= 2 and len(doc["members"]) == 2

    env = {**os.environ, "GCACHE_MASTERS": ",".join(cl.master_addresses),
           "GCACHE_TOKEN": TOKEN}
    watch = subprocess.Popen([sys.executable, "-m", "gcache.cli", "status", "-o", "tsv",
                              "--watch", "--interval", "0.3"], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        headers = 0
        while headers < 2:  # two refreshes, each a whole document
            line = watch.stdout.readline()
            assert line, "status --watch stopped on its own"
            headers += line.startswith("id\taddress")
    finally:
        watch.send_signal(signal.SIGINT)
        assert watch.wait(10) == 0


@pytest.mark.timeout(30)
def test_no_master_answers_names_every_master_tried() -> None:
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    r = CliRunner().invoke(gcache_main, ["status", "--masters", ",".join(dead)])
    assert r.exit_code == 1
    assert "(asked 2 of 2)" in r.output and all(a in r.output for a in dead), r.output
