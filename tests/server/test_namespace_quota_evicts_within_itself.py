"""Per-namespace quotas (``--quota-file``) on real gcache-server processes.

* Memory: namespace ``a/...`` (quota 2 MiB) writes far past its quota and past the
  arena; namespace ``b/...``'s objects, written before, are all still there byte-exact,
  a's newest objects are readable, and a never holds more than its quota. A put larger
  than its namespace's quota is refused (NO_SPACE) and counted.
* Disk: the same with an NVMe tier too small for a's flood: a stays within its memory
  and disk quotas, and b's objects (most of them demoted to disk before) survive.
* A SIGHUP that lowers a quota applies: the namespace is brought down to it.
* A restart rebuilds the per-namespace accounting from the recovered arena.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request

import pytest

from gcache.sdk import Client
from gcache.status import Status
from gcache.testing.oracle import value_for
from gcache.testing.waiting import wait_for as _wait_for
from gcache.testing.cluster import free_port

pytestmark = [pytest.mark.integration]

MIB = 1 << 20
SIZE = 100_000  # one 104 KiB chunk (4 KiB classes) per object


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith("GCACHE_"):
            monkeypatch.delenv(var)


def quota_toml(a_memory: str = "2MiB", a_disk: str | None = None) -> str:
    disk = f'\ndisk_bytes = "{a_disk}"' if a_disk else ""
    return f"""
[[quota]]
namespaces = "a/*"
memory_bytes = "{a_memory}"{disk}

[[quota]]
namespaces = "tiny/*"
memory_bytes = "256KiB"
"""


def start(make_cluster, tmp_path, memory: str, toml: str, extra: list[str] = ()):
    path = tmp_path / "quotas.toml"
    path.write_text(toml)
    port = free_port()
    cl = make_cluster(1, memory, extra=["--quota-file", str(path),
                                        "--metrics-listen", f"127.0.0.1:{port}", *extra])
    cl.quota_path, cl.metrics_url = path, f"http://127.0.0.1:{port}/metrics"
    return cl


def metric(cl, name: str, **labels: str) -> float | None:
    text = urllib.request.urlopen(cl.metrics_url, timeout=5).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def client(cl, ns: str) -> Client:
    return Client(servers=cl.addresses, namespace=ns, timeout_ms=10_000, transport="tcp")


def ns_stats(cl, ns: str) -> dict:
    with client(cl, "ops") as c:
        st = next(iter(c.stats().values()))
    return st.get("namespaces", {}).get(ns, {})


def below_high_watermark(cl) -> bool:
    """The server's memory at or under 95 % of its capacity (one STATS round trip)."""
    with client(cl, "ops") as c:
        st = next(iter(c.stats().values()))
    return st["used_bytes"] <= 0.95 * st["capacity_bytes"]


def put_many(cl, ns: str, keys: list[str], size: int = SIZE) -> list[Status]:
    with client(cl, ns) as c:
        return [c.put(k, value_for(k.encode(), size)) for k in keys]


def assert_all_exact(cl, ns: str, keys: list[str], size: int = SIZE) -> None:
    with client(cl, ns) as c:
        bad = [k for k in keys if c.get(k) != value_for(k.encode(), size)]
    assert not bad, f"{len(bad)} of {len(keys)} objects of {ns} lost or wrong: {bad[:5]}"


def wait_for(pred, timeout: float = 20.0):
    return _wait_for(pred, timeout, step=0.1, retry_on=())


@pytest.mark.timeout(180)
def test_memory_quota_evicts_within_the_namespace_only(make_cluster, tmp_path):
    cl = start(make_cluster, tmp_path, "32MiB", quota_toml("2MiB"))
    b_keys = [f"b{i}" for i in range(60)]  # ~6 MiB, written first: the LRU head
    assert put_many(cl, "b/m", b_keys) == [Status.OK] * len(b_keys)
    a_keys = [f"a{i}" for i in range(400)]  # ~40 MiB: past a's quota and past the arena
    st = put_many(cl, "a/m", a_keys)
    assert st.count(Status.OK) == len(a_keys), {s for s in st}
    assert_all_exact(cl, "b/m", b_keys)  # nobody else was pushed out
    assert_all_exact(cl, "a/m", a_keys[-8:])  # a's newest objects are there
    a = ns_stats(cl, "a/m")
    assert a["memory_quota_bytes"] == 2 * MIB
    assert 0 < a["memory_used_bytes"] <= 2 * MIB
    assert ns_stats(cl, "b/m")["memory_quota_bytes"] == -1  # unlimited
    used = metric(cl, "gcache_namespace_used_bytes", namespace="a/m", tier="memory")
    assert used is not None and 0 < used <= 2 * MIB
    assert metric(cl, "gcache_namespace_quota_bytes", namespace="a/m", tier="memory") == 2 * MIB
    ev = metric(cl, "gcache_namespace_quota_evictions_total", namespace="a/m", tier="memory")
    assert ev is not None and ev >= 300
    # larger than its namespace's whole quota: refused, counted, nothing evicted for it
    with client(cl, "tiny/m") as t:
        assert t.put("small", value_for(b"small", 50_000)) == Status.OK
        assert t.put("big", value_for(b"big", 300_000)) == Status.NO_SPACE
        assert t.get("small") == value_for(b"small", 50_000)
    assert metric(cl, "gcache_namespace_quota_refused_total", namespace="tiny/m") == 1


@pytest.mark.timeout(240)
def test_disk_quota_drops_own_oldest_records_and_never_pushes_others_out(make_cluster,
                                                                          tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    cl = start(make_cluster, tmp_path, "8MiB", quota_toml("1MiB", "4MiB"),
               ["--disk-dir", str(disk), "--disk", "32MiB", "--segment-bytes", "4MiB",
                "--promote-policy", "never"])
    b_keys = [f"b{i}" for i in range(120)]  # ~12 MiB: most of it demoted to disk
    for s in range(0, len(b_keys), 10):
        assert put_many(cl, "b/m", b_keys[s:s + 10]) == [Status.OK] * 10
        # pace the writer to the mover: a put that outwaits the mover's 0.5 s (a loaded
        # machine) may evict to nothing, a cache's right, and not what this test pins
        wait_for(lambda: below_high_watermark(cl))
    wait_for(lambda: ns_stats(cl, "b/m").get("disk_used_bytes", 0) > 4 * MIB)
    a_keys = [f"a{i}" for i in range(500)]  # ~50 MiB: past a's quotas and past the disk
    st = put_many(cl, "a/m", a_keys)
    assert st.count(Status.OK) == len(a_keys), {s for s in st}
    assert_all_exact(cl, "b/m", b_keys)
    assert_all_exact(cl, "a/m", a_keys[-5:])
    a = ns_stats(cl, "a/m")
    assert a["memory_used_bytes"] <= 1 * MIB and a["disk_used_bytes"] <= 4 * MIB, a
    assert a["disk_quota_bytes"] == 4 * MIB
    assert 0 < a["disk_used_bytes"], a  # a did demote (within its quota)
    used = metric(cl, "gcache_namespace_used_bytes", namespace="a/m", tier="disk")
    assert used is not None and 0 < used <= 4 * MIB
    ev = metric(cl, "gcache_namespace_quota_evictions_total", namespace="a/m", tier="disk")
    assert ev is not None and ev > 0


@pytest.mark.timeout(120)
def test_sighup_lowering_a_quota_brings_the_namespace_down(make_cluster, tmp_path):
    cl = start(make_cluster, tmp_path, "32MiB", quota_toml("8MiB"))
    b_keys = [f"b{i}" for i in range(20)]
    assert put_many(cl, "b/m", b_keys) == [Status.OK] * len(b_keys)
    a_keys = [f"a{i}" for i in range(60)]  # ~6 MiB, under the first quota
    assert put_many(cl, "a/m", a_keys) == [Status.OK] * len(a_keys)
    assert ns_stats(cl, "a/m")["memory_used_bytes"] > 5 * MIB
    cl.quota_path.write_text(quota_toml("1MiB"))
    cl.servers[0].hup()
    wait_for(lambda: ns_stats(cl, "a/m").get("memory_quota_bytes") == 1 * MIB)
    wait_for(lambda: ns_stats(cl, "a/m").get("memory_used_bytes", 0) <= 1 * MIB)
    assert_all_exact(cl, "b/m", b_keys)
    # a bad file keeps the quotas in force
    cl.quota_path.write_text('[[quota]]\nnamespaces = "a/*"\nmemory_bytes = "lots"\n')
    cl.servers[0].hup()
    time.sleep(1.0)
    assert put_many(cl, "a/m", [f"c{i}" for i in range(30)]).count(Status.OK) == 30
    assert ns_stats(cl, "a/m")["memory_used_bytes"] <= 1 * MIB


@pytest.mark.timeout(120)
def test_restart_rebuilds_namespace_accounting(make_cluster, tmp_path):
    cl = start(make_cluster, tmp_path, "32MiB", quota_toml("2MiB"))
    b_keys = [f"b{i}" for i in range(30)]
    assert put_many(cl, "b/m", b_keys) == [Status.OK] * len(b_keys)
    a_keys = [f"a{i}" for i in range(15)]  # ~1.5 MiB: within a's quota
    assert put_many(cl, "a/m", a_keys) == [Status.OK] * len(a_keys)
    before = ns_stats(cl, "a/m")["memory_used_bytes"]
    assert 1 * MIB < before <= 2 * MIB
    cl.servers[0].restart()
    assert ns_stats(cl, "a/m")["memory_used_bytes"] == before
    assert ns_stats(cl, "b/m")["memory_used_bytes"] > 2 * MIB
    more = [f"m{i}" for i in range(100)]
    assert put_many(cl, "a/m", more).count(Status.OK) == len(more)
    assert ns_stats(cl, "a/m")["memory_used_bytes"] <= 2 * MIB
    assert_all_exact(cl, "b/m", b_keys)
    assert_all_exact(cl, "a/m", more[-5:])
