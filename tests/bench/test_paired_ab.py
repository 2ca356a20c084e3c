"""``python -m gcache.bench.paired_ab``: two workers (here the same interpreter twice),
each with its own real one-server cluster with a disk tier, filled until values sit on
disk, then alternated timed windows of batch gets; the JSON result pairs the rounds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_paired_rounds_over_two_disk_tier_clusters():
    out = subprocess.run(
        [sys.executable, "-m", "gcache.bench.paired_ab", "--rounds", "3", "--window", "0.3",
         "--keys", "400", "--batch", "16", "--memory", "16MiB", "--slab", "1MiB",
         "--disk", "128MiB", "--segment-bytes", "4MiB", "--setup-timeout", "120"],
        capture_output=True, text=True, timeout=170, cwd="/tmp")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(res["ratios_b_over_a"]) == 3 and all(r > 0 for r in res["ratios_b_over_a"])
    assert res["a_gbps_median"] > 0 and res["b_gbps_median"] > 0
    for side in ("a", "b"):  # 25 MB through a 16 MiB arena: some values live on disk
        assert res["setup"][side]["disk_objects"] > 0
        assert res["setup"][side]["objects"] + res["setup"][side]["disk_objects"] >= 400
    assert "B/A per round" in out.stderr


def test_paired_rounds_of_puts_over_two_memory_clusters():
    """``--op put``: each window replaces a group of keys with ``put_batch_from``
    (every status checked by the worker), over tcp."""
    out = subprocess.run(
        [sys.executable, "-m", "gcache.bench.paired_ab", "--op", "put", "--tier", "memory",
         "--transport", "tcp", "--rounds", "2", "--window", "0.3", "--keys", "128",
         "--batch", "16", "--memory", "32MiB", "--slab", "1MiB", "--setup-timeout", "120"],
        capture_output=True, text=True, timeout=170, cwd="/tmp")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(res["ratios_b_over_a"]) == 2 and all(r > 0 for r in res["ratios_b_over_a"])
    assert res["a_gbps_median"] > 0 and res["b_gbps_median"] > 0
    for side in ("a", "b"):
        assert res["setup"][side]["objects"] >= 128  # filled before the timed puts
