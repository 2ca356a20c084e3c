"""Signals reach the server through a relay thread, never an ``Event.set`` in a handler:
a handler runs on the main thread, which may hold that very event's lock inside its own
wait, and a server so caught ignored SIGTERM until SIGKILL. Thousands of SIGHUPs (each
a reload) and then SIGTERM: the server, and a master, reload, stop cleanly and
promptly (before ``gcache.signals`` the server hung here every time)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gcache.testing.cluster import MasterProc, ServerProc, free_port_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def storm_then_stop(p) -> tuple[int | None, float]:
    """5,000 SIGHUPs, then SIGTERM: (exit code, seconds to exit)."""
    for _ in range(5):
        for _ in range(1000):
            p.proc.send_signal(signal.SIGHUP)
        time.sleep(0.05)
    assert p.alive
    t = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    rc = p.proc.wait(timeout=20)
    return rc, time.monotonic() - t


def test_server_sighup_storm_then_sigterm_stops_promptly(tmp_path):
    s = ServerProc(f"sig{os.getpid()}", "16MiB", slab="1MiB", token="t",
                   log_dir=str(tmp_path))
    s.start()
    try:
        rc, took = storm_then_stop(s)
    finally:
        s.kill9()
        s.remove_arena()
    log = (tmp_path / f"{s.name}.log").read_text()
    assert rc == 0 and took < 10, (rc, took, log[-2000:])
    assert "stopped" in log and "reload" in log.lower(), log[-2000:]


def test_master_sighup_storm_then_sigterm_stops_promptly(tmp_path):
    m = MasterProc(f"msig{os.getpid()}", free_port_pair(), [], str(tmp_path / "m"),
                   token="t", log_dir=str(tmp_path))
    m.start()
    try:
        rc, took = storm_then_stop(m)
    finally:
        m.kill9()
    log = (tmp_path / f"{m.name}.log").read_text()
    assert rc == 0 and took < 10, (rc, took, log[-2000:])
    assert "stopping gcache-master" in log, log[-2000:]
