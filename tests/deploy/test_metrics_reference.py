"""docs/metrics.md and deploy/grafana/gcache.json stay true to what the code exports:
scrape a live master and server (disk tier, miss-ratio curve, masters), then check that
every exported series is in the reference, and that every series a dashboard panel
queries is exported by someone."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from gcache.sdk import Client
from gcache.testing.cluster import Cluster, free_port

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "gcache.json"
REFERENCE = ROOT / "docs" / "metrics.md"
# PromQL words that are not series names
_PROMQL = {"sum", "by", "rate", "max", "min", "avg", "count", "histogram_quantile", "or",
           "vector", "clamp_min", "delta", "increase", "without", "on", "and", "unless"}


def _families(text: str) -> set[str]:
    """Series names of a scrape: every ``# HELP`` family, with the sample names it has
    (``_total``, ``_bucket``, ``_sum``, ``_count``, ``_info``)."""
    names = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP ")}
    names |= {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", ln)[0] for ln in text.splitlines()
              if ln and not ln.startswith("#")}
    return names


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    d = tmp_path_factory.mktemp("metrics")
    port = free_port()
    with Cluster(1, "64MiB", masters=1, token="t", log_dir=str(d),
                 extra=["--metrics-listen", f"127.0.0.1:{port}", "--disk-dir",
                        str(d / "disk"), "--disk-bytes", "256MiB", "--segment-bytes",
                        "4MiB"]) as cl:
        with Client(cl.addresses, token="t") as c:
            assert c.put("k", b"v").name == "OK" and c.get("k") == b"v"
        time.sleep(0.3)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            server = r.read().decode()
        with urllib.request.urlopen(f"http://{cl.master_addresses[0]}/metrics",
                                    timeout=5) as r:
            master = r.read().decode()
    assert "_created" not in server + master
    return {"server": _families(server), "master": _families(master)}


@pytest.mark.timeout(90)
def test_every_exported_series_is_in_the_reference(exported) -> None:
    documented = set(re.findall(r"^\| `([a-z_]+)`", REFERENCE.read_text(), re.M))
    for who, names in exported.items():
        helps = {n for n in names if not re.search(r"_(bucket|sum|count)$", n)
                 or n.removesuffix("_bucket") in names}
        missing = sorted(n for n in helps if n not in documented
                         and not any(n == d + s for d in documented
                                     for s in ("_bucket", "_sum", "_count", "_total")))
        assert missing == [], f"{who} exports series docs/metrics.md does not list: {missing}"


@pytest.mark.timeout(90)
def test_every_dashboard_query_names_exported_series(exported) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["panels"] and dash["uid"] and dash["title"]
    titles = {p["title"] for p in dash["panels"]}
    for want in ("Hit ratio", "Throughput (bytes/s)", "Frame latency p50 / p99",
                 "Evictions (objects/s)", "Tier usage", "Members up", "Migrations: handoff"):
        assert want in titles
    every = exported["server"] | exported["master"] | {"job", "instance"}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        bare = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\$\w+', " ", expr)  # labels, ranges
        bare = re.sub(r"\b[0-9.]+(e-?[0-9]+)?\b", " ", bare)  # numbers: 0.99, 1e-9
        words = set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*", bare)) - _PROMQL
        words -= {"le", "op", "instance", "direction", "tier", "state", "capacity_factor"}
        unknown = sorted(w for w in words if w not in every and not w.isdigit())
        assert unknown == [], f"{expr!r} names series nobody exports: {unknown}"
