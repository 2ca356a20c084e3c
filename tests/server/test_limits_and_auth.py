"""Size limits, the token handshake and the bind guard, against real servers.

* Values larger than one slab are a per-key ``TOO_LARGE`` and the server keeps
  serving; the SDK refuses over-long keys at call time (a setup fault raises).
  A server stricter than the client (``--max-key-bytes``) answers TOO_LARGE
  without knocking the client's connection to it into UNAVAILABLE.
* With ``--token`` only a client holding the token gets in; a wrong or missing
  token is a fast ``Status.AUTH`` / ``None``, never a hang; a raw socket that
  skips AUTH gets an AUTH error frame.
* A server refuses a non-loopback bind without a token, and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gcache.protocol import Op, auth_mac, encode_frame
from gcache.sdk import Client
from gcache.status import Status

from rawwire import LIM, RawConn, assert_serving, server_log

pytestmark = [pytest.mark.integration, pytest.mark.faults]

MIB = 1 << 20
TOKEN = "s3cret"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_token_from_env(monkeypatch):
    """Tests say exactly which token each client holds."""
    for var in list(os.environ):
        if var.startswith("GCACHE_"):
            monkeypatch.delenv(var)


# ---------------------------------------------------------------- value and key sizes

def test_value_larger_than_a_slab_is_too_large(cluster):
    with RawConn(cluster.addresses[0]) as raw:
        max_value = raw.hello["limits"]["max_value_bytes"]
    assert max_value < MIB  # one 1 MiB slab, minus the chunk header
    small, edge = os.urandom(512 << 10), os.urandom(max_value)
    with Client(servers=cluster.addresses, namespace="lim", timeout_ms=5000) as c:
        t0 = time.monotonic()
        assert c.put("small", small) == Status.OK
        assert c.put("edge", edge) == Status.OK  # exactly the advertised limit fits
        assert c.put("edge+1", os.urandom(max_value + 1)) == Status.TOO_LARGE
        assert c.put("slab+1", os.urandom(MIB + 1)) == Status.TOO_LARGE  # two slices
        assert c.put("4MiB", os.urandom(4 * MIB)) == Status.TOO_LARGE
        assert c.put_batch(["a", "big", "b"], [b"A" * 100, os.urandom(3 * MIB), b"B" * 100]
                           ) == [Status.OK, Status.TOO_LARGE, Status.OK]
        assert time.monotonic() - t0 < 3.0  # statuses, not timeouts
        # nothing of the refused values was stored; everything else still is
        assert c.exists_batch(["edge+1", "slab+1", "4MiB", "big"]) == [False] * 4
        assert c.get("4MiB") is None
        assert c.get_batch(["small", "edge", "a", "b"]) == [small, edge, b"A" * 100, b"B" * 100]
        (stats,) = c.stats().values()
        assert stats["objects"] == 4 and stats["pending_puts"] == 0
    assert_serving(cluster)


def test_sdk_refuses_too_long_key_at_call_time(cluster):
    longest = b"k" * LIM.max_key_bytes
    too_long = b"k" * (LIM.max_key_bytes + 1)
    with Client(servers=cluster.addresses, namespace="lim", timeout_ms=3000) as c:
        for call in (lambda: c.put(too_long, b"v"), lambda: c.get(too_long),
                     lambda: c.exists(too_long), lambda: c.delete(too_long),
                     lambda: c.touch(too_long), lambda: c.get_batch([b"ok", too_long]),
                     lambda: c.put_batch([b"ok", too_long.decode()], [b"1", b"2"]),
                     lambda: c.get_batch_into([too_long], [bytearray(4)]),
                     lambda: c.put(b"", b"v")):
            with pytest.raises(ValueError):
                call()
        assert not c.exists(b"ok")  # the batch with the bad key was refused whole
        assert c.put(longest, b"edge") == Status.OK  # the limit itself is fine
        assert c.get(longest) == b"edge"
    assert_serving(cluster)


def test_stricter_server_key_limit_is_too_large_not_unavailable(make_cluster):
    """The SDK checks keys against its own limits; a server configured stricter refuses
    the frame. The client must see TOO_LARGE for that key, while its other requests to
    the same (healthy) server keep working, even when the refused frame was large."""
    cl = make_cluster(1, extra=["--max-key-bytes", "64"])
    key = b"x" * 100
    with Client(servers=cl.addresses, namespace="lim", timeout_ms=3000,
                conns_per_server=1) as c:
        for n in (10, 300 << 10, 8 * MIB):
            t0 = time.monotonic()
            st = c.put(key, os.urandom(n))
            assert st == Status.TOO_LARGE, (n, st)
            assert c.put(b"short", b"%d" % n) == Status.OK, n  # no suspicion fallout
            assert c.get(b"short") == b"%d" % n
            assert c.get(key) is None
            assert time.monotonic() - t0 < 2.0
    assert "Traceback" not in server_log(cl)


# ---------------------------------------------------------------- token

@pytest.fixture
def secured(make_cluster):
    return make_cluster(1, token=TOKEN)


def test_right_token_round_trips(secured):
    with Client(servers=secured.addresses, namespace="auth", timeout_ms=3000,
                token=TOKEN) as c:
        assert c.put("k", b"value") == Status.OK
        assert c.get("k") == b"value"
        assert c.exists("k")
        assert c.delete("k") == Status.OK
        assert c.get("k") is None


@pytest.mark.parametrize("token", ["wrong", "", None], ids=["wrong", "empty", "none"])
def test_wrong_or_missing_token_is_a_fast_auth_miss(secured, token):
    with Client(servers=secured.addresses, namespace="auth", timeout_ms=5000,
                token=token) as c:
        t0 = time.monotonic()
        assert c.put("k", b"value") == Status.AUTH
        first = time.monotonic() - t0
        # later ops fail fast too: AUTH again, or UNAVAILABLE once the lane is suspect
        assert c.get("k") is None
        assert not c.exists("k")
        sts = c.put_batch([f"k{i}" for i in range(50)], [b"v"] * 50)
        assert all(s in (Status.AUTH, Status.UNAVAILABLE) for s in sts), set(sts)
        assert c.get_batch([f"k{i}" for i in range(50)]) == [None] * 50
        total = time.monotonic() - t0
    assert first < 1.0 and total < 2.5, (first, total)  # timeout is 5 s: no waiting on it
    # nothing got in
    with Client(servers=secured.addresses, namespace="auth", timeout_ms=3000,
                token=TOKEN) as good:
        assert good.get("k") is None
        assert good.exists_batch([f"k{i}" for i in range(50)]) == [False] * 50
    assert_serving(secured, token=TOKEN)


def test_raw_socket_auth_rules(secured):
    addr = secured.addresses[0]
    with RawConn(addr) as a:
        assert a.hello["auth"] is True
        a.send(encode_frame(Op.PUT, 5, {"ns": b"n", "items": [[b"k", 3, 0, 3, 0]]}, 3), b"abc")
        msg = a.expect_error(Status.AUTH, 5, Op.PUT)
        assert "auth" in msg.lower()
        a.expect_closed()
    with RawConn(addr) as a:  # STATS is not open to strangers either
        a.send(encode_frame(Op.STATS, 6, {}))
        a.expect_error(Status.AUTH, 6)
        a.expect_closed()
    with RawConn(addr) as a:  # PING is
        a.send(encode_frame(Op.PING, 7, {}))
        fh, _ = a.read()
        assert (fh.request_id, fh.status) == (7, 0)
    for mac in (b"", b"\0" * 32, auth_mac("wrong", b"x" * 16), "not-bytes", None):
        with RawConn(addr) as a:
            a.send(encode_frame(Op.AUTH, 8, {"mac": mac}))
            a.expect_error(Status.AUTH, 8, Op.AUTH)
            a.expect_closed()
    with RawConn(addr) as a, RawConn(addr) as b:  # a MAC is bound to its connection's nonce
        assert a.hello["nonce"] != b.hello["nonce"]
        b.send(encode_frame(Op.AUTH, 9, {"mac": auth_mac(TOKEN, a.hello["nonce"])}))
        b.expect_error(Status.AUTH, 9)
        b.expect_closed()
        a.auth(TOKEN, rid=10)
        a.send(encode_frame(Op.EXISTS, 11, {"ns": b"n", "items": [b"k"]}))
        fh, meta = a.read()
        assert (fh.request_id, fh.status, meta["st"]) == (11, 0, [Status.MISS])
    assert_serving(secured, token=TOKEN)


# ---------------------------------------------------------------- bind guard

def _run_server_on(listen: str, name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    return subprocess.run(
        [sys.executable, "-m", "gcache.server.cli", "--listen", listen, "--name", name,
         "--memory", "8MiB", "--slab-bytes", "1MiB"],
        capture_output=True, text=True, timeout=20, env=env, cwd=REPO)


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0"])
def test_refuses_non_loopback_bind_without_token(listen):
    name = f"x-{uuid.uuid4()}"
    arena = Path("/dev/shm") / f"gcache-{name}.arena"
    try:
        proc = _run_server_on(listen, name)
        assert proc.returncode != 0, proc
        assert "GCACHE_LISTEN=" not in proc.stdout
        assert "token" in proc.stderr.lower(), proc.stderr
        assert "refusing to bind non-loopback" in proc.stderr
    finally:
        arena.unlink(missing_ok=True)


def test_refused_bind_leaves_no_arena_behind():
    name = f"x-{uuid.uuid4()}"
    arena = Path("/dev/shm") / f"gcache-{name}.arena"
    try:
        proc = _run_server_on("0.0.0.0:0", name)
        assert proc.returncode != 0
        assert not arena.exists(), f"refused server left {arena} ({arena.stat().st_size} B)"
    finally:
        arena.unlink(missing_ok=True)
