"""The master API and the servers' metrics endpoint over https, with real processes.

Servers heartbeat to https masters (they register), the SDK discovers over https,
``gcache status`` reads https (and fails fast and clearly without the CA), plain http
to either endpoint gets no answer, and mTLS masters refuse a client with no
certificate. Certificates come from trustme (tests/conftest.py).
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from gcache.discovery import MasterClient, MasterUnavailable
from gcache.sdk import Client, Status
from gcache.testing.cluster import Cluster, free_port
from gcache.tls import client_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = "tok"
GCACHE = [sys.executable, "-m", "gcache.cli"]


def _wait_up(mc: MasterClient, n: int, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < end:
        try:
            doc = mc.view()
            if sum(m["state"] == "up" for m in doc["members"]) >= n:
                return doc
        except MasterUnavailable:
            pass
        time.sleep(0.2)
    raise AssertionError(f"servers did not register over https: {doc}")


@pytest.fixture(scope="module")
def https_cluster(tls_files, tmp_path_factory):
    port = free_port()
    c = Cluster(1, "32MiB", slab="1MiB", masters=3, token=TOKEN, tls=tls_files,
                log_dir=str(tmp_path_factory.mktemp("https-logs")),
                server_extra=["--metrics-listen", f"127.0.0.1:{port}"]).start()
    c.metrics_port = port
    yield c
    c.close()


def test_servers_register_with_https_masters_and_sdk_discovers(https_cluster, tls_files):
    mc = MasterClient(https_cluster.master_addresses, TOKEN,
                      tls=client_context(tls_files.ca_file))
    doc = _wait_up(mc, 1)
    assert [m["address"] for m in doc["members"]] == https_cluster.addresses
    with Client(masters=https_cluster.master_addresses, token=TOKEN, namespace="d",
                tls=True, tls_ca_file=tls_files.ca_file, transport="tcp") as c:
        assert [m.address for m in c.view.members] == https_cluster.addresses
        assert c.put("k", b"v" * 5000) == Status.OK
        assert c.get("k") == b"v" * 5000


def test_gcache_status_over_https(https_cluster, tls_files):
    _wait_up(MasterClient(https_cluster.master_addresses, TOKEN,
                          tls=client_context(tls_files.ca_file)), 1)
    masters = ",".join(https_cluster.master_addresses)
    r = subprocess.run(GCACHE + ["status", "--masters", masters, "--token", TOKEN,
                                 "--tls-ca-file", tls_files.ca_file, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [m["state"] for m in doc["members"]] == ["up"]
    assert doc["members"][0]["stats"]  # heartbeats carried the server's usage over https
    t0 = time.monotonic()
    r = subprocess.run(GCACHE + ["status", "--masters", masters, "--token", TOKEN],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no master answered" in r.stderr
    assert time.monotonic() - t0 < 30
    r = subprocess.run(GCACHE + ["status", "--masters", masters, "--token", TOKEN, "--tls"],
                       capture_output=True, text=True, timeout=60)  # system store: untrusted
    assert r.returncode != 0 and "is not trusted" in r.stderr


def test_plain_http_gets_no_answer_from_master_or_metrics(https_cluster):
    urls = [f"http://{https_cluster.master_addresses[0]}/healthz",
            f"http://127.0.0.1:{https_cluster.metrics_port}/metrics"]
    for url in urls:
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(url, timeout=5).read()


def test_metrics_and_health_over_https(https_cluster, tls_files):
    ctx = client_context(tls_files.ca_file)
    base = f"https://127.0.0.1:{https_cluster.metrics_port}"
    body = urllib.request.urlopen(base + "/metrics", timeout=5, context=ctx).read().decode()
    assert "gcache_memory_capacity_bytes" in body
    health = json.loads(urllib.request.urlopen(base + "/healthz", timeout=5, context=ctx).read())
    assert health["status"] == "ok"
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(base + "/metrics", timeout=5,
                               context=ssl.create_default_context())


def test_mtls_masters_refuse_clients_without_a_certificate(tls_files, tmp_path):
    with Cluster(1, "32MiB", slab="1MiB", masters=3, token=TOKEN, tls=tls_files, mtls=True,
                 log_dir=str(tmp_path)) as c:
        with_cert = MasterClient(c.master_addresses, TOKEN, tls=client_context(
            tls_files.ca_file, tls_files.client_cert_file, tls_files.client_key_file))
        _wait_up(with_cert, 1)  # the server presents its own certificate to the masters
        without = MasterClient(c.master_addresses, TOKEN, timeout_s=2.0,
                               tls=client_context(tls_files.ca_file))
        t0 = time.monotonic()
        with pytest.raises(MasterUnavailable, match="refused this client's TLS certificate"):
            without.request("GET", "/view", retry_s=0)
        assert time.monotonic() - t0 < 10
        with Client(masters=c.master_addresses, token=TOKEN, namespace="m", transport="tcp",
                    **tls_files.client_kwargs()) as cl:
            assert cl.put("k", b"v") == Status.OK
            assert cl.get("k") == b"v"
