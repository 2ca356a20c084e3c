"""gcache-bench transport sweeps, raw transport mode and the PNG plot, on real servers."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from gcache.bench.cli import main
from gcache.nixl_lib import available

pytestmark = pytest.mark.integration
TRANSPORTS = ["tcp", "shm"] + ([] if available() else ["nixl"])


def _run(args: list[str]) -> tuple[int, str]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    return res.exit_code, res.output


def _transport_args() -> list[str]:
    return [a for t in TRANSPORTS for a in ("--transport", t)]


def test_transport_and_threads_sweep_with_plot(tmp_path) -> None:
    out, png = tmp_path / "out.json", tmp_path / "gbps.png"
    code, text = _run(["--local", "1", "--memory", "256MiB", "--op", "get", "--op", "put",
                       "--size", "64KiB", "--size", "1MiB", "--batch", "4", "--iters", "3",
                       "--threads", "1", "--threads", "2", "--no-baseline", "--verify",
                       "--json", str(out), "--plot", str(png), *_transport_args()])
    assert code == 0, text
    doc = json.loads(out.read_text())
    seen = {(c["transport"], c["threads"], c["op"], c["size"]) for c in doc["cases"]}
    assert seen == {(t, n, op, s) for t in TRANSPORTS for n in (1, 2) for op in ("get", "put")
                    for s in (64 << 10, 1 << 20)}
    assert all(c["errors"] == 0 and c["gbps"] > 0 for c in doc["cases"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_large_sizes_raise_the_slab_and_cap_the_batch(tmp_path) -> None:
    out = tmp_path / "out.json"
    code, text = _run(["--local", "1", "--memory", "256MiB", "--op", "get", "--size", "16MiB",
                       "--batch", "64", "--max-batch-bytes", "32MiB", "--iters", "2",
                       "--no-baseline", "--verify", "--transport", "shm", "--json", str(out)])
    assert code == 0, text
    (case,) = json.loads(out.read_text())["cases"]
    assert case["batch"] == 2 and case["errors"] == 0


def test_raw_transport_mode(tmp_path) -> None:
    out = tmp_path / "raw.json"
    code, text = _run(["--local", "1", "--memory", "256MiB", "--raw-transport", "--size",
                       "1MiB", "--duration", "0.5", "--concurrency", "1", "--concurrency",
                       "2", "--no-baseline", "--json", str(out), *_transport_args()])
    assert code == 0, text
    rows = json.loads(out.read_text())["cases"]
    assert {(r["transport"], r["concurrency"]) for r in rows} == {
        (t, c) for t in TRANSPORTS for c in (1, 2)}
    assert all(r["op"] == "raw-read" and r["gbps"] > 0 for r in rows)
    code, text = _run(["--local", "1", "--raw-transport", "--transport", "auto"])
    assert code == 2 and "one transport at a time" in text
