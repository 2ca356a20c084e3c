"""``--plot`` without matplotlib fails at once, before any server starts or any trace
is replayed, naming the extra to install."""

from __future__ import annotations

import sys
import time

import pytest
from click.testing import CliRunner

from gcache.bench.cli import main as bench_main

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.mark.parametrize(("command", "args"), [
    ([], ["--local", "1", "--op", "get", "--size", "64KiB", "--duration", "30"]),
    (["trace"], ["--offline", "no-such-trace.jsonl"]),
])
def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, tmp_path, command,
                                                      args) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    t0 = time.monotonic()
    result = CliRunner().invoke(bench_main, [*command, "--plot", str(tmp_path / "p.png"),
                                             *args])
    assert result.exit_code == 2, result.output
    assert "needs matplotlib" in result.output and "gcache[bench]" in result.output
    assert time.monotonic() - t0 < 5  # no servers were started, nothing was measured
    assert not (tmp_path / "p.png").exists()
