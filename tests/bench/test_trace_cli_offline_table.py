"""``gcache-bench trace FILE --offline``: the subcommand is wired, prints every policy at
every capacity with the ceiling and Belady, writes the JSON, and refuses --disk with
--offline."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gcache.bench.cli import main
from gcache.config import EVICTION_POLICIES

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_offline_table_and_json(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": i, "input_length": 2048, "output_length": 1,
              "hash_ids": [0, 1] + [100 + i, 200 + i % 3]} for i in range(40)]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "o.json"
    r = CliRunner().invoke(main, ["trace", str(trace), "--offline", "--capacity", "0.5",
                                  "--capacity", "0.25", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert [(x["capacity_fraction"], x["policy"]) for x in doc["rows"]] == [
        (f, p) for f in (0.25, 0.5) for p in EVICTION_POLICIES]
    assert doc["ceiling"] == pytest.approx(0.5 - 2 / 160)  # all but the first request's head
    for row in doc["rows"]:
        assert row["hit_rate"] <= row["belady"] + 1e-9 <= doc["ceiling"] + 1e-9
    assert "Belady" in r.output and "reuse" in r.output
    bad = CliRunner().invoke(main, ["trace", str(trace), "--offline", "--disk"])
    assert bad.exit_code != 0 and "--offline" in bad.output
