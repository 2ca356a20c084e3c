"""The trace bench's offline simulation predicts the real server: a short Mooncake-format
trace (shared prefixes, follow-up turns, one-off prompts) replayed through a real
gcache-server per eviction policy (each configured one) gives the simulated token hit rate within 0.01, with
evictions happening and no wrong value, lost read or failed put."""

from __future__ import annotations

import json
import random

import pytest

from gcache.bench.trace import load_requests, replay_real, round_capacity
from gcache.bench.trace_sim import simulate
from gcache.config import EVICTION_POLICIES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _write_trace(path, n: int = 160, seed: int = 7) -> None:
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    shared = [fresh(rng.randint(4, 10)) for _ in range(4)]  # system prompts / documents
    chains: list[list[int]] = []
    with open(path, "w") as f:
        for i in range(n):
            roll = rng.random()
            if chains and roll < 0.35:  # a follow-up turn extends an earlier prompt
                ids = rng.choice(chains[-20:]) + fresh(rng.randint(1, 4))
            elif roll < 0.75:  # a new prompt on a shared prefix
                ids = rng.choice(shared) + fresh(rng.randint(1, 8))
            else:
                ids = fresh(rng.randint(1, 12))
            chains.append(ids)
            f.write(json.dumps({"timestamp": i * 100, "input_length": len(ids) * 512,
                                "output_length": 10, "hash_ids": ids}) + "\n")


def test_real_server_hit_rate_matches_the_simulation(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    reqs = load_requests(str(trace), None, 512)
    cap = round_capacity(48)
    for policy in EVICTION_POLICIES:
        sim = simulate(reqs, cap, policy)
        real = replay_real(reqs, cap, policy, disk=False, disk_ratio=10, log_dir=None,
                           timeout_ms=10000)
        assert real["errors"] == 0, real
        assert sim.evictions > 100 and real["evictions"] > 100, "the capacity must bind"
        assert 0.1 < sim.hit_rate < 0.9
        assert abs(real["hit_rate"] - sim.hit_rate) <= 0.01, (policy, real, sim.hit_rate)
