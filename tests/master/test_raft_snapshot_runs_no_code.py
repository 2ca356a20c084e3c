"""A Raft snapshot, read at start from the data dir or sent by a peer to catch a master
up, runs no code in the master.

Before, ``RaftNode._load_snapshot`` read the snapshot with plain ``pickle``: whoever could
write a master's data dir, or held the masters' Raft secret (a leaked secret, a
compromised master), ran code in it. Snapshots are now magic + msgpack; older pickled
(format 1) files are read as plain data only. Each attack's pickle would create a marker
file: the marker must never appear, the master refuses the snapshot with a clear
message, and the Raft group keeps working.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest

from gcache.discovery import MasterClient
from gcache.master import raft_snapshot
from gcache.master.membership import Membership
from gcache.testing.cluster import Cluster
from gcache.testing.waiting import wait_for as _wait_for

class _CreateFile:
    """Unpickling this object calls open(path, "w"): the file appearing proves code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_pickle(marker: Path, protocol: int = 4) -> bytes:
    return pickle.dumps(_CreateFile(str(marker)), protocol)


def evil_format1_snapshot(marker: Path) -> bytes:
    """Shaped like the pickled snapshots older masters wrote, with code in the raft part."""
    return pickle.dumps({"membership": Membership(None).snapshot(), "applied_index": 1,
                         "raft": evil_pickle(marker)})


def wait_for(pred, timeout: float):
    return _wait_for(pred, timeout, step=0.1)


def assert_no_marker(marker: Path, wait_s: float = 3.0) -> None:
    end = time.monotonic() + wait_s
    while True:
        assert not marker.exists(), "a Raft snapshot ran code in the master"
        if time.monotonic() >= end:
            return
        time.sleep(0.1)


def member_ids(api: str) -> set[str]:
    return {m["id"] for m in MasterClient([api]).view()["members"]}


def everyone_sees(cl: Cluster, member: str, timeout: float = 15) -> None:
    for api in cl.master_addresses:
        wait_for(lambda api=api: member in member_ids(api), timeout)


# ------------------------------------------------------------------ format (no processes)
@pytest.mark.unit
@pytest.mark.parametrize("make", [
    lambda m: evil_pickle(m),
    lambda m: evil_pickle(m, 2),
    evil_format1_snapshot,
    lambda m: pickle.dumps({"membership": b"", "applied_index": 1,
                            "raft": pickle.dumps(((b"\x01", 2, 1), (b"\x01", 1, 1),
                                                  {_CreateFile(str(m))}))}),
], ids=["pickle", "pickle-protocol-2", "format1-raft-part", "format1-node-is-code"])
def test_decoder_refuses_code_in_any_pickle(tmp_path, make):
    marker = tmp_path / "pwned"
    with pytest.raises(raft_snapshot.SnapshotRefused):
        raft_snapshot.decode(make(marker))
    assert not marker.exists()


@pytest.mark.unit
def test_decoder_refuses_garbage_and_oversize():
    for data in (b"", b"garbage", raft_snapshot.MAGIC + b"\xc1",
                 raft_snapshot.MAGIC + b"\x80",  # msgpack {}: no fields
                 b"\x80" * (raft_snapshot.MAX_SNAPSHOT_BYTES + 1)):
        with pytest.raises(raft_snapshot.SnapshotRefused):
            raft_snapshot.decode(data)


# ------------------------------------------------------------------ the data dir
@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("payload", ["pickle", "format1"])
def test_malicious_snapshot_file_is_refused_at_start(tmp_path, payload):
    """Someone who can write a master's data dir plants a pickled snapshot: the master
    refuses to start on it, says what to do, and after that catches up from its peers."""
    marker = tmp_path / "pwned"
    with Cluster(0, masters=3, log_dir=str(tmp_path), data_dir=str(tmp_path / "masters")) as cl:
        mc = MasterClient(cl.master_addresses)
        wait_for(lambda: mc.status()["leader"], 20)
        victim = cl.masters[1]
        victim.terminate()
        data = evil_pickle(marker) if payload == "pickle" else evil_format1_snapshot(marker)
        Path(victim.data_dir, "raft.snapshot").write_bytes(data)
        try:
            r = subprocess.run(victim.argv(), env=victim.env(), capture_output=True,
                               text=True, timeout=20)
        except subprocess.TimeoutExpired:  # before the fix: it starts (having run the code)
            assert_no_marker(marker, 0)
            raise AssertionError("gcache-master started on a snapshot it cannot read") from None
        assert_no_marker(marker, 0)
        assert r.returncode != 0
        assert "raft.snapshot" in r.stderr and "refused" in r.stderr, r.stderr[-2000:]
        assert "data directory aside" in r.stderr, r.stderr[-2000:]
        # the group kept going without it, and the fix the message names works
        mc_others = MasterClient([a for a in cl.master_addresses if a != victim.address])
        wait_for(lambda: mc_others.register("while-away", "127.0.0.1:1", 1 << 20, "b"), 20)
        shutil.move(victim.data_dir, victim.data_dir + ".refused")
        os.makedirs(victim.data_dir)
        victim.start()
        everyone_sees(cl, "while-away")
        wait_for(lambda: mc.register("after", "127.0.0.1:2", 1 << 20, "b"), 20)
        everyone_sees(cl, "after")
    assert not marker.exists()


# ------------------------------------------------------------------ a peer with the secret
def _frame(fernet, message) -> bytes:
    data = fernet.encrypt_at_time(zlib.compress(pickle.dumps(message, 4), 3), int(time.time()))
    return struct.pack("i", len(data)) + data


def _read_frame(sock: socket.socket, fernet):
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the master closed the Raft connection")
            buf += chunk
        return buf

    (n,) = struct.unpack("i", exact(4))
    return pickle.loads(zlib.decompress(fernet.decrypt(exact(n))))  # from the master: trusted


def send_snapshot_as_leader(raft_addr: str, claim: str, secret: str, snapshot: bytes) -> None:
    """Act as master ``claim`` (the secret lets us) and install ``snapshot`` on the master
    at ``raft_addr``, exactly as a pysyncobj leader sends one to a lagging follower."""
    from pysyncobj.encryptor import getEncryptor

    fernet = getEncryptor(secret)
    host, port = raft_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        mine = os.urandom(32)
        s.sendall(_frame(fernet, mine))
        echoed, theirs = _read_frame(s, fernet)
        assert echoed == mine
        s.sendall(_frame(fernet, (theirs, claim)))
        s.sendall(_frame(fernet, (theirs, {"type": "append_entries", "term": 1000,
                                           "commit_index": 0,
                                           "serialized": (snapshot, True, True)})))
        s.settimeout(2)
        try:
            while s.recv(65536):
                pass
        except OSError:
            pass


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_peer_holding_the_raft_secret_cannot_run_code_by_a_snapshot(tmp_path):
    marker = tmp_path / "pwned"
    with Cluster(0, masters=3, log_dir=str(tmp_path), data_dir=str(tmp_path / "masters")) as cl:
        mc = MasterClient(cl.master_addresses)
        wait_for(lambda: mc.status()["leader"], 20)
        gone, victim = cl.masters[2], cl.masters[1]
        gone.kill9()  # its Raft address is the one the attacker claims
        raft = {m.address: m.address.rsplit(":", 1)[0] + f":{m.port + 1}" for m in cl.masters}
        send_snapshot_as_leader(raft[victim.address], raft[gone.address], cl.raft_secret,
                                evil_format1_snapshot(marker))
        assert_no_marker(marker)
        assert victim.alive
        # the two live masters still form a group and the victim follows it again
        live = MasterClient([cl.masters[0].address, victim.address])
        wait_for(lambda: live.register("after-attack", "127.0.0.1:1", 1 << 20, "b"), 30)
        wait_for(lambda: "after-attack" in member_ids(victim.address), 15)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "refused the Raft snapshot" in logs
    assert not marker.exists()
