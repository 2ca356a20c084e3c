"""gcache-bench --credential against servers with a credentials file: a cluster-admin
credential (the bench sizes its working set from STATS) runs the cases without
errors; one scoped to another namespace reports every call as an error (AUTH),
never a hang or a crash."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gcache.bench.cli import main

pytestmark = pytest.mark.integration

SECRET, OTHER = "b" * 24, "c" * 24
CREDS = f"""
[[credential]]
id = "bench"
secret = "{SECRET}"
grants = [{{ namespaces = "*", rights = ["admin"] }}]

[[credential]]
id = "other"
secret = "{OTHER}"
grants = [{{ namespaces = "other/*", rights = ["read", "write"] }}]
"""


def _run(cluster, cred: str, out) -> dict:
    res = CliRunner().invoke(main, [
        "--servers", ",".join(cluster.addresses), "--credential", cred, "--op", "put",
        "--op", "get", "--size", "16KiB", "--batch", "2", "--iters", "3", "--no-baseline",
        "--json", str(out)], catch_exceptions=False)
    assert res.exit_code in (0, 1), res.output
    return json.loads(out.read_text())


def test_bench_authenticates_with_its_credential(make_cluster, tmp_path, monkeypatch):
    monkeypatch.delenv("GCACHE_TOKEN", raising=False)
    path = tmp_path / "creds.toml"
    path.write_text(CREDS)
    cl = make_cluster(1, "64MiB", extra=["--credentials-file", str(path)])
    doc = _run(cl, f"bench:{SECRET}", tmp_path / "ok.json")
    assert doc["cases"] and all(c["errors"] == 0 for c in doc["cases"])
    doc = _run(cl, f"other:{OTHER}", tmp_path / "refused.json")
    assert all(c["errors"] > 0 for c in doc["cases"])
