"""``--drain-on-stop`` ends: a drain that cannot finish within its budget (a handoff
capped by ``--migrate-mbps`` far below what the server holds) stops at the budget, with
a log line naming what was left, and leaves the member draining (not deregistered: a
restart under the same name hands off the rest); a second SIGTERM during a drain stops
the server at once."""

from __future__ import annotations

import re
import time

import pytest

from drainops import add_own_server, log_of, routed_client, sigterm_and_wait
from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, masters, put_all, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

SIZE = 64_000
N = 240  # 15 MB over 3 servers; at 0.2 MB/s the leaving one needs ~25 s
BUDGET_S = 3
SLOW = ["--migrate-mbps", "0.2"]


def states(cl) -> dict[str, str]:
    return {m["id"]: m["state"] for m in masters(cl).view()["members"]}


def test_over_budget_stops_at_budget_naming_what_was_left(make_cluster):
    cl = start_cluster(make_cluster, 1, "32MiB", slab="1MiB")
    slow = add_own_server(cl, "slow", SLOW + ["--drain-on-stop", str(BUDGET_S)])
    again = add_own_server(cl, "again", SLOW + ["--drain-on-stop", "60"])
    keys = [f"b-{i}".encode() for i in range(N)]
    with routed_client(cl) as c:
        put_all(c, keys, SIZE, batch=16)
        st = c.stats()
        assert st[slow.address]["objects"] > 20 and st[again.address]["objects"] > 20
    code, took = sigterm_and_wait(slow, BUDGET_S + 30)
    assert code == 0
    assert BUDGET_S <= took < BUDGET_S + 10, f"took {took:.1f} s"
    log = log_of(slow)
    line = re.search(r"stopping undrained after [0-9.]+ s \(the budget of 3.0 s ran out\): "
                     r"(\d+) objects \((\d+) bytes\) left in the handoff pass, (\d+) objects "
                     r"held in the tiers; the member stays draining", log)
    assert line, log[-3000:]
    assert int(line[1]) > 0 and int(line[2]) == int(line[1]) * SIZE and int(line[3]) > 0
    assert "deregistered" not in log
    assert slow.name in states(cl)  # left draining (down once its heartbeats stop)

    # a second SIGTERM ends a 60 s drain at once
    t0 = time.monotonic()
    gone = again.proc
    again.proc.send_signal(15)
    wait_for(lambda: "draining before the stop" in log_of(again), 10)
    time.sleep(0.5)
    code, took = sigterm_and_wait(again, 30)
    assert code == 0 and gone.returncode == 0
    assert took < 10 and time.monotonic() - t0 < 20, f"took {took:.1f} s"
    assert "stopping undrained after" in log_of(again) and "(a second signal)" in log_of(again)


def test_last_server_in_the_ring_stops_at_once_undrained(make_cluster):
    cl = start_cluster(make_cluster, 1, "16MiB", slab="1MiB",
                       server_extra=["--drain-on-stop", "60"])
    last = cl.servers[0]
    with Client([last.address], token=TOKEN) as c:
        wait_for(lambda: c.stats()[last.address].get("handoff_passes", 0) >= 1, 10)
    code, took = sigterm_and_wait(last, 30)
    assert code == 0 and took < 10, f"took {took:.1f} s"
    assert "the only one in the ring" in log_of(last)
    assert states(cl)[last.name] in ("up", "down")  # never drained
