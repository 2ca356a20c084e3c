"""A ``Client(background=True)`` (the servers' handoff uses one) keeps off foreground CPU:
its dispatch threads run under ``SCHED_IDLE``, and so does each server thread serving its
connections (AUTH flag ``bg``), while a plain client's threads, and the server threads
serving them, keep the normal policy. Policies are read from ``/proc/<pid>/task/*/stat``
(field 41), so this checks what the kernel applies, not what the code meant.
"""

from __future__ import annotations

import os
import sys

import pytest

from gcache.sched import background_thread
from gcache.sdk import Client
from gcache.status import Status
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")]

SCHED_IDLE = 5


def idle_threads(pid: int) -> int:
    """How many of ``pid``'s threads run under SCHED_IDLE now."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        n += int(fields[41 - 3]) == SCHED_IDLE  # fields after ") " start at field 3
    return n


@pytest.mark.timeout(60)
def test_background_client_and_its_server_threads_run_idle(make_cluster):
    cl = make_cluster(1, "32MiB")
    pid = cl.servers[0].proc.pid
    mine = os.getpid()
    before = idle_threads(mine)
    with Client(servers=cl.addresses, namespace="fg", timeout_ms=3000,
                transport="tcp", conns_per_server=2) as fg:
        assert fg.put("k", b"x" * 4096) == Status.OK
        assert fg.get("k") == b"x" * 4096
        assert idle_threads(pid) == 0, "a plain client's connections run at normal priority"
        assert idle_threads(mine) == before
    with Client(servers=cl.addresses, namespace="bg", timeout_ms=3000, transport="tcp",
                conns_per_server=2, background=True) as bg:
        assert bg.put_batch([f"k{i}" for i in range(8)], [b"y" * 4096] * 8) == [Status.OK] * 8
        assert bg.get_batch([f"k{i}" for i in range(8)]) == [b"y" * 4096] * 8
        # both dispatch threads (each dialled one connection) and the server threads
        # serving those connections
        wait_for(lambda: idle_threads(mine) == before + 2, 5)
        # the sync calls above ran on this thread (one-hop): a caller keeps its priority
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        wait_for(lambda: idle_threads(pid) >= 1, 5)


@pytest.mark.timeout(10)
def test_background_thread_reports_what_it_applied():
    import threading

    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(background_thread()))
    t.start()
    t.join(5)
    assert got == ["idle"]  # Linux grants SCHED_IDLE to any thread, unprivileged too
