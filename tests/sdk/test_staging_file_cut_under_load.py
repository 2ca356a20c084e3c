"""A same-host client that keeps cutting its staging file and growing it back while its
PUT_STAGED frames are being copied (the server copies from a mapping of that file, and
each cut faults there) never brings the server down, never gets a value published that
it did not write, and costs honest clients of the same server nothing: their values
read back exact throughout. Every value refused for the cut is counted in
``gcache_protocol_errors_total{reason="staging_shrunk"}``."""

from __future__ import annotations

import os
import random
import threading
import time
import urllib.request

import pytest

from gcache import staging
from gcache.hashing import checksum
from gcache.protocol import Limits, Op
from gcache.sdk import Client, Status
from gcache.sdk.transports.shm import ShmTransport
from gcache.testing.cluster import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SIZE = 64 << 10
N = 16  # values per hostile frame: one read group of the server's
SECONDS = 3.0


def _hostile_stage(t: ShmTransport) -> tuple[int, str, bytes]:
    """A staging file written with pwrite only (a mapping of our own would fault here
    when the file is cut): its fd, name and key."""
    arena = t.auth_reply["shm"]["path"]
    name = staging.new_name(arena)
    key = os.urandom(staging.KEY_BYTES)
    fd = os.open(os.path.join(os.path.dirname(arena), name),
                 os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.ftruncate(fd, staging.HEADER_BYTES + N * SIZE)
    os.pwrite(fd, staging.header(key), 0)
    return fd, name, key


def test_a_client_cutting_its_staging_file_under_load_harms_no_one(make_cluster):
    port = free_port()
    cl = make_cluster(1, "96MiB", slab="8MiB", extra=["--metrics-listen", f"127.0.0.1:{port}"])
    addr = cl.addresses[0]
    t = ShmTransport(addr, "", Limits(), 2.0, "shm")
    t.connect(time.monotonic() + 5)
    assert t.kind == "shm"
    fd, name, skey = _hostile_stage(t)
    full = staging.HEADER_BYTES + N * SIZE
    values = [os.urandom(SIZE) for _ in range(N)]
    stop = threading.Event()
    honest_wrong: list[bytes] = []
    honest_rounds = [0]
    errors: list[BaseException] = []

    def write_values() -> None:
        for i, v in enumerate(values):
            os.pwrite(fd, v, staging.HEADER_BYTES + i * SIZE)

    def frame(keys: list[bytes]) -> list[int]:
        items = [[k, SIZE, 0, SIZE, 0, checksum(v)] for k, v in zip(keys, values)]
        return t.call(Op.PUT_STAGED, {"ns": b"default", "stage": name, "skey": skey,
                                      "items": items}, time.monotonic() + 10)["st"]

    def cutter() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            os.ftruncate(fd, staging.HEADER_BYTES + rng.randrange(N * SIZE))
            time.sleep(rng.random() * 0.002)
            os.ftruncate(fd, full)
            write_values()

    def honest() -> None:
        try:
            with Client([addr], transport="shm", timeout_ms=10_000) as c:
                while not stop.is_set():
                    r = honest_rounds[0]
                    keys = [b"honest/%d/%d" % (r, i) for i in range(N)]
                    vals = [os.urandom(SIZE) for _ in range(N)]
                    assert c.put_batch(keys, vals) == [Status.OK] * N
                    got = c.get_batch(keys)
                    honest_wrong.extend(k for k, g, v in zip(keys, got, vals)
                                        if g is not None and g != v)
                    honest_rounds[0] += 1
        except BaseException as exc:  # noqa: B036 - reported by the main thread
            errors.append(exc)

    write_values()
    assert frame([b"first/%d" % i for i in range(N)]) == [Status.OK] * N  # validated, mapped
    threads = [threading.Thread(target=cutter), threading.Thread(target=honest)]
    for th in threads:
        th.start()
    published: dict[bytes, bytes] = {}
    seen: dict[int, int] = {}
    end = time.monotonic() + SECONDS
    r = 0
    try:
        while time.monotonic() < end:
            keys = [b"hostile/%d/%d" % (r, i) for i in range(N)]
            for k, v, s in zip(keys, values, frame(keys)):
                seen[s] = seen.get(s, 0) + 1
                if s == Status.OK:
                    published[k] = v
            r += 1
    finally:
        stop.set()
        for th in threads:
            th.join(30)
        os.close(fd)
        os.unlink(os.path.join(os.path.dirname(t.auth_reply["shm"]["path"]), name))
        t.close()
    assert errors == [], errors
    assert cl.servers[0].proc.poll() is None, "the server died"
    # the cuts did hit copies (values refused), and some frames still went through whole
    assert seen.get(int(Status.OK), 0) > 0 and (
        seen.get(int(Status.BAD_REQUEST), 0) + seen.get(int(Status.CORRUPT), 0)) > 0, seen
    assert set(seen) <= {int(Status.OK), int(Status.BAD_REQUEST), int(Status.CORRUPT)}, seen
    assert honest_rounds[0] > 0 and honest_wrong == []
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    counted = [float(ln.rpartition(" ")[2]) for ln in body.decode().splitlines()
               if ln.startswith('gcache_protocol_errors_total{reason="staging_shrunk"}')]
    assert counted == [seen.get(int(Status.BAD_REQUEST), 0)], (counted, seen)
    with Client([addr], transport="tcp") as c:
        ks = list(published)
        got = c.get_batch(ks)
        # a published hostile value is the bytes its writer checksummed (or evicted since)
        assert [k for k, g in zip(ks, got) if g is not None and g != published[k]] == []
        assert c.put("after", values[0]) == Status.OK and c.get("after") == values[0]
