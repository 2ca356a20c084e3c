"""gcache-bench --tier disk end to end, small and short: disk-served gets next to a raw
pread of the same segment files, and get latency under background demotion."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gcache.bench.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_disk_tier_gets_raw_pread_and_demotion_impact(tmp_path) -> None:
    out = tmp_path / "out.json"
    res = CliRunner().invoke(main, [
        "--local", "1", "--tier", "disk", "--disk-dir", str(tmp_path / "disk"),
        "--memory", "16MiB", "--slab-bytes", "1MiB", "--disk-bytes", "512MiB",
        "--disk-working-set", "48MiB", "--op", "get", "--size", "64KiB", "--batch", "8",
        "--duration", "2", "--no-baseline", "--verify", "--demotion-impact",
        "--impact-memory", "32MiB", "--bg-mbps", "100", "--json", str(out),
        "--log-dir", str(tmp_path / "logs")],
        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "pread" in res.output and "busy/idle" in res.output  # both tables printed
    assert len(list((tmp_path / "logs").glob("*.log"))) == 3  # main + the two impact servers
    doc = json.loads(out.read_text())
    assert doc["local"]["tier"] == "disk"
    (case,) = doc["cases"]
    assert case["errors"] == 0 and case["prefill_errors"] == 0
    assert case["disk_fraction"] > 0.5, "gets must be served from the disk tier"
    raw = case["raw_disk"]
    assert raw["gbps"] > 0 and raw["records"] > 100 and len(raw["rounds"]) == 2
    assert len(case["round_ratios"]) == 2 and case["vs_pread"] > 0
    disk, mem = doc["demotion_impact"]
    assert disk["server"].startswith("disk") and mem["server"].startswith("memory")
    assert disk["busy_demoted"] > 0 and disk["busy_evictions"] == 0
    assert mem["busy_demoted"] == 0 and mem["busy_evictions"] > 0
    # demoted, not lost (the kinds say what went wrong if not)
    assert disk["idle"]["errors"] == 0 and disk["busy"]["errors"] == 0, (
        disk["idle"], disk["busy"], disk["bg_errors"], _log_tails(tmp_path / "logs"))
    # (at this toy size the memory-only control's LRU turns over in ~0.1 s, so a stalled
    # foreground read may find its hot key evicted: that is the control's job)
    for r in (disk, mem):
        assert r["bg_errors"] == {} and r["idle"]["errors"] == 0
        assert 0 < r["idle"]["p50_us"] <= r["idle"]["p99_us"] and r["p99_ratio"] > 0


def test_disk_tier_needs_a_local_server() -> None:
    res = CliRunner().invoke(main, ["--servers", "127.0.0.1:1", "--tier", "disk"])
    assert res.exit_code == 2 and "--tier disk needs --local" in res.output
    res = CliRunner().invoke(main, ["--local", "1", "--demotion-impact"])
    assert res.exit_code == 2 and "--demotion-impact needs --tier disk" in res.output


def _log_tails(d) -> str:
    """The last lines of every server log of the run (for a failure message)."""
    out = []
    for f in sorted(d.glob("*.log")):
        lines = f.read_text(errors="replace").splitlines()
        out.append(f"--- {f.name}\n" + "\n".join(lines[-15:]))
    return "\n".join(out)
