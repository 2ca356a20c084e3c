"""`gcache up` end to end: serve-until-signal, the sessions workload, and trace replay."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from gcache.sdk import Client, Status

pytestmark = pytest.mark.integration

UP = [sys.executable, "-m", "gcache.cli", "up"]


def _arenas() -> set[str]:
    return set(glob.glob("/dev/shm/gcache-up*.arena"))


def _logs_kept(stderr: str) -> list[str]:
    return [ln.split("logs kept in ", 1)[1].strip() for ln in stderr.splitlines()
            if "logs kept in " in ln]


def test_up_serves_until_sigint_and_cleans_up():
    before = _arenas()
    p = subprocess.Popen(UP + ["--servers", "2", "--memory", "32MiB", "--slab-bytes", "1MiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: dict[str, str] = {}
        while "GCACHE_SERVERS" not in lines:
            line = p.stdout.readline()
            assert line, "gcache up exited before printing GCACHE_SERVERS"
            if line.startswith("GCACHE_"):
                k, v = line.strip().split("=", 1)
                lines[k] = v
        servers = lines["GCACHE_SERVERS"].split(",")
        masters = lines["GCACHE_MASTERS"].split(",")  # printed first, 3 by default
        assert len(servers) == 2 and len(masters) == 3
        page = lines["GCACHE_CLUSTER_PAGE"]
        assert page == f"http://{masters[0]}/ui"
        with urllib.request.urlopen(page, timeout=10) as r:  # the live cluster page
            assert r.status == 200 and b"<html" in r.read().lower()
        with Client(masters=masters) as c:
            assert sorted(m.address for m in c.view.members) == sorted(servers)
            assert c.put("k", b"v") == Status.OK
            assert c.get("k") == b"v"
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert _arenas() - before == set(), "gcache up left arena files behind"
    logs = [ln.split("logs in ", 1)[1].strip() for ln in err.splitlines() if "; logs in " in ln]
    assert logs and not os.path.exists(logs[0]), "a clean run must remove its log directory"
    assert _logs_kept(err) == []


def test_up_keeps_the_logs_of_a_failed_start_and_a_named_log_dir(tmp_path):
    # a server that cannot start (its arena cannot fit the slab) fails the run: logs kept
    r = subprocess.run(UP + ["--servers", "1", "--masters", "0", "--memory", "1MiB",
                             "--slab-bytes", "4MiB"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    kept = _logs_kept(r.stderr)
    assert len(kept) == 1 and os.listdir(kept[0]), r.stderr
    import shutil

    shutil.rmtree(kept[0])
    # --log-dir: the operator's directory is never removed
    mine = tmp_path / "up-logs"
    r = subprocess.run(UP + ["--servers", "1", "--masters", "0", "--memory", "32MiB",
                             "--slab-bytes", "1MiB", "--workload", "sessions", "--sessions", "2",
                             "--turns", "1", "--page-bytes", "64KiB", "--log-dir", str(mine)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _logs_kept(r.stderr) == [str(mine)] and any(mine.iterdir())


def test_up_sessions_workload_prints_table_and_json(tmp_path):
    out = tmp_path / "report.json"
    r = subprocess.run(UP + ["--servers", "2", "--memory", "128MiB", "--slab-bytes", "1MiB",
                             "--workload", "sessions", "--sessions", "8", "--turns", "3",
                             "--page-bytes", "64KiB", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "token hit rate" in r.stdout and "wrong values" in r.stdout
    rep = json.loads(out.read_text())
    assert rep["steps"] == 24 and rep["wrong_values"] == 0
    assert 0 < rep["token_hit_rate"] < 1  # shared system prompts and earlier turns hit
    assert rep["pages_put"] + rep["pages_hit"] == rep["pages"]


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_up_workload_over_a_fast_path(tmp_path, transport):
    from gcache.nixl_lib import available

    if transport == "nixl" and available():
        pytest.skip(available())
    out = tmp_path / "report.json"
    r = subprocess.run(UP + ["--servers", "2", "--masters", "0", "--memory", "128MiB",
                             "--slab-bytes", "1MiB", "--workload", "sessions", "--sessions",
                             "8", "--turns", "3", "--page-bytes", "64KiB", "--transport",
                             transport, "--json", str(out)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "UCX_NET_DEVICES": "lo"})
    assert r.returncode == 0, r.stderr
    assert f"{transport} transport" in " ".join(r.stdout.split())  # the table title
    rep = json.loads(out.read_text())
    assert rep["steps"] == 24 and rep["wrong_values"] == 0 and rep["pages_hit"] > 0


def test_up_replays_a_mooncake_trace(tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": i * 10, "input_length": 1024, "output_length": 8,
             "hash_ids": [0, 1, 2 + i]} for i in range(10)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "report.json"
    r = subprocess.run(UP + ["--servers", "1", "--memory", "32MiB", "--slab-bytes", "1MiB",
                             "--trace", str(trace), "--page-bytes", "16KiB",
                             "--concurrency", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    # blocks 0 and 1 are shared: request 0 misses 3 pages, every later one hits 2 of 3
    assert rep["pages"] == 30 and rep["pages_hit"] == 18 and rep["wrong_values"] == 0


def test_up_rejects_bad_size():
    r = subprocess.run(UP + ["--memory", "12 potatoes"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "memory" in r.stderr.lower()
