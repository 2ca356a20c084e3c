"""A TCP peer on another host may not ALLOC or LEASE: only GET and PUT.

ALLOC reserves an arena chunk for a one-sided writer (shm on the same host, or NIXL),
and LEASE pins an object for a one-sided reader. Before the fix a TCP client on another
host could ALLOC: 63 slots evicted every object and every other put got NO_SPACE, and
an ALLOC committed without a write published a chunk's old bytes. Pinned here with two
real hosts: the server listens on one end of a veth pair, the client runs in a network
namespace this test creates on the other end. The remote client is refused with
``AUTH`` items and ``one_sided: false``, holds no reservation, and its plain PUT and
GET still work.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gcache.sdk import Client
from gcache.status import Status
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TOKEN = "remote-peer-test-token"
REPO = Path(__file__).resolve().parents[2]

# runs inside the namespace: raw frames from "another host"
REMOTE = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from rawwire import RawConn
from gcache.protocol import Op, encode_frame
from gcache.sdk import Client
from gcache.testing.oracle import value_for
addr, token = sys.argv[1], sys.argv[3]
out = {}
with RawConn(addr) as raw:
    raw.auth(token)
    raw.send(encode_frame(Op.ALLOC, 2, {"ns": b"r", "items": [[b"k", 4096, 0, 4096, 0, 7]]}))
    fh, meta = raw.read()
    out["alloc"] = {"status": fh.status, "items": meta["items"],
                    "one_sided": meta.get("one_sided"), "error": meta.get("error", "")}
    raw.send(encode_frame(Op.LEASE, 3, {"ns": b"r", "items": [[b"k", 0]]}))
    fh, meta = raw.read()
    out["lease"] = {"status": fh.status, "items": meta["items"],
                    "one_sided": meta.get("one_sided")}
with Client(servers=[addr], namespace="r", token=token, timeout_ms=5000,
            transport="auto") as c:
    out["put"] = int(c.put("plain", value_for(b"plain", 200_000)))
    out["get_ok"] = c.get("plain") == value_for(b"plain", 200_000)
print(json.dumps(out))
"""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture
def remote_host():
    """A network namespace joined to this host by a veth pair: (host ip, namespace, its ip)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a second host (ip netns)")
    tag = uuid.uuid4().hex[:6]
    ns, here, there = f"gc-{tag}", f"gch{tag}", f"gcn{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    host_ip, ns_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("addr", "add", f"{ns_ip}/30", "dev", there, ns=ns)
        _ip("link", "set", there, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        yield host_ip, ns, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.mark.timeout(90)
def test_remote_tcp_peer_cannot_alloc_or_lease(remote_host, make_cluster):
    host_ip, ns, _ = remote_host
    cl = make_cluster(1, "64MiB", token=TOKEN, extra=["--listen", f"{host_ip}:0"])
    addr = cl.addresses[0]
    assert addr.startswith(host_ip)
    with Client(servers=[addr], namespace="r", token=TOKEN, timeout_ms=5000) as local:
        assert local.put("k", value_for(b"k", 4096)) == Status.OK  # LEASE has a target
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", REMOTE, addr,
                            str(REPO / "tests" / "server"), TOKEN],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["alloc"]["status"] == 0  # a normal reply: the stream stays in sync
        assert out["alloc"]["items"] == [[int(Status.AUTH), 0, 0]]
        assert out["alloc"]["one_sided"] is False and "GET and PUT" in out["alloc"]["error"]
        assert out["lease"]["items"][0][0] == int(Status.AUTH)
        assert out["lease"]["one_sided"] is False
        assert out["put"] == int(Status.OK) and out["get_ok"]  # plain ops still work
        (stats,) = local.stats().values()
        assert stats["shm_slots"] == 0 and stats["shm_leases"] == 0
        assert local.get("k") == value_for(b"k", 4096)
