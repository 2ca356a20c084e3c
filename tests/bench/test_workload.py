"""Tests for gcache.bench.workload: synthetic sessions and Mooncake trace replay."""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path

import pytest

from gcache.bench.workload import (
    DEFAULT_PAGE_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    ROOT_DIGEST,
    Step,
    StepSource,
    block_tokens,
    chain_key,
    mooncake_key,
    mooncake_trace,
    session_workload,
)

pytestmark = pytest.mark.unit


def _by_session(steps: list[Step]) -> dict[int, list[Step]]:
    out: dict[int, list[Step]] = defaultdict(list)
    for s in steps:
        out[s.session].append(s)
    return out


# --------------------------------------------------------------------------- sessions


def test_session_workload_is_deterministic_for_a_seed() -> None:
    a = list(session_workload(sessions=16, turns=4, seed=7))
    b = list(session_workload(sessions=16, turns=4, seed=7))
    assert a == b
    c = list(session_workload(sessions=16, turns=4, seed=8))
    assert [s.page_keys for s in a] != [s.page_keys for s in c]
    # different seeds never share pages
    keys_a = {k for s in a for k in s.page_keys}
    keys_c = {k for s in c for k in s.page_keys}
    assert not keys_a & keys_c


def test_session_workload_shape() -> None:
    steps = list(session_workload(sessions=10, turns=3, turn_pages=4, system_pages=5))
    assert len(steps) == 30
    assert [s.request_id for s in steps] == list(range(30))
    times = [s.timestamp_ms for s in steps]
    assert times == sorted(times) and times[0] == 0.0
    per = _by_session(steps)
    assert sorted(per) == list(range(10))
    for chain in per.values():
        assert len(chain) == 3
        # system prompt + per-turn additions in [3, 5]
        prev = 5
        for s in chain:
            added = len(s.page_keys) - prev
            assert 3 <= added <= 5
            prev = len(s.page_keys)
    for s in steps:
        assert isinstance(s.page_keys, tuple)
        assert all(isinstance(k, bytes) and len(k) == 16 for k in s.page_keys)
        assert len(set(s.page_keys)) == len(s.page_keys)


def test_sessions_are_interleaved() -> None:
    steps = list(session_workload(sessions=8, turns=4))
    order = [s.session for s in steps]
    # not simply session after session
    assert order != sorted(order)
    # every session's turns appear in order (chains only grow)
    for chain in _by_session(steps).values():
        lengths = [len(s.page_keys) for s in chain]
        assert lengths == sorted(lengths)


def test_shared_system_prompts_produce_identical_leading_keys() -> None:
    system_pages = 6
    steps = list(
        session_workload(sessions=24, turns=2, system_prompts=3, system_pages=system_pages)
    )
    firsts = {sess: chain[0] for sess, chain in _by_session(steps).items()}
    groups: dict[tuple[bytes, ...], list[int]] = defaultdict(list)
    for sess, step in firsts.items():
        groups[step.page_keys[:system_pages]].append(sess)
    # at most 3 distinct system prompts, and at least one is shared
    assert 1 <= len(groups) <= 3
    assert max(len(v) for v in groups.values()) >= 2
    # sessions sharing a system prompt diverge right after it
    for members in groups.values():
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                ka, kb = firsts[a].page_keys, firsts[b].page_keys
                assert ka[system_pages] != kb[system_pages]
                assert not set(ka[system_pages:]) & set(kb[system_pages:])
    # different system prompts share nothing at all
    prefixes = list(groups)
    for i, p in enumerate(prefixes):
        for q in prefixes[i + 1 :]:
            assert not set(p) & set(q)


def test_each_turn_extends_previous_turn_of_same_session() -> None:
    steps = list(session_workload(sessions=12, turns=5, seed=3))
    for chain in _by_session(steps).values():
        for prev, cur in zip(chain, chain[1:]):
            assert len(cur.page_keys) > len(prev.page_keys)
            assert cur.page_keys[: len(prev.page_keys)] == prev.page_keys
            assert cur.timestamp_ms >= prev.timestamp_ms


def test_keys_are_prefix_chained() -> None:
    step = next(iter(session_workload(sessions=1, turns=1, system_pages=3)))
    keys = step.page_keys
    # recompute the system part independently of the generator's internals
    parent = ROOT_DIGEST
    for i in range(3):
        parent = chain_key(parent, struct.pack("<4sqqq", b"sys\0", 0, _prompt_of(keys), i))
        assert keys[i] == parent


def _prompt_of(keys: tuple[bytes, ...]) -> int:
    for p in range(4):
        if chain_key(ROOT_DIGEST, struct.pack("<4sqqq", b"sys\0", 0, p, 0)) == keys[0]:
            return p
    raise AssertionError("first key is not a system-prompt page")


def test_session_chain_independent_of_session_count() -> None:
    small = _by_session(list(session_workload(sessions=4, turns=3, seed=5)))
    large = _by_session(list(session_workload(sessions=40, turns=3, seed=5)))
    for sess in range(4):
        assert [s.page_keys for s in small[sess]] == [s.page_keys for s in large[sess]]


def test_session_workload_zero_system_pages_and_lazy() -> None:
    src = session_workload(sessions=2, turns=2, system_pages=0)
    assert isinstance(src, StepSource)
    first = next(src)
    assert len(first.page_keys) >= 3
    assert len(list(src)) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sessions": -1},
        {"turns": 0},
        {"system_prompts": 0},
        {"turn_pages": 0},
        {"seed": -1},
        {"page_tokens": 0},
        {"sessions": 2.5},
        {"turns": True},
    ],
)
def test_session_workload_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        session_workload(**kwargs)


def test_block_tokens() -> None:
    assert block_tokens(session_workload()) == DEFAULT_PAGE_TOKENS == 64
    assert block_tokens(session_workload(page_tokens=16)) == 16
    assert block_tokens("sessions") == 64
    assert block_tokens("mooncake") == MOONCAKE_BLOCK_TOKENS == 512
    with pytest.raises(TypeError):
        block_tokens(iter([]))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- mooncake


def _write_trace(path: Path, records: list[object], blank_lines: bool = True) -> None:
    lines = []
    for r in records:
        lines.append(r if isinstance(r, str) else json.dumps(r))
        if blank_lines:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")


TRACE = [
    {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 40, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 3]},
    {"timestamp": 91.5, "input_length": 300, "output_length": 7, "hash_ids": [2**64 - 1]},
    {"timestamp": 100, "input_length": 0, "output_length": 1, "hash_ids": []},
]


def test_mooncake_trace_parses_small_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write_trace(path, TRACE)
    src = mooncake_trace(path)
    assert block_tokens(src) == 512
    steps = list(src)
    assert len(steps) == 4
    assert steps[0] == Step(
        request_id=0,
        session=0,
        page_keys=(mooncake_key(0), mooncake_key(1), mooncake_key(2)),
        timestamp_ms=0.0,
    )
    assert steps[1].page_keys[:2] == steps[0].page_keys[:2]
    assert steps[1].page_keys[2] == b"mc:" + (3).to_bytes(8, "little")
    assert steps[2].page_keys == (b"mc:" + b"\xff" * 8,)
    assert steps[2].timestamp_ms == 91.5
    assert steps[3].page_keys == ()
    assert [s.request_id for s in steps] == [0, 1, 2, 3]
    assert all(isinstance(s.timestamp_ms, float) for s in steps)


def test_mooncake_trace_limit(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write_trace(path, TRACE[:2] + ["{broken"])
    assert len(list(mooncake_trace(path, limit=2))) == 2  # never reads the bad line
    assert list(mooncake_trace(str(path), limit=0)) == []
    assert len(list(mooncake_trace(path, limit=1))) == 1
    with pytest.raises(ValueError):
        mooncake_trace(path, limit=-1)


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        "[1, 2, 3]",
        json.dumps({"timestamp": 1, "input_length": 5}),
        json.dumps({"timestamp": "soon", "hash_ids": [1]}),
        json.dumps({"timestamp": 1, "hash_ids": [1, -2]}),
        json.dumps({"timestamp": 1, "hash_ids": [1, 2**64]}),
        json.dumps({"timestamp": 1, "hash_ids": [1, "2"]}),
        json.dumps({"timestamp": 1, "hash_ids": [True]}),
        json.dumps({"timestamp": 1, "hash_ids": 3}),
        json.dumps({"timestamp": 1, "input_length": -4, "hash_ids": [1]}),
        '{"timestamp": NaN, "hash_ids": [1]}',
    ],
)
def test_mooncake_trace_rejects_malformed_line(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "bad.jsonl"
    # line 1 good, line 2 blank, line 3 good, line 4 bad
    path.write_text(json.dumps(TRACE[0]) + "\n\n" + json.dumps(TRACE[1]) + "\n" + bad + "\n")
    src = mooncake_trace(path)
    assert next(src).request_id == 0
    assert next(src).request_id == 1
    with pytest.raises(ValueError, match=r"line 4\b"):
        next(src)


def test_mooncake_trace_rejects_undecodable_bytes(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(TRACE[0]).encode() + b"\n\xff\xfe\x00garbage\n")
    with pytest.raises(ValueError, match=r"line 2\b"):
        list(mooncake_trace(path))


def test_mooncake_trace_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        mooncake_trace(tmp_path / "nope.jsonl")


def test_mooncake_trace_close_releases_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    _write_trace(path, TRACE)
    src = mooncake_trace(path)
    next(src)
    src.close()
    with pytest.raises(StopIteration):
        next(src)
