"""A server stopped by SIGTERM without a drain budget marks itself down at the masters as
it stops, so clients route around it at once instead of after the heartbeat timeout; it
stays a member, and a restart under its name comes back up with its objects."""

from __future__ import annotations

import time

import pytest

from gcache.discovery import MasterClient
from gcache.sdk import Client, Status
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

TOKEN = "sigterm-down-token"


def _state(mc: MasterClient, name: str) -> str | None:
    return next((m["state"] for m in mc.view()["members"] if m["id"] == name), None)


def test_sigterm_marks_the_member_down_at_once_and_a_restart_is_warm(make_cluster) -> None:
    # a 60 s heartbeat timeout: only the server's own call can mark it down in time
    cl = make_cluster(2, "32MiB", slab="1MiB", masters=1, token=TOKEN,
                      heartbeat_timeout_ms=60000)
    mc = MasterClient(cl.master_addresses, TOKEN)
    a = cl.servers[0]
    wait_for(lambda: _state(mc, a.name) == "up", 30)
    with Client([a.address], token=TOKEN) as direct:
        assert direct.put("warm", b"kept across the restart") == Status.OK
    t0 = time.monotonic()
    assert a.terminate() == 0
    wait_for(lambda: _state(mc, a.name) == "down", 5)
    assert time.monotonic() - t0 < 10
    a.start(60)
    wait_for(lambda: _state(mc, a.name) == "up", 30)
    with Client([a.address], token=TOKEN) as direct:
        assert direct.get("warm") == b"kept across the restart"
