"""The masters' Raft port (API port + 1) runs no code for a peer without the masters' secret.

pysyncobj decrypts each Raft frame with a Fernet key derived from its password and then
unpickles it. The attacker here holds what servers and clients hold (the cluster token) and
also knows the old fixed loopback password; it sends each master a correctly framed,
pysyncobj-encrypted pickle whose unpickling would create a marker file. Masters are started
the way ``gcache up`` starts them (``Cluster``: a random Raft secret per cluster, in the
masters' environment). The marker must never appear and the Raft group must keep working.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from gcache.discovery import MasterClient
from gcache.testing.cluster import Cluster, MasterProc, free_port_pair
from gcache.testing.waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration]

TOKEN = "client-token-every-server-and-client-holds"
OLD_LOOPBACK_PASSWORD = "gcache-loopback-dev"


class _CreateFile:
    """Unpickling this object calls open(path, "w"): the file appearing proves code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def attack_frame(password: str, marker: Path) -> bytes:
    """One Raft frame exactly as pysyncobj's TcpConnection.send builds it."""
    from pysyncobj.encryptor import getEncryptor

    data = zlib.compress(pickle.dumps(_CreateFile(str(marker)), 2), 3)
    data = getEncryptor(password).encrypt(data)
    return struct.pack("i", len(data)) + data


def send_to_raft_port(api: str, frame: bytes) -> None:
    host, port = api.rsplit(":", 1)
    with socket.create_connection((host, int(port) + 1), timeout=5) as s:
        s.sendall(frame)
        s.settimeout(1.5)
        try:  # the master answers its own first frame, or closes on a bad one
            while s.recv(65536):
                pass
        except OSError:
            pass


def assert_no_marker(marker: Path, wait_s: float = 3.0) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        assert not marker.exists(), "a Raft frame from a non-master ran code in the master"
        time.sleep(0.1)


def wait_for(pred, timeout: float):
    return _wait_for(pred, timeout, step=0.1)


@pytest.mark.timeout(120)
def test_token_holder_cannot_run_code_through_the_raft_port(tmp_path):
    marker = tmp_path / "pwned"
    with Cluster(0, masters=3, token=TOKEN, log_dir=str(tmp_path)) as cl:
        mc = MasterClient(cl.master_addresses, TOKEN)
        wait_for(lambda: mc.status()["leader"], 20)
        for api in cl.master_addresses:
            for password in (TOKEN, OLD_LOOPBACK_PASSWORD):
                send_to_raft_port(api, attack_frame(password, marker))
        assert_no_marker(marker)
        assert all(m.alive for m in cl.masters)
        # the group still replicates: a registration commits and every master serves it
        wait_for(lambda: mc.register("after-attack", "127.0.0.1:1", 1 << 20, "boot"), 20)
        for api in cl.master_addresses:
            wait_for(lambda api=api: any(m["id"] == "after-attack" for m in
                                         MasterClient([api], TOKEN).view()["members"]), 10)
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_even_the_master_secret_cannot_unpickle_code(tmp_path):
    """Defence in depth: Raft frames are unpickled as plain data only, so a peer holding the
    masters' secret (a leaked secret, a compromised master) still cannot run code by a frame."""
    marker = tmp_path / "pwned"
    with Cluster(0, masters=3, token=TOKEN, log_dir=str(tmp_path)) as cl:
        mc = MasterClient(cl.master_addresses, TOKEN)
        wait_for(lambda: mc.status()["leader"], 20)
        for api in cl.master_addresses:
            send_to_raft_port(api, attack_frame(cl.raft_secret, marker))
        assert_no_marker(marker)
        assert all(m.alive for m in cl.masters)
        wait_for(lambda: mc.register("after-attack", "127.0.0.1:1", 1 << 20, "boot"), 20)
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "refused a Raft frame" in logs
    assert not marker.exists()


@pytest.mark.timeout(60)
def test_lone_loopback_master_without_secret_uses_no_well_known_password(tmp_path):
    marker = tmp_path / "pwned"
    m = MasterProc("lone", free_port_pair(), [], str(tmp_path / "data"), token="",
                   log_dir=str(tmp_path))
    try:
        m.start()
        for password in (OLD_LOOPBACK_PASSWORD, TOKEN):
            send_to_raft_port(m.address, attack_frame(password, marker))
        assert_no_marker(marker)
        assert m.alive
        assert MasterClient([m.address]).view()["epoch"] >= 0
    finally:
        m.terminate()
    assert not marker.exists()


def run_master(tmp_path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    try:
        return subprocess.run([sys.executable, "-m", "gcache.master.cli", *args,
                               "--data-dir", str(tmp_path / "data")],
                              env={**base, **env}, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as exc:  # today: it starts serving instead of refusing
        raise AssertionError(f"gcache-master did not refuse to start: {exc}") from None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["non-loopback", "peers-on-loopback", "secret-is-the-token",
                                  "short-secret"])
def test_master_refuses_to_start_without_its_own_secret(tmp_path, case):
    p, q = free_port_pair(), free_port_pair()
    args = {"non-loopback": ["--listen", "192.0.2.1:7000"],
            "peers-on-loopback": ["--listen", f"127.0.0.1:{p}", "--peers", f"127.0.0.1:{q}"],
            "secret-is-the-token": ["--listen", f"127.0.0.1:{p}"],
            "short-secret": ["--listen", f"127.0.0.1:{p}"]}[case]
    env = {"GCACHE_TOKEN": TOKEN}
    if case == "secret-is-the-token":
        env["GCACHE_RAFT_SECRET"] = TOKEN
    if case == "short-secret":
        env["GCACHE_RAFT_SECRET"] = "short"
    r = run_master(tmp_path, args, env)
    assert r.returncode != 0
    assert "Raft secret" in r.stderr and "openssl rand" in r.stderr, r.stderr[-2000:]


@pytest.mark.timeout(60)
def test_raft_secret_file_is_read(tmp_path):
    """The deploy files mount the secret as a file: a master started so serves."""
    secret = tmp_path / "raft-secret"
    secret.write_text("s3cret-only-the-masters-hold-0123456789\n")
    m = MasterProc("filed", free_port_pair(), [], str(tmp_path / "data"), token=TOKEN,
                   log_dir=str(tmp_path), extra=["--raft-secret-file", str(secret)])
    try:
        m.start()
        assert MasterClient([m.address], TOKEN).view()["epoch"] >= 0
    finally:
        m.terminate()
