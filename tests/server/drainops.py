"""Shared by the self-drain tests: one more server with flags of its own (the cluster's
flags apply to every server, and a ``--drain-on-stop`` on all of them would slow every
cluster's close), its log, and a SIGTERM that measures how long the process took."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from gcache.sdk import Client
from gcache.testing.cluster import Cluster, ServerProc
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, up_members


def add_own_server(cl: Cluster, name: str, flags: list[str]) -> ServerProc:
    """A server like the cluster's first (same masters, memory, disk flags) plus
    ``flags``, started, once every server of the cluster is up in the masters' view;
    closed with the cluster."""
    first = cl.servers[0]
    s = ServerProc(name, first.memory, slab=first.slab, token=first.token,
                   shm_dir=first.shm_dir, extra=first.extra + flags, log_dir=first.log_dir)
    cl.servers.append(s)
    s.start(60)
    wait_for(lambda: len(up_members(cl)) == len(cl.servers), 30)
    return s


def routed_client(cl: Cluster) -> Client:
    """A client on the masters' view, once that view routes to every server."""
    c = Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000)
    wait_for(lambda: len(c.view.members) == len(cl.servers), 10)
    return c


def log_of(s: ServerProc) -> str:
    return (Path(s.log_dir) / f"{s.name}.log").read_text()


def sigterm_and_wait(s: ServerProc, timeout: float) -> tuple[int | None, float]:
    """SIGTERM ``s``; ``(exit code, seconds until it exited)``, code None when it was
    still running after ``timeout`` (then it is killed)."""
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    try:
        code = s.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        s.kill9()
        return None, time.monotonic() - t0
    return code, time.monotonic() - t0
