"""gcache-bench --tls: local TLS-only servers with throwaway certificates, verified gets,
and the same flags against running TLS servers (--servers with --tls-ca-file)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gcache.bench.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _run(args: list[str]) -> tuple[int, str]:
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    return res.exit_code, res.output


def test_local_tls_run_verifies_every_get(tmp_path) -> None:
    out = tmp_path / "out.json"
    code, text = _run(["--local", "1", "--memory", "256MiB", "--tls", "--op", "put", "--op",
                       "get", "--size", "64KiB", "--size", "1MiB", "--batch", "8",
                       "--transport", "tcp", "--duration", "0.5", "--no-baseline",
                       "--verify", "--json", str(out)])
    assert code == 0, text
    assert "tcp+tls" in text
    doc = json.loads(out.read_text())
    assert doc["settings"]["tls"] is True
    assert len(doc["cases"]) == 4
    for c in doc["cases"]:
        assert c["tls"] is True and c["errors"] == 0 and c["gbps"] > 0


def test_existing_tls_servers_need_their_ca(make_cluster, tls_files, tmp_path) -> None:
    srv = make_cluster(1, "128MiB", slab="2MiB", tls=tls_files)
    args = ["--servers", srv.addresses[0], "--op", "get", "--size", "64KiB", "--batch", "4",
            "--iters", "5", "--no-baseline", "--transport", "tcp", "--verify"]
    code, text = _run(args + ["--tls", "--tls-ca-file", tls_files.ca_file])
    assert code == 0, text
    code, text = _run(args)  # plain client: every call refused, the exit code says so
    assert code != 0


def test_tls_refuses_what_it_cannot_measure() -> None:
    code, text = _run(["--local", "1", "--tls", "--transport", "nixl"])
    assert code != 0 and "--tls measures" in text
