"""A master whose API port or Raft port (API port + 1) is taken exits at once with one
line naming the port, non-zero, and makes no data directory (pysyncobj alone would retry
a busy Raft port forever while the master logged "serving")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gcache.testing.cluster import free_port_pair

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("offset", "named"), [(0, "--listen"),
                                               (1, "the Raft port (--listen's port + 1)")])
def test_a_busy_master_port_is_one_line_and_makes_no_data_dir(tmp_path: Path, offset: int,
                                                              named: str) -> None:
    port = free_port_pair()
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + offset))
        busy.listen(1)
        r = subprocess.run([sys.executable, "-m", "gcache.master.cli", "--listen",
                            f"127.0.0.1:{port}", "--data-dir", str(data)],
                           capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"gcache-master: cannot bind {named} 127.0.0.1:{port + offset}: "
        "Address already in use"), r.stderr
    assert not data.exists()
