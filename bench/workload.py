"""KV-page workload sources: streams of request steps, each the page-key chain
of one prompt. Pure data: no network, no cache client.

Design: a page key identifies a page *together with its whole prefix*, the
way SGLang / vLLM prefix caching names KV pages: key_i = H(key_{i-1} || page
contents). Two prompts that share their first n pages therefore share their
first n keys exactly, and nothing after the first difference. A benchmark
driver looks up the chain front to back and stops at the first miss, exactly
like an engine does.

Two sources:

* ``session_workload`` - synthetic multi-turn chat. Sessions share a few
  system prompts, every turn re-sends the whole conversation plus a few new
  pages, and sessions are interleaved like concurrent users on one server.
  Keys are chained 16-byte xxh3_128 digests of (parent digest || page content
  id); content ids stand in for token ids.
* ``mooncake_trace`` - replays a Mooncake FAST'25 trace (JSONL). Its
  ``hash_ids`` already name 512-token prefix blocks, so a key is simply
  ``b"mc:" + u64le(hash_id)``.

Both return a ``StepSource``: an iterator of ``Step`` that also carries
``block_tokens`` (tokens per page) so reports can convert pages to tokens.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from gcache.errors import ConfigError

__all__ = [
    "DEFAULT_PAGE_TOKENS",
    "MOONCAKE_BLOCK_TOKENS",
    "SESSION_INTERARRIVAL_MS",
    "Step",
    "StepSource",
    "block_tokens",
    "chain_key",
    "mooncake_key",
    "mooncake_trace",
    "session_workload",
]

DEFAULT_PAGE_TOKENS = 64
"""Tokens per page of ``session_workload`` unless ``page_tokens`` says otherwise."""

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_id`` block in the Mooncake FAST'25 traces."""

SESSION_INTERARRIVAL_MS = 10.0
"""Mean gap between consecutive synthetic requests (exponential arrivals)."""

ROOT_DIGEST = bytes(16)
"""Parent digest of the first page of every chain."""

_MOONCAKE_PREFIX = b"mc:"
_U64 = struct.Struct("<Q")
_SYS_CONTENT = struct.Struct("<4sqqq")  # tag, seed, system prompt, page index
_TURN_CONTENT = struct.Struct("<4sqqqq")  # tag, seed, session, turn, page index


@dataclass(frozen=True, slots=True)
class Step:
    """One request: the full prompt's page chain, in order.

    ``page_keys[i]`` names page ``i`` together with pages ``0..i-1``.
    """

    request_id: int
    session: int
    page_keys: tuple[bytes, ...]
    timestamp_ms: float


class StepSource(Iterator[Step]):
    """An iterator of ``Step`` that knows its name and tokens per page."""

    __slots__ = ("_steps", "block_tokens", "name")

    def __init__(self, steps: Iterator[Step], *, name: str, block_tokens: int) -> None:
        self._steps = steps
        self.name = name
        self.block_tokens = block_tokens

    def __iter__(self) -> StepSource:
        return self

    def __next__(self) -> Step:
        return next(self._steps)

    def close(self) -> None:
        """Release the underlying generator (and any open trace file)."""
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()

    def __repr__(self) -> str:
        return f"StepSource(name={self.name!r}, block_tokens={self.block_tokens})"


def block_tokens(source: StepSource | str) -> int:
    """Tokens per page of a source (or of a source name: "sessions", "mooncake")."""
    if isinstance(source, StepSource):
        return source.block_tokens
    if source == "mooncake":
        return MOONCAKE_BLOCK_TOKENS
    if source == "sessions":
        return DEFAULT_PAGE_TOKENS
    raise TypeError(f"not a workload source: {source!r}")


def chain_key(parent: bytes, content: bytes) -> bytes:
    """16-byte key of a page: xxh3_128(parent digest || page content)."""
    return xxhash.xxh3_128_digest(parent + content)


def mooncake_key(hash_id: int) -> bytes:
    """Page key of a Mooncake trace block."""
    return _MOONCAKE_PREFIX + _U64.pack(hash_id)


# --------------------------------------------------------------------------- sessions


def _require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def session_workload(
    *,
    sessions: int = 64,
    turns: int = 6,
    system_prompts: int = 4,
    system_pages: int = 16,
    turn_pages: int = 4,
    seed: int = 0,
    page_tokens: int = DEFAULT_PAGE_TOKENS,
) -> StepSource:
    """Multi-turn chat sessions sharing ``system_prompts`` system prompts.

    Each session picks one system prompt (``system_pages`` pages, identical
    keys for every session that picked it). Turn 0's prompt is the system
    prompt plus a user message; every later turn's prompt is the previous
    prompt plus the previous answer plus a new user message. Each turn adds
    ``turn_pages`` pages, varied by up to +-25% (at least one page).

    The ``sessions * turns`` steps are interleaved in a seeded random order
    that keeps each session's turns in order; timestamps follow exponential
    arrivals with mean ``SESSION_INTERARRIVAL_MS``. The seed is part of every
    page's content, so different seeds produce disjoint key spaces, and a
    session's chains do not depend on how many other sessions there are.
    """
    sessions = _require_int("sessions", sessions, 0)
    turns = _require_int("turns", turns, 1)
    system_prompts = _require_int("system_prompts", system_prompts, 1)
    system_pages = _require_int("system_pages", system_pages, 0)
    turn_pages = _require_int("turn_pages", turn_pages, 1)
    seed = _require_int("seed", seed, 0)
    page_tokens = _require_int("page_tokens", page_tokens, 1)
    steps = _session_steps(sessions, turns, system_prompts, system_pages, turn_pages, seed)
    return StepSource(steps, name="sessions", block_tokens=page_tokens)


def _system_chain(seed: int, prompt: int, pages: int) -> tuple[bytes, ...]:
    keys: list[bytes] = []
    parent = ROOT_DIGEST
    for i in range(pages):
        parent = chain_key(parent, _SYS_CONTENT.pack(b"sys\0", seed, prompt, i))
        keys.append(parent)
    return tuple(keys)


def _session_steps(
    sessions: int,
    turns: int,
    system_prompts: int,
    system_pages: int,
    turn_pages: int,
    seed: int,
) -> Iterator[Step]:
    spread = turn_pages // 4
    lo, hi = max(1, turn_pages - spread), turn_pages + spread

    order_rng = np.random.default_rng([seed, 0])
    order = np.repeat(np.arange(sessions, dtype=np.int64), turns)
    order_rng.shuffle(order)
    gaps = order_rng.exponential(SESSION_INTERARRIVAL_MS, size=order.shape[0])
    times = np.cumsum(gaps) - gaps[0] if order.shape[0] else gaps

    system_chains: dict[int, tuple[bytes, ...]] = {}
    chains: dict[int, tuple[bytes, ...]] = {}
    rngs: dict[int, np.random.Generator] = {}
    next_turn: dict[int, int] = {}

    for request_id, (session_np, t_ms) in enumerate(zip(order, times)):
        session = int(session_np)
        rng = rngs.get(session)
        if rng is None:  # first turn: choose the shared system prompt
            rng = rngs[session] = np.random.default_rng([seed, 1, session])
            prompt = int(rng.integers(system_prompts))
            if prompt not in system_chains:
                system_chains[prompt] = _system_chain(seed, prompt, system_pages)
            chains[session] = system_chains[prompt]
            next_turn[session] = 0
        turn = next_turn[session]
        chain = chains[session]
        added = int(rng.integers(lo, hi + 1))
        parent = chain[-1] if chain else ROOT_DIGEST
        new_keys: list[bytes] = []
        for i in range(added):
            parent = chain_key(parent, _TURN_CONTENT.pack(b"turn", seed, session, turn, i))
            new_keys.append(parent)
        chain = chain + tuple(new_keys)
        if turn + 1 < turns:
            chains[session] = chain
            next_turn[session] = turn + 1
        else:  # session finished: drop its state
            del chains[session], rngs[session], next_turn[session]
        yield Step(
            request_id=request_id,
            session=session,
            page_keys=chain,
            timestamp_ms=float(t_ms),
        )


# --------------------------------------------------------------------------- mooncake


def mooncake_trace(path: str | os.PathLike[str], limit: int | None = None) -> StepSource:
    """Replay a Mooncake FAST'25 JSONL trace.

    Each non-blank line is ``{"timestamp": ms, "input_length": N,
    "output_length": M, "hash_ids": [ints]}``; every hash id names a
    512-token block including its prefix. The trace has no session ids, so
    each request is its own session (``session == request_id``, counting
    non-blank lines from 0). At most ``limit`` steps are produced; lines
    after the limit are not read. A malformed line raises ``ValueError``
    naming the file and 1-based line number. The file is read lazily.
    """
    if limit is not None:
        limit = _require_int("limit", limit, 0)
    fspath = os.fspath(path)
    if not os.path.isfile(fspath):
        raise FileNotFoundError(f"trace file not found: {fspath}")
    return StepSource(
        _mooncake_steps(fspath, limit), name="mooncake", block_tokens=MOONCAKE_BLOCK_TOKENS
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_mooncake_line(line: bytes) -> tuple[float, tuple[bytes, ...]]:
    """(timestamp_ms, page_keys) of one trace line; ValueError says what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg})") from None
    except ValueError as exc:  # undecodable bytes
        raise ValueError(f"invalid text ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "timestamp" not in record or "hash_ids" not in record:
        raise ValueError("missing 'timestamp' or 'hash_ids'")
    ts = record["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError(f"bad timestamp {ts!r}")
    for field in ("input_length", "output_length"):
        if field in record and not (_is_int(record[field]) and record[field] >= 0):
            raise ValueError(f"bad {field} {record[field]!r}")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise ValueError("'hash_ids' must be a list")
    for h in hash_ids:
        if not (_is_int(h) and 0 <= h < 1 << 64):
            raise ValueError(f"bad hash id {h!r}")
    prefix, pack = _MOONCAKE_PREFIX, _U64.pack
    return float(ts), tuple(prefix + pack(h) for h in hash_ids)


def _mooncake_steps(path: str, limit: int | None) -> Iterator[Step]:
    if limit == 0:
        return
    request_id = 0
    with open(path, "rb") as f:  # json.loads decodes per line, so bad bytes get a line number
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                ts, keys = _parse_mooncake_line(line)
            except ValueError as exc:
                raise ValueError(f"{path}: line {lineno}: malformed trace line: {exc}") from None
            yield Step(request_id=request_id, session=request_id, page_keys=keys, timestamp_ms=ts)
            request_id += 1
            if limit is not None and request_id >= limit:
                return
