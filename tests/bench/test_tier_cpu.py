"""``python -m gcache.bench.tier_cpu``: a real MemoryTier over an arena it creates and
removes, rounds of one-by-one and batched puts alternated; the JSON has both modes'
CPU per item for every round."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_tier_cpu_measures_both_modes_and_removes_its_arena(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "gcache.bench.tier_cpu", "--size", "4KiB", "--batch", "64",
         "--keys", "256", "--rounds", "3", "--memory", "64MiB", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=100, cwd="/tmp")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for mode in ("one", "batch"):
        assert len(res["us_per_item"][mode]) == 3
        assert all(0 < v < 10_000 for v in res["us_per_item"][mode])
    assert res["batch_over_one"] > 0
    assert os.listdir(tmp_path) == []  # its arena file is gone
