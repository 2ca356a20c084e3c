"""``gcache-bench trace --swa`` keeps swa_replay's hybrid-SWA geometry (issue 14, item 4):
KV and SWA pools of different page sizes through a real server per policy, window-safe
hits. With room for every page the hit rate is the offline ceiling exactly; at a fifth of
it the server evicts and the hit rate drops, with no wrong value or lost read."""

from __future__ import annotations

import pytest

from gcache.bench.swa_replay import Geometry
from gcache.bench.trace import run_swa
from test_trace_replay_matches_simulation import _write_trace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_swa_geometry_replays_two_pools_and_meets_the_ceiling_with_room(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace, n=60)
    geo = Geometry(layers=8, full_layers=2, window_tokens=128, page_tokens=128,
                   bytes_per_token_layer=4)  # KV pages 1 KiB, SWA pages 3 KiB
    doc = run_swa(str(trace), fractions=[0.2, 1.0], policies=["reuse"], limit=None, geo=geo,
                  log_dir=None, timeout_ms=10000)
    assert doc["unique_kv_pages"] > doc["unique_swa_pages"] > 0
    small, full = doc["rows"]
    assert 0.1 < doc["ceiling"] < 0.9
    assert full["real"]["errors"] == 0 and small["real"]["errors"] == 0
    assert full["real"]["evictions"] == 0 and full["hit_rate"] == pytest.approx(doc["ceiling"],
                                                                                abs=1e-4)
    assert small["real"]["evictions"] > 0 and small["hit_rate"] < doc["ceiling"] - 0.05
