"""The scheduler-side hit rule of the vLLM connector, with no vLLM import.

A request's external hit is the longest prefix, past what vLLM already holds, that every
KV-cache group can restore from gcache:

* a **full** group (full attention, MLA) needs every one of its blocks in the prefix;
* a **window** group (sliding-window attention) needs only the blocks the window can
  still see at the prefix's end: the last ``window_blocks`` blocks before it, clipped at
  the locally computed part (which is already on the GPU). Blocks before that are never
  loaded: vLLM keeps them as null blocks;
* an **other** group (Mamba state, chunked-local attention, ...) is not stored by the
  connector: a request on a model with one never gets an external hit;
* a **skip** group is one vLLM marks as not transferable (an accelerator-side replica
  it rebuilds from its source group after a load): neither stored nor needed.

The window rule is the one vLLM's own ``SlidingWindowManager`` applies to its prefix
cache (``cdiv(sliding_window - 1, block_size)`` contiguous blocks end a hit), and the one
the SGLang plugin applies to its SWA pool (``gcache.sdk.sglang.window_safe_stops``).
Everything here is a pure function of (plan, presence), so it is unit-tested without
vLLM and without a cluster.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple, Sequence


class GroupKind(str, enum.Enum):
    FULL = "full"
    WINDOW = "window"
    OTHER = "other"
    SKIP = "skip"


class GroupPlan(NamedTuple):
    """One KV-cache group as the connector stores it."""

    gid: int
    kind: GroupKind
    block_size: int  # tokens per block of this group
    window_blocks: int  # WINDOW: blocks a hit must end with; else 0
    ratio: int  # block_size // hash_block_size: a block's key is its last hash's
    replicated: bool  # MLA: every TP rank holds the same bytes; rank 0 writes


def window_blocks(sliding_window: int, block_size: int) -> int:
    """Blocks that end a hit in a sliding-window group (vLLM's rule)."""
    return max(1, -(-(sliding_window - 1) // block_size))


class Lookup(NamedTuple):
    """What one request asks gcache: per group, the block indices whose presence matters."""

    start_tokens: int  # locally computed tokens (aligned to every group's block size)
    end_tokens: int  # the longest hit possible (whole blocks, <= num_tokens - 1)
    blocks: tuple[tuple[int, ...], ...]  # per plan: block indices to look up


def plan_lookup(plans: Sequence[GroupPlan], num_hashes: int, hash_block_size: int,
                num_computed_tokens: int, num_tokens: int) -> Lookup | None:
    """The blocks to ask about, or None when no hit is possible (unaligned start, an
    unsupported group, or nothing past the local prefix)."""
    if any(p.kind is GroupKind.OTHER for p in plans):
        return None
    unit = _unit(plans)
    if not unit:
        return None
    if num_computed_tokens % unit:
        return None
    # vLLM recomputes at least the last token; only whole hashed blocks are stored.
    end = min(num_tokens - 1, num_hashes * hash_block_size)
    end -= end % unit
    if end <= num_computed_tokens:
        return None
    blocks = tuple(() if p.kind is GroupKind.SKIP else
                   tuple(range(num_computed_tokens // p.block_size, end // p.block_size))
                   for p in plans)
    return Lookup(num_computed_tokens, end, blocks)


def longest_hit(plans: Sequence[GroupPlan], lookup: Lookup,
                present: Sequence[Sequence[bool]]) -> int:
    """Tokens past ``lookup.start_tokens`` every group can restore (0 = none).

    ``present[i][k]``: whether block ``lookup.blocks[i][k]`` of ``plans[i]`` is stored.
    """
    unit = _unit(plans)
    start, end = lookup.start_tokens, lookup.end_tokens
    # full groups: the first missing block caps the hit
    for p, have in zip(plans, present):
        if p.kind is GroupKind.FULL:
            first_missing = next((k for k, ok in enumerate(have) if not ok), len(have))
            end = min(end, start + first_missing * p.block_size)
    end -= (end - start) % unit
    # window groups: walk back until every window group's last blocks are all present
    while end > start:
        if all(_window_ok(p, have, start, end) for p, have in zip(plans, present)
               if p.kind is GroupKind.WINDOW):
            return end - start
        end -= unit
    return 0


def _unit(plans: Sequence[GroupPlan]) -> int:
    """Tokens a hit is a multiple of: every stored group's blocks are whole (0: none)."""
    sizes = [p.block_size for p in plans if p.kind is not GroupKind.SKIP]
    return math.lcm(*sizes) if sizes else 0


def _window_ok(p: GroupPlan, have: Sequence[bool], start: int, end: int) -> bool:
    first = start // p.block_size  # index of have[0]
    hi = end // p.block_size
    lo = max(first, hi - p.window_blocks)
    return all(have[k - first] for k in range(lo, hi))


def blocks_to_load(p: GroupPlan, start: int, hit_end: int) -> range:
    """Block indices of group ``p`` a hit [start, hit_end) restores."""
    lo, hi = start // p.block_size, hit_end // p.block_size
    if p.kind is GroupKind.SKIP:
        return range(0)
    if p.kind is GroupKind.WINDOW:
        lo = max(lo, hi - p.window_blocks)
    return range(lo, hi)
