"""``--metrics-listen`` on a non-loopback address needs a token, like the data bind.

Before the fix ``--metrics-listen 0.0.0.0:PORT`` was accepted on a server without a
token, publishing /metrics and /healthz to the network. Now the server refuses to start
(and leaves no arena behind), saying which flag and what to set; with a token it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("metrics", ["0.0.0.0:0", "[::]:0"])
def test_metrics_listen_refuses_non_loopback_without_token(metrics):
    name = f"m-{uuid.uuid4()}"
    arena = Path("/dev/shm") / f"gcache-{name}.arena"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gcache.server.cli", "--listen", "127.0.0.1:0",
             "--name", name, "--memory", "8MiB", "--slab-bytes", "1MiB",
             "--metrics-listen", metrics],
            capture_output=True, text=True, timeout=20, env=env, cwd=REPO)
        assert proc.returncode != 0, proc
        assert "GCACHE_LISTEN=" not in proc.stdout
        assert "refusing to bind non-loopback" in proc.stderr, proc.stderr
        assert "--metrics-listen" in proc.stderr and "token" in proc.stderr
        assert not arena.exists()
    finally:
        arena.unlink(missing_ok=True)


def test_metrics_listen_non_loopback_with_token_starts(make_cluster):
    cl = make_cluster(1, "8MiB", token="s3cret", extra=["--metrics-listen", "0.0.0.0:0"])
    assert cl.servers[0].alive
