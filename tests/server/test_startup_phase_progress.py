"""``Startup``: the phase, its progress for /readyz and the gauge, and a progress log at
most once per interval with its rate (a virtual clock)."""

from __future__ import annotations

import logging

import pytest

from gcache.clock import VirtualClock
from gcache.server.startup import Phase, Startup

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_progress_is_logged_once_per_interval_with_percent_and_rate(caplog) -> None:
    clock = VirtualClock()
    st = Startup(clock=clock.monotonic, log_every_s=1.0)
    caplog.set_level(logging.INFO, logger="gcache.server")
    st.enter(Phase.PREFAULT)
    report = st.progress("bytes")
    gib = 1 << 30
    for i in range(1, 9):  # 8 chunks of 1 GiB, 0.25 s apart: logs at 1 s and 2 s, and done
        clock.advance(0.25)
        report(i * gib, 8 * gib)
        assert st.snapshot() == (Phase.PREFAULT, i / 8)
        if i == 3:
            assert st.describe() == "prefaulting the arena (38%)"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefault ")]
    assert lines == ["prefault 50% (4.00 GiB of 8.00 GiB, 4.29 GB/s)",
                     "prefault 100% (8.00 GiB of 8.00 GiB, 4.29 GB/s)"]
    st.enter(Phase.RECOVERY)
    assert st.snapshot() == (Phase.RECOVERY, 0.0)
    assert st.describe() == "recovering the arena's objects"
    st.progress("objects")(10, 10)
    assert "recovery 100% (10 of 10 objects" in caplog.records[-1].getMessage()
    st.enter(Phase.SERVING)
    assert st.describe() == "serving"
