"""TLS on the data port: byte-exact round trips, mTLS refusals and plain/TLS mismatches.

Every refusal must be fast and clean: a status (AUTH when a certificate or TLS itself is
refused, UNAVAILABLE when the server does not speak TLS), well inside the op's deadline,
never a TIMEOUT or a hang. Certificates come from trustme (tests/conftest.py).
"""

from __future__ import annotations

import os
import socket
import ssl
import time

import numpy as np
import pytest

from gcache.errors import ConfigError
from gcache.protocol import Limits, Op, read_frame
from gcache.sdk import Client, Status
from gcache.sdk.transports.onesided import STATS
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOKEN = "tls-tok"
SIZES = [0, 1, 100, 16 << 10, (16 << 10) + 1, 64 << 10, (1 << 20) + 7, 3 << 20]
FAST_S = 3.0  # a refusal comes well before the 8 s op deadline used below


@pytest.fixture(scope="module")
def tls_server(tls_files, tmp_path_factory):
    from gcache.testing.cluster import Cluster

    c = Cluster(1, "96MiB", slab="4MiB", token=TOKEN, tls=tls_files,
                log_dir=str(tmp_path_factory.mktemp("tls-logs"))).start()
    yield c
    c.close()


@pytest.fixture(scope="module")
def mtls_server(tls_files, tmp_path_factory):
    from gcache.testing.cluster import Cluster

    c = Cluster(1, "64MiB", slab="1MiB", token=TOKEN, tls=tls_files, mtls=True,
                log_dir=str(tmp_path_factory.mktemp("mtls-logs"))).start()
    yield c
    c.close()


def _timed_put(client: Client, key: str = "k") -> tuple[Status, float]:
    t0 = time.monotonic()
    st = client.put(key, b"v" * 1000)
    return st, time.monotonic() - t0


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_tls_round_trip_is_byte_exact(tls_server, tls_files, transport):
    """put/get over TLS, sizes around the 16 KiB TLS record and the 1 MiB slice, into
    fresh bytes and into caller buffers (the recv_into fallback); auto = shm control
    RPCs over the TLS socket."""
    before = STATS["shm_connections"]
    keys = [f"{transport}/{n}" for n in SIZES]
    vals = [value_for(k.encode(), n) for k, n in zip(keys, SIZES)]
    with Client(tls_server.addresses, namespace="tls", token=TOKEN, tls=True,
                tls_ca_file=tls_files.ca_file, transport=transport, timeout_ms=8000) as c:
        assert c.put_batch(keys, vals) == [Status.OK] * len(keys)
        assert c.get_batch(keys) == vals
        bufs = [np.zeros(n, dtype=np.uint8) for n in SIZES]
        assert c.get_batch_into(keys, bufs) == [Status.OK] * len(keys)
        assert all(b.tobytes() == v for b, v in zip(bufs, vals))
        big = [os.urandom(64 << 10) for _ in range(64)]  # one 4 MiB frame: many buffers
        bkeys = [f"{transport}/b{i}" for i in range(64)]
        assert c.put_batch(bkeys, big) == [Status.OK] * 64
        assert c.get_batch(bkeys) == big
        assert c.delete_batch(keys) == [Status.OK] * len(keys)
    if transport == "auto":
        assert STATS["shm_connections"] > before  # co-located: shm under TLS


def test_tls_with_a_ready_ssl_context(tls_server, tls_files):
    ctx = ssl.create_default_context(cafile=tls_files.ca_file)
    with Client(tls_server.addresses, namespace="ctx", token=TOKEN, tls=ctx,
                transport="tcp") as c:
        assert c.put("a", b"hello") == Status.OK
        assert c.get("a") == b"hello"


def test_plain_client_against_tls_server_gets_auth_fast(tls_server):
    with Client(tls_server.addresses, namespace="plain", token=TOKEN, transport="tcp",
                timeout_ms=8000) as c:
        st, took = _timed_put(c)
    assert st == Status.AUTH and took < FAST_S, (st, took)


def test_raw_plain_socket_reads_why_it_is_refused(tls_server):
    """A peer that waits for HELLO reads one plaintext AUTH frame naming TLS, then EOF."""
    host, port = tls_server.addresses[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        t0 = time.monotonic()
        fh, meta = read_frame(s, Limits())
        assert fh.status == Status.AUTH and "TLS" in meta["error"]
        assert time.monotonic() - t0 < FAST_S
        assert s.recv(1) == b""


def test_raw_plain_frame_to_tls_server_is_refused(tls_server):
    """Plain bytes that are not a ClientHello get the same refusal at once."""
    host, port = tls_server.addresses[0].rsplit(":", 1)
    from gcache.protocol import encode_frame

    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(encode_frame(Op.PING, 1, {}))
        t0 = time.monotonic()
        fh, meta = read_frame(s, Limits())
        assert fh.status == Status.AUTH and "TLS" in meta["error"]
        assert time.monotonic() - t0 < 0.9  # not the 1 s silence rule: the first byte


def test_tls_client_against_plain_server_fails_fast(make_cluster, tls_files):
    plain = make_cluster(1, "32MiB", slab="1MiB")
    with Client(plain.addresses, namespace="x", tls=True, tls_ca_file=tls_files.ca_file,
                transport="tcp", timeout_ms=8000) as c:
        st, took = _timed_put(c)
    assert st == Status.UNAVAILABLE and took < FAST_S, (st, took)


def test_untrusted_server_certificate_is_auth(tls_server, other_ca_files):
    with Client(tls_server.addresses, namespace="x", token=TOKEN, tls=True,
                tls_ca_file=other_ca_files.ca_file, transport="tcp", timeout_ms=8000) as c:
        st, took = _timed_put(c)
    assert st == Status.AUTH and took < FAST_S, (st, took)


def test_mtls_client_without_certificate_is_refused_with_auth(mtls_server, tls_files):
    with Client(mtls_server.addresses, namespace="m", token=TOKEN, tls=True,
                tls_ca_file=tls_files.ca_file, transport="tcp", timeout_ms=8000) as c:
        st, took = _timed_put(c)
    assert st == Status.AUTH and took < FAST_S, (st, took)


def test_mtls_client_with_foreign_certificate_is_refused_with_auth(mtls_server, tls_files,
                                                                   other_ca_files):
    with Client(mtls_server.addresses, namespace="m", token=TOKEN, tls=True,
                tls_ca_file=tls_files.ca_file, tls_cert_file=other_ca_files.client_cert_file,
                tls_key_file=other_ca_files.client_key_file, transport="tcp",
                timeout_ms=8000) as c:
        st, took = _timed_put(c)
    assert st == Status.AUTH and took < FAST_S, (st, took)


def test_mtls_client_with_certificate_round_trips(mtls_server, tls_files):
    with Client(mtls_server.addresses, namespace="m", token=TOKEN, transport="tcp",
                **tls_files.client_kwargs()) as c:
        v = value_for(b"m/ok", 300_000)
        assert c.put("ok", v) == Status.OK
        assert c.get("ok") == v


def test_mtls_wrong_token_is_still_auth(mtls_server, tls_files):
    """TLS replaces no token: the HMAC handshake runs inside the channel."""
    with Client(mtls_server.addresses, namespace="m", token="wrong", transport="tcp",
                timeout_ms=8000, **tls_files.client_kwargs()) as c:
        assert _timed_put(c)[0] == Status.AUTH


def test_silent_peer_does_not_hold_the_tls_server(tls_server, tls_files):
    """Peers that connect and say nothing are dropped after the 1 s silence rule, and
    the server keeps serving TLS clients meanwhile."""
    host, port = tls_server.addresses[0].rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(8)]
    try:
        with Client(tls_server.addresses, namespace="s", token=TOKEN, tls=True,
                    tls_ca_file=tls_files.ca_file, transport="tcp") as c:
            assert c.put("a", b"x") == Status.OK
        for s in idle:
            s.settimeout(5)
            while s.recv(4096):
                pass  # the refusal frame, then EOF
    finally:
        for s in idle:
            s.close()


def test_nixl_is_refused_under_tls(tls_files):
    with pytest.raises(ConfigError, match="nixl"):
        Client(["127.0.0.1:1"], transport="nixl", tls=True, tls_ca_file=tls_files.ca_file)


def test_bad_tls_config_is_a_setup_error(tls_files, tmp_path):
    from gcache.config import load_config
    from gcache.tls import dialer_context, listener_context

    cfg = load_config("server", env={}, cli={"tls_cert_file": tls_files.cert_file,
                                             "tls_key_file": tls_files.key_file,
                                             "tls_require_client_cert": "true"})
    with pytest.raises(ConfigError, match="tls_ca_file"):
        listener_context(cfg)
    cfg = load_config("client", env={}, cli={"tls_ca_file": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="missing.pem"):
        dialer_context(cfg)
    with pytest.raises(ConfigError, match="missing.pem"):
        Client(["127.0.0.1:1"], tls_ca_file=str(tmp_path / "missing.pem"))
