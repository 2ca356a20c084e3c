"""gcache.bench.handoff: drains a server holding --total bytes and reports the handoff's
rate from the drained server's own log, every object moved and none lost, and
foreground reads during the drain stay correct; with --join, a newcomer gets every key
chosen to be its."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gcache.bench.handoff import pass_rates

pytestmark = [pytest.mark.timeout(120)]

LOG = """\
2026-11-23 15:00:00,000 INFO    gcache.server.handoff: handoff pass at epoch 3: 10 objects \
(2000000000 bytes) to move (this server is not in the ring)
2026-11-23 15:00:01,500 INFO    gcache.server.agent: view epoch 4: 1 routable servers
2026-11-23 15:00:02,000 INFO    gcache.server.handoff: handoff pass at epoch 3 done: 10 moved, \
0 waiting
"""


COPIED = """\
2026-11-23 15:00:01,000 INFO    gcache.server.handoff: handoff pass at epoch 3 copied: 10 \
moved; the old copies go 1.0 s after their put
"""


@pytest.mark.unit
def test_pass_rates_pairs_start_and_done_lines():
    assert pass_rates(LOG) == [{"epoch": 3, "objects": 10, "bytes": 2_000_000_000,
                                "moved": 10, "seconds": 2.0, "gb_per_s": 1.0,
                                "pass_seconds": 2.0}]
    assert pass_rates(LOG.splitlines()[0]) == []  # a pass that never finished
    # the rate counts until every put was answered, not the grace before the deletes
    lines = LOG.splitlines(keepends=True)
    log = lines[0] + COPIED + "".join(lines[1:])
    assert pass_rates(log) == [{"epoch": 3, "objects": 10, "bytes": 2_000_000_000,
                                "moved": 10, "seconds": 1.0, "gb_per_s": 2.0,
                                "pass_seconds": 2.0}]


@pytest.mark.integration
def test_bench_handoff_drains_everything(tmp_path):
    out = tmp_path / "h.json"
    r = subprocess.run([sys.executable, "-m", "gcache.bench.handoff", "--total", "16MiB",
                        "--size", "64KiB", "--foreground", "--quiet-s", "0.5",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["handoff_objects_moved"] == res["objects"] == 256
    assert res["handoff_bytes_moved"] == res["total_bytes"] and res["handoff_lost"] == 0
    assert res["passes"] and res["passes"][-1]["gb_per_s"] > 0
    fg = res["foreground"]  # foreground reads of the other server's keys: all hits
    assert fg["quiet"]["gets"] > 0 and fg["wrong"] == 0 and fg["misses"] == 0


@pytest.mark.integration
def test_bench_handoff_join_moves_the_newcomers_keys(tmp_path):
    out, tmp = tmp_path / "j.json", tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-m", "gcache.bench.handoff", "--join", "--total",
                        "16MiB", "--size", "64KiB", "--json", str(out)],
                       capture_output=True, text=True, timeout=110,
                       env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list(tmp.glob("gcache-bench-handoff-*"))  # a run that succeeds keeps no logs
    res = json.loads(out.read_text())
    # every key was chosen (by the real ring) to belong to the newcomer: all moved
    assert res["handoff_objects_moved"] == res["objects"] == 256
    assert res["handoff_bytes_moved"] == res["total_bytes"] and res["handoff_lost"] == 0
