"""Namespace-scoped credentials on a real gcache-server (--credentials-file).

* Credential A (read/write on ``team-a/*``) cannot get, put, delete, exists, touch,
  LEASE or ALLOC ``team-b/...`` objects: every item answers ``AUTH``, the connection
  stays usable, B's objects are untouched, and each refusal is counted in
  ``gcache_auth_refused_total{credential, op}``. A uses its own namespace normally.
* A read-only credential cannot put or delete; STATS needs a cluster admin.
* SIGHUP re-reads the file: a narrowed grant applies to a live connection's next
  frame, an extended one too; a bad file keeps the old credentials (and says why);
  a removed credential ends its connections.
* Per-namespace hit/miss/bytes metrics, with a bounded label set.
* The legacy --token still has full rights next to the file.
"""

from __future__ import annotations

import os
import re
import urllib.request

import pytest

from gcache.protocol import Op, encode_frame
from gcache.sdk import Client
from gcache.status import Status
from gcache.testing.waiting import wait_for as _wait_for
from gcache.testing.cluster import free_port

from rawwire import RawConn, server_log

pytestmark = [pytest.mark.integration]

SA, SB, SR, SO = ("a" * 24, "b" * 24, "r" * 24, "o" * 24)
TOKEN = "legacy-token-0123456789"


def creds_toml(a_pattern: str = "team-a/*", extra: str = "") -> str:
    return f"""
[[credential]]
id = "team-a"
secret = "{SA}"
grants = [{{ namespaces = "{a_pattern}", rights = ["read", "write"] }}]

[[credential]]
id = "team-b"
secret = "{SB}"
grants = [{{ namespaces = "team-b/*", rights = ["read", "write"] }}]

[[credential]]
id = "reader"
secret = "{SR}"
grants = [{{ namespaces = "team-a/*", rights = ["read"] }}]

[[credential]]
id = "ops"
secret = "{SO}"
grants = [{{ namespaces = "*", rights = ["admin"] }}]
{extra}
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith("GCACHE_"):
            monkeypatch.delenv(var)


@pytest.fixture
def scoped(make_cluster, tmp_path):
    path = tmp_path / "credentials.toml"
    path.write_text(creds_toml())
    port = free_port()
    cl = make_cluster(1, "32MiB", token=TOKEN,
                      extra=["--credentials-file", str(path),
                             "--metrics-listen", f"127.0.0.1:{port}",
                             # ALLOC is scope-checked for the writers that may use it
                             "--shm-trusted-writers", "true"])
    cl.creds_path, cl.metrics_url = path, f"http://127.0.0.1:{port}/metrics"
    return cl


def metrics(cl) -> str:
    return urllib.request.urlopen(cl.metrics_url, timeout=5).read().decode()


def metric(cl, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # exposition order
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", metrics(cl), re.M)
    return float(m.group(1)) if m else 0.0


def client(cl, cred: str | None, ns: str, **kw) -> Client:
    return Client(servers=cl.addresses, namespace=ns, timeout_ms=5000, credential=cred,
                  transport="tcp", **kw)


def wait_for(pred, timeout: float = 10.0):
    return _wait_for(pred, timeout, retry_on=())


def test_credential_a_cannot_touch_team_b_objects(scoped):
    value = os.urandom(64 << 10)
    with client(scoped, f"team-b:{SB}", "team-b/m") as b:
        assert b.put("k", value) == Status.OK
    with client(scoped, f"team-a:{SA}", "team-b/m") as a:
        assert a.get("k") is None
        assert a.get_batch_into(["k"], [bytearray(len(value))]) == [Status.AUTH]
        assert a.put("k", b"overwritten by A") == Status.AUTH
        assert a.put("new", b"x" * 100) == Status.AUTH
        assert not a.exists("k")
        assert a.delete("k") == Status.AUTH
        assert a.touch("k") == Status.AUTH
        # the same client keeps working afterwards (no lane marked suspect)
        assert a.put("k", b"again") == Status.AUTH
    with client(scoped, f"team-a:{SA}", "team-a/m") as a:
        assert a.put("own", value) == Status.OK
        assert a.get("own") == value
        assert a.exists("own")
        assert a.delete("own") == Status.OK
    with client(scoped, f"team-b:{SB}", "team-b/m") as b:
        assert b.get("k") == value  # B's object was never changed or deleted
        assert not b.exists("new")
    assert metric(scoped, "gcache_auth_refused_total", credential="team-a", op="GET") >= 2
    for op in ("PUT", "DELETE", "TOUCH", "EXISTS"):
        assert metric(scoped, "gcache_auth_refused_total", credential="team-a", op=op) >= 1


def test_raw_wire_scope_every_op_and_stream_stays_in_sync(scoped):
    with client(scoped, f"team-b:{SB}", "team-b/m") as b:
        assert b.put("k", b"B" * 1000) == Status.OK
    with RawConn(scoped.addresses[0]) as raw:
        raw.auth(SA, cred_id="team-a")
        ns_b = b"team-b/m"
        # a refused PUT: its payload is drained, the reply is per item
        raw.send(encode_frame(Op.PUT, 2, {"ns": ns_b, "items": [[b"k", 5, 0, 5, 0]]}, 5),
                 b"AAAAA")
        fh, meta = raw.read()
        assert fh.status == 0 and meta == {"st": [int(Status.AUTH)]}
        raw.send(encode_frame(Op.GET, 3, {"ns": ns_b, "items": [[b"k", 0, 4096, 0]]}))
        fh, meta = raw.read()
        assert fh.status == 0 and fh.payload_len == 0
        assert meta["items"] == [[int(Status.AUTH), 0, 0, 0, 0]]
        for rid, op in ((4, Op.EXISTS), (5, Op.DELETE), (6, Op.TOUCH)):
            raw.send(encode_frame(op, rid, {"ns": ns_b, "items": [b"k"]}))
            fh, meta = raw.read()
            assert (fh.request_id, fh.status, meta) == (rid, 0, {"st": [int(Status.AUTH)]})
        # shared-memory control ops are scoped like GET and PUT
        raw.send(encode_frame(Op.LEASE, 7, {"ns": ns_b, "items": [[b"k", 0]]}))
        fh, meta = raw.read()
        assert meta["items"] == [[int(Status.AUTH), 0, 0, 0, 0, 0]]
        raw.send(encode_frame(Op.ALLOC, 8, {"ns": ns_b, "items": [[b"k", 5, 0, 5, 0, 0]]}))
        fh, meta = raw.read()
        assert meta["items"] == [[int(Status.AUTH), 0, 0]]
        # server-wide STATS needs a cluster admin; the connection stays open
        raw.send(encode_frame(Op.STATS, 9, {}))
        fh, meta = raw.read()
        assert fh.status == Status.AUTH and "admin" in meta["error"]
        # and the own namespace works on the very same connection
        ns_a = b"team-a/m"
        raw.send(encode_frame(Op.PUT, 10, {"ns": ns_a, "items": [[b"k", 5, 0, 5, 0]]}, 5),
                 b"hello")
        assert raw.read()[1] == {"st": [0]}
        raw.send(encode_frame(Op.LEASE, 11, {"ns": ns_a, "items": [[b"k", 0]]}))
        (st, length, _ver, _off, lid, _csum), = raw.read()[1]["items"]
        assert (st, length) == (0, 5) and lid > 0
        raw.send(encode_frame(Op.RELEASE, 12, {"leases": [lid]}))
        assert raw.read()[1] == {"st": [0]}
        raw.send(encode_frame(Op.ALLOC, 13, {"ns": ns_a, "items": [[b"k2", 5, 0, 5, 0, 0]]}))
        (st, _off, sid), = raw.read()[1]["items"]
        assert st == 0 and sid > 0
        raw.send(encode_frame(Op.COMMIT, 14, {"slots": [], "abort": [sid]}))
        assert raw.read()[1] == {"st": []}
    with client(scoped, f"team-b:{SB}", "team-b/m") as b:
        assert b.get("k") == b"B" * 1000
    for op in ("PUT", "GET", "EXISTS", "DELETE", "TOUCH", "LEASE", "ALLOC", "STATS"):
        assert metric(scoped, "gcache_auth_refused_total", credential="team-a", op=op) == 1, op


def test_read_only_credential_cannot_put_or_delete(scoped):
    with client(scoped, f"team-a:{SA}", "team-a/m") as a:
        assert a.put("k", b"v" * 100) == Status.OK
    with client(scoped, f"reader:{SR}", "team-a/m") as r:
        assert r.get("k") == b"v" * 100
        assert r.exists("k")
        assert r.touch("k") == Status.OK  # recency only, like any GET hit
        assert r.put("k", b"w" * 100) == Status.AUTH
        assert r.put("other", b"w") == Status.AUTH
        assert r.delete("k") == Status.AUTH
        assert r.get("k") == b"v" * 100
        stats = r.stats()
        assert "error" in next(iter(stats.values()))
    with client(scoped, f"ops:{SO}", "anything") as o:  # admin on "*": read, write, STATS
        assert o.get("k") is None  # another namespace: a plain miss
        (st,) = o.stats().values()
        assert st["objects"] >= 1
    with client(scoped, None, "team-b/m", token=TOKEN) as legacy:  # the token: full rights
        assert legacy.put("t", b"t") == Status.OK and legacy.get("t") == b"t"
    assert metric(scoped, "gcache_auth_refused_total", credential="reader", op="PUT") == 2


def test_wrong_secret_or_unknown_id_fails_auth(scoped):
    for cred in (f"team-a:{SB}", f"nobody:{SA}"):
        with client(scoped, cred, "team-a/m") as c:
            assert c.put("k", b"v") == Status.AUTH


def test_sighup_narrows_and_extends_scope_of_live_connections(scoped):
    srv = scoped.servers[0]
    with RawConn(scoped.addresses[0]) as raw:
        raw.auth(SA, cred_id="team-a")

        def put(ns: bytes, rid: int) -> int:
            raw.send(encode_frame(Op.PUT, rid, {"ns": ns, "items": [[b"k", 1, 0, 1, 0]]}, 1),
                     b"x")
            return raw.read()[1]["st"][0]

        assert put(b"team-a/m", 2) == Status.OK
        assert put(b"team-c/m", 3) == Status.AUTH
        # narrow team-a to team-a/only/*: the same connection's next frame is refused
        scoped.creds_path.write_text(creds_toml("team-a/only/*"))
        srv.hup()
        rid = iter(range(10, 1000))
        wait_for(lambda: put(b"team-a/m", next(rid)) == Status.AUTH)
        assert put(b"team-a/only/x", next(rid)) == Status.OK
        # a bad file keeps the narrowed credentials and the log says why
        scoped.creds_path.write_text(creds_toml("team-a/*").replace('secret = "' + SB,
                                                                    'secret = "short'))
        srv.hup()
        wait_for(lambda: "credentials reload failed" in server_log(scoped))
        assert "credential #2 (id 'team-b')" in server_log(scoped)
        assert put(b"team-a/m", next(rid)) == Status.AUTH
        assert put(b"team-a/only/x", next(rid)) == Status.OK
        # extend to "team-*": applies at once, on the same connection
        scoped.creds_path.write_text(creds_toml("team-*"))
        srv.hup()
        wait_for(lambda: put(b"team-c/m", next(rid)) == Status.OK)
        # remove team-a altogether: its live connection is ended with AUTH
        text = creds_toml().split("[[credential]]")
        scoped.creds_path.write_text("[[credential]]".join([text[0], *text[2:]]))
        srv.hup()

        def refused() -> bool:
            raw.send(encode_frame(Op.EXISTS, next(rid), {"ns": b"team-a/m",
                                                         "items": [b"k"]}))
            fh, meta = raw.read()
            return fh.status == Status.AUTH

        wait_for(refused)
        raw.expect_closed()
    with client(scoped, f"team-a:{SA}", "team-a/m") as a:
        assert a.put("k", b"v") == Status.AUTH  # the handshake itself now fails
    assert srv.alive


def test_per_namespace_metrics_are_bounded(make_cluster, tmp_path):
    port = free_port()
    cl = make_cluster(1, "32MiB", extra=["--metrics-listen", f"127.0.0.1:{port}",
                                         "--metrics-max-namespaces", "3"])
    cl.metrics_url = f"http://127.0.0.1:{port}/metrics"
    for i in range(6):
        with Client(servers=cl.addresses, namespace=f"ns{i}", timeout_ms=5000,
                    transport="tcp") as c:
            assert c.put("k", b"x" * 1000) == Status.OK
            assert c.get("k") == b"x" * 1000
            assert c.get("absent") is None
    assert metric(cl, "gcache_namespace_hits_total", namespace="ns0") == 1
    assert metric(cl, "gcache_namespace_misses_total", namespace="ns0") == 1
    assert metric(cl, "gcache_namespace_bytes_total", namespace="ns1", direction="in") == 1000
    assert metric(cl, "gcache_namespace_bytes_total", namespace="ns2", direction="out") == 1000
    assert metric(cl, "gcache_namespace_hits_total", namespace="other") == 3
    assert metric(cl, "gcache_namespace_bytes_total", namespace="other", direction="in") == 3000
    assert 'namespace="ns3"' not in metrics(cl)
