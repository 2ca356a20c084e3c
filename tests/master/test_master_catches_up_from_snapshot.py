"""Raft snapshots end to end: a wiped master catches up from the snapshot a peer sends
(the log it missed was compacted away), the files are the plain msgpack format, and a
master upgraded from the older pickled format keeps its state.

``--raft-compaction-min-entries 20`` makes the masters compact after a few writes.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
from pysyncobj.node import TCPNode

from gcache.discovery import MasterClient
from gcache.master import raft_snapshot
from gcache.master.membership import Membership
from gcache.testing.cluster import Cluster, MasterProc, free_port_pair
from gcache.testing.waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

COMPACT = ["--raft-compaction-min-entries", "20"]


def wait_for(pred, timeout: float):
    return _wait_for(pred, timeout, step=0.1)


def snapshot_file(m: MasterProc) -> Path:
    return Path(m.data_dir, "raft.snapshot")


def compacted(m: MasterProc) -> bool:
    f = snapshot_file(m)
    return f.exists() and f.stat().st_size > 0


def assert_plain_format(m: MasterProc) -> raft_snapshot.RaftSnapshot:
    data = snapshot_file(m).read_bytes()
    assert data.startswith(raft_snapshot.MAGIC), \
        f"{m.name}'s snapshot is not the msgpack format (starts {data[:8]!r})"
    return raft_snapshot.decode(data)


@pytest.mark.timeout(180)
def test_wiped_master_catches_up_from_a_snapshot_and_the_group_keeps_working(tmp_path):
    with Cluster(0, masters=3, log_dir=str(tmp_path), data_dir=str(tmp_path / "masters"),
                 master_extra=COMPACT) as cl:
        mc = MasterClient(cl.master_addresses)
        wait_for(lambda: mc.status()["leader"], 20)
        victim = cl.masters[2]
        victim.kill9()
        shutil.rmtree(victim.data_dir)
        os.makedirs(victim.data_dir)
        others = MasterClient(cl.master_addresses[:2])
        for i in range(40):  # well past the compaction threshold, while it is gone
            wait_for(lambda i=i: others.register(f"m-{i}", f"127.0.0.1:{i + 1}", 1 << 20,
                                                 "boot"), 10)
        for m in cl.masters[:2]:
            wait_for(lambda m=m: compacted(m), 20)
            snap = assert_plain_format(m)
            assert snap.applied_index > 20 and len(snap.cluster) == 3
        victim.start()
        want = others.view()
        mine = MasterClient([victim.address])
        wait_for(lambda: mine.view()["epoch"] >= want["epoch"], 20)
        got = {m["id"] for m in mine.view()["members"]}
        assert {f"m-{i}" for i in range(40)} <= got
        # it caught up by a snapshot (the log it missed is gone), stored as sent
        assert compacted(victim)
        assert_plain_format(victim)
        # and the group keeps working, through the caught-up master too
        wait_for(lambda: mine.register("after", "127.0.0.1:99", 1 << 20, "boot"), 20)
        for api in cl.master_addresses:
            wait_for(lambda api=api: "after" in {m["id"] for m in
                                                 MasterClient([api]).view()["members"]}, 15)
        # and a full restart reads the (msgpack) snapshot files back
        for m in cl.masters:
            m.terminate()
        for m in cl.masters:
            m.spawn()
        for m in cl.masters:
            m.wait_ready()
        wait_for(lambda: mc.status()["leader"], 20)
        for api in cl.master_addresses:
            wait_for(lambda api=api: "after" in {m["id"] for m in
                                                 MasterClient([api]).view()["members"]}, 15)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "refused" not in logs and "failed to load full dump" not in logs


def format1_snapshot(raft_addr: str) -> bytes:
    """A snapshot exactly as masters before the msgpack format wrote it: a pickle of our
    membership and a pickle of pysyncobj's (last entry, previous entry, nodes)."""
    m = Membership(None)
    m.apply({"op": "register", "id": "from-old-snapshot", "address": "127.0.0.1:5",
             "capacity_bytes": 1 << 20, "boot_id": "b"}, index=9)
    no_op = bytes([1])  # pysyncobj's NO_OP command
    meta = ((no_op, 10, 1), (no_op, 9, 1), {TCPNode(raft_addr)})
    return pickle.dumps({"membership": m.snapshot(), "applied_index": m.applied_index,
                         "raft": pickle.dumps(meta)})


@pytest.mark.timeout(90)
def test_master_upgraded_from_a_pickled_snapshot_keeps_its_state(tmp_path):
    port = free_port_pair()
    data = tmp_path / "data"
    data.mkdir()
    (data / "raft.snapshot").write_bytes(format1_snapshot(f"127.0.0.1:{port + 1}"))
    m = MasterProc("upgraded", port, [], str(data), log_dir=str(tmp_path), extra=COMPACT)
    try:
        m.start()
        mc = MasterClient([m.address])
        wait_for(lambda: "from-old-snapshot" in {x["id"] for x in mc.view()["members"]}, 15)
        # new writes land after the snapshot's index (not skipped as replays) ...
        wait_for(lambda: mc.register("new", "127.0.0.1:6", 1 << 20, "b"), 15)
        assert {x["id"] for x in mc.view()["members"]} == {"from-old-snapshot", "new"}
        # ... and the next compaction rewrites the file in the msgpack format
        for i in range(30):
            wait_for(lambda i=i: mc.register(f"n-{i}", "127.0.0.1:7", 1 << 20, "b"), 10)
        wait_for(lambda: snapshot_file(m).read_bytes().startswith(raft_snapshot.MAGIC), 20)
    finally:
        m.terminate()
    log = (tmp_path / "upgraded.log").read_text()
    assert "format-1" in log
