"""The source stopped mid-handoff: a draining server stopped (SIGTERM) in the middle of a
rate-capped pass exits promptly, keeps what it had not handed off yet, and, restarted
under the same name, comes back draining and hands off the rest: every acknowledged key
reads back byte-exact, none wrong, and the server ends empty."""

from __future__ import annotations

import time

import pytest

from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, handoff_done, masters, member, put_all, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 64_000
N = 160  # about 5 MB on the drained server: 5 s of handoff at 1 MB/s


def test_source_stopped_mid_pass_resumes_after_restart(make_cluster):
    cl = start_cluster(make_cluster, 2, "32MiB", slab="1MiB",
                       server_extra=["--migrate-mbps", "1"])
    keys = [f"s-{i}".encode() for i in range(N)]
    gone = cl.servers[0]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, keys, SIZE, batch=16)
        masters(cl).admin("drain", gone.name)
        wait_for(lambda: member(cl, gone.name)["stats"].get("handoff_bytes_moved", 0) > 0, 20)
        t0 = time.monotonic()
        assert gone.terminate(timeout=15) == 0
        assert time.monotonic() - t0 < 8, "stop must not wait for the handoff"
        with Client([cl.servers[1].address], token=TOKEN) as direct:
            st = direct.stats()[cl.servers[1].address]
        assert 0 < st["objects"] < N, "stopped mid-pass: some but not all moved"
        gone.start()  # same name: its arena is back, and it is still drained
        wait_for(lambda: member(cl, gone.name)["state"] == "draining", 20)
        epoch = masters(cl).view()["epoch"]
        wait_for(lambda: handoff_done(member(cl, gone.name), epoch)
                 and member(cl, gone.name)["stats"]["objects"] == 0, 30)
        got = read_back(c, keys, SIZE)
        assert got.wrong == [] and got.missing == [] and got.ok == N
        assert member(cl, gone.name)["stats"]["handoff_lost"] == 0
