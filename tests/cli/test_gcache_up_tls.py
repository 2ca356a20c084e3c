"""`gcache up --tls` runs a whole local cluster over TLS: throwaway CA and certificates,
https masters, TLS-only servers, and the workload over TLS with a client certificate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

UP = [sys.executable, "-m", "gcache.cli", "up"]


def test_up_tls_mtls_sessions_workload(tmp_path):
    out = tmp_path / "report.json"
    r = subprocess.run(UP + ["--tls", "--mtls", "--servers", "2", "--memory", "64MiB",
                             "--slab-bytes", "1MiB", "--workload", "sessions", "--sessions",
                             "6", "--turns", "2", "--page-bytes", "64KiB", "--json", str(out)],
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr
    assert "TLS" in " ".join(r.stdout.split())  # the table title names it
    lines = dict(ln.split("=", 1) for ln in r.stdout.splitlines() if ln.startswith("GCACHE_"))
    assert lines["GCACHE_TLS_CA_FILE"].endswith("ca.pem")
    assert len(lines["GCACHE_MASTERS"].split(",")) == 3
    rep = json.loads(out.read_text())
    assert rep["steps"] == 12 and rep["wrong_values"] == 0 and rep["pages_hit"] > 0
    assert not rep["put_failures"]


def test_up_tls_refuses_nixl_and_mtls_alone():
    r = subprocess.run(UP + ["--tls", "--transport", "nixl"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "TLS channel" in r.stderr
    r = subprocess.run(UP + ["--mtls"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--mtls needs --tls" in r.stderr
