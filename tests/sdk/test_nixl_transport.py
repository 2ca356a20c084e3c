"""The nixl transport between real processes: gcache-server --nixl on, UCX over loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any agent exists (servers inherit it)

from gcache.nixl_lib import available  # noqa: E402
from gcache.protocol import Limits  # noqa: E402
from gcache.sdk import Client, Status  # noqa: E402
from gcache.sdk.transports import onesided  # noqa: E402
from gcache.sdk.transports.tcp import TcpTransport  # noqa: E402

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(available()), reason=available() or "nixl present")]

SIZES = [1, 7, 4096, 65536, 65537, 1 << 20, (3 << 20) + 5, 4 << 20]
NIXL = ["--nixl", "on"]


def _value(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def srv(make_cluster):
    return make_cluster(1, "96MiB", slab="8MiB", extra=NIXL)


def _delta(before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in onesided.STATS.items()}


def test_round_trip_staged_registered_and_torch(srv):
    vals = [_value(n, i) for i, n in enumerate(SIZES)]
    keys = [f"k{n}" for n in SIZES]
    before = dict(onesided.STATS)
    # a 1 MiB bounce buffer: the 3 MiB and 4 MiB values are staged in several rounds
    with Client(srv.addresses, namespace="nx", transport="nixl", timeout_ms=10_000,
                nixl_bounce_bytes=1 << 20) as c:
        assert c.put_batch_from(keys, vals) == [Status.OK] * len(keys)
        assert c.get_batch(keys) == [v.tobytes() for v in vals]
        outs = [np.zeros(len(v), dtype=np.uint8) for v in vals]
        assert c.get_batch_into(keys, outs) == [Status.OK] * len(keys)
        assert all(np.array_equal(o, v) for o, v in zip(outs, vals))
        staged = _delta(before)["nixl_staged_bytes"]
        assert staged >= 3 * sum(SIZES)  # put + get + get_into all went through the bounce

        pool = np.zeros(16 << 20, dtype=np.uint8)  # a registered pool: no staging at all
        assert c.register_buffer(pool) is True
        views, off = [], 0
        for v in vals:
            views.append(pool[off:off + len(v)])
            off += len(v) + 4096
        mark = dict(onesided.STATS)
        assert c.get_batch_into(keys, views) == [Status.OK] * len(keys)
        assert all(np.array_equal(o, v) for o, v in zip(views, vals))
        for v, dst in zip(vals, views):
            dst[:] = v[::-1]
        assert c.put_batch_from([k + "r" for k in keys], views) == [Status.OK] * len(keys)
        assert _delta(mark)["nixl_staged_bytes"] == 0
        assert c.get_batch([k + "r" for k in keys]) == [v[::-1].tobytes() for v in vals]
        assert c.unregister_buffer(pool) is True

        import torch

        t = torch.zeros(len(vals[5]), dtype=torch.uint8)
        assert c.get_batch_into([keys[5]], [t]) == [Status.OK]
        assert bytes(t.numpy()) == vals[5].tobytes()
        assert c.get_batch_into([keys[5]], [np.zeros(10, np.uint8)]) == [Status.SIZE_MISMATCH]
        assert c.get("absent") is None
    d = _delta(before)
    assert d["nixl_get_items"] > 0 and d["nixl_put_items"] > 0 and d["nixl_connections"] > 0
    assert d["tcp_fallback_items"] == 0


def test_nixl_info_only_after_auth(make_cluster):
    c = make_cluster(1, "32MiB", slab="1MiB", extra=NIXL, token="s3cret")
    t = TcpTransport(c.addresses[0], "s3cret", Limits(), 2.0)
    t.connect(time.monotonic() + 5)
    assert "nixl" not in t.hello  # HELLO goes to anyone: no memory keys in it
    info = t.auth_reply["nixl"]
    assert info["size"] == 32 << 20 and info["md"] and info["base"] > 0
    t.close()
    bad = TcpTransport(c.addresses[0], "wrong", Limits(), 2.0)
    with pytest.raises(Exception, match="auth"):
        bad.connect(time.monotonic() + 5)


def test_server_without_nixl(make_cluster):
    c = make_cluster(1, "32MiB", slab="1MiB", extra=["--nixl", "off"])
    with Client(c.addresses, transport="nixl", timeout_ms=1500) as cl:
        t0 = time.monotonic()
        assert cl.put("k", b"v") == Status.UNAVAILABLE  # refused: no agent to write into
        assert time.monotonic() - t0 < 3
    with Client(c.addresses, transport="auto", timeout_ms=5000) as cl:  # no RDMA: shm/tcp
        assert cl.put("k", b"v") == Status.OK and cl.get("k") == b"v"
    r = subprocess.run([sys.executable, "-m", "gcache.server.cli", "--nixl", "maybe"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "nixl" in r.stderr and "auto, on, off" in r.stderr


def test_concurrent_readers_and_writers_byte_exact(srv):
    import threading

    errors: list[str] = []
    with Client(srv.addresses, transport="nixl", timeout_ms=10_000) as c:
        def worker(w: int) -> None:
            for r in range(6):
                keys = [f"w{w}r{r}i{i}" for i in range(8)]
                vals = [_value(65536 + 977 * i, w * 100 + r * 10 + i) for i in range(8)]
                if c.put_batch_from(keys, vals) != [Status.OK] * 8:
                    errors.append("put")
                got = c.get_batch(keys)
                if got != [v.tobytes() for v in vals]:
                    errors.append(f"w{w}r{r} wrong bytes")
        ts = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    assert errors == []


def test_hot_set_survives_put_pressure_over_nixl(make_cluster):
    c = make_cluster(1, "64MiB", slab="1MiB", extra=NIXL)
    v = _value(256 << 10, 3).tobytes()
    hot = [f"hot{i}" for i in range(8)]
    with Client(c.addresses, transport="nixl", timeout_ms=10_000) as cl:
        assert cl.put_batch(hot, [v] * 8) == [Status.OK] * 8
        for r in range(40):
            cl.put_batch([f"cold{r}_{i}" for i in range(16)], [v] * 16)
            got = cl.get_batch(hot)
        assert got == [v] * 8
        assert cl.exists("cold0_0") is False


def test_killed_server_is_a_timely_miss(srv):
    with Client(srv.addresses, transport="nixl", timeout_ms=800) as c:
        assert c.put("k", b"x" * 65536) == Status.OK
        srv.servers[0].kill9()
        t0 = time.monotonic()
        assert c.get("k") is None
        assert c.put("k2", b"y") != Status.OK
        assert time.monotonic() - t0 < 3


def test_processes_exit_cleanly(make_cluster, tmp_path):
    """Agents are torn down explicitly: neither side crashes at interpreter exit."""
    c = make_cluster(1, "32MiB", slab="1MiB", extra=NIXL)
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        from gcache.sdk import Client
        c = Client([{c.addresses[0]!r}], transport="nixl", timeout_ms=5000)
        assert c.put("x", b"abc" * 1000).name == "OK"
        assert c.get("x") == b"abc" * 1000
        c.close()
        print("DONE")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "UCX_NET_DEVICES": "lo"})
    assert r.returncode == 0 and "DONE" in r.stdout, r.stderr[-2000:]
    assert c.servers[0].terminate() == 0


def test_idle_agent_does_not_spin_and_tcp_rma_is_progressed(srv, tmp_path):
    """NIXL's own progress thread busy-polls a core; ours is paced. With UCX limited to
    tcp (RMA emulated by messages: the server must progress), transfers still finish."""
    pid = srv.servers[0].proc.pid

    def cpu_s() -> float:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    a = cpu_s()
    time.sleep(2.0)
    assert (cpu_s() - a) / 2.0 < 0.5  # a busy-polling agent shows ~1.0 (a whole core)
    script = tmp_path / "tcp_only.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from gcache.sdk import Client
        from gcache.sdk.transports import onesided
        v = np.arange(3 << 20, dtype=np.uint32).view(np.uint8)[: 3 << 20]
        with Client([{srv.addresses[0]!r}], transport="nixl", timeout_ms=20000) as c:
            assert c.put_batch_from(["t"], [v])[0].name == "OK"
            assert c.get("t") == v.tobytes()
        assert onesided.STATS["nixl_get_items"] > 0
        print("DONE")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=90, env={**os.environ, "UCX_NET_DEVICES": "lo",
                                        "UCX_TLS": "tcp"})
    assert r.returncode == 0 and "DONE" in r.stdout, r.stderr[-2000:]


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs CUDA")
def test_cuda_tensors_round_trip(srv):  # pragma: no cover - no GPU on CI
    import torch

    v = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    out = torch.zeros_like(v)
    with Client(srv.addresses, transport="nixl", timeout_ms=10_000) as c:
        assert c.put_batch_from(["g"], [v]) == [Status.OK]  # staged through the bounce
        assert c.get_batch_into(["g"], [out]) == [Status.OK]
        assert torch.equal(out, v)
        pool = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda")
        assert c.register_buffer(pool)  # GPUDirect where the NIC supports it
        assert c.get_batch_into(["g"], [pool[: 1 << 20]]) == [Status.OK]
        assert torch.equal(pool[: 1 << 20], v)
        c.unregister_buffer(pool)



def test_device_view_staged_path_with_a_cpu_tensor(srv):
    """The CUDA staging code (DeviceView slices, to_host/from_host through the bounce
    buffer, split into rounds) runs here on CPU tensors: the same torch copies."""
    import torch

    from gcache.sdk.buffers import DeviceView
    from gcache.sdk.transports.base import GetItem, PutItem, Work
    from gcache.sdk.transports.nixl import NixlTransport
    from gcache.protocol import Op
    from gcache.hashing import checksum

    t = NixlTransport(srv.addresses[0], "", Limits(), 5.0, "nixl", bounce_bytes=1 << 20)
    t.connect(time.monotonic() + 10)
    try:
        n = (2 << 20) + 4097  # larger than the bounce: three rounds
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dv = DeviceView(src)
        assert len(dv) == n and len(dv[4096:8192]) == 4096
        csum = checksum(src.numpy())
        res = t.execute(Work(Op.PUT, b"dv", [PutItem(b"dev", n, 0, n, 0, dv, csum)],
                             time.monotonic() + 10, None))
        assert [r.status for r in res] == [Status.OK]
        dst = torch.zeros(n, dtype=torch.uint8)
        res = t.execute(Work(Op.GET, b"dv", [GetItem(b"dev", 0, n, 0, DeviceView(dst))],
                             time.monotonic() + 10, None))
        assert [r.status for r in res] == [Status.OK] and res[0].nbytes == n
        assert torch.equal(dst, src)
    finally:
        t.close()


def test_nixl_without_the_library_is_a_clear_config_error(srv):
    """A host without nixl-cu12: transport='nixl' fails at construction with what to
    install; 'auto' just works (shm/tcp)."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["nixl_cu12"] = None  # as if nixl-cu12 were not installed
        from gcache.errors import ConfigError
        from gcache.sdk import Client
        try:
            Client([{srv.addresses[0]!r}], transport="nixl")
        except ConfigError as exc:
            print("ERR", exc)
        with Client([{srv.addresses[0]!r}], transport="auto") as c:
            assert c.put("a", b"b").name == "OK" and c.get("a") == b"b"
        print("DONE")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERR transport='nixl': nixl-cu12 is not importable" in r.stdout
    assert "pip install torch==2.13.0 nixl-cu12==1.5.1" in r.stdout and "DONE" in r.stdout
