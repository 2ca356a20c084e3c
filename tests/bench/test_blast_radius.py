"""The blast-radius bench: chain placement loses ~1/N of the sessions when one of N
servers dies and key placement ~1-(1-1/N)^P; the bench places pages exactly as the SDK
does; shared prompts are one object each and gather their sessions' first runs; and
with real processes (kill -9) the sessions hit are exactly the predicted ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from gcache.bench.blast_radius import (
    KEY,
    Placement,
    Workload,
    blast_radius,
    make_workload,
    owners,
    ring_addresses,
    ring_rows,
    sessions_hit,
)
from gcache.bench.cli import main as bench_main
from gcache.sdk import Client

CHAIN = Placement(64)


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [4, 8])
def test_chain_hits_one_in_n_sessions_and_key_hits_one_minus_survival_to_the_p(n) -> None:
    p = 16
    w = make_workload(2000, p, p, seed=n)
    rows = {r["placement"]: r for r in ring_rows(w, [KEY, CHAIN, Placement(4)], [n])}
    chain, key, runs = rows["chain/64"], rows["key"], rows["chain/4"]
    assert chain["servers_per_session"] == 1.0  # one group per session: one server
    assert chain["hit_mean"] == pytest.approx(1 / n, abs=1e-9)
    assert chain["hit_max"] == pytest.approx(1 / n, abs=0.05)
    assert key["hit_mean"] == pytest.approx(1 - (1 - 1 / n) ** p, abs=0.02)
    assert runs["hit_mean"] == pytest.approx(1 - (1 - 1 / n) ** (p // 4), abs=0.03)
    for r in rows.values():
        assert r["pages_lost_mean"] == pytest.approx(1 / n)  # every page lives somewhere
        assert r["hit_expected"] == pytest.approx(r["hit_mean"], abs=0.03)
    # a key-placed chain is cut near its start: most of its prefix is unusable
    assert key["prefix_lost_mean"] > 2 * chain["prefix_lost_mean"]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_prefix_lost_counts_from_the_first_page_on_the_dead_server() -> None:
    w = Workload(b"ns", ["a", "b", "c", "d"], np.zeros(4, np.int64),
                 np.arange(4, dtype=np.int64), np.array([4]), np.ones(4, bool), False)
    r = blast_radius(w, np.array([0, 1, 0, 1]), 2)
    assert r["hit_mean"] == r["hit_max"] == 1.0
    assert r["prefix_lost_max"] == 1.0          # server 0 holds page 0: all 4 pages
    assert r["prefix_lost_mean"] == (4 + 3) / 2 / 4  # server 1's first page is page 1
    assert r["pages_lost_mean"] == 0.5 and r["load_max_over_mean"] == 1.0
    assert sessions_hit(w, np.array([0, 0, 0, 0]), 1).tolist() == [False]


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("placement", [KEY, CHAIN, Placement(3)])
def test_bench_places_pages_where_the_client_sends_them(placement) -> None:
    w = make_workload(20, 2, 9, seed=1)
    addresses = [f"127.0.0.1:{p}" for p in (1, 2, 3, 4, 5)]  # never dialed
    with Client(addresses, namespace=w.namespace_of(placement)) as c:
        want = c.owners(w.keys, group=w.groups(placement))
    got = owners(w, placement, addresses)
    assert [addresses[i] for i in got] == want
    if placement.group_pages:  # a run of a chain is on one server
        for s in range(20):
            mine = got[w.session == s]
            runs = w.position[w.session == s] // placement.group_pages
            assert all(len(set(mine[runs == r].tolist())) == 1 for r in set(runs.tolist()))


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_shared_prompts_are_one_object_and_pull_their_sessions_first_runs_together() -> None:
    w = make_workload(1000, 4, 32, seed=5, shared_pages=3, prompts=5)
    prompt_pages = {p for p in w.pages if p.startswith("prompt")}
    assert len(prompt_pages) == 15
    assert all(p.startswith("prompt") for p, pos in zip(w.pages, w.position) if pos < 3)
    assert int(w.stored.sum()) == len(set(w.pages)) == len(w.pages) - 3 * 1000 + 15
    groups = w.groups(CHAIN)
    assert len({g for g, pos in zip(groups, w.position) if pos == 0}) == 5
    plain = make_workload(1000, 4, 32, seed=5)
    rows = ring_rows(w, [KEY, CHAIN], [64]) + ring_rows(plain, [KEY, CHAIN], [64])
    shared_key, shared_chain, key, chain = rows
    assert shared_chain["hit_mean"] == pytest.approx(1 / 64)  # still one server a session
    assert shared_chain["hit_expected"] is None and chain["hit_expected"] is not None
    # five servers hold every session's first run: the load cost of naming a run by its
    # first page when sessions share a prompt
    assert shared_chain["load_max_over_mean"] > 2 * chain["load_max_over_mean"]
    assert shared_key["load_max_over_mean"] < 1.5


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_ring_addresses_are_distinct_at_512() -> None:
    assert len(set(ring_addresses(512))) == 512


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_kill9_hits_exactly_the_predicted_sessions(tmp_path) -> None:
    out = tmp_path / "blast.json"
    res = CliRunner().invoke(bench_main, [
        "blast-radius", "--ring", "4", "--sessions", "300", "--local", "4",
        "--local-sessions", "150", "--min-pages", "4", "--max-pages", "16",
        "--shared-pages", "2", "--prompts", "40",  # shared pages are written once
        "--page-bytes", "1KiB", "--memory", "64MiB", "--seed", "3", "--log-dir",
        str(tmp_path), "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [r["placement"] for r in doc["ring"]] == ["key", "chain/64"]
    real = {r["placement"]: r for r in doc["real"]}
    assert set(real) == {"key", "chain/64"}
    for r in real.values():
        assert r["servers"] == 4 and r["disagree"] == 0 and r["wrong_values"] == 0
        assert r["hit"] == r["hit_predicted"]
        assert r["pages_lost"] == r["pages_lost_predicted"] > 0
        assert r["read_after_kill_s"] < 10  # misses are timely, not stuck on the dead peer
    assert real["chain/64"]["hit"] < real["key"]["hit"]
