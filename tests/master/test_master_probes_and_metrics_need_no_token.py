"""Kubernetes probes and Prometheus reach the masters without a credential, and learn
nothing from them an outsider could use: /healthz says "ok", /readyz whether a Raft leader
and a quorum are known, /metrics counts (no member id or address)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from gcache.discovery import MasterClient
from gcache.testing.cluster import Cluster
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.integration]

TOKEN = "probe-test-token"


def _get(url: str, token: str = "") -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}
                                 if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _metrics(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _value(text: str, name: str) -> float:
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(name + " ")))


@pytest.mark.timeout(90)
def test_probes_answer_without_a_token_and_reveal_nothing(tmp_path) -> None:
    with Cluster(0, masters=3, token=TOKEN, log_dir=str(tmp_path)) as cl:
        wait_for(lambda: _get(f"http://{cl.master_addresses[0]}/readyz")[0] == 200, 30)
        leader = _get(f"http://{cl.master_addresses[0]}/healthz", TOKEN)[1]["leader"]
        a = next(x for x in cl.master_addresses if x != leader)  # a follower
        assert _get(f"http://{a}/healthz") == (200, {"status": "ok"})
        # a follower may still be connecting to its peers when the first master is ready
        wait_for(lambda: _get(f"http://{a}/readyz")[0] == 200, 15)
        code, ready = _get(f"http://{a}/readyz")
        assert code == 200 and ready["ready"] is True
        assert set(ready) == {"ready", "reason"} and "127.0.0.1" not in json.dumps(ready)
        code, full = _get(f"http://{a}/healthz", TOKEN)  # a credential: the full document
        assert code == 200 and full["leader"] in cl.master_addresses and "epoch" in full
        assert _get(f"http://{a}/view")[0] == 401  # everything else still needs one
        # /metrics: counts only, no credential; the leader's role and the members by state
        MasterClient([leader], TOKEN).register("m-1", "127.0.0.1:1", 1 << 20, "boot-1")
        wait_for(lambda: 'gcache_master_members{state="up"} 1.0' in _metrics(a), 10)
        # pysyncobj may be re-dialing a peer link under load: wait for both links
        wait_for(lambda: 'gcache_master_raft_peers_connected 2.0' in _metrics(leader), 15)
        text = _metrics(leader)
        for line in ('gcache_master_raft_role{role="leader"} 1.0',
                     'gcache_master_raft_quorum 1.0', 'gcache_master_raft_peers_connected 2.0',
                     'gcache_master_members{state="down"} 0.0',
                     'gcache_build_info{component="master",version="'):
            assert line in text, line
        assert _value(text, "gcache_master_raft_term") >= 1
        assert _value(text, "gcache_master_epoch") >= 1
        assert "process_resident_memory_bytes" in text and "_created" not in text
        assert "m-1" not in text and "127.0.0.1" not in text
        # the two others (the leader among them) gone: no quorum, so the follower left is
        # alive but not ready
        for m in cl.masters:
            if m.address != a:
                m.kill9()
        wait_for(lambda: _get(f"http://{a}/readyz")[0] == 503, 40)
        code, why = _get(f"http://{a}/readyz")
        assert why == {"ready": False, "reason": "no quorum of masters reachable"}
        assert _get(f"http://{a}/healthz") == (200, {"status": "ok"})
