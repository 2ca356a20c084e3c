"""A server that cannot start says why in one line naming the flag, exits non-zero and
leaves no arena file; one that can logs its prefault's progress and answers /readyz
(503 with the reason until it is ready)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from gcache.testing.cluster import free_port

pytestmark = [pytest.mark.integration]

SERVER = [sys.executable, "-m", "gcache.server.cli"]


def _start(args: list[str], shm: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    return subprocess.run([*SERVER, "--name", "s", "--shm-dir", str(shm), "--slab-bytes",
                           "1MiB", *args], capture_output=True, text=True, timeout=60, env=env)


def _refused(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("gcache-server: "), r.stderr
    assert all(w in last for w in words), last
    return last


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    d = Path("/dev/shm") / f"gcache-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--listen", "--metrics-listen"])
def test_a_busy_port_is_one_line_naming_the_flag_and_leaves_no_arena(shm: Path,
                                                                     flag: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        ports = {"--listen": f"127.0.0.1:{free_port()}",
                 "--metrics-listen": f"127.0.0.1:{free_port()}", flag: taken}
        t0 = time.monotonic()
        # 2 GiB: a prefault before the bind would show in the time
        r = _start(["--memory", "2GiB", *[x for kv in ports.items() for x in kv]], shm)
    _refused(r, f"cannot bind {flag} {taken}", "in use")
    assert list(shm.iterdir()) == [], "a failed first start left files behind"
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_a_busy_kv_events_endpoint_fails_before_the_arena(shm: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        t0 = time.monotonic()
        r = _start(["--memory", "2GiB", "--listen", f"127.0.0.1:{free_port()}",
                    "--kv-events-endpoint", taken], shm)
    _refused(r, f"cannot bind the KV-event endpoints {taken}")
    assert "clean start of arena" not in r.stderr  # refused before the arena was made
    assert list(shm.iterdir()) == [] and time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_an_arena_bigger_than_the_tmpfs_is_refused_and_leaves_no_file(shm: Path) -> None:
    r = _start(["--memory", "4TiB", "--listen", f"127.0.0.1:{free_port()}"], shm)
    _refused(r, "not enough space", "--memory")
    assert list(shm.iterdir()) == []


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.timeout(90)
def test_prefault_progress_is_logged_and_readyz_says_why_not_ready(shm: Path) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    dead_master = f"127.0.0.1:{free_port()}"  # nobody listens: never registered
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    proc = subprocess.Popen([*SERVER, "--name", "s", "--shm-dir", str(shm), "--slab-bytes",
                             "1MiB", "--memory", "600MiB", "--listen",
                             f"127.0.0.1:{free_port()}", "--metrics-listen", metrics,
                             "--masters", dead_master, "--log-format", "text"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().startswith("GCACHE_LISTEN="), proc.stderr.read()
        code, doc = _get(f"http://{metrics}/readyz")
        assert (code, doc) == (503, {"ready": False,
                                     "reason": "not registered with the masters"})
        code, health = _get(f"http://{metrics}/healthz")
        assert code == 200 and health["status"] == "ok" and health["phase"] == "serving"
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'gcache_server_phase{phase="serving"} 1.0' in text
        assert 'gcache_server_phase{phase="prefault"} 0.0' in text
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert proc.returncode == 0, err
    progress = [ln for ln in err.splitlines() if "prefault 100% (" in ln]
    assert progress and "GB/s" in progress[0], err
    phases = [ln.rsplit("start-up phase: ", 1)[1] for ln in err.splitlines()
              if "start-up phase: " in ln]
    assert phases == ["prefault", "recovery", "starting", "serving", "stopping"], phases


@pytest.mark.timeout(60)
def test_a_start_failing_after_the_arena_was_made_removes_it(shm: Path, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    r = _start(["--memory", "64MiB", "--listen", f"127.0.0.1:{free_port()}",
                "--disk-dir", str(not_a_dir / "disk")], shm)
    _refused(r, "--disk-dir")
    assert "clean start of arena" in r.stderr  # the arena was made, then the disk failed
    assert list(shm.iterdir()) == [], "a failed first start left its arena behind"
