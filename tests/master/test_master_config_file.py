"""``gcache-master --config FILE``: the file's [master] table sets the flags' defaults
(file < env < flags), a typo is refused with the nearest flag, and secrets are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gcache.discovery import MasterClient
from gcache.master.cli import main as master_main
from gcache.testing.cluster import free_port_pair

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(60)
def test_master_takes_its_flags_from_the_config_file(tmp_path: Path) -> None:
    port = free_port_pair()
    conf = tmp_path / "gcache.toml"
    conf.write_text(f'[server]\nmemory = "1Gi"\n\n[master]\nlisten = "127.0.0.1:{port}"\n'
                    f'data-dir = "{tmp_path / "data"}"\nlog-format = "text"\n'
                    'log_level = "INFO"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    proc = subprocess.Popen([sys.executable, "-m", "gcache.master.cli", "--config", str(conf)],
                            env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 30
        lines: list[str] = []
        while time.monotonic() < end and not (lines and lines[-1].startswith("GCACHE_MASTER=")):
            lines.append(proc.stdout.readline())
            assert proc.poll() is None, lines
        assert lines[-1].strip() == f"GCACHE_MASTER=127.0.0.1:{port}"
        assert (tmp_path / "data").is_dir()  # data-dir came from the file
        logs = [ln for ln in lines[:-1] if ln.strip()]
        # log-format and log_level came from the file: INFO lines, as text (json by default)
        assert logs and not any(ln.lstrip().startswith("{") for ln in logs), logs
        assert any("INFO" in ln for ln in logs), logs
        assert MasterClient([f"127.0.0.1:{port}"]).view()["epoch"] >= 0
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("table", "message"), [
    ('join-timout-s = 5', "unknown [master] key 'join-timout-s'; did you mean 'join_timeout_s'?"),
    ('raft_secret = "x" ', "'raft_secret' is a secret; set it with GCACHE_RAFT_SECRET"),
    ('token = "t"', "'token' is a secret"),
])
def test_config_file_typos_and_secrets_are_refused(tmp_path: Path, table: str,
                                                   message: str) -> None:
    conf = tmp_path / "m.toml"
    conf.write_text(f"[master]\n{table}\n")
    result = CliRunner().invoke(master_main, ["--config", str(conf), "--listen",
                                              "127.0.0.1:1", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert message in result.output.replace("\n", " ").replace("  ", " ")
