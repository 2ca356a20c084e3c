"""gcache-bench end to end: real servers, short cases, JSON report and exit codes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gcache.bench.cli import main
from gcache.bench.runner import working_set_keys

pytestmark = pytest.mark.integration


def _run(args: list[str]) -> tuple[int, str]:
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    return res.exit_code, res.output


def test_local_run_with_baseline_and_verify(tmp_path) -> None:
    out = tmp_path / "out.json"
    code, text = _run(["--local", "1", "--memory", "256MiB", "--size", "64KiB", "--size",
                       "1MiB", "--batch", "8", "--duration", "0.5", "--json", str(out),
                       "--verify"])
    assert code == 0, text
    assert "vs raw" in text and "GB/s" in text
    doc = json.loads(out.read_text())
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["python"]
    assert isinstance(doc["command"], str)
    base = doc["baseline"]
    for direction in ("get", "put"):
        for size in ("64KiB", "1MiB"):
            assert base["stream"][direction][size]["gbps"] > 0
    assert base["rtt"]["p50_us"] > 0
    cases = doc["cases"]
    assert {(c["op"], c["size"]) for c in cases} == {
        (op, s) for op in ("get", "put") for s in (64 << 10, 1 << 20)}
    for c in cases:
        assert c["batch"] == 8 and c["concurrency"] == 1
        assert c["errors"] == 0, c
        assert c["gbps"] > 0 and c["keys_per_s"] > 0
        assert 0 < c["p50_us"] <= c["p99_us"]
        assert c["vs_raw"] > 0


def test_no_baseline_iters_concurrency_and_existing_servers(cluster, tmp_path) -> None:
    out = tmp_path / "out.json"
    code, text = _run(["--servers", ",".join(cluster.addresses), "--op", "get", "--size",
                       "16KiB", "--batch", "1", "--batch", "4", "--concurrency", "2",
                       "--iters", "20", "--no-baseline", "--verify", "--json", str(out)])
    assert code == 0, text
    assert "vs raw" not in text
    doc = json.loads(out.read_text())
    assert doc["baseline"] is None
    assert [(c["op"], c["batch"], c["concurrency"]) for c in doc["cases"]] == [
        ("get", 1, 2), ("get", 4, 2)]
    for c in doc["cases"]:
        assert c["errors"] == 0 and c["gbps"] > 0 and c["vs_raw"] is None
        assert c["batches"] == 2 * 20


def test_errors_make_exit_code_nonzero(cluster) -> None:
    # the fixture's servers use 1 MiB slabs, so a 2 MiB value cannot be stored
    code, text = _run(["--servers", cluster.addresses[0], "--op", "put", "--size", "2MiB",
                       "--batch", "1", "--iters", "2", "--no-baseline"])
    assert code == 1
    assert "TOO_LARGE" in text or "NO_SPACE" in text


def test_needs_exactly_one_target() -> None:
    code, text = _run(["--size", "4KiB"])
    assert code == 2 and "--servers" in text
    code, _ = _run(["--local", "1", "--servers", "127.0.0.1:1"])
    assert code == 2
    code, text = _run(["--local", "1", "--size", "lots"])
    assert code == 2 and "size" in text.lower()


def test_working_set_is_capped_by_capacity() -> None:
    assert working_set_keys(1 << 20, 8, None) == 256
    assert working_set_keys(64 << 10, 64, None) == 4096
    assert working_set_keys(4 << 20, 64, None) == 256  # batch * 4 wins
    assert working_set_keys(1 << 20, 8, 256 << 20) < 128  # ~50% of capacity
    assert working_set_keys(1 << 20, 8, 4 << 20) == 8  # never fewer than one batch
