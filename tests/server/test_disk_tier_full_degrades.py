"""A full or failing disk degrades the server to memory-only — clear log line, metric, no
wrong bytes, puts keep working — and it recovers once space (or the device) comes back.

The disk-full case needs a real, small filesystem: a 16 MiB tmpfs mounted for the test
(root only; skipped otherwise), partly taken by a filler file that the test deletes to
"give space back"."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, value_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 100_000


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _wait_for(c: Client, addr: str, pred, timeout: float = 15.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        st = c.stats()[addr]
        if pred(st) or time.monotonic() > end:
            return st
        time.sleep(0.1)


def _put_range(c: Client, start: int, n: int) -> list[bytes]:
    keys = [f"f-{i}".encode() for i in range(start, start + n)]
    for s in range(0, n, 20):
        ks = keys[s:s + 20]
        assert c.put_batch(ks, [value_for(k, SIZE) for k in ks]) == [Status.OK] * len(ks)
    return keys


def _no_wrong(c: Client, keys: list[bytes]) -> int:
    got = c.get_batch(keys)
    assert all(check_value(k, v) and len(v) == SIZE for k, v in zip(keys, got) if v is not None)
    return sum(v is not None for v in got)


def test_disk_full_degrades_to_memory_only_and_recovers(small_fs, make_cluster, tmp_path):
    # small_fs first: it is torn down (unmounted) after the server has stopped
    filler = small_fs / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 6 << 20)  # leaves room for two segments
    cl = make_cluster(1, "16MiB", slab="1MiB", extra=[
        "--disk-dir", str(small_fs), "--disk", "64MiB", "--segment-bytes", "4MiB"])
    addr = cl.addresses[0]
    with Client(cl.addresses, timeout_ms=10_000) as c:
        keys = _put_range(c, 0, 300)  # 30 MB: memory 16 MiB + ~8 MiB of disk is not enough
        st = _wait_for(c, addr, lambda s: s["disk_degraded"] == 1)
        assert st["disk_degraded"] == 1 and st["disk_write_errors"] >= 1
        assert st["evictions"] > 0, "degraded: memory evicts to nothing instead of demoting"
        assert 0 < st["disk_allocated_bytes"] <= 8 << 20
        present = _no_wrong(c, keys)
        assert 0 < present < len(keys)
        more = _put_range(c, 300, 40)  # still serving puts
        assert _no_wrong(c, more) > 0
        demoted = st["demoted"]

        filler.unlink()  # space comes back: the mover's probe finds it within a second or two
        st = _wait_for(c, addr, lambda s: s["disk_degraded"] == 0)
        assert st["disk_degraded"] == 0
        late = _put_range(c, 400, 30)  # 3 MB: fits the space that came back
        st = _wait_for(c, addr, lambda s: s["demoted"] > demoted)
        assert st["demoted"] > demoted, "demotion resumes after recovery"
        assert _no_wrong(c, late) == len(late)
    log = (tmp_path / f"{cl.servers[0].name}.log").read_text()
    assert "disk tier degraded to memory-only" in log and "No space left on device" in log
    assert "free space on" in log  # the log line says what the operator should do
    assert "disk tier recovered" in log


def test_disk_write_eio_degrades_then_recovers(make_cluster, tmp_path):
    cl = make_cluster(1, "16MiB", slab="1MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk", "128MiB", "--segment-bytes", "4MiB",
        "--failpoints", "disk_write=eio:2x"])
    addr = cl.addresses[0]
    with Client(cl.addresses, timeout_ms=10_000) as c:
        keys = _put_range(c, 0, 250)
        st = _wait_for(c, addr, lambda s: s["disk_write_errors"] >= 2 and s["disk_degraded"] == 0)
        assert st["disk_write_errors"] >= 2 and st["disk_degraded"] == 0
        late = _put_range(c, 250, 200)
        assert _wait_for(c, addr, lambda s: s["disk_objects"] > 100)["disk_objects"] > 100
        assert _no_wrong(c, keys) > 0
        assert _no_wrong(c, late) == len(late), "after recovery nothing is lost"
    log = (tmp_path / f"{cl.servers[0].name}.log").read_text()
    assert "failpoint disk_write" in log and "disk tier recovered" in log
