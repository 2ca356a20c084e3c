"""A server drains itself when it finds itself unhealthy:

* the platform hook: touching its ``--unhealthy-file`` makes it ask the masters to
  drain it (within about a second); it empties to the other servers, every key stays
  a byte-exact hit, and STATS, /metrics (``gcache_self_drain{reason}``) and the log say
  why;
* a degraded disk tier (``--failpoints disk_full``: every segment allocation fails with
  ENOSPC, so the first demotion degrades the tier) for longer than
  ``--auto-drain-after-ms`` drains it the same way.
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from drainops import add_own_server, log_of, routed_client
from gcache.sdk import Client
from gcache.testing.oracle import check_value
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, masters, put_all, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(240)]

SIZE = 16_000


def state_of(cl, name: str) -> str:
    return next(m["state"] for m in masters(cl).view()["members"] if m["id"] == name)


def test_touching_the_unhealthy_file_drains_the_server(make_cluster, tmp_path):
    cl = start_cluster(make_cluster, 2, "16MiB", slab="1MiB")
    hook = tmp_path / "unhealthy"
    sick = add_own_server(cl, "sick", ["--unhealthy-file", str(hook),
                                       "--metrics-listen", "127.0.0.1:0"])
    keys = [f"u-{i}".encode() for i in range(600)]
    with routed_client(cl) as c:
        put_all(c, keys, SIZE)
        with Client([sick.address], token=TOKEN) as direct:
            held = direct.stats()[sick.address]
            assert held["objects"] > 50 and held["self_drain"] == ""
            time.sleep(1.5)  # a tick or so without the file: nothing happens
            assert state_of(cl, sick.name) == "up"
            hook.touch()
            t0 = time.monotonic()
            wait_for(lambda: state_of(cl, sick.name) == "draining", 10)
            assert time.monotonic() - t0 < 5
            st = wait_for(lambda: (lambda s: s if s["objects"] == 0 else None)(
                direct.stats()[sick.address]), 30)
        assert st["self_drain"] == "unhealthy_file"
        assert st["handoff_objects_moved"] == held["objects"] and st["handoff_lost"] == 0
        got = read_back(c, keys, SIZE)
        assert got.wrong == [] and got.missing == [] and got.ok == len(keys)
    log = log_of(sick)
    assert len(re.findall(r"self-drain \(the unhealthy file .* exists\): this server asked "
                          r"the masters to drain it", log)) == 1, log[-3000:]
    url = re.search(r"metrics on (http://\S+/metrics)", log)[1]
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'gcache_self_drain{reason="unhealthy_file"} 1.0' in text
    assert 'gcache_self_drain{reason="disk_degraded"} 0.0' in text


def test_degraded_disk_tier_drains_the_server(make_cluster, tmp_path):
    disk = ["--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "64MiB",
            "--segment-bytes", "4MiB"]
    cl = start_cluster(make_cluster, 2, "16MiB", slab="1MiB", extra=disk)
    bad = add_own_server(cl, "baddisk", ["--failpoints", "disk_full",
                                         "--auto-drain-after-ms", "1s"])
    # 24 MB of keys baddisk owns, in its 16 MiB: it must demote, and its disk refuses
    # (keys spread over all three gave it a share that, by the draw, may fit in memory)
    with routed_client(cl) as c:
        cand = [f"d-{i}".encode() for i in range(6000)]
        keys = [k for k, a in zip(cand, c.owners(cand)) if a == bad.address][:1500]
        assert len(keys) == 1500
        put_all(c, keys, SIZE)
        with Client([bad.address], token=TOKEN) as direct:
            # generous: under a loaded full suite the mover and heartbeats run late
            wait_for(lambda: direct.stats()[bad.address]["disk_degraded"] == 1, 45)
            wait_for(lambda: state_of(cl, bad.name) == "draining", 30)
            st = wait_for(lambda: (lambda s: s if s["objects"] == 0 else None)(
                direct.stats()[bad.address]), 45)
        assert st["self_drain"] == "disk_degraded" and st["handoff_lost"] == 0
        assert st["handoff_objects_moved"] > 0
        # what it held lives on elsewhere; nothing read is ever wrong
        for k, v in zip(keys, c.get_batch(keys)):
            assert v is None or check_value(k, v)
    log = log_of(bad)
    assert len(re.findall(r"self-drain \(the disk tier has been degraded for \d+ s\)",
                          log)) == 1, log[-3000:]
    for s in cl.servers[:2]:  # the healthy ones did not drain
        assert state_of(cl, s.name) == "up"
