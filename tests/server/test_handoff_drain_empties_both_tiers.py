"""Drain 4 -> 3 with the memory and the disk tier populated: once ``gcache admin drain ID
--wait`` returns, the drained server holds nothing, and every key acknowledged before
(and during) the drain reads back byte-exact from the other three; an oracle reader
running throughout never sees a wrong value, nor a miss. ``gcache status`` and the drained server's
/metrics show what it handed off."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections import Counter

import pytest

from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import OracleLoad, TOKEN, member, put_all, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

SIZE = 16_000
N = 2400  # 38 MB over 4 servers of 8 MiB memory: about half of each on disk


def test_drain_wait_hands_off_memory_and_disk(make_cluster, tmp_path):
    cl = start_cluster(make_cluster, 4, "8MiB", slab="1MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "128MiB",
        "--segment-bytes", "4MiB", "--metrics-listen", "127.0.0.1:0"])
    keys = [f"k-{i}".encode() for i in range(N)]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, keys, SIZE)
        # the server owning the most keys (at least N / 4, past its memory's high
        # watermark): the ring's draw decides the shares, as server ids are random, and
        # the smallest may demote too few objects to its disk
        most = Counter(c.owners(keys)).most_common(1)[0][0]
        gone = next(s for s in cl.servers if s.address == most)
        before = Client([gone.address], token=TOKEN)
        # the mover demotes past the memory tier's high watermark in the background
        wait_for(lambda: (lambda st: st["objects"] > 50 and st["disk_objects"] > 50)(
            before.stats()[gone.address]), 20)  # both tiers hold data
        load = OracleLoad(c, keys, SIZE).start()
        try:
            r = subprocess.run(
                [sys.executable, "-m", "gcache.cli", "admin", "drain", gone.name, "--wait",
                 "--timeout", "60", "--masters", ",".join(cl.master_addresses),
                 "--token", TOKEN], capture_output=True, text=True, timeout=90)
        finally:
            load.stop()
        assert r.returncode == 0, r.stdout + r.stderr
        assert "drained" in r.stdout and "can be removed" in r.stdout
        # the drained server holds nothing, in either tier
        st = before.stats()[gone.address]
        before.close()
        assert (st["objects"], st["disk_objects"]) == (0, 0), st
        row = member(cl, gone.name)
        assert row["state"] == "draining"
        assert row["stats"]["handoff_lost"] == 0
        assert row["stats"]["handoff_objects_moved"] >= N // 8
        # 100 % of what was acknowledged, byte-exact, from the other three
        assert gone.address not in {m.address for m in c.view.members}
        got = read_back(c, keys + load.written, SIZE)
        # reads stay hits while the data moves (the SDK asks the previous owner on a miss)
        assert load.misses == 0, f"{load.misses} of {load.reads} reads missed"
        assert got.wrong == [] and load.wrong == []
        assert got.missing == [], f"{len(got.missing)} acknowledged keys lost"
        assert got.ok == N + len(load.written)
        assert load.reads > 0
    moved = row["stats"]["handoff_objects_moved"]
    r = subprocess.run([sys.executable, "-m", "gcache.cli", "status", "--masters",
                        ",".join(cl.master_addresses), "--token", TOKEN],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "handoff" in r.stdout
    assert f"done, {moved:,} moved" in r.stdout
    log = (tmp_path / f"{gone.name}.log").read_text()
    url = re.search(r"metrics on (http://\S+/metrics)", log)[1]
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert f"gcache_handoff_objects_moved_total {float(moved)}" in text
    assert "gcache_handoff_objects_left 0.0" in text and "gcache_handoff_lost_total 0.0" in text
